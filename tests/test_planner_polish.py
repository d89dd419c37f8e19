"""Tests for the polish of a budget-stopped plan (planner._polish) and the wider beam
with a dense cost: the moves are priced right, the result is a local optimum of those
moves and never worse than the plan it started from, and `optimal` at the valve uses it.

Every time a test compares is recomputed with cost_model.simulate, the reference
recurrence, never with the polish's own flow-shop identity.
"""

import dataclasses
import itertools
import math
import warnings

import numpy as np
import pytest
from test_planner import random_instance

from omgs_hook import planner
from omgs_hook.cost_model import Instance, LinearCost, TopkCost, Unit, simulate
from omgs_hook.planner import SearchBudgetWarning, make_plan


def _time(inst, bounds, modes):
    groups = planner._groups_from_bounds(list(bounds))
    return simulate(inst, groups, list(modes)).comm_end_s


def _random_plan(rng, inst):
    L = inst.num_units
    cuts = sorted(set(int(x) for x in rng.integers(1, L, size=rng.integers(0, L))))
    bounds = [c for c in cuts if 0 < c < L] + [L]
    dense = inst.dense is not None
    modes = [bool(dense and rng.random() < 0.5) for _ in bounds]
    return bounds, modes


def _recovers(bounds, modes, dense_allowed):
    """Every plan one polish move away: a window of 1..3 groups re-covered by one or two
    groups, every cut and mode pair (independent enumeration)."""
    starts = [0] + list(bounds[:-1])
    choices = (False, True) if dense_allowed else (False,)
    m = len(bounds)
    for j in range(m):
        for width in range(1, min(planner._POLISH_WINDOW, m - j) + 1):
            lo, hi = starts[j], bounds[j + width - 1]
            before, after = list(bounds[:j]), list(bounds[j + width:])
            mb, ma = list(modes[:j]), list(modes[j + width:])
            for d in choices:
                yield before + [hi] + after, mb + [d] + ma
            for cut in range(lo + 1, hi):
                for d1, d2 in itertools.product(choices, repeat=2):
                    yield before + [cut, hi] + after, mb + [d1, d2] + ma


@pytest.mark.parametrize("dense", [False, True])
def test_group_terms_match_the_reference_timeline(dense):
    rng = np.random.default_rng(1)
    for _ in range(30):
        inst = random_instance(rng, int(rng.integers(1, 9)), dense)
        ps = planner._prefix_sums(inst)
        L = inst.num_units
        lo = int(rng.integers(0, L))
        hi = int(rng.integers(lo + 1, L + 1))
        sparse_terms, dense_terms = planner._group_terms(inst, ps, lo, hi)
        assert (dense_terms is None) == (not dense)
        one = dataclasses.replace(inst, layers=inst.layers[lo:hi])
        for flag, terms in ((False, sparse_terms), (True, dense_terms)):
            if terms is None:
                continue
            x, y = terms
            # one group alone: compute end = x, network end = x + y
            timeline = simulate(one, [tuple(range(hi - lo))], [flag])
            assert math.isclose(float(x), timeline.compute_end_s, rel_tol=1e-9, abs_tol=1e-15)
            assert math.isclose(float(x + y), timeline.comm_end_s, rel_tol=1e-9, abs_tol=1e-15)


