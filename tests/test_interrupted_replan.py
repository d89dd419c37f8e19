"""A Ctrl-C that lands in a re-plan (at bucket 0, where the re-plan started at the end
of the previous step is finished) must not lose that re-plan: the state saved after it
carries the plan job, as the other ranks' do, so that the saved states resume together."""

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import omgs_hook
from ddp_harness import run_ranks

OPTIONS = dict(density=0.1, strategy="layerwise", select="model", allow_dense=False,
               warmup_steps=2, replan_every=3, log_every=0)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 4))


def _train(ddp, opt, gen, steps):
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()


def _interrupt_first_periodic_replan(state, rank, interrupt):
    """Make ``interrupt()`` (which raises) land in the first periodic re-plan: on rank 0
    before the re-plan is made, on rank 1 right after it."""
    replan = state._replan

    def interrupted(layout, reason="first", built=None):
        if reason == "periodic":
            if rank == 0:
                interrupt()
            replan(layout, reason, built)
            interrupt()
        return replan(layout, reason, built)

    state._replan = interrupted


def _raise_keyboard_interrupt():
    raise KeyboardInterrupt


def worker(rank, world_size):
    model = _model()
    ddp = DDP(model, bucket_cap_mb=0)
    state = omgs_hook.register(ddp, **OPTIONS)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    _interrupt_first_periodic_replan(state, rank, _raise_keyboard_interrupt)
    try:
        _train(ddp, opt, torch.Generator().manual_seed(rank), 40)
    except KeyboardInterrupt:
        pass
    del state._replan
    saved = state.state_dict()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    state.close()
    return saved, weights


def resume_worker(rank, world_size, saved, weights):
    model = _model()
    model.load_state_dict(weights)
    ddp = DDP(model, bucket_cap_mb=0)
    state = omgs_hook.register(ddp, **OPTIONS)
    state.load_state_dict(saved[rank])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    _train(ddp, opt, torch.Generator().manual_seed(rank + 10), 8)
    stats = state.stats()
    state.close()
    return stats["step"], stats["plan"]["groups"]


@pytest.mark.timeout(120)
def test_a_re_plan_interrupted_on_one_rank_is_saved_as_on_the_others():
    results = run_ranks("test_interrupted_replan", "worker", world_size=2, timeout=60)
    states = [saved for saved, _ in results]
    assert states[0]["step"] == states[1]["step"] < 40  # both interrupted at that step
    assert states[1]["plan_job"] is not None
    assert states[0]["plan_job"] == states[1]["plan_job"]
    resumed = run_ranks("test_interrupted_replan", "resume_worker", world_size=2, timeout=60,
                        pg_timeout_s=20, saved=states, weights=results[0][1])
    assert resumed[0] == resumed[1]
    assert resumed[0][0] == states[0]["step"] + 8


class _Terminated(Exception):
    pass


def handler_worker(rank, world_size):
    """A SIGTERM handler that saves and stops, landing inside the periodic re-plan on
    rank 0 (its save cannot make the re-plan it interrupted) and after it on rank 1."""
    model = _model()
    ddp = DDP(model, bucket_cap_mb=0)
    state = omgs_hook.register(ddp, **OPTIONS)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    saved = {}

    def handler():
        saved["state"] = state.state_dict()
        raise _Terminated

    _interrupt_first_periodic_replan(state, rank, handler)
    try:
        _train(ddp, opt, torch.Generator().manual_seed(rank), 40)
    except _Terminated:
        pass
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    state.close()
    return saved["state"], weights


@pytest.mark.timeout(120)
def test_states_saved_inside_and_after_a_re_plan_are_refused_at_resume_not_hung():
    results = run_ranks("test_interrupted_replan", "handler_worker", world_size=2, timeout=60)
    states = [saved for saved, _ in results]
    assert states[0]["step"] == states[1]["step"]
    assert (states[0]["plan_job"] is None) != (states[1]["plan_job"] is None)
    resumed = run_ranks("test_interrupted_replan", "resume_worker", world_size=2, timeout=60,
                        pg_timeout_s=30, allow_failure=True, saved=states,
                        weights=results[0][1])
    for outcome in resumed:
        assert "ranks are configured differently: plan_job" in outcome["error"]
