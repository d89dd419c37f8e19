"""The two-level exchange's stage driver (StepExchange.advance / drain), with fake
collectives whose completion the test controls.

On the CPU a hook call must never wait for a two-level group's collective (a group's
inter-node all-gather over a slow link would otherwise sit on backward's critical path),
and however the stages of different groups interleave, every communicator (one per
stage) must see its collectives in group order - the same order on every rank, which is
what gloo matches collectives by.
"""

import random

import pytest
import torch

from omgs_hook.group_exchange import StepExchange
from omgs_hook.hierarchical import _last_stage_group
from omgs_hook.topology import Subgroups, gpu_only_backend

STAGES = 3  # reduce-scatter, inter-node collective, intra-node all-gather


class FakeWork:
    def __init__(self, log, stage, group):
        self.log, self.stage, self.group = log, stage, group
        self.done = False

    def is_completed(self):
        return self.done

    def wait(self):
        self.log.append(("wait", self.stage, self.group, self.done))
        self.done = True


def fake_group(log, works, group):
    """Issues STAGES collectives like hierarchical.sparse_group: yields the first two
    work handles, issues the last one and returns."""
    for stage in range(1, STAGES + 1):
        log.append(("issue", stage, group))
        if stage == STAGES:
            return
        work = FakeWork(log, stage, group)
        works.append(work)
        yield work


def exchange(device="cpu"):
    ex = StepExchange(memory=None, selector=None, process_group=None, world_size=4,
                      density=0.01)
    ex.arrived = {"p": (0, torch.zeros(1, device=device), 0)}
    ex.subgroups = Subgroups(intra="intra", inter="inter", intra_gather="intra_gather")
    return ex


def issues_per_stage(log):
    order = {}
    for event in log:
        if event[0] == "issue":
            order.setdefault(event[1], []).append(event[2])
    return order


def run_step(rng, groups, blocking_driver=False):
    """Send `groups` groups over hook calls, completing random pending collectives
    between calls, then drain. Returns the event log."""
    ex = exchange()
    log, works = [], []
    sent = 0
    while sent < groups:
        # a hook call: first the groups in flight, then (sometimes) a new group
        if blocking_driver:
            for entry in list(ex._pipelines):  # the old driver: wait for every group
                if ex._step_pipeline(entry):
                    ex._pipelines.remove(entry)
        else:
            ex.advance()
        if rng.random() < 0.6:
            ex._start_pipeline(fake_group(log, works, sent), ["p"], sent)
            sent += 1
        for work in works:  # the network: some collectives complete between calls
            if not work.done and rng.random() < 0.4:
                work.done = True
    ex.drain()
    assert ex._pipelines == []
    return log


@pytest.mark.parametrize("seed", range(40))
def test_a_hook_call_never_waits_and_each_stage_keeps_group_order(seed):
    rng = random.Random(seed)
    groups = rng.randint(1, 7)
    log = run_step(rng, groups)
    order = issues_per_stage(log)
    # every group issued all its collectives, and each stage's communicator saw them in
    # group order (the same on every rank, whatever the timing)
    assert order == {stage: list(range(groups)) for stage in range(1, STAGES + 1)}
    # a group's stages in order
    for g in range(groups):
        stages = [e[1] for e in log if e[0] == "issue" and e[2] == g]
        assert stages == [1, 2, 3]
    # a wait for a collective that had not completed: only in the drain (for the first
    # group in flight, when nothing else could move on)
    drain_started = max(i for i, e in enumerate(log) if e[0] == "issue" and e[1] == 1)
    for i, event in enumerate(log):
        if event[0] == "wait" and not event[3]:
            assert i > drain_started, f"a hook call waited for the network: {event}"


def test_the_old_blocking_driver_fails_the_no_wait_check():
    # the check above can fail: a driver that waits for every group at every hook call
    # waits for collectives that have not completed before the last group is sent
    waited_early = False
    for seed in range(10):
        log = run_step(random.Random(seed), groups=6, blocking_driver=True)
        last_send = max(i for i, e in enumerate(log) if e[0] == "issue" and e[1] == 1)
        waited_early |= any(e[0] == "wait" and not e[3] and i < last_send
                            for i, e in enumerate(log))
    assert waited_early