@pytest.mark.parametrize("dense", [False, True])
def test_polish_ends_in_a_local_optimum_never_worse_than_its_start(dense):
    """From random plans of random instances: the result is a valid plan (contiguous,
    covering, sparse only without a dense cost), no worse than the start under the
    reference timeline, and no single move (checked by brute force with simulate)
    beats it by more than rounding."""
    rng = np.random.default_rng(7 if dense else 8)
    moved = 0
    for _ in range(40):
        inst = random_instance(rng, int(rng.integers(2, 9)), dense)
        ps = planner._prefix_sums(inst)
        bounds, modes = _random_plan(rng, inst)
        start = _time(inst, bounds, modes)
        new_bounds, new_modes = planner._polish(inst, ps, (tuple(bounds), tuple(modes)))
        assert list(new_bounds) == sorted(set(new_bounds)) and new_bounds[-1] == inst.num_units
        assert new_bounds[0] > 0 and len(new_modes) == len(new_bounds)
        if not dense:
            assert not any(new_modes)
        result = _time(inst, new_bounds, new_modes)
        scale = planner._time_scale(inst)
        assert result <= start + 1e-9 * scale
        moved += (list(new_bounds), list(new_modes)) != (bounds, modes)
        best_neighbour = min(_time(inst, b, m) for b, m in _recovers(new_bounds, new_modes, dense))
        assert best_neighbour >= result - 1e-9 * scale
    assert moved > 10  # the polish did move most starts


def test_polish_moves_a_boundary_far_in_one_pass():
    """Two groups with the cut at the wrong end of a 60-unit run: the best cut is found
    in one move, wherever it is."""
    layers = tuple(Unit(numel=10_000, backward_s=1e-3) for _ in range(60))
    inst = Instance(layers=layers, world_size=4, density=0.01, forward_s=0.0,
                    comm=LinearCost(2e-3, 1e-8), topk=TopkCost(1e-4, 1e-9, 0.0))
    ps = planner._prefix_sums(inst)
    start = ((1, 60), (False, False))
    best = min((_time(inst, (c, 60), (False, False)), c) for c in range(1, 60))
    bounds, modes = planner._polish(inst, ps, start)
    result = _time(inst, bounds, modes)
    assert result <= best[0] + 1e-12
    assert result < _time(inst, *start)


def test_polish_is_deterministic():
    rng = np.random.default_rng(3)
    inst = random_instance(rng, 8, True)
    ps = planner._prefix_sums(inst)
    plan = _random_plan(rng, inst)
    assert planner._polish(inst, ps, plan) == planner._polish(inst, ps, plan)


def _best_recover(inst, prefix_sums, bounds, modes, j, width, heads_tails, below):
    """The reference for planner._best_move, one window at a time (the polish's code
    before 2026-12-06): the best re-cover of groups ``j .. j+width-1`` by one group or two (every cut
    position at once, every mode pair) whose plan time is below ``below``, as
    ``(time, bounds, modes)``, or None. Priced by ``max(e + Ys, c + G)`` with the state
    before the window and the suffix after it."""
    head_c, head_e, tail_ys, tail_g = heads_tails
    starts = [0] + list(bounds[:-1])
    lo, hi = starts[j], bounds[j + width - 1]
    c0, e0 = head_c[j], head_e[j]
    ys, g = tail_ys[j + width], tail_g[j + width]
    choices = (False,) if inst.dense is None else (False, True)
    best, found = below, None
    one = planner._group_terms(inst, prefix_sums, lo, hi)
    for dense in choices:
        x1, y1 = one[dense]
        c = c0 + float(x1)
        value = max(max(e0, c) + float(y1) + ys, c + g)
        if value < best:
            best, found = value, ([hi], [dense])
    if hi - lo >= 2:
        cut = np.arange(lo + 1, hi)
        first = planner._group_terms(inst, prefix_sums, lo, cut)
        second = planner._group_terms(inst, prefix_sums, cut, hi)
        for dense1 in choices:
            x1, y1 = first[dense1]
            c1 = c0 + x1
            e1 = np.maximum(e0, c1) + y1
            for dense2 in choices:
                x2, y2 = second[dense2]
                c2 = c1 + x2
                values = np.maximum(np.maximum(e1, c2) + y2 + ys, c2 + g)
                at = int(np.argmin(values))
                if values[at] < best:
                    best, found = float(values[at]), ([int(cut[at]), hi], [dense1, dense2])
    if found is None:
        return None
    return (best, list(bounds[:j]) + found[0] + list(bounds[j + width:]),
            list(modes[:j]) + found[1] + list(modes[j + width:]))


