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
    # a wait for an inter-node collective (stage 2) that had not completed: only in the
    # drain (for the first group in flight, when nothing else could move on). A
    # reduce-scatter (stage 1) is waited for: gloo's never reports completion.
    drain_started = max(i for i, e in enumerate(log) if e[0] == "issue" and e[1] == 1)
    for i, event in enumerate(log):
        if event[0] == "wait" and not event[3] and event[1] == 2:
            assert i > drain_started, f"a hook call waited for the network: {event}"


def test_the_old_blocking_driver_fails_the_no_wait_check():
    # the check above can fail: a driver that waits for every group at every hook call
    # waits for inter-node collectives that have not completed before the last group is
    # sent
    waited_early = False
    for seed in range(10):
        log = run_step(random.Random(seed), groups=6, blocking_driver=True)
        last_send = max(i for i, e in enumerate(log) if e[0] == "issue" and e[1] == 1)
        waited_early |= any(e[0] == "wait" and not e[3] and e[1] == 2 and i < last_send
                            for i, e in enumerate(log))
    assert waited_early


def test_a_reduce_scatter_is_waited_for_at_the_next_hook_call():
    # gloo's reduce-scatter never reports completion: polling it would leave every
    # group's top-k and inter-node all-gather to the drain
    ex = exchange()
    log, works = [], []
    ex._start_pipeline(fake_group(log, works, 0), ["p"], 0)
    assert ex.advance() is True
    assert log[-2:] == [("wait", 1, 0, False), ("issue", 2, 0)]
    assert ex.advance() is False  # the inter-node collective is still running
    works[1].done = True
    assert ex.advance() is True and log[-1] == ("issue", 3, 0) and ex._pipelines == []


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


def test_on_cuda_tensors_every_hook_call_moves_each_group_one_stage():
    # the wait only orders streams there: no polling, the lock-step driver as before
    ex = exchange(device="meta")
    log, works = [], []
    ex._start_pipeline(fake_group(log, works, 0), ["p"], 0)
    assert ex.poll_stages is False
    ex.advance()
    assert issues_per_stage(log) == {1: [0], 2: [0]}
    assert log[-2] == ("wait", 1, 0, False)  # waited although not completed
