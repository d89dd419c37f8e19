"""The pure logic of measured plan selection: candidates, the trial schedule, the decision."""

import dataclasses
import itertools
import math
import random
import statistics

import numpy as np
import pytest

from omgs_hook import plan_selection, planner
from omgs_hook.cost_model import Instance, LinearCost, TopkCost, Unit, hierarchical_instance
from omgs_hook.plan_selection import (
    CONFIRM_STEPS, MAX_CANDIDATES, MAX_CONFIRM, MAX_REMEASURE, MAX_RETAKES, MEASURE_STEPS,
    SCREEN_PASSES, SETTLE_STEPS, SPELL_FACTOR, TIEBREAK_STEPS, TIEBREAK_TURNS,
    MAX_FEWER_GROUPS,
    Candidate, Correction, Trial, dedupe, fewer_group_plans, fit_correction, model_candidates,
    neighbour_plans,
    plan_features, summary_of, trial_steps_bound,
)


@pytest.fixture(autouse=True)
def no_duel_unless_asked(monkeypatch):
    """The tests of the rounds before the duel see the trial end where those rounds
    decide; the duel's own tests pass ``duel_pairs``."""
    monkeypatch.setattr(plan_selection, "DUEL_PAIRS", 0)


@pytest.fixture(autouse=True)
def no_baseline_rules_unless_asked(monkeypatch):
    """The tests of the schedule and the rounds compare candidates as measured (many of
    them have one sparse group, the baseline's shape); the baseline's own tests pass
    ``baseline_margin`` and ``baseline_window``."""
    monkeypatch.setattr(plan_selection, "BASELINE_MARGIN", 0.0)
    monkeypatch.setattr(plan_selection, "BASELINE_WINDOW", 0.0)


def instance(dense=True, units=6, slow_network=False):
    layers = tuple(Unit(numel=1000 * (i + 1) ** 2, backward_s=0.001 * (1 + i % 3))
                   for i in range(units))
    comm = LinearCost(alpha_s=0.004 if slow_network else 0.0005, beta_s_per_byte=2e-8)
    return Instance(layers=layers, world_size=2, density=0.01, forward_s=0.002, comm=comm,
                    topk=TopkCost(c0=1e-4, c1=2e-9, c2=0.0),
                    dense=LinearCost(alpha_s=0.0005, beta_s_per_byte=1e-9) if dense else None,
                    tail_s=0.001)


def cand(name, groups, dense=None, predicted=1.0):
    groups = tuple(tuple(g) for g in groups)
    return Candidate(name, groups, tuple(dense or [False] * len(groups)), predicted)


def run_round(trial, step_times, first_step=None, probe=None, extra=None, forward=None):
    """Drive one round as the hook does: times[rank][candidate index] -> seconds per step,
    plus ``extra(rank, step)`` seconds when given, with load probes ``probe(rank, step)``
    and the steps' own forwards ``forward(rank, step)`` (None: none). Returns the step
    after the round (where finish_round was called)."""
    step = trial.round_start if first_step is None else first_step
    ranks = len(step_times)
    rows = [None] * ranks
    locals_ = []
    while not trial.round_complete(step):
        index = trial.candidate_at(step)
        assert index is not None
        locals_.append(index)
        step += 1
    # each rank records its own durations (one Trial object per rank in the hook; here
    # the same object is refilled per rank)
    start = trial.round_start
    for r in range(ranks):
        trial.local = trial._empty_local()
        trial.local_probe = trial._empty_local()
        trial.local_forward = trial._empty_local()
        for s in range(start, step):
            seconds = step_times[r][trial.candidate_at(s)] + (extra(r, s) if extra else 0.0)
            trial.record(s, seconds, probe(r, s) if probe else None,
                         forward=forward(r, s) if forward else None)
        rows[r] = trial.local_row()
    return step, rows


# ----------------------------------------------------------------------------- candidates
def test_dedupe_keeps_the_first_of_equal_plans_and_the_limit():
    a = cand("a", [[0, 1]])
    b = cand("b", [[0, 1]])  # same plan, other name
    c = cand("c", [[0], [1]])
    d = cand("d", [[0], [1]], [True, True])
    assert [x.name for x in dedupe([a, b, c, d])] == ["a", "c", "d"]
    assert [x.name for x in dedupe([a, b, c, d], limit=2)] == ["a", "c"]


@pytest.mark.parametrize("dense", [True, False])
@pytest.mark.parametrize("slow", [True, False])
def test_model_candidates_for_optimal(dense, slow):
    inst = instance(dense=dense, slow_network=slow)
    got = model_candidates(inst, "optimal", prune_factor=math.inf)
    model = planner.make_plan(inst, "optimal")
    assert got[0].key == (model.groups, model.dense) and got[0].name == "optimal"
    assert len({c.key for c in got}) == len(got) <= MAX_CANDIDATES
    sparse = inst if not dense else Instance(**{**inst.__dict__, "dense": None})
    expected = {("optimal-sparse",) : planner.make_plan(sparse, "optimal")}
    for name in ("single", "layerwise", "greedy"):
        expected[(name,)] = planner.make_plan(sparse, name)
    keys = {c.key for c in got}
    for (name,), plan in expected.items():
        assert (plan.groups, plan.dense) in keys, name
    all_dense = (tuple((u,) for u in range(inst.num_units)), (True,) * inst.num_units)
    assert (all_dense in keys) == dense
    for c in got:  # predictions are the model's own for that plan
        p = planner.evaluate(inst if any(c.dense) else sparse, c.groups, c.dense)
        assert c.predicted_s == pytest.approx(p.predicted_iteration_s, rel=1e-12)
    if not dense:
        assert not any(any(c.dense) for c in got)


def test_model_candidates_prune_hopeless_plans_but_never_the_model_choice():
    inst = instance(dense=False, slow_network=True)
    everything = model_candidates(inst, "optimal", prune_factor=math.inf)
    best = min(c.predicted_s for c in everything)
    pruned = model_candidates(inst, "optimal", prune_factor=1.05)
    assert pruned[0] == everything[0]
    assert all(c.predicted_s <= 1.05 * best for c in pruned[1:])
    assert len(pruned) < len(everything)


def test_other_strategies_compare_only_their_own_modes():
    inst = instance(dense=True)
    for strategy in ("single", "layerwise", "greedy", "threshold:20000"):
        got = model_candidates(inst, strategy)
        model = planner.make_plan(inst, strategy)
        assert got[0].key == (model.groups, model.dense)
        assert all(c.groups == model.groups for c in got)
        assert len(got) == (2 if any(model.dense) else 1)
    assert len(model_candidates(instance(dense=False), "layerwise")) == 1


def _neighbour_plans_walked(inst, groups):
    """The plain definition: every merge and every split through evaluate, ``(label,
    [plans in order])`` per kind that has options."""
    groups = [tuple(g) for g in groups]
    out = []
    for options, label in (
            ([groups[:i] + [groups[i] + groups[i + 1]] + groups[i + 2:]
              for i in range(len(groups) - 1)], f"{len(groups) - 1}-groups"),
            ([groups[:i] + [g[:j], g[j:]] + groups[i + 1:]
              for i, g in enumerate(groups) for j in range(1, len(g))],
             f"{len(groups) + 1}-groups")):
        if options:
            out.append((label, [planner.evaluate(inst, option, [False] * len(option),
                                                 strategy=label) for option in options]))
    return out


def _assert_the_earliest_of_the_least(got, walked):
    """``got`` (neighbour_plans) holds, per kind, the earliest walked plan whose time is
    within a tie of the least; where no other is that close, exactly the walk's best."""
    from omgs_hook.plan_selection import NEIGHBOUR_TIE

    slack = 1e-12  # the pricing's rounding, relative; far below the tie
    assert [label for label, _ in got] == [label for label, _ in walked]
    for (_, plan), (_, plans) in zip(got, walked):
        times = [p.predicted_iteration_s for p in plans]
        least = min(times)
        chosen = plans.index(plan)
        assert times[chosen] <= least * (1 + NEIGHBOUR_TIE + slack)
        assert all(t > least * (1 + NEIGHBOUR_TIE - slack) for t in times[:chosen])
        if sum(t <= least * (1 + NEIGHBOUR_TIE + slack) for t in times) == 1:
            assert plan.predicted_iteration_s == least  # no tie: the walk's own best


def test_neighbour_plans_priced_at_once_are_the_walked_ones():
    """The vectorised pricing only preselects: the plans are those the walk over every
    merge and split picks, ties included - on wide-ranging instances (c2 = 0 and > 0,
    zero backward times), on instances made of identical units (every split ties) and
    on plans of one group, single units and random cuts."""
    from test_planner import random_instance

    rng = np.random.default_rng(7)
    cases = 0
    for trial in range(160):
        units = int(rng.integers(1, 40))
        inst = random_instance(rng, units, dense=bool(trial % 3 == 0))
        if trial % 4 == 1:  # identical units: plateaus of exactly tied options
            inst = dataclasses.replace(inst, layers=(Unit(4096, 0.0 if trial % 8 == 1
                                                          else 1e-4),) * units)
        kind = trial % 5
        if kind == 0:
            groups = (tuple(range(units)),)
        elif kind == 1:
            groups = tuple((u,) for u in range(units))
        elif kind == 2:
            groups = planner.make_plan(dataclasses.replace(inst, dense=None), "optimal").groups
        else:
            cuts = sorted(set(rng.integers(1, units, size=int(rng.integers(0, units))).tolist()))
            bounds = [c for c in cuts if 0 < c < units] + [units]
            groups = tuple(tuple(range(a, b)) for a, b in zip([0] + bounds[:-1], bounds))
        _assert_the_earliest_of_the_least(neighbour_plans(inst, groups),
                                          _neighbour_plans_walked(inst, groups))
        cases += 1
    assert cases == 160


def test_neighbour_plans_that_are_not_priced_at_once_follow_the_same_rule():
    """Instances the numpy pricing leaves to the walk - sparse groups the int32 index
    range cuts, two-level instances - pick by the same rule."""
    from omgs_hook.cost_model import Hierarchy
    from omgs_hook.plan_selection import _neighbour_times

    huge = Instance(layers=tuple(Unit(n, 0.01) for n in (2**30, 2**30, 2**29, 1000, 5)),
                    world_size=4, density=0.001, forward_s=0.01, comm=LinearCost(1e-3, 1e-9),
                    topk=TopkCost(1e-4, 1e-10, 0.0))
    two_level = dataclasses.replace(instance(dense=False, units=7), world_size=4,
                                    hierarchy=Hierarchy(2, LinearCost(1e-4, 1e-10),
                                                        LinearCost(1e-3, 1e-8)))
    for inst in (huge, two_level):
        assert _neighbour_times(inst, [tuple(range(inst.num_units))]) is None
        for groups in ((tuple(range(inst.num_units)),), tuple((u,) for u in range(inst.num_units)),
                       ((0, 1), tuple(range(2, inst.num_units)))):
            _assert_the_earliest_of_the_least(neighbour_plans(inst, groups),
                                              _neighbour_plans_walked(inst, groups))


