"""What one re-plan computes: the model's plan and the measured selection's candidates.

:func:`compute_plan` is the hook's planning job. It is pure - plain numbers in (the job
dict the hook builds from the gathered measurements), plans out - and imports neither
torch nor ``torch.distributed``, so the background planner can run it on a worker thread
or in its worker process (``omgs_hook.plan_worker``), where it shares no interpreter lock
with the training thread. Every rank computes the same job and gets the same result.
"""

from __future__ import annotations

from . import plan_selection
from . import planner as planner_mod
from .cost_model import Instance

__all__ = ["compute_plan", "plan_key", "replan_budget", "REPLAN_SEARCH_BUDGET"]

#: The valve's budget (planner.SEARCH_BUDGET is 10 million) of a re-plan that starts from
#: the plan in use. Where the valve stops the search (a dense cost), the plan is the best
#: of the beam, the heuristics and the start, polished; the turns between 2.5 and 10
#: million candidates rarely improve on it, and on 2 cores their CPU is taken from
#: training. Realistic dense instances, the plan found for the unperturbed instance as
#: the start, backward times perturbed by up to 5% and 25% (docs/cost-model.md):
#: 1000 units, 30 cases: the same plan time as 10 million in all, CPU 438-718 -> 251-441
#: ms; 300 units, 122 cases: the same in 117, up to 0.0033% slower in 5 (where the full
#: budget finished exactly), CPU of the stopped searches median 354 -> 141 ms.
REPLAN_SEARCH_BUDGET = 2_500_000


def replan_budget(inst):
    """The valve's count for a re-plan of ``inst`` with a start: the smaller of
    :data:`REPLAN_SEARCH_BUDGET` and the first plan's own (with a dense cost
    :func:`~omgs_hook.planner.dense_valve_budget`, a tenth at 1000 units)."""
    return min(REPLAN_SEARCH_BUDGET, planner_mod.default_valve_budget(inst))


def compute_plan(job, strategy, select):
    """The planning of one re-plan, on the background planner's worker thread or process
    (pure: no torch, no collective, no clock). ``job``: what
    :meth:`omgs_hook.hook.OMGSState._replan` gathered, as plain lists and dicts. Returns
    ``{"candidates": [...] or None, "plan": Candidate or None (None: keep the plan in
    use), "reason": ..., "model_key": ...}``."""
    inst = Instance.from_dict(job["instance"])
    # the exchange of the model's plans, and (topology="auto" resolved to the two-level
    # exchange) the flat instance whose plans the trial compares with them
    exchange = job.get("exchange")
    flat_inst = Instance.from_dict(job["flat_instance"]) if job.get("flat_instance") else None
    # the plan in use (same layout) as the search's start: a bound, and the least a
    # search stopped by the valve returns (jobs of older checkpoints have none)
    start = job.get("start")
    start = (start["groups"], start["dense"]) if start else None
    unit_plan = planner_mod.make_plan(inst, strategy, start=start,
                                      budget=replan_budget(inst) if start else None)
    model_key = plan_key(unit_plan)
    out = {"candidates": None, "plan": None, "reason": "model", "model_key": model_key}
    if select == "model":
        out["plan"] = plan_selection.Candidate.from_plan(unit_plan.strategy, unit_plan, exchange)
        return out
    # the flat model's plan (of the user's strategy), for the later trials' flat candidate
    flat_plan = planner_mod.make_plan(flat_inst, strategy) if flat_inst is not None else None
    out["flat_key"] = plan_key(flat_plan) if flat_plan is not None else None
    kept = job["kept"]
    if kept is None:  # a full trial: the first plan, a new layout
        candidates = plan_selection.model_candidates(inst, strategy, unit_plan,
                                                     exchange=exchange, flat_inst=flat_inst)
        if len(candidates) > 1:
            out["candidates"] = candidates
        else:
            out["plan"] = candidates[0]
        return out
    out["reason"] = "kept"
    previous = job["model_key"]
    model_changed = model_key != (tuple(map(tuple, previous[0])), tuple(previous[1]))
    # topology="auto" resolved two-level: the flat model's plan is watched as well
    previous_flat = job.get("flat_model_key")
    flat_changed = flat_plan is not None and (
        previous_flat is None
        or out["flat_key"] != (tuple(map(tuple, previous_flat[0])), tuple(previous_flat[1])))
    # the workload itself moved (a larger batch): every measurement of the last trial is
    # stale, so the full candidate set is timed again, the kept plan among them
    moved = plan_selection.workload_moved(job.get("workload_s"), job.get("trial_workload_s"))
    if not model_changed and not flat_changed and not moved:
        return out  # the model's inputs led to the plans the last trial started from
    groups = tuple(tuple(g) for g in kept["groups"])
    kept_exchange = kept.get("exchange") or exchange
    # a kept flat winner is priced on the flat instance
    kept_inst = flat_inst if kept_exchange == "flat" and flat_inst is not None else inst
    dense = tuple(kept["dense"]) if kept_inst.dense is not None else (False,) * len(groups)
    # (one prefix: the kept plan's name carries it already when an earlier trial kept it)
    name = kept["name"] if kept["name"].startswith("kept:") else f"kept:{kept['name']}"
    pool = [plan_selection.Candidate.from_plan(name,
                                               planner_mod.evaluate(kept_inst, groups, dense),
                                               kept_exchange)]
    if moved:  # the model's set, its choice first and the kept plan second (kept when
        # the trial budget trims the set from its end)
        full = plan_selection.model_candidates(inst, strategy, unit_plan, exchange=exchange,
                                               flat_inst=flat_inst)
        pool = plan_selection.dedupe(full[:1] + pool + full[1:],
                                     limit=plan_selection.MAX_CANDIDATES)
    elif model_changed:  # (an unchanged model plan lost to the kept one, or is it)
        pool.insert(0, plan_selection.Candidate.from_plan(unit_plan.strategy, unit_plan,
                                                          exchange))
    best = min(c.predicted_s for c in pool)
    if not moved and flat_plan is not None and (flat_plan.predicted_iteration_s
                                                <= plan_selection.PRUNE_FACTOR * best):
        # last: the first to go when the budget is short; pruned as in a full trial
        pool.append(plan_selection.Candidate.from_plan(
            plan_selection.FLAT_PREFIX + flat_plan.strategy, flat_plan, "flat"))
    candidates = plan_selection.dedupe(pool)  # (the flat one goes when it is the kept plan)
    room = job.get("retrial_room")
    while room is not None and len(candidates) > 2 and (
            plan_selection.trial_steps_bound(
                len(candidates), duel_pairs=plan_selection.duel_pairs_for("periodic")) > room):
        candidates.pop()
    if len(candidates) > 1 and job["retrial_ok"]:
        out["candidates"] = candidates
    return out  # over the trial budget, or nothing new: the measured winner stays


def plan_key(plan):
    """A plan's (groups, dense flags) as tuples: what the later trials compare."""
    return (tuple(map(tuple, plan.groups)), tuple(bool(d) for d in plan.dense))
