"""The periodic re-plan's decision to trial again (omgs_hook.plan_job.compute_plan, pure):
when the model's plan changed, and when the workload itself moved."""

import numpy as np
import pytest

from omgs_hook import plan_selection
from omgs_hook.cost_model import Instance, LinearCost, TopkCost, Unit
from omgs_hook.plan_job import compute_plan, plan_key
from omgs_hook.planner import make_plan


def _instance(scale=1.0):
    """12 units; ``scale`` multiplies every compute time (a larger batch)."""
    rng = np.random.default_rng(5)
    return Instance(
        layers=tuple(Unit(int(rng.integers(10**4, 10**6)), float(rng.uniform(2e-4, 2e-3)) * scale)
                     for _ in range(12)),
        world_size=2, density=0.01, forward_s=0.01 * scale, comm=LinearCost(1e-3, 2e-9),
        topk=TopkCost(1e-4, 2e-9, 0.0), dense=None, tail_s=0.002 * scale)


def _periodic_job(inst, kept, **extra):
    """A periodic re-plan's job for ``inst`` whose last trial started from the model's
    plan for ``inst`` (so the model's plan is unchanged) and kept ``kept`` (a unit plan's
    groups)."""
    model = make_plan(inst, "optimal")
    key = plan_key(model)
    job = {"instance": inst.to_dict(), "reason": "periodic",
           "kept": {"name": "single", "groups": [list(g) for g in kept],
                    "dense": [False] * len(kept), "exchange": None},
           "model_key": [[list(g) for g in key[0]], list(key[1])],
           "start": None, "retrial_ok": True, "retrial_room": 1000.0}
    job.update(extra)
    return job


def test_compute_and_when_it_has_moved():
    inst = _instance()
    assert plan_selection.compute_s(inst) == pytest.approx(
        0.01 + 0.002 + sum(u.backward_s for u in inst.layers))
    assert plan_selection.compute_s(_instance(3.0)) == pytest.approx(
        3 * plan_selection.compute_s(inst))
    moved = plan_selection.workload_moved
    factor = plan_selection.WORKLOAD_FACTOR
    assert moved(0.1 * factor * 1.01, 0.1) and moved(0.1, 0.1 * factor * 1.01)
    assert not moved(0.1 * factor * 0.99, 0.1) and not moved(0.1, 0.1 * factor * 0.99)
    for unknown in ((None, 0.1), (0.1, None), (0.0, 0.1), (0.1, -1.0)):
        assert not moved(*unknown)


def test_a_moved_workload_trials_the_full_set_again_with_the_kept_plan():
    inst = _instance()
    single = [list(range(12))]
    before = plan_selection.compute_s(inst)
    # the model's plan is the same, the compute is too: the measured winner stays
    same = compute_plan(_periodic_job(inst, single, workload_s=before, trial_workload_s=before),
                        "optimal", "measured")
    assert same["candidates"] is None and same["plan"] is None
    # (a job of a state saved before the workload was recorded: as before)
    assert compute_plan(_periodic_job(inst, single), "optimal", "measured")["candidates"] is None
    # the batch grew 3x; the model's plan for it is the one the last trial started
    # from (model_changed is False), but every measurement of that trial is stale
    grown = _instance(3.0)
    unchanged = _periodic_job(grown, single)
    assert compute_plan(unchanged, "optimal", "measured")["candidates"] is None
    job = dict(unchanged, workload_s=plan_selection.compute_s(grown), trial_workload_s=before)
    result = compute_plan(job, "optimal", "measured")
    names = [c.name for c in result["candidates"]]
    full = plan_selection.model_candidates(grown, "optimal")
    # the model's choice first, the kept plan second (unless it is the model's choice)
    assert names[0] == full[0].name
    kept_key = (((tuple(range(12)),), (False,)))
    assert result["candidates"][1].key == kept_key or full[0].key == kept_key
    assert 2 < len(names) <= plan_selection.MAX_CANDIDATES
    # every candidate of the model's own set is in (up to the limit), none twice
    assert len({c.key for c in result["candidates"]}) == len(names)
    assert {c.key for c in full[:plan_selection.MAX_CANDIDATES - 1]} <= {
        c.key for c in result["candidates"]}
    # a short trial budget trims the set from its end, the kept plan (second) stays
    room = plan_selection.trial_steps_bound(2, duel_pairs=0)  # (later trials: no duel)
    short = compute_plan(dict(job, retrial_room=room), "optimal", "measured")
    assert [c.name for c in short["candidates"]] == names[:2]
    # beyond the budget (retrial_ok False) nothing runs: the winner stays
    over = compute_plan(dict(job, retrial_ok=False), "optimal", "measured")
    assert over["candidates"] is None and over["plan"] is None
    # and it shrank by 3x: the same
    shrunk = compute_plan(dict(job, workload_s=before / 3), "optimal", "measured")
    assert shrunk["candidates"] is not None


def test_select_model_never_trials():
    inst = _instance()
    job = _periodic_job(inst, [list(range(12))], workload_s=1.0, trial_workload_s=0.1)
    result = compute_plan(job, "optimal", "model")
    assert result["candidates"] is None and result["plan"] is not None