def test_neighbour_plans_of_a_thousand_units_need_few_walks(monkeypatch):
    """What the pricing is for: a 3-group plan of 1000 units has 997 splits and 2
    merges; only the chosen option of each kind is walked (each walk is O(units))."""
    rng = np.random.default_rng(3)
    layers = tuple(Unit(int(rng.integers(100, 200000)), float(rng.uniform(1e-5, 1e-3)))
                   for _ in range(1000))
    inst = Instance(layers=layers, world_size=4, density=0.001, forward_s=0.01,
                    comm=LinearCost(2e-3, 1e-8), topk=TopkCost(1e-4, 2e-9, 1e-11))
    groups = (tuple(range(0, 300)), tuple(range(300, 700)), tuple(range(700, 1000)))
    walked = []
    evaluate = planner.evaluate

    def counting(*args, **kwargs):
        walked.append(1)
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(planner, "evaluate", counting)
    got = neighbour_plans(inst, groups)
    assert len(walked) == 2
    monkeypatch.setattr(planner, "evaluate", evaluate)
    _assert_the_earliest_of_the_least(got, _neighbour_plans_walked(inst, groups))


def test_neighbour_plans_are_the_best_merge_and_the_best_split():
    inst = instance(dense=False, units=5)
    for groups in [((0,), (1, 2), (3, 4)), ((0, 1, 2, 3, 4),), tuple((u,) for u in range(5))]:
        got = dict(neighbour_plans(inst, groups))

        def time(gs):
            return planner.evaluate(inst, gs, [False] * len(gs)).predicted_iteration_s

        g = len(groups)
        merges = [groups[:i] + (groups[i] + groups[i + 1],) + groups[i + 2:] for i in range(g - 1)]
        splits = [groups[:i] + (grp[:j], grp[j:]) + groups[i + 1:]
                  for i, grp in enumerate(groups) for j in range(1, len(grp))]
        if merges:
            assert got[f"{g - 1}-groups"].predicted_iteration_s == min(map(time, merges))
        else:
            assert f"{g - 1}-groups" not in got
        if splits:
            assert got[f"{g + 1}-groups"].predicted_iteration_s == min(map(time, splits))
        else:
            assert f"{g + 1}-groups" not in got


def many_groups_instance(units, seed):
    """A sparse instance whose optimum has many groups: long backward per unit, cheap
    start-up, so a group's exchange hides behind the next units' backward."""
    rng = random.Random(seed)
    layers = tuple(Unit(numel=rng.choice([20000, 50000, 200000]),
                        backward_s=0.004 * rng.uniform(0.5, 2)) for _ in range(units))
    return Instance(layers=layers, world_size=8, density=0.01, forward_s=0.01,
                    comm=LinearCost(alpha_s=0.001, beta_s_per_byte=2e-6),
                    topk=TopkCost(c0=2e-4, c1=2e-9, c2=0.0), tail_s=0.001)


def two_level(inst):
    return hierarchical_instance(inst, 2, LinearCost(alpha_s=1e-4, beta_s_per_byte=1e-9),
                                 inst.comm)


@pytest.mark.parametrize("units,seed,hierarchical", [
    (10, 0, False), (10, 1, False), (10, 2, False), (12, 1, False), (40, 3, False),
    (16, 4, True), (24, 0, True)])
def test_fewer_group_plans_follow_the_chain_of_best_merges(units, seed, hierarchical):
    # walked plan by plan: from the optimum, merge the two neighbouring groups whose
    # merge the model prices fastest (the earliest on a tie), down to the target counts
    # (a two-level instance: every merge walked by fewer_group_plans as well)
    inst = many_groups_instance(units, seed)
    inst = two_level(inst) if hierarchical else inst
    opt = planner.make_plan(inst, "optimal")
    got = fewer_group_plans(inst, opt)
    g = len(opt.groups)
    assert g >= 4 and got  # (these instances are meant to need it)
    targets = sorted({round(1 + (g - 2) / 3), round(1 + 2 * (g - 2) / 3)} & set(range(2, g - 1)),
                     reverse=True)
    expected, groups = [], list(opt.groups)
    while len(groups) > min(targets):
        options = [groups[:i] + [groups[i] + groups[i + 1]] + groups[i + 2:]
                   for i in range(len(groups) - 1)]
        times = [planner.evaluate(inst, o, [False] * len(o)).predicted_iteration_s
                 for o in options]
        least = min(times)
        groups = options[next(i for i, t in enumerate(times) if t <= least * (1 + 1e-9))]
        if len(groups) in targets:
            expected.append(tuple(tuple(x) for x in groups))
    assert [tuple(p.groups) for _, p in got] == expected
    assert [len(p.groups) for _, p in got] == targets  # coarsest last
    assert len(got) <= MAX_FEWER_GROUPS
    for name, plan in got:
        k = len(plan.groups)
        assert name == f"{k}-groups" and not any(plan.dense)
        assert plan.predicted_iteration_s == pytest.approx(
            planner.evaluate(inst, plan.groups, [False] * k).predicted_iteration_s, rel=1e-12)


@pytest.mark.parametrize("hierarchical,budget,counts", [
    (False, 3, [5]), (False, 5, [5, 3]), (True, 17, []), (True, 20, [5]), (True, 25, [5, 3])])
def test_the_chain_of_merges_stays_within_its_walks(monkeypatch, hierarchical, budget, counts):
    # 8 groups, targets 5 and 3: three and five merges; priced at once each merge walks
    # one plan, on a two-level instance every merge of the plan (7 + 6 + 5, then 4 + 3)
    inst = many_groups_instance(24, 0)
    inst = two_level(inst) if hierarchical else inst
    groups = [tuple(range(3 * i, 3 * i + 3)) for i in range(8)]
    plan = planner.evaluate(inst, groups, [False] * 8)
    monkeypatch.setattr(plan_selection, "MAX_CHAIN_WALKS", budget)
    walked = []
    real = planner.evaluate
    monkeypatch.setattr(plan_selection.planner_mod, "evaluate",
                        lambda *a, **k: walked.append(1) or real(*a, **k))
    got = fewer_group_plans(inst, plan)
    assert [len(p.groups) for _, p in got] == counts
    assert len(walked) <= budget


def test_fewer_group_plans_only_where_the_optimum_leaves_a_gap():
    inst = many_groups_instance(10, 0)
    for groups in [((0, 1, 2, 3, 4, 5, 6, 7, 8, 9),), ((0, 1, 2, 3, 4), (5, 6, 7, 8, 9)),
                   ((0, 1, 2), (3, 4, 5), (6, 7, 8, 9))]:
        plan = planner.evaluate(inst, groups, [False] * len(groups))
        assert fewer_group_plans(inst, plan) == []


@pytest.mark.parametrize("g,counts", [(4, [2]), (5, [3, 2]), (6, [4, 2]), (7, [4, 3]),
                                      (8, [5, 3]), (20, [13, 7])])