@pytest.mark.parametrize("dense", [False, True])
def test_a_pass_priced_at_once_is_its_windows_priced_in_turn(dense):
    """_best_move (every window of a pass at once) returns what _best_recover returns
    last when the windows are priced in turn, each against the best time so far: the
    same move, ties going to the first window and choice (identical units make ties)."""
    rng = np.random.default_rng(11 if dense else 12)
    for trial in range(60):
        inst = random_instance(rng, int(rng.integers(1, 30)), dense)
        if trial % 3 == 0:  # identical units: many moves of the same time
            inst = dataclasses.replace(inst, layers=(inst.layers[0],) * inst.num_units)
        ps = planner._prefix_sums(inst)
        bounds, modes = _random_plan(rng, inst)
        heads_tails = planner._heads_and_tails(inst, ps, bounds, modes)
        windows = [(j, width) for j in range(len(bounds))
                   for width in range(1, min(planner._POLISH_WINDOW, len(bounds) - j) + 1)]
        value, _ = planner._comm_end(inst, ps, bounds, tuple(modes))
        for below in (value, value * 0.999, math.inf):
            move, bar = None, below
            for j, width in windows:
                found = _best_recover(inst, ps, bounds, modes, j, width, heads_tails, bar)
                if found is not None:
                    move, bar = found, found[0]
            assert planner._best_move(inst, ps, bounds, modes, windows, heads_tails,
                                      below) == move


def test_polish_stops_at_its_window_budget(monkeypatch):
    """The number of windows priced is the bound (what keeps the polish's time small on
    plans of hundreds of groups): one window, at most one move."""
    layers = tuple(Unit(numel=10_000, backward_s=1e-3) for _ in range(40))
    inst = Instance(layers=layers, world_size=4, density=0.01, forward_s=0.0,
                    comm=LinearCost(2e-3, 1e-8), topk=TopkCost(1e-4, 1e-9, 0.0))
    ps = planner._prefix_sums(inst)
    start = (tuple(range(1, 41)), (False,) * 40)  # layerwise: many merges pay
    full = planner._polish(inst, ps, start)
    calls = []
    move = planner._best_move

    def counting(*args):
        calls.extend(args[4])  # the windows priced
        return move(*args)

    monkeypatch.setattr(planner, "_best_move", counting)
    monkeypatch.setattr(planner, "_POLISH_WINDOWS", 1)
    once = planner._polish(inst, ps, start)
    assert len(calls) == 1
    assert len(once[0]) >= 38  # one move re-covers at most 3 groups with 1
    assert _time(inst, *once) <= _time(inst, *start)
    monkeypatch.setattr(planner, "_POLISH_WINDOWS", 50)
    calls.clear()
    some = planner._polish(inst, ps, start)
    assert len(calls) == 50
    assert _time(inst, *full) <= _time(inst, *some) < _time(inst, *start)
    assert len(full[0]) < len(once[0])


def test_polish_time_is_bounded_on_a_plan_of_many_groups():
    """A 1000-unit plan of 400 groups: the polish stops at its window budget (a sweep
    alone is 1200 windows) and still improves the plan."""
    inst = _realistic_dense(4, 1000)
    ps = planner._prefix_sums(inst)
    bounds = tuple(int(b) for b in np.linspace(0, 1000, 401)[1:].round())
    start = (bounds, (False,) * 400)
    calls = []
    move = planner._best_move

    def counting(*args):
        calls.extend(args[4])  # the windows priced
        return move(*args)

    planner._best_move = counting
    try:
        result = planner._polish(inst, ps, start)
    finally:
        planner._best_move = move
    assert len(calls) == planner._POLISH_WINDOWS
    assert _time(inst, *result) < _time(inst, *start)


def _realistic_dense(seed, units):
    from script_loader import load_script

    compare = load_script("compare_strategies")
    return compare.realistic_instance(np.random.default_rng(seed), units, True, "mixed")