def test_a_group_waits_for_the_group_before_it_on_the_same_stage():
    # group 1's inter-node collective completes first; group 0's is still running: group
    # 1 must not issue its last collective before group 0 has issued its own
    ex = exchange()
    log, works = [], []
    ex._start_pipeline(fake_group(log, works, 0), ["p"], 0)
    ex._start_pipeline(fake_group(log, works, 1), ["p"], 1)
    for w in works:
        w.done = True
    ex.advance()  # both issue their inter-node collectives (stage 2), in group order
    assert issues_per_stage(log) == {1: [0, 1], 2: [0, 1]}
    inter0, inter1 = works[2], works[3]
    inter1.done = True  # group 1's completes first
    assert ex.advance() is False
    assert issues_per_stage(log)[2] == [0, 1] and 3 not in issues_per_stage(log)
    inter0.done = True
    assert ex.advance() is True
    assert issues_per_stage(log)[3] == [0, 1]


def test_stage_three_has_its_own_process_group_only_where_stages_are_polled():
    ex = exchange()
    ex._start_pipeline(fake_group([], [], 0), ["p"], 0)
    assert ex.poll_stages and _last_stage_group(ex) == "intra_gather"
    # no such group (an NCCL-only world makes none): no polling, stage 3 on the intra group
    ex = exchange()
    ex.subgroups = Subgroups(intra="intra", inter="inter")
    ex._start_pipeline(fake_group([], [], 0), ["p"], 0)
    assert not ex.poll_stages and _last_stage_group(ex) == "intra"


@pytest.mark.parametrize("backend, gpu_only", [
    ("gloo", False), ("nccl", True), ("NCCL", True), ("cpu:gloo,cuda:nccl", False),
    ("cuda:nccl", True), ("mpi", False)])
def test_which_backends_get_the_last_stage_groups(backend, gpu_only):
    # build_subgroups makes the last stage's own groups unless the backend is GPU-only
    assert gpu_only_backend(backend) is gpu_only


def test_on_cuda_tensors_every_hook_call_moves_each_group_one_stage():
    # the wait only orders streams there: no polling, the lock-step driver as before
    ex = exchange(device="meta")
    log, works = [], []
    ex._start_pipeline(fake_group(log, works, 0), ["p"], 0)
    assert ex.poll_stages is False
    ex.advance()
    assert issues_per_stage(log) == {1: [0], 2: [0]}
    assert log[-2] == ("wait", 1, 0, False)  # waited although not completed


# -- communicator.start_shard_sum on gloo: what stage 1 computes -------------------------
def _shard_sum_worker(rank, world_size, size):
    import time

    import torch.distributed as dist

    from omgs_hook import communicator

    generator = torch.Generator().manual_seed(1234 + rank)
    source = torch.randn(world_size * size, generator=generator)
    shard = torch.empty(size)
    receive = torch.empty(world_size * size)
    work, complete = communicator.start_shard_sum(shard, source, None, receive)
    deadline = time.monotonic() + 30
    while not work.is_completed():  # it reports completion (gloo's reduce-scatter does not)
        assert time.monotonic() < deadline, "the all-to-all never reported completion"
        time.sleep(0.001)
    work.wait()
    complete()
    reduce_scattered = torch.empty(size)
    communicator.reduce_scatter_flat(reduce_scattered, source, async_op=True).wait()
    sources = [torch.randn(world_size * size, generator=torch.Generator().manual_seed(1234 + r))
               for r in range(world_size)]
    exact = sum(s.double() for s in sources)[rank * size:(rank + 1) * size]
    return shard, reduce_scattered, exact


@pytest.mark.multiprocess
def test_stage_one_on_the_cpu_sums_the_shards_and_reports_completion():
    from ddp_harness import run_ranks

    results = run_ranks("test_two_level_pipeline", "_shard_sum_worker", world_size=3,
                        timeout=120, size=1000)
    for shard, reduce_scattered, exact in results:
        torch.testing.assert_close(shard.double(), exact, rtol=0, atol=1e-5)
        torch.testing.assert_close(shard, reduce_scattered, rtol=1e-6, atol=1e-6)