def test_fewer_group_plans_spread_over_the_gap(g, counts):
    inst = many_groups_instance(24, 0)
    groups = [tuple(range(i * 24 // g, (i + 1) * 24 // g)) for i in range(g)]
    plan = planner.evaluate(inst, groups, [False] * g)
    assert [len(p.groups) for _, p in fewer_group_plans(inst, plan)] == counts


def test_the_trial_set_holds_the_coarser_plans_between_the_merge_and_the_split():
    inst = many_groups_instance(10, 2)
    got = model_candidates(inst, "optimal", prune_factor=math.inf, limit=20)
    names = [c.name for c in got]
    opt = planner.make_plan(inst, "optimal")
    g = len(opt.groups)
    fewer = [name for name, _ in fewer_group_plans(inst, opt)]
    assert len(fewer) == 2
    at = names.index(f"{g - 1}-groups")
    assert names[at:] == [f"{g - 1}-groups"] + fewer + [f"{g + 1}-groups"]
    # within the usual limit the split gives way first
    limited = [c.name for c in model_candidates(inst, "optimal", prune_factor=math.inf)]
    assert limited == names[:MAX_CANDIDATES] and f"{g + 1}-groups" not in limited


def test_a_cost_per_group_the_model_misses_makes_a_coarser_plan_win():
    # the fake clock: every sparse group costs 10% of the step more than the model says;
    # the model's optimum and its neighbours lose to a coarser plan the set now holds
    inst = many_groups_instance(10, 1)
    candidates = model_candidates(inst, "optimal")
    step = planner.make_plan(inst, "optimal").predicted_iteration_s
    times = [c.predicted_s + 0.1 * step * len(c.groups) for c in candidates]
    winner, _ = decide(Trial(candidates, 0), [times, times])
    assert winner == min(range(len(times)), key=times.__getitem__)
    assert len(candidates[winner].groups) < len(candidates[0].groups) - 1
    assert candidates[winner].name in [name for name, _ in fewer_group_plans(
        inst, planner.make_plan(inst, "optimal"))]


# ----------------------------------------------------------------------------- schedule
def test_schedule_settles_then_measures_each_candidate_in_order():
    cands = [cand("a", [[0]]), cand("b", [[0]], [True]), cand("c", [[0]], [False])]
    trial = Trial(cands[:2] + [cand("c", [[0, 1]])], start_step=10, settle=1, measure=3,
                  screen_passes=1)
    per = 4
    assert [trial.candidate_at(s) for s in range(9, 10 + 3 * per + 1)] == (
        [None] + [0] * per + [1] * per + [2] * per + [None])
    assert trial.round_end == 22 and not trial.round_complete(21) and trial.round_complete(22)
    # only counted steps are kept; settle steps and steps outside the round are ignored
    for s in range(5, 30):
        trial.record(s, float(s), probe=s / 100 if s % 2 else None,
                     forward=s / 1000 if s % 3 else None)
    row = trial.local_row()
    assert row[:9] == [11.0, 12.0, 13.0, 15.0, 16.0, 17.0, 19.0, 20.0, 21.0]
    # then the same steps' load probes (NaN where the hook had none)
    assert row[9:18] == pytest.approx([0.11, math.nan, 0.13, 0.15, math.nan, 0.17, 0.19,
                                       math.nan, 0.21], nan_ok=True)
    # then their own forwards (the pace)
    assert row[18:] == pytest.approx([0.011, math.nan, 0.013, math.nan, 0.016, 0.017,
                                      0.019, 0.020, math.nan], nan_ok=True)


def test_the_screen_runs_every_candidate_forward_then_backward():
    trial = Trial(three(), start_step=0, settle=1, measure=1)
    assert trial.screen_passes == SCREEN_PASSES == 2
    assert [trial.candidate_at(s) for s in range(13)] == (
        [0, 0, 1, 1, 2, 2, 2, 2, 1, 1, 0, 0, None])
    # each candidate's screen samples are those of both its turns
    for s in range(12):
        trial.record(s, float(s))
    assert trial.local_row()[:6] == [1.0, 3.0, 5.0, 7.0, 9.0, 11.0]
    assert trial.finish_round([trial.local_row()], 12) is None  # a linear drift: all tie
    assert trial.round_samples[0] == {0: [1.0, 11.0], 1: [3.0, 9.0], 2: [5.0, 7.0]}
    assert [trial.measured_s(i) for i in range(3)] == [6.0, 6.0, 6.0]
    assert trial.samples[0] == [1.0, 11.0]
    assert trial.rounds[-1] == [2, 1, 0]  # each contender once in the confirm round
    report = trial.report()
    assert report["confirmed"] == ["dense", "sparse", "model"]
    assert [c["samples"] for c in report["candidates"]] == [2, 2, 2]
    # a lone candidate wins whatever it reads: one turn
    assert Trial([cand("a", [[0]])], 0).rounds == [[0]]


def test_trial_budget_bound():
    trial = Trial([cand(str(i), [[0]] * 1, [bool(i % 2)]) for i in range(MAX_CANDIDATES)], 0)
    assert trial.max_steps() == (MAX_CANDIDATES * SCREEN_PASSES * (SETTLE_STEPS + MEASURE_STEPS)
                                 + (MAX_CONFIRM + MAX_RETAKES) * (SETTLE_STEPS + CONFIRM_STEPS)
                                 + MAX_REMEASURE * TIEBREAK_TURNS
                                 * (SETTLE_STEPS + TIEBREAK_STEPS))
    assert trial.max_steps() == 66  # the documented bound: 6.6% of a 1000-step run
    assert trial_steps_bound(MAX_CANDIDATES, max_retakes=0) == 58  # without load spells
    assert trial_steps_bound(2) == 36  # a later trial: the kept plan and the new one
    assert trial_steps_bound(1) == SETTLE_STEPS + MEASURE_STEPS  # one candidate: no more rounds
    # the bound holds for every path through the rounds, load spells (retakes) included
    rng = random.Random(5)
    retaken = 0
    for _ in range(300):
        n = rng.randint(1, MAX_CANDIDATES)
        trial = Trial([cand(str(i), [[0]] * (i + 1)) for i in range(n)], 0)
        spells = {s for s in range(60) if rng.random() < 0.3}
        step, ran = 0, 0
        while not trial.done:
            times = [[rng.choice([1.0, 1.01, 1.1, 1.5]) for _ in range(n)]]
            step, rows = run_round(trial, times, first_step=step,
                                   probe=lambda r, s: 2.0 if s in spells else 1.0)
            ran = step
            trial.finish_round(rows, step)
        retaken += bool(trial.report()["retaken"])
        assert trial.retakes_used <= MAX_RETAKES
        assert ran <= trial.max_steps() == trial_steps_bound(n)
    assert retaken > 50  # the retake paths were taken


def test_a_trial_with_its_duel_stays_within_its_bound():
    rng = random.Random(6)
    dueled = 0
    for _ in range(200):
        n = rng.randint(1, MAX_CANDIDATES)
        trial = Trial([cand(str(i), [[0]] * (i + 1)) for i in range(n)], 0, duel_pairs=5)
        spells = {s for s in range(100) if rng.random() < 0.3}
        step = 0
        while not trial.done:
            times = [[rng.choice([1.0, 1.01, 1.1, 1.5]) for _ in range(n)]]
            step, rows = run_round(trial, times, first_step=step,
                                   probe=lambda r, s: 2.0 if s in spells else 1.0)
            trial.finish_round(rows, step)
        dueled += trial.round_kinds[-1] == "duel"
        assert step <= trial.max_steps() == trial_steps_bound(n, duel_pairs=5)
        assert sum(trial.steps_run()) == step
    assert dueled > 50  # the duel ran


def test_bad_trial_arguments():
    with pytest.raises(ValueError):
        Trial([], 0)
    with pytest.raises(ValueError):
        Trial([cand("a", [[0]])], 0, measure=0)
    with pytest.raises(ValueError, match="confirm"):
        Trial([cand("a", [[0]])], 0, confirm=0)
    with pytest.raises(ValueError, match="windows"):
        Trial([cand("a", [[0]])], 0, confirm_window=-0.1)
    for bad in (0, 1.5, True, None):
        with pytest.raises(ValueError, match="screen_passes"):
            Trial([cand("a", [[0]])], 0, screen_passes=bad)
    trial = Trial([cand("a", [[0]]), cand("b", [[0, 1]])], 0, measure=3, screen_passes=1)
    with pytest.raises(ValueError, match="rows of 18"):
        trial.finish_round([[1.0] * 5], 8)
    with pytest.raises(ValueError, match="rows of 18"):  # ranks must agree on the width
        trial.finish_round([[1.0] * 6, [1.0] * 12], 8)
    for bad in (1, "yes"):
        with pytest.raises(ValueError, match="adjust_pace"):
            Trial([cand("a", [[0]])], 0, adjust_pace=bad)
    with pytest.raises(ValueError, match="spell_factor"):
        Trial([cand("a", [[0]])], 0, spell_factor=1.0)
    with pytest.raises(ValueError, match="max_retakes"):
        Trial([cand("a", [[0]])], 0, max_retakes=-1)


# ----------------------------------------------------------------------------- decision
def three():
    return [cand("model", [[0, 1]]), cand("sparse", [[0], [1]]), cand("dense", [[0], [1]], [True, True])]


def decide(trial, step_times, first_step=None):
    """Run rounds with the same per-candidate times until the trial decides."""
    step = first_step
    while True:
        step, rows = run_round(trial, step_times, first_step=step)
        winner = trial.finish_round(rows, step)
        if winner is not None:
            return winner, step


def test_the_slowest_rank_decides_and_the_model_choice_can_lose():
    # rank 0 alone would keep the model's choice; rank 1 is slow under it, so the step
    # (which waits for rank 1) is slow, and "sparse" wins
    trial = Trial(three(), 0)
    step, rows = run_round(trial, [[1.0, 1.2, 1.5], [2.0, 1.3, 1.6]])
    # screen: sparse 1.3 is best, dense 1.6 within 30% and the model's 2.0 is not
    assert trial.finish_round(rows, step) is None and trial.rounds[-1] == [2, 1]
    winner, _ = decide(trial, [[1.0, 1.2, 1.5], [2.0, 1.3, 1.6]], first_step=step)
    assert winner == 1 and trial.done
    assert trial.measured_s(0) == 2.0 and trial.measured_s(1) == 1.3
    report = trial.report()
    assert report["winner"] == "sparse" and [c["winner"] for c in report["candidates"]] == [False, True, False]
    assert report["confirmed"] == ["dense", "sparse"] and report["remeasured"] == []
    assert "*sparse" in summary_of(report) and trial.candidate_at(step) is None


def test_a_clear_winner_of_the_screen_needs_no_more_rounds():
    trial = Trial(three(), 0)
    step, rows = run_round(trial, [[1.0, 2.0, 3.0]])
    assert trial.finish_round(rows, step) == 0 and len(trial.rounds) == 1
    assert step == 3 * SCREEN_PASSES * (SETTLE_STEPS + MEASURE_STEPS)


def test_same_rows_same_decision_whatever_each_rank_clock_reads():
    """Each rank decides from the gathered rows alone; permuting or re-basing the ranks'
    clocks (an offset) changes nothing, a rank whose clock runs fast changes the maximum
    the same way for everyone."""
    rng = random.Random(3)
    for _ in range(200):
        n = rng.randint(1, 5)
        ranks = rng.randint(1, 4)
        times = [[rng.choice([1.0, 1.01, 1.3, 2.0]) * (1 + 0.5 * r) for _ in range(n)]
                 for r in range(ranks)]
        cands = [cand(f"c{i}", [[0]] * 1, [i % 2 == 1]) if i < 2 else cand(f"c{i}", [[0, i]])
                 for i in range(n)]
        decisions = []
        for order in itertools.islice(itertools.permutations(range(ranks)), 3):
            trial = Trial(cands, 7)
            winner, _ = decide(trial, [times[r] for r in order])
            decisions.append((winner, trial.report()))
        assert all(d == decisions[0] for d in decisions)
        slowest = [max(times[r][i] for r in range(ranks)) for i in range(n)]
        assert decisions[0][0] == min(range(n), key=lambda i: (slowest[i], i))


def timed_round(trial, step, seconds):
    """One round on one rank in which the candidate ``index`` running ``step`` takes
    ``seconds(index, step)``. Returns the step after the round and the rows to finish it."""
    start = step
    while not trial.round_complete(step):
        trial.record(step, seconds(trial.candidate_at(step), step))
        step += 1
    assert start < step
    return step, [trial.local_row()]


def drifting_round(trial, step, base, drift):
    """One round in which candidate i takes base[i] * (1 + drift * step): the machine
    slows down (or speeds up) linearly while the trial runs."""
    return timed_round(trial, step, lambda i, s: base[i] * (1.0 + drift * s))


def test_reversed_rounds_cancel_a_drift_that_would_favour_the_last_candidate():
    """The model's choice is 3% faster than two equal plans, measured while the machine
    gets quicker or slower by 0.5% per step: the screen alone ranks by position (the
    last one looks fastest when the machine speeds up); the confirm round runs in
    reverse and the rounds are averaged, which picks the truly fastest."""
    base = [0.97, 1.0, 1.0]
    for drift in (-0.005, 0.005):
        trial = Trial(three(), 0)
        step = 0
        while not trial.done:
            step, rows = drifting_round(trial, step, base, drift)
            trial.finish_round(rows, step)
        assert trial.winner == 0, (drift, trial.report())
    # a one-round, one-pass trial (no confirm) is fooled by the same drift; the two-pass
    # screen alone is not
    fooled = Trial(three(), 0, confirm_window=0.0, **ONE_PASS)
    step, rows = drifting_round(fooled, 0, base, -0.005)
    assert fooled.finish_round(rows, step) == 2
    screen = Trial(three(), 0, confirm_window=0.0)
    step, rows = drifting_round(screen, 0, base, -0.005)
    assert screen.finish_round(rows, step) == 0


def test_the_first_trial_leads_in_so_a_slow_start_does_not_drop_the_first_candidates():
    """As on the shaped cluster: the steps right after the dense warm-up run 30% slow.
    The fastest plan (third of six, 6% ahead) read slow in a screen that starts there
    and was not confirmed (only 3 contenders are); the lead's uncounted steps (the
    model's choice) let the start-up pass before anything is counted."""
    base = [1.10, 1.08, 1.00, 1.07, 1.06, 1.07]
    cands = [cand(f"c{i}", [[0]] * (i + 1)) for i in range(len(base))]

    def run(trial):
        step, ran = 0, []
        while not trial.done:
            start = step
            while not trial.round_complete(step):
                index = trial.candidate_at(step)
                ran.append(index)
                trial.record(step, base[index] * (1.3 if step < 6 else 1.0))
                step += 1
            assert start < step
            trial.finish_round([trial.local_row()], step)
        return trial.report(), ran
    for passes in (1, 2):  # (two passes halve a start-up spell; they do not remove it)
        report, _ = run(Trial(cands, 0, screen_passes=passes))
        assert "c2" not in report["confirmed"] and report["winner"] != "c2"
    report, ran = run(Trial(cands, 0, lead=6))
    assert report["winner"] == "c2" and report["lead"] == 6
    assert ran[:8] == [0] * 8  # the lead, then c0's first turn (settle, counted)
    assert Trial(cands, 0, lead=6).max_steps() == trial_steps_bound(len(cands)) + 6
    with pytest.raises(ValueError, match="lead"):
        Trial(cands, 0, lead=-1)


def test_near_ties_are_broken_by_a_third_round_sized_by_the_noise():
    trial = Trial(three(), 0, near_tie=0.02, max_remeasure=2)
    step, rows = run_round(trial, [[1.00, 1.015, 1.019]])  # all within 30% of the best
    assert trial.finish_round(rows, step) is None and trial.rounds[1] == [2, 1, 0]
    assert trial.round_start == step and trial.candidate_at(step) == 2
    per = SETTLE_STEPS + CONFIRM_STEPS
    assert trial.candidate_at(step + per) == 1 and trial.round_end == step + 3 * per
    # confirm: "sparse" now best, "model" within 2%: the tie-break round runs both, two
    # turns each in mirrored order ("dense", 30% behind after confirming, does not)
    step, rows = run_round(trial, [[1.02, 1.0, 1.3]])
    assert trial.finish_round(rows, step) is None
    assert trial.rounds[2] == [0, 1, 1, 0]
    assert trial.round_kinds == ["screen", "confirm", "tiebreak"]
    per = SETTLE_STEPS + TIEBREAK_STEPS
    assert trial.round_end == step + 4 * per and trial.counted == TIEBREAK_STEPS
    step, rows = run_round(trial, [[1.05, 1.0]])
    assert trial.finish_round(rows, step) == 1
    # weighted by turns: 2 in the screen, 1 in the confirm round, 2 in the tie-break
    assert trial.measured_s(1) == pytest.approx(1.015 ** (2 / 5))
    report = trial.report()
    assert report["remeasured"] == ["model", "sparse"]
    assert report["candidates"][1]["rounds"] == [
        ["screen", pytest.approx(1.015)], ["confirm", 1.0], ["tiebreak", 1.0]]
    assert report["candidates"][2]["rounds"] == [["screen", 1.019], ["confirm", 1.3]]


def test_a_near_tie_of_three_remeasures_all_three():
    """At N = 8, d = 0.001 three confirmed plans were within 2% and only the best two
    were measured again: the third (``single``) ran 7% faster in the timed steps."""
    trial = Trial(three(), 0)
    winner, _ = decide(trial, [[1.01, 1.0, 1.02]])
    assert winner == 1
    assert trial.rounds[-1] == [0, 1, 2, 2, 1, 0]
    assert trial.report()["remeasured"] == ["model", "sparse", "dense"]
    old = Trial(three(), 0, max_remeasure=2, tiebreak_turns=1)
    decide(old, [[1.01, 1.0, 1.02]])
    assert old.rounds[-1] == [0, 1]


def test_the_turn_noise_is_what_one_candidate_moved_against_the_others():
    trial = Trial(three() + [cand("d", [[1], [0]])], 0)
    assert trial.turn_noise() is None  # nothing measured yet
    # second turns against first: +10% for "model" and "d", +14% for "sparse", +2% for
    # "dense"
    firsts, seconds = [1.0, 1.2, 1.5, 1.1], [1.1, 1.2 * 1.14, 1.5 * 1.02, 1.21]
    first_pass = 4 * (SETTLE_STEPS + MEASURE_STEPS)  # (every first turn, then the second)
    step, rows = timed_round(trial, 0, lambda i, s: (firsts if s < first_pass else seconds)[i])
    trial.finish_round(rows, step)
    # what all moved alike (the median, +10%) is a drift; the noise is the median
    # deviation from it: of 0, 0, |log 1.14/1.1| and |log 1.02/1.1|
    deviations = [0.0, 0.0, math.log(1.14 / 1.1), math.log(1.1 / 1.02)]
    assert trial.turn_noise() == pytest.approx(statistics.median(deviations))
    assert trial.turn_noise() > 0.01
    # one pass has no turn to compare
    one = Trial(three(), 0, screen_passes=1)
    step, rows = run_round(one, [[1.0, 1.2, 1.3]])
    one.finish_round(rows, step)
    assert one.turn_noise() is None


def test_turn_to_turn_noise_widens_the_tie():
    """Quiet turns (every step of a turn alike) that disagree from turn to turn: the
    spread within the confirm round reads 0, the screen's turns say the readings move by
    about 8%: the lead is not resolved and the tie-break runs."""
    def run(second_turn):
        trial = Trial(three(), 0)
        first_pass = 3 * (SETTLE_STEPS + MEASURE_STEPS)
        step, rows = timed_round(trial, 0, lambda i, s: [1.0, 1.06, 1.5][i] * (
            1.0 if s < first_pass else second_turn[i]))
        assert trial.finish_round(rows, step) is None  # confirm 0, 1
        step, rows = run_round(trial, [[1.0, 1.06, 1.5]])
        trial.finish_round(rows, step)
        return trial
    quiet = run([1.0, 1.0, 1.0])
    assert quiet.done and quiet.turn_noise() == 0.0
    assert quiet.winner == 0 and quiet.round_kinds == ["screen", "confirm"]
    noisy = run([1.08, 0.92, 1.0])
    assert not noisy.done and noisy.round_kinds[-1] == "tiebreak"
    assert noisy.noise == pytest.approx(noisy.turn_noise()) and noisy.noise > 0.04


def test_noisy_samples_widen_the_tie():
    # screen: both 1.00; confirm: medians 1.00 and 1.15 (4.8% apart over the rounds,
    # beyond NEAR_TIE); the samples scatter by about 10%, so the difference is not
    # resolved and the tie-break runs
    trial = Trial(three()[:2], 0, measure=1, confirm=3)
    step, rows = run_round(trial, [[1.0, 1.0]])
    assert trial.finish_round(rows, step) is None
    rows = [[1.25, 1.15, 1.05, 0.9, 1.0, 1.1]]  # candidate 1 first (reverse order)
    step = trial.round_end
    assert trial.finish_round(rows, step) is None and trial.noise > 0.04
    assert trial.round_kinds[-1] == "tiebreak"
    # the same medians with quiet samples: decided at once
    quiet = Trial(three()[:2], 0, measure=1, confirm=3)
    step, rows = run_round(quiet, [[1.0, 1.0]])
    quiet.finish_round(rows, step)
    assert quiet.finish_round([[1.15, 1.15, 1.15, 1.0, 1.0, 1.0]], quiet.round_end) == 0
    assert quiet.noise == 0.0


def test_exact_ties_go_to_the_model_choice():
    trial = Trial(three(), 0)
    winner, _ = decide(trial, [[1.0, 1.0, 3.0]])
    assert winner == 0  # a tie to the end: the lower index
    assert trial.round_kinds == ["screen", "confirm", "tiebreak"]


def test_missing_samples_are_ignored():
    nan = math.nan
    trial = Trial(three()[:2], 0, measure=3, confirm_window=0.0, screen_passes=1)
    # rank 0 missed the first counted step of candidate 0 (a resume); rank 1 has it all
    rows = [[nan, 1.0, 1.0, 2.0, 2.0, 2.0], [1.1, 1.1, 1.1, 2.1, 2.1, 2.1]]
    assert trial.finish_round(rows, 8) == 0
    assert trial.samples[0] == [1.1, 1.1, 1.1]
    trial = Trial(three()[:2], 0, measure=2, screen_passes=1)
    # no rank measured candidate 0 at all: it cannot win
    assert trial.finish_round([[nan, nan, 3.0, 3.0]], 8) == 1
    assert trial.report()["candidates"][0]["measured_s"] is None


# --------------------------------------------------------------------------- load spells
#: the one-pass screen of 2 counted steps per candidate that the step numbers of the
#: spells below were written for (the spell logic is the same with two passes)
ONE_PASS = dict(screen_passes=1, measure=2)


def spell_over(steps, factor=1.8):
    """(probe, extra): a load spell over ``steps`` slows those steps' compute by
    ``factor`` on every rank; the forward (probe, 10 ms quiet) shows it."""
    def probe(rank, step):
        return 0.010 * (factor if step in steps else 1.0)

    def extra(rank, step):
        return 0.050 * (factor - 1.0) if step in steps else 0.0
    return probe, extra


def run_trial(trial, times, probe=None, extra=None):
    step = trial.round_start
    while not trial.done:
        step, rows = run_round(trial, times, first_step=step, probe=probe, extra=extra)
        trial.finish_round(rows, step)
    return trial.report()


def test_a_load_spell_over_the_best_candidates_screen_turn_is_retaken():
    # four candidates; "b" (index 1) is the fastest by 10%, but a 1.8x spell covers
    # its whole screen turn (steps 3-5, 3 the settle step) and c's first counted step (7)
    times = [[0.100, 0.090, 0.105, 0.130]]
    probe, extra = spell_over({3, 4, 5, 7})
    cands = [cand(n, [[0]] * (i + 1)) for i, n in enumerate("abcd")]
    blind = run_trial(Trial(cands, 0, **ONE_PASS), times, extra=extra)  # no probes: the spell decides
    assert blind["winner"] != "b" and not blind["retaken"]
    seen = run_trial(Trial(cands, 0, **ONE_PASS), times, probe=probe, extra=extra)
    assert seen["winner"] == "b"
    assert seen["retaken"] == ["b"]  # all of b's screen samples were disturbed
    by_name = {c["name"]: c for c in seen["candidates"]}
    # c kept its undisturbed screen sample, b its retake's: both at their quiet times
    assert by_name["b"]["disturbed"] == 2 and by_name["c"]["disturbed"] == 1
    assert by_name["b"]["measured_s"] == pytest.approx(0.090)
    assert "*b 1000.0/90.0 ~2, c 1000.0/105.0 ~1" in summary_of(seen) and summary_of(seen).endswith("load spell: b")
    assert by_name["c"]["measured_s"] == pytest.approx(0.105)
    # with the guard off (a factor no spell reaches) the probes change nothing
    off = run_trial(Trial(cands, 0, spell_factor=1e9, **ONE_PASS), times, probe=probe, extra=extra)
    assert off["winner"] == blind["winner"] and off["candidates"] == blind["candidates"]


def test_a_disturbed_candidate_that_could_not_contend_is_not_retaken():
    # "d" is 2.5x slower than the best; a 1.8x spell over its turn (steps 10-11) cannot
    # explain that, so its turn is not run again; the same spell over "b" is retaken
    times = [[0.100, 0.090, 0.105, 0.250]]
    cands = [cand(n, [[0]] * (i + 1)) for i, n in enumerate("abcd")]
    probe, extra = spell_over({10, 11})
    report = run_trial(Trial(cands, 0, **ONE_PASS), times, probe=probe, extra=extra)
    assert report["retaken"] == [] and report["winner"] == "b"
    assert {c["name"]: c["disturbed"] for c in report["candidates"]}["d"] == 2
    probe, extra = spell_over({4, 5})
    assert run_trial(Trial(cands, 0, **ONE_PASS), times, probe=probe, extra=extra)["retaken"] == ["b"]


def test_each_rank_is_judged_against_its_own_forward_time():
    # rank 1's forward is always 3x rank 0's (a slower host): not a spell. A spell on
    # rank 1 alone slows the collective step, and is seen there.
    times = [[0.100, 0.090, 0.120], [0.100, 0.090, 0.120]]
    spell_steps = {4}

    def probe(rank, step):
        return 0.010 * (3.0 if rank else 1.0) * (2.0 if rank and step in spell_steps else 1.0)

    def extra(rank, step):
        return 0.1 if rank and step in spell_steps else 0.0
    trial = Trial(three(), 0, **ONE_PASS)
    report = run_trial(trial, times, probe=probe, extra=extra)
    assert report["winner"] == "sparse"
    assert [c["disturbed"] for c in report["candidates"]] == [0, 1, 0]
    assert not report["retaken"]  # "sparse" kept its other screen sample


def test_retakes_are_bounded_and_a_disturbed_retake_keeps_the_lower_median():
    # every step of the trial is in the spell but the very first ones: the probes'
    # median follows the spell, so a long enough spell reads as the normal level - and
    # the trial still ends within its bound
    times = [[0.100, 0.090, 0.105, 0.130, 0.095]]
    cands = [cand(n, [[0]] * (i + 1)) for i, n in enumerate("abcde")]
    probe, extra = spell_over(set(range(3, 12)), factor=1.5)
    trial = Trial(cands, 0, max_retakes=1, **ONE_PASS)
    report = run_trial(trial, times, probe=probe, extra=extra)
    assert trial.retakes_used <= 1 and trial.decided_at <= trial.max_steps()
    # retake fallback: both sets disturbed, the lower median stays
    t = Trial(three()[:2], 0, confirm=2, confirm_window=0.0, max_retakes=1, **ONE_PASS)
    quiet = [0.01, 0.01, 0.01, 0.01]
    assert t.finish_round([[1.0, 1.0, 1.2, 1.2] + quiet[:2] + [0.02, 0.02]], 6) is None
    assert t.report()["retaken"] == ["sparse"] and t.round_kinds[-1] == "retake"
    assert t.finish_round([[2.5, 2.5, 0.03, 0.03]], 9) == 0  # disturbed again, slower
    assert t.round_samples[0][1] == [1.2, 1.2]  # the lower of the two kept
    assert report["winner"] in "abcde"


def test_state_dict_round_trip_during_a_retake_continues_identically():
    times = [[0.100, 0.090, 0.105]]
    probe, extra = spell_over({4, 5})
    reference = Trial(three(), 0, **ONE_PASS)
    step, rows = run_round(reference, times, probe=probe, extra=extra)
    assert reference.finish_round(rows, step) is None and reference.round_kinds[-1] == "retake"
    saved = reference.state_dict()
    restored = Trial.from_state_dict(saved)
    assert restored.state_dict() == saved
    assert run_trial(restored, times, probe=probe) == run_trial(reference, times, probe=probe)
    # a state saved before load probes (no probe fields) still loads and finishes
    old = {k: v for k, v in Trial(three(), 0).state_dict().items()
           if k not in ("spell_factor", "max_retakes", "retakes_used", "disturbed", "probes",
                        "local_probe")}
    assert run_trial(Trial.from_state_dict(old), times)["winner"] == "sparse"


PHASED = dict(screen_passes=1, measure=2, confirm=2)


def _phased_host(adjust, trial=None):
    """Two candidates on 2 ranks: ``b`` is 5% slower than ``a``, but every turn of
    ``a`` runs in a slow phase of the host (its forwards, and the compute of its steps,
    20% slower) and every turn of ``b`` in a quick one. Returns the finished trial."""
    if trial is None:
        trial = Trial([cand("a", [[0, 1]]), cand("b", [[0], [1]])], 0, adjust_pace=adjust,
                      **PHASED)
    base = [[1.0, 1.05], [1.0, 1.05]]
    slow = {0: 1.2, 1: 1.0}

    def extra(rank, step):  # the whole step slows with the host (compute-bound)
        index = trial.candidate_at(step)
        return base[rank][index] * (slow[index] - 1.0)

    def forward(rank, step):
        return 0.3 * slow[trial.candidate_at(step)] * (1.0 + 0.01 * rank)

    step = 0
    while not trial.done:
        step, rows = run_round(trial, base, first_step=step, extra=extra, forward=forward)
        trial.finish_round(rows, step)
    return trial


def test_each_step_is_divided_by_its_pace():
    """The forward of a step tells how fast the host ran it: without the pace the
    slow phase picks the slower plan, with it the faster one wins."""
    fooled = _phased_host(adjust=False)
    assert fooled.report()["winner"] == "b"
    paced = _phased_host(adjust=True)
    report = paced.report()
    assert report["winner"] == "a"
    by_name = {c["name"]: c for c in report["candidates"]}
    # each rank's median forward is the reference: a's steps ran at 1.2 / 1.1 of it
    assert by_name["a"]["pace"] == pytest.approx(1.2 / 1.1)
    assert by_name["b"]["pace"] == pytest.approx(1.0 / 1.1)
    assert by_name["a"]["measured_s"] == pytest.approx(1.2 * 1.1 / 1.2)
    assert by_name["b"]["measured_s"] == pytest.approx(1.05 * 1.1)
    # without forwards (NaN, e.g. on CUDA) nothing is divided
    plain = Trial([cand("a", [[0, 1]]), cand("b", [[0], [1]])], 0, **PHASED)
    step, rows = run_round(plain, [[1.0, 1.05]])
    plain.finish_round(rows, step)
    assert all(c["pace"] == 1.0 for c in plain.report()["candidates"])


def test_the_pace_is_the_mean_over_ranks():
    """One rank's forward alone 20% slow (its own jitter) moves the pace by half that on
    2 ranks; the load probe of the same step takes the largest rank."""
    trial = Trial([cand("a", [[0, 1]]), cand("b", [[0], [1]])], 0, screen_passes=1,
                  measure=3)
    jitter = {(0, 1): 1.2}
    step, rows = run_round(trial, [[1.0, 1.0], [1.0, 1.0]],
                           forward=lambda r, s: jitter.get((r, s), 1.0),
                           probe=lambda r, s: jitter.get((r, s), 1.0))
    trial.finish_round(rows, step)
    assert trial.paces[0] == pytest.approx([1.1, 1.0, 1.0])
    assert trial.samples[0] == pytest.approx([1.0 / 1.1, 1.0, 1.0])


def test_a_pace_beyond_the_spell_factor_is_clamped_to_it():
    times = [[1.0, 1.0]]
    trial = Trial([cand("a", [[0, 1]]), cand("b", [[0], [1]])], 0, screen_passes=1,
                  measure=3, spell_factor=1.5)
    step, rows = run_round(trial, times, forward=lambda r, s: 9.0 if s == 1 else 1.0)
    trial.finish_round(rows, step)
    # a's three samples: 1.0, then one with a forward 9x the median (clamped to 1.5)
    assert trial.samples[0] == pytest.approx([1.0 / 1.5, 1.0, 1.0])
    assert trial.paces[0] == pytest.approx([1.5, 1.0, 1.0])


def test_a_trial_saved_before_the_pace_goes_on_without_it():
    new = Trial([cand("a", [[0, 1]]), cand("b", [[0], [1]])], 0, **PHASED)
    old = {k: v for k, v in new.state_dict().items()
           if k not in ("adjust_pace", "forwards", "paces", "local_forward")}
    restored = Trial.from_state_dict(old)
    assert restored.adjust_pace is False
    assert all(math.isnan(x) for r in restored.local_forward for x in r)
    # it decides as it would have before: the phases fool it
    assert _phased_host(adjust=None, trial=restored).report()["winner"] == "b"
    # a state with the pace round-trips
    saved = _phased_host(adjust=True).state_dict()
    assert Trial.from_state_dict(saved).state_dict() == saved


def test_rows_without_probes_are_the_plain_trial():
    times = [[1.0, 1.01, 1.5], [1.2, 1.19, 1.4]]
    a, b = Trial(three(), 0), Trial(three(), 0)
    step = 0
    while not a.done:
        step, rows = run_round(a, times, first_step=step)
        half = [r[:len(r) // 3] for r in rows]  # a caller that sends times only
        assert a.finish_round(rows, step) == b.finish_round(half, step)
    assert a.report() == b.report()


def test_state_dict_round_trip_mid_trial_continues_identically():
    times = [[1.0, 1.01, 1.5], [1.2, 1.19, 1.4]]
    reference = Trial(three(), 5)
    step, rows = run_round(reference, times)
    reference.finish_round(rows, step)  # the confirm round starts
    for _ in range(2):
        saved = reference.state_dict()
        restored = Trial.from_state_dict(saved)
        assert restored.state_dict() == saved
        outcomes = []
        for trial in (reference, restored):
            step2, rows2 = run_round(trial, times)
            outcomes.append((trial.finish_round(rows2, step2), trial.report()))
        assert outcomes[0] == outcomes[1]
        if reference.done:
            break
    assert reference.done and reference.round_kinds[-1] == "tiebreak"
    assert reference.rounds[-1] == [0, 1, 1, 0]


# ------------------------------------------------------------------------------ the duel
def run_duel(trial, reading, step, ranks=1):
    """Drive the duel round: ``reading(candidate, step)`` -> seconds (every rank)."""
    assert trial.round_kinds[-1] == "duel"
    start = trial.round_start
    while not trial.round_complete(step):
        step += 1
    rows = []
    for _ in range(ranks):
        trial.local, trial.local_probe, trial.local_forward = (
            trial._empty_local(), trial._empty_local(), trial._empty_local())
        for s in range(start, step):
            trial.record(s, reading(trial.candidate_at(s), s))
        rows.append(trial.local_row())
    return trial.finish_round(rows, step), step


def test_the_duel_alternates_the_two_leaders_and_the_faster_side_by_side_wins():
    trial = Trial(three(), 0, duel_pairs=6)
    # the rounds before: "model" ahead of "sparse" by 2% ("dense" beyond the windows)
    winner, step = decide_or_duel(trial, [[1.0, 1.02, 1.5]])
    assert winner is None and trial.round_kinds[-1] == "duel"
    assert trial.rounds[-1] == [0, 1, 1, 0] * 3  # W R, R W, ...
    assert trial.round_end == step + 12 * (SETTLE_STEPS + plan_selection.DUEL_STEPS)
    # side by side, under a host that runs in phases of 10 steps 30% apart: "sparse"
    # is 3% faster; each pair's two turns share their phase
    def reading(index, s):
        phase = 1.3 if (s // 10) % 2 else 1.0
        return phase * (1.0 if index == 1 else 1.03)
    winner, end = run_duel(trial, reading, step)
    assert winner == 1 and trial.done and trial.decided_at == end
    duel = trial.report()["duel"]
    assert duel["winner"] == "model" and duel["rival"] == "sparse" and duel["switched"]
    assert duel["pairs"] == 6 and duel["median_ratio"] == pytest.approx(1 / 1.03)
    assert trial.report()["winner"] == "sparse"
    # the duel decides between its two alone: the rounds before are the reported times
    assert trial.measured_s(0) == pytest.approx(1.0) and trial.measured_s(1) == pytest.approx(1.02)
    assert "side by side, sparse over model: 0.971 (median of 6 pairs), sparse kept" in trial.summary()
    assert sum(trial.steps_run()) == end


def decide_or_duel(trial, step_times):
    """Run rounds until the trial decides or its duel starts: (winner or None, step)."""
    step = None
    while True:
        step, rows = run_round(trial, step_times, first_step=step)
        winner = trial.finish_round(rows, step)
        if winner is not None or trial.round_kinds[-1] == "duel":
            return winner, step


def test_the_duel_keeps_the_winner_that_stays_faster():
    trial = Trial(three(), 0, duel_pairs=4)
    _, step = decide_or_duel(trial, [[1.0, 1.02, 1.5]])
    # one pair reads the other way (a spell over the winner's turn): the median holds
    winner, _ = run_duel(trial, lambda i, s: (1.0 if i == 0 else 1.01) * (2 if s == step + 1 else 1), step)
    assert winner == 0 and trial.report()["duel"]["switched"] is False
    assert trial.report()["duel"]["median_ratio"] == pytest.approx(1.01)


def test_no_duel_without_a_runner_up_in_the_window_or_with_none_asked_for(monkeypatch):
    # "sparse" 40% behind: beyond the confirm window, the screen decides alone
    trial = Trial(three(), 0, duel_pairs=4)
    winner, _ = decide_or_duel(trial, [[1.0, 1.4, 1.5]])
    assert winner == 0 and trial.duel is None and trial.report()["duel"] is None
    trial = Trial(three(), 0, duel_pairs=0)
    winner, _ = decide_or_duel(trial, [[1.0, 1.02, 1.5]])
    assert winner == 0 and "duel" not in trial.round_kinds
    one = Trial(three()[:1], 0, duel_pairs=4)
    assert decide_or_duel(one, [[1.0]])[0] == 0 and one.duel is None
    # the module's value is the default; later trials run none
    monkeypatch.setattr(plan_selection, "DUEL_PAIRS", 7)
    assert Trial(three(), 0).duel_pairs == 7
    assert plan_selection.duel_pairs_for("first") == plan_selection.duel_pairs_for("layout") == 7
    assert plan_selection.duel_pairs_for("periodic") == plan_selection.duel_pairs_for("regret") == 0


def test_a_duel_without_a_known_pair_leaves_the_rounds_before_deciding():
    trial = Trial(three(), 0, duel_pairs=3)
    _, step = decide_or_duel(trial, [[1.0, 1.02, 1.5]])
    winner, _ = run_duel(trial, lambda i, s: math.nan, step)
    assert winner == 0 and trial.report()["duel"]["pairs"] == 0


def test_bad_duel_arguments_name_the_option():
    for kwargs, name in (({"duel_pairs": -1}, "duel_pairs"), ({"duel_pairs": 1.5}, "duel_pairs"),
                         ({"duel_steps": 0}, "duel_steps")):
        with pytest.raises(ValueError, match=name):
            Trial(three(), 0, **kwargs)


def test_state_dict_round_trip_mid_duel_continues_identically():
    reference = Trial(three(), 0, duel_pairs=4)
    _, step = decide_or_duel(reference, [[1.0, 1.02, 1.5]])
    # the duel's first turns recorded, then saved and restored
    for s in range(step, step + 3):
        reference.record(s, 1.0 if reference.candidate_at(s) == 1 else 1.05)
    restored = Trial.from_state_dict(reference.state_dict())
    assert restored.state_dict() == reference.state_dict()
    outcomes = []
    for trial in (reference, restored):
        for s in range(step + 3, trial.round_end):
            trial.record(s, 1.0 if trial.candidate_at(s) == 1 else 1.05)
        outcomes.append((trial.finish_round([trial.local_row()], trial.round_end), trial.report()))
    assert outcomes[0] == outcomes[1] and outcomes[0][0] == 1
    # a state saved before the duel existed ends without one
    old = reference.state_dict()
    for key in ("duel_pairs", "duel_steps", "duel"):
        old.pop(key)
    assert Trial.from_state_dict(old).duel_pairs == 0


def test_the_regret_check_leaves_out_the_duels_loser():
    trial = Trial(three(), 0, duel_pairs=4)
    _, step = decide_or_duel(trial, [[1.0, 1.02, 1.5]])
    run_duel(trial, lambda i, s: 1.0 if i == 1 else 1.03, step)
    report = trial.report()
    # the winner ("sparse") runs at 1.2 once settled: "model" (1.0 in the trial) lost
    # the duel to it side by side, "dense" (1.5) is slower
    assert plan_selection.regret_rival(report, 1.2) is None
    without = dict(report, duel=None)
    assert plan_selection.regret_rival(without, 1.2)["name"] == "model"


def test_the_trial_reports_its_steps_and_what_they_cost_against_the_winner():
    trial = Trial(three(), 0, lead=6)
    assert trial.excess_steps() is None and trial.steps_run() == [6, 0, 0]
    winner, end = decide(trial, [[1.0, 1.1, 2.0]])
    assert winner == 0 and trial.round_kinds == ["screen", "confirm"]
    # screen: 2 turns of 2 steps each; the confirm round: "model" and "sparse" (within
    # 30%), 4 steps each; the lead ran the model's choice
    assert trial.steps_run() == [6 + 4 + 4, 4 + 4, 4] and sum(trial.steps_run()) == end
    assert trial.excess_steps() == pytest.approx(8 * 0.1 + 4 * 1.0)
    report = trial.report()
    assert report["steps"] == end and report["excess_steps"] == pytest.approx(4.8)


def test_a_trial_saved_by_the_two_round_version_finishes_its_tie_break():
    old = {"candidates": [c.to_dict() for c in three()], "reason": "first", "settle": 1,
           "measure": 3, "near_tie": 0.02, "max_remeasure": 2, "start_step": 5,
           "rounds": [[0, 1, 2], [0, 1]], "round_start": 17,
           "samples": [[1.0] * 3, [1.01] * 3, [1.5] * 3],
           "local": [[math.nan] * 3, [math.nan] * 3], "winner": None, "decided_at": None}
    trial = Trial.from_state_dict(old)
    assert trial.round_kinds == ["screen", "tiebreak"] and trial.round_end == 17 + 2 * 4
    assert trial.finish_round([[1.0] * 3 + [0.9] * 3], 25) == 1


# ----------------------------------------------------------------------------- correction
NUMELS = [100, 200, 300, 400]
PLANS = [([[0, 1, 2, 3]], [False]), ([[0], [1], [2], [3]], [False] * 4),
         ([[0], [1], [2], [3]], [True, False, True, False]), ([[0, 1], [2, 3]], [True, False]),
         ([[0], [1, 2, 3]], [False, True])]


def entries(truth, predicted=0.05, plans=PLANS, measured=True):
    out = []
    for groups, dense in plans:
        extra = truth.extra_s(*plan_features(groups, dense, NUMELS))
        out.append({"groups": groups, "dense": dense, "predicted_s": predicted,
                    "measured_s": predicted + extra if measured else None})
    return out


def test_plan_features():
    assert plan_features([[0, 1], [2, 3]], [True, False], NUMELS) == (300, 1)
    assert plan_features([[0, 1, 2, 3]], [False], NUMELS) == (0, 1)


def test_fit_correction_recovers_the_extra_cost_of_dense_elements_and_groups():
    truth = Correction(constant_s=0.004, dense_s_per_element=2e-6, sparse_group_s=0.001)
    got = fit_correction(entries(truth), NUMELS)
    assert got.points == len(PLANS)
    assert got.constant_s == pytest.approx(0.004, rel=1e-9)
    assert got.dense_s_per_element == pytest.approx(2e-6, rel=1e-9)
    assert got.sparse_group_s == pytest.approx(0.001, rel=1e-9)
    assert Correction.from_dict(got.to_dict()) == got


def test_fit_correction_drops_what_it_cannot_tell_apart():
    # no dense plan measured: the dense term is not identifiable and stays zero
    sparse_only = [p for p in PLANS if not any(p[1])]
    truth = Correction(constant_s=0.002, sparse_group_s=0.0005)
    got = fit_correction(entries(truth, plans=sparse_only), NUMELS)
    assert got.dense_s_per_element == 0.0
    assert got.constant_s == pytest.approx(0.002) and got.sparse_group_s == pytest.approx(0.0005)
    # dense groups that measured *faster* than predicted: contention is never negative
    got = fit_correction(entries(Correction(constant_s=0.01, dense_s_per_element=-1e-6)), NUMELS)
    assert got.dense_s_per_element == 0.0
    # one point: the constant alone; none measured: nothing to fit
    one = fit_correction(entries(Correction(constant_s=0.003), plans=PLANS[:1]), NUMELS)
    assert one == Correction(constant_s=pytest.approx(0.003), points=1)
    assert fit_correction(entries(Correction(), measured=False), NUMELS) is None


def test_fit_correction_is_not_tilted_by_one_candidate_far_off_the_line():
    """The README job's trial (2026-12-03): five candidates 6-12 ms above the model and
    LAGS-SGD's 9 groups 116 ms above it. Least squares made that 15 ms per sparse group
    (with -18 ms of constant, which is not applied), pricing a 3-group plan 40 ms too
    slow; the fit leaves the worst point out and keeps the others' line."""
    numels = [10_000] * 9
    plans = [([[0], [1], [2, 3], [4, 5], [6], [7, 8]], [True] * 5 + [False], 0.0117),
             ([list(range(8)), [8]], [False, False], 0.0116),
             ([[i] for i in range(9)], [True] * 9, 0.0103),
             ([list(range(9))], [False], 0.0104),
             ([[i] for i in range(9)], [False] * 9, 0.1163),
             ([[0, 1], list(range(2, 8)), [8]], [False] * 3, 0.0057)]
    candidates = [{"groups": g, "dense": d, "predicted_s": 0.08, "measured_s": 0.08 + extra}
                  for g, d, extra in plans]
    got = fit_correction(candidates, numels)
    assert abs(got.sparse_group_s) < 0.001 and got.constant_s == pytest.approx(0.0103, abs=0.001)
    # exact data with one point moved far off: the line of the others, exactly
    truth = Correction(constant_s=0.004, dense_s_per_element=2e-6, sparse_group_s=0.001)
    moved = entries(truth, plans=PLANS + [([[0], [1], [2], [3]], [False] * 4)])
    moved[-1]["measured_s"] += 0.5
    got = fit_correction(moved, NUMELS)
    assert got.constant_s == pytest.approx(0.004, rel=1e-9)
    assert got.dense_s_per_element == pytest.approx(2e-6, rel=1e-9)
    assert got.sparse_group_s == pytest.approx(0.001, rel=1e-9)


def eight_rank_trial():
    """Units, ``(groups, predicted, measured)`` and trial candidates of ResNet-20's trial on
    8 ranks at density 0.01 (2026-12-05), on 8 units."""
    plans = [([[0, 1], [2, 3, 4], [5, 6, 7]], 0.781, 0.750),
             ([list(range(8))], 0.975, 0.867),
             ([[0], [1, 2, 3, 4], [5, 6, 7]], 0.808, 0.761),
             ([[0, 1, 2, 3], [4, 5, 6, 7]], 0.817, 0.776),
             ([[0, 1], [2, 3], [4, 5], [6, 7]], 0.782, 0.764)]
    candidates = [{"groups": g, "dense": [False] * len(g), "predicted_s": p, "measured_s": m}
                  for g, p, m in plans]
    return [1000] * 8, plans, candidates


def test_the_group_term_is_centred_on_the_trials_typical_plan():
    """ResNet-20 on 8 ranks at density 0.01 (2026-12-05): the model priced TopK-SGD's one
    group 108 ms too slow and plans of 2-4 groups 18-47 ms too slow, so the fit's line
    falls steeply towards one group and its constant - its value at *no* group - is far
    below every candidate. The reference is the candidates' median group count, where
    the line sits among the points."""
    numels, plans, candidates = eight_rank_trial()
    got = fit_correction(candidates, numels)
    assert got.sparse_group_s > 0.02 and got.constant_s < -0.1  # steep, from far below
    assert got.sparse_groups_ref == 3.0
    # at the reference the line is within the points' spread; the constant is not
    at_ref = got.constant_s + got.sparse_group_s * got.sparse_groups_ref
    residuals = [m - p for _, p, m in plans]
    assert min(residuals) <= at_ref <= max(residuals)
    assert got.constant_s < min(residuals)
    # a state saved before the centring has no reference: the term counts from zero
    old = {k: v for k, v in got.to_dict().items() if k != "sparse_groups_ref"}
    assert Correction.from_dict(old).sparse_groups_ref == 0.0
    # no group term fitted (one point): no reference either
    assert fit_correction(candidates[:1], numels).sparse_groups_ref == 0.0


def test_fit_correction_keeps_the_candidate_nearest_its_reference_as_the_typical_plan():
    """The reference plan is the measured candidate whose sparse group count is nearest
    the median (the first on a tie); it survives the state dict as plain lists."""
    import json

    numels, plans, candidates = eight_rank_trial()
    candidates.insert(0, dict(candidates[0], measured_s=None))  # unmeasured: never it
    got = fit_correction(candidates, numels)
    assert got.sparse_groups_ref == 3.0
    assert got.ref_plan == (((0, 1), (2, 3, 4), (5, 6, 7)), (False, False, False), None)
    # nearest, not equal: a median of 2.5 groups takes the first of the 2- and 3-group plans
    four = candidates[2:]  # 1, 3, 2 and 4 groups
    nearest = fit_correction([dict(c, exchange="flat") for c in four], numels)
    assert nearest.sparse_groups_ref == 2.5 and len(nearest.ref_plan[0]) == 3
    assert nearest.ref_plan[2] == "flat"
    saved = json.loads(json.dumps(got.to_dict()))
    assert Correction.from_dict(saved) == got
    with pytest.raises(ValueError, match="ref_plan"):
        Correction.from_dict(dict(saved, ref_plan=[[[0]], [False], "ring"]))
    # no group term: no typical plan either
    assert fit_correction(candidates[:2], numels).ref_plan is None


def test_fit_correction_is_centred_on_the_trials_winner():
    """With a winner among the measured candidates (a finished trial's report) the term
    is centred on it: the plan the hook runs next keeps the model's own prediction, and
    the slope prices the others against it. Every fitted term is unchanged."""
    numels, plans, candidates = eight_rank_trial()
    plain = fit_correction(candidates, numels)
    for index in range(len(candidates)):
        flagged = [dict(c, winner=(i == index)) for i, c in enumerate(candidates)]
        got = fit_correction(flagged, numels)
        winner = candidates[index]
        assert got.sparse_groups_ref == sum(1 for d in winner["dense"] if not d)
        assert got.ref_plan == (tuple(tuple(g) for g in winner["groups"]),
                                tuple(winner["dense"]), None)
        assert (got.constant_s, got.dense_s_per_element, got.sparse_group_s) == (
            plain.constant_s, plain.dense_s_per_element, plain.sparse_group_s)
    # an unmeasured winner (it cannot be: a winner has samples) is not a point: the median
    flagged = [dict(c, winner=(i == 0), measured_s=None if i == 0 else c["measured_s"])
               for i, c in enumerate(candidates)]
    assert fit_correction(flagged, numels).ref_plan == fit_correction(
        candidates[1:], numels).ref_plan


def test_fit_correction_never_leaves_out_a_point_below_its_line():
    """CI's selection trial (2026-12-04, the test Net's six buckets): the model's plan sends
    three small buckets dense and measured 90 ms above the model, the all-dense plan 39 ms.
    Leaving out the all-dense point fitted the dense term to the small dense group alone
    and priced the all-dense plan at 522 ms; only a point above the line may be left out
    (noise adds time), so the fit keeps the all-dense point and leaves out the other."""
    numels = [8, 256, 32, 1024, 32, 512]
    singles = [[i] for i in range(6)]
    plans = [([[0, 1, 2], [3, 4, 5]], [True, False], 0.0055, 0.0967),
             ([list(range(6))], [False], 0.0055, 0.0165),
             (singles, [True] * 6, 0.0075, 0.0465),
             (singles, [False] * 6, 0.0062, 0.0240),
             ([[0, 1, 2], [3, 4, 5]], [False, False], 0.0056, 0.0180),
             ([[0, 1, 2, 3], [4, 5]], [False, False], 0.0056, 0.0180)]
    candidates = [{"groups": g, "dense": d, "predicted_s": p, "measured_s": m}
                  for g, d, p, m in plans]
    got = fit_correction(candidates, numels)
    refit = [p + got.extra_s(*plan_features(g, d, numels)) for g, d, p, _ in plans]
    for (_, _, _, measured), priced in zip(plans[1:], refit[1:]):
        assert priced == pytest.approx(measured, abs=2e-4)
    assert refit[0] < plans[0][3]  # the one left out lies above the line


# ------------------------------------------------------------------ flat against two-level
def test_flat_candidates_join_a_two_level_set_last_and_within_the_limit():
    from omgs_hook.cost_model import hierarchical_instance

    flat_inst = instance(dense=True)
    two_level = hierarchical_instance(flat_inst, 2, LinearCost(1e-5, 1e-10),
                                      LinearCost(4e-3, 4e-8))
    alone = model_candidates(two_level, "optimal", exchange="hierarchical",
                             prune_factor=math.inf)
    got = model_candidates(two_level, "optimal", exchange="hierarchical",
                           flat_inst=flat_inst, prune_factor=math.inf)
    assert len(got) <= MAX_CANDIDATES and got[0] == alone[0]
    names = [c.name for c in got]
    assert names[-2:] == ["flat:optimal", "flat:single"], names
    assert [c.exchange for c in got] == ["hierarchical"] * (len(got) - 2) + ["flat"] * 2
    # the model's own set gives up its last places to them, in order
    assert got[:-2] == alone[:MAX_CANDIDATES - 2]
    for c, name in zip(got[-2:], ("optimal", "single")):  # planned on the flat instance
        plan = planner.make_plan(flat_inst, name)
        assert c.key == (plan.groups, plan.dense)
        assert c.predicted_s == pytest.approx(plan.predicted_iteration_s, rel=1e-12)
    # the same groups on another exchange are another candidate
    same = cand("a", [[0, 1]])
    other = Candidate("b", same.groups, same.dense, 1.0, exchange="flat")
    assert len(dedupe([same, other])) == 2 and len(dedupe([other, other])) == 1
    # another strategy: its own plan on the flat exchange
    got = model_candidates(two_level, "layerwise", exchange="hierarchical", flat_inst=flat_inst)
    assert [c.name for c in got][-1] == "flat:layerwise" and got[-1].exchange == "flat"
    # without a flat instance nothing flat is added
    assert all(c.exchange == "hierarchical" for c in alone)


def test_flat_candidates_are_pruned_like_the_others():
    flat_inst = instance(dense=False, slow_network=True)
    fast = Instance(**{**flat_inst.__dict__, "comm": LinearCost(1e-6, 1e-12)})
    got = model_candidates(fast, "optimal", exchange="hierarchical", flat_inst=flat_inst,
                           prune_factor=1.05)
    assert all(c.exchange == "hierarchical" for c in got), [c.name for c in got]


def test_exchange_is_saved_and_old_plans_load_with_the_default():
    from omgs_hook.group_plan import GroupPlan

    c = Candidate("flat:single", ((0, 1),), (False,), 0.5, exchange="flat")
    assert Candidate.from_dict(c.to_dict()) == c
    old = {k: v for k, v in c.to_dict().items() if k != "exchange"}
    assert Candidate.from_dict(old).exchange is None
    with pytest.raises(ValueError, match="exchange"):
        Candidate.from_dict(dict(c.to_dict(), exchange="ring"))
    plan = GroupPlan(groups=(("a", "b"),), dense=(False,), layout=(("a",), ("b",)),
                     strategy="x", predicted_iteration_s=0.1, made_at_step=3, exchange="flat")
    assert GroupPlan.from_dict(plan.to_dict()) == plan
    legacy = {k: v for k, v in plan.to_dict().items() if k != "exchange"}
    assert GroupPlan.from_dict(legacy).exchange is None
    assert GroupPlan.from_dict(legacy, default_exchange="hierarchical").exchange == "hierarchical"
    # ranks compare the exchange too; a plan without one keeps its old digest
    two = plan.__class__(**{**plan.__dict__, "exchange": "hierarchical"})
    assert plan.checksum() != two.checksum()
    bare = plan.__class__(**{**plan.__dict__, "exchange": None})
    assert bare.checksum() not in (plan.checksum(), two.checksum())
    with pytest.raises(ValueError, match="plan: 'exchange'"):
        GroupPlan.from_dict(dict(plan.to_dict(), exchange="tree"))
    report = Trial([c, cand("b", [[0], [1]])], 0).report()
    assert [e["exchange"] for e in report["candidates"]] == ["flat", None]


def test_a_spell_over_both_screen_turns_of_a_candidate_is_retaken():
    # the two-pass screen of three: "sparse" (index 1) counts steps 3 and 9; a spell over
    # both leaves it no quiet sample, so it is retaken, and wins at its quiet time
    times = [[0.100, 0.090, 0.105]]
    probe, extra = spell_over({3, 9})
    report = run_trial(Trial(three(), 0), times, probe=probe, extra=extra)
    assert report["retaken"] == ["sparse"] and report["winner"] == "sparse"
    by_name = {c["name"]: c for c in report["candidates"]}
    assert by_name["sparse"]["disturbed"] == 2 and by_name["sparse"]["measured_s"] == pytest.approx(0.090)
    # a spell over one of its turns only: the other turn's sample stands, no retake
    probe, extra = spell_over({9})
    report = run_trial(Trial(three(), 0), times, probe=probe, extra=extra)
    assert report["retaken"] == [] and report["winner"] == "sparse"


# -- the baseline's margin ----------------------------------------------------------------
def with_baseline():
    """The model's 3-group plan, TopK-SGD's one sparse group, an all-dense plan."""
    return [cand("optimal", [[0], [1], [2]]), cand("single", [[0, 1, 2]]),
            cand("all-dense", [[0], [1], [2]], [True] * 3)]


def test_only_one_sparse_group_is_the_baseline():
    assert cand("single", [[0, 1, 2]]).is_baseline
    assert cand("optimal", [[0, 1, 2]]).is_baseline  # the model's choice can be that plan
    assert not cand("dense", [[0, 1, 2]], [True]).is_baseline
    assert not cand("two", [[0], [1, 2]]).is_baseline


def test_a_plan_must_read_faster_than_the_baseline_by_the_margin_to_be_chosen():
    # "optimal" reads 2% ahead of "single": within the margin of 3%, "single" is kept
    trial = Trial(with_baseline(), 0, baseline_margin=0.03)
    assert decide(trial, [[0.98, 1.0, 1.5]])[0] == 1
    assert trial.report()["winner"] == "single" and trial.report()["baseline_margin"] == 0.03
    assert trial.scored_s(0) == pytest.approx(0.98 * 1.03) and trial.scored_s(1) == 1.0
    # 5% ahead: beyond the margin, it is chosen
    assert decide(Trial(with_baseline(), 0, baseline_margin=0.03), [[0.95, 1.0, 1.5]])[0] == 0
    # without the margin the lower reading wins, as before
    assert decide(Trial(with_baseline(), 0, baseline_margin=0.0), [[0.98, 1.0, 1.5]])[0] == 0


def test_the_margin_moves_no_decision_between_plans_that_are_not_the_baseline():
    rng = random.Random(5)
    for _ in range(100):
        n = rng.randint(2, 5)
        cands = [cand(f"c{i}", [[0], [1, i]], [i % 2 == 1, False]) for i in range(n)]
        times = [[rng.choice([1.0, 1.01, 1.02, 1.1, 1.3]) for _ in range(n)] for _ in range(2)]
        plain, margined = Trial(cands, 0, baseline_margin=0.0), Trial(cands, 0, baseline_margin=0.05)
        assert decide(plain, times)[0] == decide(margined, times)[0]
        assert plain.rounds == margined.rounds


def test_the_duel_holds_the_rival_to_the_margin_against_the_baseline():
    # the rounds before: "single" 1.0, "optimal" 1.005 (scored 1.035: the runner-up)
    def duel(side_by_side):
        trial = Trial(with_baseline(), 0, duel_pairs=4, baseline_margin=0.03)
        _, step = decide_or_duel(trial, [[1.005, 1.0, 1.5]])
        assert trial.duel == {"winner": 1, "rival": 0, "ratios": []}
        return run_duel(trial, lambda i, s: side_by_side if i == 0 else 1.0, step)[0], trial
    # side by side "optimal" reads 2% faster: not enough
    winner, trial = duel(0.98)
    assert winner == 1 and not trial.report()["duel"]["switched"]
    assert trial.report()["duel"]["to_beat"] == pytest.approx(1 / 1.03)
    assert ("side by side, optimal over single: 0.980 (median of 4 pairs, to beat 0.971), "
            "single kept") in trial.summary()
    # 4% faster: it takes over
    winner, trial = duel(0.96)
    assert winner == 0 and trial.report()["duel"]["switched"]


def test_the_baseline_margin_is_saved_with_the_trial_and_old_states_run_without():
    trial = Trial(with_baseline(), 0, baseline_margin=0.04)
    restored = Trial.from_state_dict(trial.state_dict())
    assert restored.baseline_margin == 0.04 and restored.state_dict() == trial.state_dict()
    old = trial.state_dict()
    old.pop("baseline_margin")
    assert Trial.from_state_dict(old).baseline_margin == 0.0


def test_the_module_margin_is_the_default(monkeypatch):
    monkeypatch.setattr(plan_selection, "BASELINE_MARGIN", 0.07)
    assert Trial(with_baseline(), 0).baseline_margin == 0.07


def test_bad_baseline_margins_name_the_option():
    for bad in (-0.01, 1.0, "0.03", True, math.nan):
        with pytest.raises(ValueError, match="baseline_margin"):
            Trial(with_baseline(), 0, baseline_margin=bad)


def test_the_regret_check_weighs_the_rival_as_the_trial_did():
    # "single" won within the margin (the others 2% and 50% behind as scored); once
    # settled it runs 4% above its trial time
    trial = Trial(with_baseline(), 0, baseline_margin=0.03)
    assert decide(trial, [[0.99, 1.0, 1.5]])[0] == 1
    report = trial.report()
    # unweighted, "optimal" (0.99 * (1 + 3% tie) = 1.02) would be a rival at 1.04;
    # weighted (0.99 * 1.03 * 1.03 = 1.05) it is not: the margin would keep it out again
    assert plan_selection.regret_rival(dict(report, baseline_margin=0.0), 1.04)["name"] == "optimal"
    assert plan_selection.regret_rival(report, 1.04) is None
    assert plan_selection.regret_rival(report, 1.06)["name"] == "optimal"


def test_the_baseline_reaches_the_confirm_round_within_its_wider_window():
    cands = [cand("optimal", [[0], [1], [2]]), cand("two", [[0, 1], [2]]),
             cand("three", [[0], [1, 2]]), cand("single", [[0, 1, 2]])]
    # the screen reads "single" 1.35x the best: beyond the 30% window, within 60%
    trial = Trial(cands, 0, baseline_margin=0.0, baseline_window=0.6)
    step, rows = run_round(trial, [[1.0, 1.05, 1.1, 1.35]])
    assert trial.finish_round(rows, step) is None
    # it takes the last of the three places ("three", 1.1, is left out)
    assert trial.round_kinds[-1] == "confirm" and sorted(trial.rounds[-1]) == [0, 1, 3]
    # with no window of its own (0) the screen alone decides, as before
    trial = Trial(cands, 0, baseline_margin=0.0, baseline_window=0.0)
    step, rows = run_round(trial, [[1.0, 1.05, 1.1, 1.35]])
    trial.finish_round(rows, step)
    assert sorted(trial.rounds[-1]) == [0, 1, 2]
    # beyond its window too: left out
    trial = Trial(cands, 0, baseline_margin=0.0, baseline_window=0.3)
    step, rows = run_round(trial, [[1.0, 1.05, 1.1, 1.35]])
    trial.finish_round(rows, step)
    assert sorted(trial.rounds[-1]) == [0, 1, 2]
    # once confirmed it can win: the screen's readings were a slow phase (a candidate's
    # time weighs the screen's two turns against the confirm round's one)
    trial = Trial(cands, 0, baseline_margin=0.0, baseline_window=0.6)
    step, rows = run_round(trial, [[1.0, 1.05, 1.1, 1.35]])
    trial.finish_round(rows, step)
    winner, _ = decide(trial, [[1.0, 1.05, 1.1, 0.5]], first_step=step)
    assert winner == 3


def test_the_baseline_window_keeps_the_trial_within_its_step_bound():
    rng = random.Random(11)
    for _ in range(100):
        n = rng.randint(2, MAX_CANDIDATES)
        cands = [cand(f"c{i}", [[0], [1, i]]) for i in range(n - 1)] + [cand("single", [[0, 1]])]
        rng.shuffle(cands)
        trial = Trial(cands, 0, baseline_margin=0.03, baseline_window=0.6)
        times = [[rng.uniform(1.0, 1.6) for _ in range(n)]]
        _, end = decide(trial, times)
        assert end <= trial.max_steps() == trial_steps_bound(n)


def test_bad_baseline_windows_name_the_option_and_old_states_run_without():
    for bad in (-0.1, "0.6", True, math.nan):
        with pytest.raises(ValueError, match="baseline_window"):
            Trial(with_baseline(), 0, baseline_window=bad)
    trial = Trial(with_baseline(), 0, baseline_window=0.5)
    assert Trial.from_state_dict(trial.state_dict()).baseline_window == 0.5
    assert trial.report()["baseline_window"] == 0.5
    old = trial.state_dict()
    old.pop("baseline_window")
    assert Trial.from_state_dict(old).baseline_window == 0.0