def test_optimal_at_the_valve_returns_the_polished_plan(monkeypatch):
    """With a budget that stops the search at once, `optimal` still warns, and its plan is
    what _polish makes of the plan found - no worse than that plan."""
    inst = _realistic_dense(3, 120)
    monkeypatch.setattr(planner, "SEARCH_BUDGET", 2_000)
    seen = {}
    polish = planner._polish

    def recording(inst_, ps, plan):
        seen["start"] = plan
        seen["result"] = polish(inst_, ps, plan)
        return seen["result"]

    monkeypatch.setattr(planner, "_polish", recording)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = make_plan(inst, "optimal")
    assert any(issubclass(w.category, SearchBudgetWarning) for w in caught)
    bounds, modes = seen["result"]
    assert [g[-1] + 1 for g in plan.groups] == list(bounds)
    assert list(plan.dense) == list(modes)
    assert _time(inst, bounds, modes) <= _time(inst, *seen["start"]) + 1e-12


def test_an_exact_search_is_not_polished(monkeypatch):
    """Sparse instances up to EXACT_UNITS are solved exactly: the polish never runs."""
    rng = np.random.default_rng(5)
    inst = random_instance(rng, 30, False)

    def fail(*_):
        raise AssertionError("an exact plan was polished")

    monkeypatch.setattr(planner, "_polish", fail)
    make_plan(inst, "optimal")


# ----------------------------------------------------------------------- a start plan


def _exact(inst):
    saved = planner.SEARCH_BUDGET
    planner.SEARCH_BUDGET = 10**12
    try:
        return make_plan(inst, "optimal")
    finally:
        planner.SEARCH_BUDGET = saved


def test_a_start_plan_bounds_a_search_the_valve_stops(monkeypatch):
    """A search stopped at once returns a plan no worse than the start it was given -
    here the optimum itself - and without it, something worse on this instance."""
    inst = _realistic_dense(3, 120)
    best = _exact(inst)
    monkeypatch.setattr(planner, "SEARCH_BUDGET", 2_000)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SearchBudgetWarning)
        without = make_plan(inst, "optimal")
        with_start = make_plan(inst, "optimal", start=(best.groups, best.dense))
    assert with_start.predicted_iteration_s <= best.predicted_iteration_s * (1 + 1e-12)
    assert without.predicted_iteration_s > best.predicted_iteration_s * (1 + 1e-9)


@pytest.mark.parametrize("dense", [False, True])
def test_a_start_plan_does_not_change_the_optimum(dense):
    rng = np.random.default_rng(11 if dense else 12)
    for _ in range(6):
        inst = random_instance(rng, 14, dense)
        bounds, modes = _random_plan(rng, inst)
        start = (planner._groups_from_bounds(bounds), modes)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SearchBudgetWarning)
            plain = make_plan(inst, "optimal")
            started = make_plan(inst, "optimal", start=start)
            # the optimum itself as the start: the bound is then tight from the first turn
            tight = make_plan(inst, "optimal", start=(plain.groups, plain.dense))
        assert math.isclose(started.predicted_iteration_s, plain.predicted_iteration_s,
                            rel_tol=1e-9)
        assert math.isclose(tight.predicted_iteration_s, plain.predicted_iteration_s,
                            rel_tol=1e-9)


def test_a_start_plan_that_does_not_fit_is_ignored():
    rng = np.random.default_rng(13)
    inst = random_instance(rng, 10, True)
    plain = make_plan(inst, "optimal")
    for start in [([[0, 1], [2]], [False, False]),            # another number of units
                  ([[0, 2], [1, 3, 4, 5, 6, 7, 8, 9]], [True, False]),  # not contiguous
                  ([list(range(10))], [True, False])]:        # flags of another length
        assert make_plan(inst, "optimal", start=start) == plain
    with pytest.raises(TypeError, match="start must be"):
        make_plan(inst, "optimal", start=[[0, 1, 2]])
    # the other strategies take no start
    greedy = make_plan(inst, "greedy")
    assert make_plan(inst, "greedy", start=([list(range(10))], [True])) == greedy


def test_the_planning_job_starts_from_the_plan_in_use(monkeypatch):
    """compute_plan hands the job's "start" (the hook's plan in use) to make_plan, with
    the re-plan's smaller valve budget; a job without one searches with the planner's."""
    from omgs_hook import plan_job

    seen = []
    original = plan_job.planner_mod.make_plan

    def recording(inst, strategy, start=None, budget=None):
        seen.append((start, budget))
        return original(inst, strategy, start=start, budget=budget)

    monkeypatch.setattr(plan_job.planner_mod, "make_plan", recording)
    inst = random_instance(np.random.default_rng(14), 6, False)
    job = {"instance": inst.to_dict(), "kept": None, "model_key": None, "retrial_ok": True,
           "start": {"groups": [[0, 1, 2], [3, 4, 5]], "dense": [False, False]}}
    plan_job.compute_plan(job, "optimal", "model")
    assert seen[0] == (([[0, 1, 2], [3, 4, 5]], [False, False]), plan_job.REPLAN_SEARCH_BUDGET)
    assert plan_job.REPLAN_SEARCH_BUDGET < plan_job.planner_mod.SEARCH_BUDGET
    seen.clear()
    plan_job.compute_plan(dict(job, start=None), "optimal", "model")
    assert seen[0] == (None, None)


# ----------------------------------------------------------------------- the fast prediction


@pytest.mark.parametrize("dense", [False, True])
def test_predicted_iteration_s_agrees_with_evaluate(dense):
    rng = np.random.default_rng(21 if dense else 22)
    for _ in range(60):
        inst = random_instance(rng, int(rng.integers(1, 30)), dense)
        inst = dataclasses.replace(inst, tail_s=float(rng.uniform(0, 0.01)))
        bounds, modes = _random_plan(rng, inst)
        groups = [list(g) for g in planner._groups_from_bounds(bounds)]
        flags = list(modes) if dense else (None if rng.random() < 0.5 else [False] * len(groups))
        expected = planner.evaluate(inst, groups, flags).predicted_iteration_s
        assert math.isclose(planner.predicted_iteration_s(inst, groups, flags), expected,
                            rel_tol=1e-9)


def test_predicted_iteration_s_leaves_the_rest_to_evaluate(monkeypatch):
    """Free modes with a dense cost, groups that are not runs, and flags without a dense
    cost go to evaluate (which chooses the modes or raises its error)."""
    rng = np.random.default_rng(23)
    inst = random_instance(rng, 6, True)
    calls = []
    evaluate = planner.evaluate

    def recording(*args, **kwargs):
        calls.append(args[1])
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(planner, "evaluate", recording)
    planner.predicted_iteration_s(inst, [[0, 1, 2], [3, 4, 5]], None)  # free modes
    assert len(calls) == 1
    planner.predicted_iteration_s(inst, [[0, 1, 2], [3, 4, 5]], [True, False])
    assert len(calls) == 1  # the fast path
    from omgs_hook.cost_model import InstanceError

    with pytest.raises(InstanceError):
        planner.predicted_iteration_s(inst, [[0, 2, 1], [3, 4, 5]], [False, False])
    with pytest.raises(InstanceError):
        planner.predicted_iteration_s(inst, [[0, 5, 2], [3, 4, 1]], [False, False])
    sparse = dataclasses.replace(inst, dense=None)
    with pytest.raises(InstanceError):
        planner.predicted_iteration_s(sparse, [[0, 1, 2], [3, 4, 5]], [True, False])
    with pytest.raises(InstanceError):
        planner.predicted_iteration_s(inst, [[0, 1, 2], [3, 4]], [False, False])
