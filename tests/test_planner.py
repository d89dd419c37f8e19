"""Tests for omgs_hook.planner: exactness against brute force, every strategy's rule,
determinism, the dense option and error handling.

The brute force and the re-simulation below are written independently of
omgs_hook.cost_model / omgs_hook.planner (their own formulas, vectorised with numpy).
"""

import dataclasses
import math
import warnings

import numpy as np
import pytest
from script_loader import load_script

from omgs_hook import planner
from omgs_hook.cost_model import Instance, InstanceError, LinearCost, TopkCost, Unit
from omgs_hook.planner import (
    Plan,
    SearchBudgetWarning,
    best_modes,
    evaluate,
    greedy_groups,
    make_plan,
    parse_strategy,
    threshold_groups,
)

REL = 1e-9  # agreement required between the planner and the independent code

# ----------------------------------------------------------------------- independent code


def _log_uniform(rng, low, high):
    return math.exp(rng.uniform(math.log(low), math.log(high)))


def random_instance(rng, num_units, dense):
    """Wide-ranging instances: tiny bias vectors to 2e7-element layers, alpha 1e-5..2e-2."""
    layers = []
    speed = _log_uniform(rng, 1e-11, 1e-8)  # backward seconds per element
    for _ in range(num_units):
        numel = int(_log_uniform(rng, 1, 2e7))
        backward = 0.0 if rng.random() < 0.05 else numel * speed * rng.uniform(0.3, 3.0) + 1e-6
        layers.append(Unit(numel, backward))
    c2 = 0.0 if rng.random() < 0.5 else _log_uniform(rng, 1e-15, 1e-10)
    return Instance(
        layers=tuple(layers),
        world_size=int(rng.choice([2, 4, 16, 64])),
        density=float(rng.choice([1e-3, 1e-2, 0.1, 1.0])),
        forward_s=float(rng.uniform(0.0, 0.05)),
        comm=LinearCost(_log_uniform(rng, 1e-5, 2e-2), _log_uniform(rng, 1e-11, 1e-8)),
        topk=TopkCost(_log_uniform(rng, 1e-6, 1e-3), _log_uniform(rng, 1e-12, 1e-8), c2),
        value_bytes=4 if rng.random() < 0.8 else 2,
        index_bytes=4,
        dense=(
            LinearCost(_log_uniform(rng, 1e-5, 2e-2), _log_uniform(rng, 1e-12, 1e-8))
            if dense
            else None
        ),
    )


def _arrays(inst):
    numel = np.array([u.numel for u in inst.layers], dtype=np.float64)
    backward = np.array([u.backward_s for u in inst.layers], dtype=np.float64)
    return numel, backward


def vector_timeline(inst, group_end, dense_flag):
    """Final network time e_m for many plans at once.

    group_end[p, u] is True when plan p closes a group after unit u (always true for the
    last unit); dense_flag[p, u] is the mode of that group (read where group_end is True).
    """
    numel, backward = _arrays(inst)
    plans = group_end.shape[0]
    c = np.zeros(plans)
    e = np.zeros(plans)
    d = np.zeros(plans)
    b = np.zeros(plans)
    t = inst.topk
    entry_bytes = inst.value_bytes + inst.index_bytes
    for u in range(inst.num_units):
        d = d + numel[u]
        b = b + backward[u]
        topk = t.c0 + t.c1 * d + t.c2 * d * np.log2(d)
        k = np.maximum(1.0, np.ceil(inst.density * d))
        sparse_comm = inst.comm.alpha_s + inst.comm.beta_s_per_byte * entry_bytes * k
        c_sparse = c + b + topk
        e_sparse = np.maximum(e, c_sparse) + sparse_comm
        if inst.dense is not None:
            dense_comm = inst.dense.alpha_s + inst.dense.beta_s_per_byte * inst.value_bytes * d
            c_dense = c + b
            e_dense = np.maximum(e, c_dense) + dense_comm
            use_dense = dense_flag[:, u]
            c_closed = np.where(use_dense, c_dense, c_sparse)
            e_closed = np.where(use_dense, e_dense, e_sparse)
        else:
            c_closed, e_closed = c_sparse, e_sparse
        end = group_end[:, u]
        c = np.where(end, c_closed, c)
        e = np.where(end, e_closed, e)
        d = np.where(end, 0.0, d)
        b = np.where(end, 0.0, b)
    return e


def resimulate(inst, groups, dense):
    """Independent predicted_iteration_s of one plan."""
    L = inst.num_units
    group_end = np.zeros((1, L), dtype=bool)
    dense_flag = np.zeros((1, L), dtype=bool)
    for group, flag in zip(groups, dense):
        group_end[0, group[-1]] = True
        dense_flag[0, group[-1]] = flag
    return inst.forward_s + float(vector_timeline(inst, group_end, dense_flag)[0])


def brute_force(inst, fixed_groups=None):
    """Minimum predicted_iteration_s over every partition (and every mode choice)."""
    L = inst.num_units
    if fixed_groups is not None:
        ends = [g[-1] for g in fixed_groups]
        modes = np.arange(2 ** len(ends))
        group_end = np.zeros((modes.size, L), dtype=bool)
        dense_flag = np.zeros((modes.size, L), dtype=bool)
        for j, u in enumerate(ends):
            group_end[:, u] = True
            dense_flag[:, u] = (modes >> j) & 1
    elif inst.dense is None:
        cuts = np.arange(2 ** (L - 1))
        group_end = np.ones((cuts.size, L), dtype=bool)
        for u in range(L - 1):
            group_end[:, u] = (cuts >> u) & 1
        dense_flag = np.zeros_like(group_end)
    else:
        # per boundary: 0 = no cut, 1 = cut a sparse group, 2 = cut a dense group;
        # times 2 for the mode of the last group
        count = 2 * 3 ** (L - 1)
        code = np.arange(count)
        group_end = np.ones((count, L), dtype=bool)
        dense_flag = np.zeros((count, L), dtype=bool)
        for u in range(L - 1):
            digit = (code // 3**u) % 3
            group_end[:, u] = digit != 0
            dense_flag[:, u] = digit == 2
        dense_flag[:, L - 1] = code // 3 ** (L - 1) == 1
    return inst.forward_s + float(vector_timeline(inst, group_end, dense_flag).min())


def reference_optimum(inst):
    """The optimum by a plain dynamic program: for every prefix, the exact Pareto front
    of (compute end, network end) over all ways to group it, with no bounds and no
    pruning beyond strict dominance. Polynomial only in practice; for medium instances.
    """
    numel, backward = _arrays(inst)
    L = inst.num_units
    numel_before = np.concatenate(([0.0], np.cumsum(numel)))
    backward_before = np.concatenate(([0.0], np.cumsum(backward)))
    t = inst.topk
    entry_bytes = inst.value_bytes + inst.index_bytes
    fronts = [(np.zeros(1), np.zeros(1))]
    for end in range(1, L + 1):
        computes, networks = [], []
        for start in range(end):
            c, e = fronts[start]
            d = numel_before[end] - numel_before[start]
            b = backward_before[end] - backward_before[start]
            x = b + t.c0 + t.c1 * d + t.c2 * d * math.log2(d)
            k = max(1, math.ceil(inst.density * d))
            y = inst.comm.alpha_s + inst.comm.beta_s_per_byte * entry_bytes * k
            computes.append(c + x)
            networks.append(np.maximum(e, c + x) + y)
            if inst.dense is not None:
                y_dense = inst.dense.alpha_s + inst.dense.beta_s_per_byte * inst.value_bytes * d
                computes.append(c + b)
                networks.append(np.maximum(e, c + b) + y_dense)
        c = np.concatenate(computes)
        e = np.concatenate(networks)
        order = np.lexsort((e, c))
        c, e = c[order], e[order]
        keep = np.ones(c.size, dtype=bool)
        keep[1:] = e[1:] < np.minimum.accumulate(e)[:-1]
        fronts.append((c[keep], e[keep]))
    return inst.forward_s + inst.tail_s + float(fronts[L][1].min())


def realistic_instance(rng, num_units, dense, topk):
    return load_script("compare_strategies").realistic_instance(rng, num_units, dense, topk)


def all_strategies(inst, rng):
    threshold = int(_log_uniform(rng, 1, 4 * sum(u.numel for u in inst.layers)))
    return ["optimal", "greedy", "layerwise", "single", f"threshold:{threshold}"]


# ----------------------------------------------------------------------- exactness


def _check_instance(inst, rng):
    plans = {s: make_plan(inst, s) for s in all_strategies(inst, rng)}
    optimal = plans["optimal"]
    truth = brute_force(inst)
    assert optimal.predicted_iteration_s == pytest.approx(truth, rel=REL)
    for strategy, plan in plans.items():
        assert plan.strategy == strategy
        # the reported time is the plan's own time
        assert plan.predicted_iteration_s == pytest.approx(
            resimulate(inst, plan.groups, plan.dense), rel=REL
        ), strategy
        assert plan.non_overlapped_s == pytest.approx(
            plan.predicted_iteration_s - inst.forward_s - sum(u.backward_s for u in inst.layers),
            rel=1e-9,
            abs=1e-15,
        )
        assert optimal.predicted_iteration_s <= plan.predicted_iteration_s * (1 + 1e-12)
        if inst.dense is None:
            assert not any(plan.dense)
    return plans


@pytest.fixture(params=[1, None], ids=["prune-every-target", "default-pruning"])
def pruning(request, monkeypatch):
    """Run the exact searches with their pruning rules applied at every target (forward)
    and suffix start (backward) and the candidate pre-filter (_undominated) on every
    candidate set (so that small instances exercise them), and with the default
    schedule."""
    if request.param is not None:
        monkeypatch.setattr(planner._FrontierSearch, "_PRUNE_EVERY", request.param)
        monkeypatch.setattr(planner, "_RETIRE_EVERY", request.param)
        monkeypatch.setattr(planner, "_PREFILTER_SIZE", 1)
    return request.param


def test_optimal_equals_brute_force_sparse(pruning):
    rng = np.random.default_rng(20240101)
    greedy_worse = 0
    for i in range(300):
        inst = random_instance(rng, int(rng.integers(1, 13)), dense=False)
        plans = _check_instance(inst, rng)
        if plans["greedy"].predicted_iteration_s > plans["optimal"].predicted_iteration_s * (
            1 + 1e-9
        ):
            greedy_worse += 1
    # the comparison can tell strategies apart: the paper's greedy is not exact
    assert greedy_worse >= 10


def test_optimal_equals_brute_force_with_dense(pruning):
    rng = np.random.default_rng(7)
    dense_used = 0
    for i in range(160):
        num_units = int(rng.integers(1, 10)) if i < 150 else int(rng.integers(11, 13))
        inst = random_instance(rng, num_units, dense=True)
        plans = _check_instance(inst, rng)
        dense_used += any(plans["optimal"].dense)
        # the modes chosen for fixed groups are the best for those groups
        for strategy in ("greedy", "layerwise"):
            plan = plans[strategy]
            if len(plan.groups) <= 10:
                assert plan.predicted_iteration_s == pytest.approx(
                    brute_force(inst, fixed_groups=plan.groups), rel=REL
                )
    assert 20 <= dense_used < 160  # both modes occur


def _engine_times(inst, upper_bound=math.inf):
    """predicted_iteration_s of the plans each exact search finds on its own."""
    times = {}
    forward = planner._FrontierSearch(inst, upper_bound=upper_bound).solve()
    backward = planner._SuffixSearch(inst, upper_bound).solve()
    for name, found in (("forward", forward), ("backward", backward)):
        assert found is not None, name
        bounds, modes = found
        groups = planner._groups_from_bounds(bounds)
        times[name] = resimulate(inst, groups, modes)
    return times


@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
@pytest.mark.parametrize("c2", ["zero", "positive"])
def test_both_exact_searches_equal_brute_force(dense, c2):
    """Each of the two exact searches alone, unbounded and with the optimum itself as
    the bound (the tightest bound they can get), on instances with c2 = 0 and c2 > 0."""
    rng = np.random.default_rng(31 + 2 * dense + (c2 == "positive"))
    for _ in range(60 if dense else 100):
        inst = random_instance(rng, int(rng.integers(1, 10 if dense else 13)), dense=dense)
        if c2 == "zero":
            inst = dataclasses.replace(inst, topk=dataclasses.replace(inst.topk, c2=0.0))
        else:
            inst = dataclasses.replace(
                inst, topk=dataclasses.replace(inst.topk, c2=_log_uniform(rng, 1e-14, 1e-10))
            )
        truth = brute_force(inst)
        for bound in (math.inf, truth - inst.forward_s):
            for name, value in _engine_times(inst, bound).items():
                assert value == pytest.approx(truth, rel=REL), (name, bound)
        assert make_plan(inst).predicted_iteration_s == pytest.approx(truth, rel=REL)


def test_optimal_equals_the_reference_dp_on_medium_instances():
    """Against the plain Pareto DP (no bounds): random and realistic instances of 40-150
    units, sparse and dense, linear and n log n top-k; both searches and make_plan."""
    rng = np.random.default_rng(77)
    cases = []
    for i in range(6):
        cases.append(random_instance(rng, int(rng.integers(60, 150)), dense=False))
        cases.append(realistic_instance(rng, int(rng.integers(60, 150)), False,
                                        "nlogn" if i % 2 else "linear"))
        cases.append(random_instance(rng, int(rng.integers(25, 45)), dense=True))
        cases.append(realistic_instance(rng, int(rng.integers(25, 45)), True, "mixed"))
    for inst in cases:
        truth = reference_optimum(inst)
        with warnings.catch_warnings():
            warnings.simplefilter("error", SearchBudgetWarning)
            plan = make_plan(inst)
        assert plan.predicted_iteration_s == pytest.approx(truth, rel=REL)
        for name, value in _engine_times(inst).items():
            assert value == pytest.approx(truth, rel=REL), name


@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
@pytest.mark.parametrize("c2", ["zero", "positive"])
def test_prefix_network_floor_is_a_lower_bound_and_often_tight(dense, c2):
    """_prefix_network_floor[t] never exceeds the least network end of any grouping (and
    modes) of the first t units, by brute force on every prefix; it is the exact least
    value for many prefixes (so the comparison can tell a weak floor from a tight one)."""
    rng = np.random.default_rng(41 + 2 * dense + (c2 == "positive"))
    tight = total = 0
    for _ in range(40):
        inst = random_instance(rng, int(rng.integers(1, 9)), dense=dense)
        c2_value = 0.0 if c2 == "zero" else _log_uniform(rng, 1e-14, 1e-10)
        inst = dataclasses.replace(inst, topk=dataclasses.replace(inst.topk, c2=c2_value))
        _, _, numel_prefix, backward_prefix = planner._unit_arrays(inst)
        least = backward_prefix.copy()
        if not dense:
            least += planner._least_topk_time(inst, numel_prefix)
        floor = planner._prefix_network_floor(inst, numel_prefix, backward_prefix, least)
        assert floor[0] == 0.0
        for t in range(1, inst.num_units + 1):
            prefix = dataclasses.replace(inst, layers=inst.layers[:t])
            truth = brute_force(prefix) - inst.forward_s
            assert floor[t] <= truth * (1 + 1e-12), (t, floor[t], truth)
            total += 1
            tight += floor[t] >= truth * (1 - 1e-9)
    assert tight >= total // 4


def _prefix_states_of_random_plans(inst, rng, count):
    """Per prefix s: (c, e) arrays of `count` random groupings (and modes) of units
    0..s-1, by the independent recurrence."""
    numel, backward = _arrays(inst)
    L = inst.num_units
    t = inst.topk
    entry_bytes = inst.value_bytes + inst.index_bytes
    states = [None] * (L + 1)
    for _ in range(count):
        c = e = 0.0
        d = b = 0.0
        for u in range(L):
            d += numel[u]
            b += backward[u]
            if u == L - 1 or rng.random() < 0.4:  # close a group after unit u
                dense = inst.dense is not None and rng.random() < 0.5
                if dense:
                    c += b
                    y = inst.dense.alpha_s + inst.dense.beta_s_per_byte * inst.value_bytes * d
                else:
                    c += b + t.c0 + t.c1 * d + t.c2 * d * math.log2(d)
                    k = max(1, math.ceil(inst.density * d))
                    y = inst.comm.alpha_s + inst.comm.beta_s_per_byte * entry_bytes * k
                e = max(e, c) + y
                d = b = 0.0
                old = states[u + 1]
                new = (np.array([c]), np.array([e]))
                states[u + 1] = new if old is None else (
                    np.concatenate((old[0], new[0])), np.concatenate((old[1], new[1])))
    return states


@pytest.mark.parametrize("c2", ["zero", "positive"])
def test_the_retirement_compute_floor_bounds_every_earlier_group_start(c2):
    """Rule 2 of the backward search prices a live state at t with the compute floor
    C0(s) + X(s..t) for every group s'..t-1 with s' <= s: by brute force over all
    groupings of 0..s'-1, the least compute at s' plus X(s'..t) is never below it (and
    with c2 > 0 the floor is often above the one-unit sums it replaced)."""
    rng = np.random.default_rng(401 + (c2 == "positive"))
    above = 0
    for _ in range(40):
        inst = random_instance(rng, int(rng.integers(2, 10)), dense=False)
        c2_value = 0.0 if c2 == "zero" else _log_uniform(rng, 1e-14, 1e-10)
        inst = dataclasses.replace(inst, topk=dataclasses.replace(inst.topk, c2=c2_value))
        numel, backward = _arrays(inst)
        L = inst.num_units
        t_ = inst.topk

        def x(a, b):  # compute of one sparse group a..b-1
            d = numel[a:b].sum()
            return backward[a:b].sum() + t_.c0 + t_.c1 * d + t_.c2 * d * math.log2(d)

        least = [0.0] + [math.inf] * L  # least compute of any grouping of 0..s-1
        for b in range(1, L + 1):
            least[b] = min(least[a] + x(a, b) for a in range(b))
        floor = planner._SuffixSearch(inst, math.inf).prefix_compute_no_c0
        singles = np.concatenate(([0.0], np.cumsum(
            backward + (t_.c1 + t_.c2 * np.log2(numel)) * numel)))
        for t in range(1, L + 1):
            for s in range(t):
                priced = floor[s] + x(s, t)
                for s2 in range(s + 1):
                    assert least[s2] + x(s2, t) >= priced * (1 - 1e-12) - 1e-18
        above += sum(floor[s] > singles[s] * (1 + 1e-9) for s in range(1, L))
    # (with c2 = 0 one group has the least top-k time, and the two floors agree)
    assert above > 40 if c2 == "positive" else above == 0


@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
@pytest.mark.parametrize("c2", ["zero", "positive"])
def test_backward_search_joined_to_known_prefixes_stays_exact(dense, c2):
    """_SuffixSearch with prefix states of actual groupings (as the beam supplies) and a
    loose bound: it still finds the brute-force optimum, and every plan time it saw on
    the way (best_found) is that of an actual plan, so never below the optimum."""
    rng = np.random.default_rng(51 + 2 * dense + (c2 == "positive"))
    tightened = 0
    for _ in range(50):
        inst = random_instance(rng, int(rng.integers(2, 10)), dense=dense)
        c2_value = 0.0 if c2 == "zero" else _log_uniform(rng, 1e-14, 1e-10)
        inst = dataclasses.replace(inst, topk=dataclasses.replace(inst.topk, c2=c2_value))
        truth = brute_force(inst) - inst.forward_s
        known = _prefix_states_of_random_plans(inst, rng, 6)
        search = planner._SuffixSearch(inst, math.inf, prefix_states=known)
        found = search.solve()
        assert found is not None
        bounds, modes = found
        value = resimulate(inst, planner._groups_from_bounds(bounds), modes) - inst.forward_s
        assert value == pytest.approx(truth, rel=REL)
        assert search.best_found >= truth * (1 - 1e-12)
        tightened += search.best_found < math.inf
    assert tightened >= 25  # the join did happen


def _small_case(rng, dense, c2):
    """A random instance small enough for brute force (``c2``: "zero" or "positive"
    top-k curvature) and its optimum after the forward pass."""
    inst = random_instance(rng, int(rng.integers(2, 9 if dense else 11)), dense=dense)
    c2_value = 0.0 if c2 == "zero" else _log_uniform(rng, 1e-14, 1e-10)
    inst = dataclasses.replace(inst, topk=dataclasses.replace(inst.topk, c2=c2_value))
    return inst, brute_force(inst) - inst.forward_s


@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
@pytest.mark.parametrize("c2", ["zero", "positive"])
def test_forward_search_joined_to_a_stopped_backward_search_is_exact(dense, c2):
    """A backward search stopped by its budget part way, then the forward search joined
    to the fronts it finished (at every point where it can stop): the brute-force
    optimum, with and without a bound."""
    rng = np.random.default_rng(71 + 2 * dense + (c2 == "positive"))
    joins = used = 0
    for _ in range(30):
        inst, truth = _small_case(rng, dense, c2)
        full = planner._SuffixSearch(inst, math.inf)
        full.solve()
        for budget in sorted({1, 2, 3, 5, 8, full.examined // 2, full.examined - 1}):
            for bound in (math.inf, truth * (1 + 1e-9)):
                backward = planner._SuffixSearch(inst, bound, budget=max(1, budget))
                if backward.solve() is not None:
                    continue
                assert backward.stopped_at is not None
                forward = planner._FrontierSearch(inst, upper_bound=bound, suffix=backward)
                found = forward.solve()
                assert found is not None
                used += forward.used_join
                bounds, modes = found
                assert bounds[-1] == inst.num_units and len(modes) == len(bounds)
                value = resimulate(inst, planner._groups_from_bounds(bounds), modes)
                assert value - inst.forward_s == pytest.approx(truth, rel=REL), (budget, bound)
                joins += 1
    assert joins >= 100
    assert used >= joins // 6  # the joined plans often win (the others end at the last unit)


@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
def test_a_joined_forward_turn_that_stops_early_returns_what_the_full_turn_does(
        dense, monkeypatch):
    """A joined exact forward turn gives up as soon as its budget must run out before its
    last target (the live set only grows until the next prune): with every budget up to
    what it needs, it returns None exactly where the turn run to the end of its budget
    does, and the same plan where that finishes."""
    rng = np.random.default_rng(131 + dense)
    stopped = finished = early_stops = 0
    for _ in range(12):
        inst = random_instance(rng, int(rng.integers(20, 60)), dense=dense)
        full = planner._SuffixSearch(inst, math.inf)
        full.solve()
        backward = planner._SuffixSearch(inst, math.inf, budget=max(1, full.examined // 3))
        if backward.solve() is not None:
            continue
        need = planner._FrontierSearch(inst, suffix=backward)
        assert need.solve() is not None
        budgets = sorted(set(np.geomspace(1, 2 * inst.num_units * 64, 40).astype(int)))
        for budget in budgets:
            early = planner._FrontierSearch(inst, budget=int(budget), suffix=backward)
            monkeypatch.setattr(planner._FrontierSearch, "_STOP_EARLY", False)
            late = planner._FrontierSearch(inst, budget=int(budget), suffix=backward)
            expected = late.solve()
            monkeypatch.setattr(planner._FrontierSearch, "_STOP_EARLY", True)
            assert early.solve() == expected
            stopped += expected is None
            finished += expected is not None
            early_stops += early.stopped_early
    assert stopped >= 100 and finished >= 50 and early_stops >= 100


@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
@pytest.mark.parametrize("c2", ["zero", "positive"])
def test_backward_search_joined_to_exact_prefix_fronts_is_exact(dense, c2):
    """A first forward turn that ran out of budget (and went on as a beam) leaves the
    exact fronts of its first prefixes; the backward search joined to them (suffix
    starts up to there priced against those fronts, not searched) finds the brute-force
    optimum - in one go, resumed in small steps, and with a forward search joined to it
    where it stopped - with and without a tight bound."""
    rng = np.random.default_rng(95 + 2 * dense + (c2 == "positive"))
    joined = regions = 0
    for _ in range(30):
        inst, truth = _small_case(rng, dense, c2)
        for budget in (1, 2, 4, 8, 16, 40):
            for bound in (math.inf, truth * (1 + 1e-9)):
                forward = planner._FrontierSearch(inst, upper_bound=bound, budget=budget,
                                                  then_beam=(1, 2))
                forward.solve()  # (if it finished, its fronts cover every prefix)
                for step in (None, 3):
                    backward = planner._SuffixSearch(
                        inst, bound, budget=step, prefix_states=forward.beam_states,
                        exact_prefix=forward)
                    regions += backward.join_to >= 0
                    found = backward.solve()
                    while found is None and backward.outcome == "budget":
                        # a forward search joined to it where it stopped is exact too
                        again = planner._FrontierSearch(inst, upper_bound=bound,
                                                        suffix=backward).solve()
                        value = resimulate(inst, planner._groups_from_bounds(again[0]),
                                           again[1])
                        assert value - inst.forward_s == pytest.approx(truth, rel=REL)
                        found = backward.resume(step)
                    assert found is not None, (budget, bound, step)
                    joined += backward.used_join
                    bounds, modes = found
                    assert bounds[-1] == inst.num_units and len(modes) == len(bounds)
                    value = resimulate(inst, planner._groups_from_bounds(bounds), modes)
                    assert value - inst.forward_s == pytest.approx(truth, rel=REL), (
                        budget, bound, step)
    assert regions >= 50 and joined == regions  # the join did happen


@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
def test_a_resumed_backward_search_is_the_one_shot_search(dense):
    """A backward search stopped by its budget and resumed in small steps returns the
    same plan as one run without a budget, and with the bound lowered on the way (to
    just above the optimum) still the brute-force optimum."""
    rng = np.random.default_rng(81 + dense)
    resumed = 0
    for i in range(40):
        inst = random_instance(rng, int(rng.integers(2, 9 if dense else 11)), dense=dense)
        if i % 2:
            inst = dataclasses.replace(inst, topk=dataclasses.replace(inst.topk, c2=0.0))
        truth = brute_force(inst) - inst.forward_s
        one_shot = planner._SuffixSearch(inst, math.inf).solve()
        for lowered in (math.inf, truth * (1 + 1e-9)):
            search = planner._SuffixSearch(inst, math.inf, budget=1)
            found = search.solve()
            while found is None and search.outcome == "budget":
                found = search.resume(int(rng.integers(1, 6)), lowered)
                resumed += 1
            assert found is not None
            if lowered == math.inf:
                assert found == one_shot
            value = resimulate(inst, planner._groups_from_bounds(found[0]), found[1])
            assert value - inst.forward_s == pytest.approx(truth, rel=REL)
    assert resumed >= 100


@pytest.mark.parametrize("start_budget", [4, 60])
def test_the_first_turn_turning_into_a_beam_keeps_optimal_exact(monkeypatch, start_budget):
    """A first forward turn that runs out of budget goes on as a beam search, whose plan
    and states then seed the other turns: on random small instances (sparse and dense,
    c2 = 0 and c2 > 0) `optimal` is still the brute-force optimum."""
    monkeypatch.setattr(planner, "_RACE_START_BUDGET", start_budget)
    rng = np.random.default_rng(61 + start_budget)
    for i in range(80):
        dense = bool(i % 2)
        inst = random_instance(rng, int(rng.integers(2, 9 if dense else 12)), dense=dense)
        if i % 4 < 2:
            inst = dataclasses.replace(inst, topk=dataclasses.replace(inst.topk, c2=0.0))
        with warnings.catch_warnings():
            warnings.simplefilter("error", SearchBudgetWarning)
            plan = make_plan(inst)
        assert plan.predicted_iteration_s == pytest.approx(brute_force(inst), rel=REL)


def test_the_joined_race_equals_the_reference_dp_on_medium_instances(monkeypatch):
    """With a tiny first turn, every part of the race runs on 40-120-unit instances - the
    beam taking over the first turn, the backward search joined to its prefixes and
    resumed, the forward search joined to a stopped backward search - and `optimal`
    is still the plain Pareto DP's optimum (sparse and dense, linear and n log n)."""
    monkeypatch.setattr(planner, "_RACE_START_BUDGET", 500)
    rng = np.random.default_rng(91)
    cases = []
    for i in range(3):
        cases.append(random_instance(rng, int(rng.integers(60, 120)), dense=False))
        cases.append(realistic_instance(rng, int(rng.integers(60, 120)), False,
                                        "nlogn" if i % 2 else "linear"))
        cases.append(random_instance(rng, int(rng.integers(25, 40)), dense=True))
        cases.append(realistic_instance(rng, int(rng.integers(25, 40)), True, "mixed"))
    for inst in cases:
        with warnings.catch_warnings():
            warnings.simplefilter("error", SearchBudgetWarning)
            plan = make_plan(inst)
        assert plan.predicted_iteration_s == pytest.approx(reference_optimum(inst), rel=REL)


def _front_with_and_without_prefilter(first, second, tie):
    order = first.argsort(kind="stable")
    plain = planner._pareto_front(first, second, order, tie)
    kept = planner._undominated(first, second)
    f, s = first[kept], second[kept]
    chosen, new_first, new_second = planner._pareto_front(f, s, f.argsort(kind="stable"), tie)
    return plain, (kept[chosen], new_first, new_second)


def test_the_candidate_prefilter_changes_no_front():
    """_undominated only drops candidates that _pareto_front would drop too, and dropping
    them changes nothing it keeps - with exact ties, near ties (within `tie`) and blocks
    of sorted runs like the searches' candidate sets."""
    rng = np.random.default_rng(123)
    dropped = 0
    for i in range(400):
        n = int(rng.integers(1, 3000))
        if i % 3 == 0:  # few distinct values: many exact ties in both coordinates
            first = rng.integers(0, 20, n).astype(float)
            second = rng.integers(0, 20, n).astype(float)
        elif i % 3 == 1:  # sorted runs (one per source prefix), e falling along a run
            first = np.concatenate([np.sort(rng.random(r)) + rng.random()
                                    for r in rng.integers(1, 40, n // 20 + 1)])
            second = 3.0 - first + 0.3 * rng.random(first.size)
        else:  # values within a few ties of each other
            first = 1.0 + 1e-12 * rng.integers(0, 5, n)
            second = 2.0 + 1e-12 * rng.integers(0, 5, n)
        tie = float(rng.choice([0.0, 1e-12, 0.05]))
        plain, filtered = _front_with_and_without_prefilter(first, second, tie)
        for a, b in zip(plain, filtered):
            np.testing.assert_array_equal(a, b)
        dropped += first.size - planner._undominated(first, second).size
    assert dropped > 0  # the filter does drop candidates


def test_a_wrong_prefilter_is_detected(monkeypatch):
    """The comparison above can fail: a filter that also drops candidates dominated by
    one of equal `first` (not before them in the stable order) changes the front."""
    first = np.array([1.0, 1.0, 2.0])
    second = np.array([5.0, 5.0, 1.0])

    def too_eager(f, s):
        return np.array([1, 2])  # drops candidate 0, the one the stable order keeps

    monkeypatch.setattr(planner, "_undominated", too_eager)
    plain, filtered = _front_with_and_without_prefilter(first, second, 0.0)
    assert not np.array_equal(plain[0], filtered[0])


def test_the_reference_dp_equals_brute_force():
    """The reference itself, checked on small instances (so that agreeing with it means
    something)."""
    rng = np.random.default_rng(78)
    for i in range(40):
        inst = random_instance(rng, int(rng.integers(1, 9)), dense=bool(i % 2))
        assert reference_optimum(inst) == pytest.approx(brute_force(inst), rel=REL)


def test_large_instance_consistency():
    rng = np.random.default_rng(3)
    for dense, num_units in ((False, 1000), (True, 150)):
        inst = random_instance(rng, num_units, dense=dense)
        with warnings.catch_warnings():
            warnings.simplefilter("error", SearchBudgetWarning)  # exact: no fallback
            plans = {s: make_plan(inst, s) for s in ("optimal", "greedy", "layerwise", "single")}
        for plan in plans.values():
            assert plan.predicted_iteration_s == pytest.approx(
                resimulate(inst, plan.groups, plan.dense), rel=REL
            )
            assert plans["optimal"].predicted_iteration_s <= plan.predicted_iteration_s * (
                1 + 1e-12
            )


def test_degenerate_all_zero_costs():
    inst = Instance(
        layers=(Unit(5, 0.0), Unit(7, 0.0), Unit(1, 0.0)),
        world_size=2,
        density=1.0,
        forward_s=0.0,
        comm=LinearCost(0.0, 0.0),
        topk=TopkCost(0.0, 0.0, 0.0),
        dense=LinearCost(0.0, 0.0),
    )
    plan = make_plan(inst)
    assert plan.predicted_iteration_s == 0.0
    assert [u for g in plan.groups for u in g] == [0, 1, 2]


# ----------------------------------------------------------------------- strategies


def _instance(units, **kw):
    base = dict(
        world_size=2,
        density=1.0,
        forward_s=0.0,
        comm=LinearCost(0.01, 0.0),
        topk=TopkCost(0.0, 0.0, 0.0),
    )
    base.update(kw)
    return Instance(layers=tuple(Unit(n, b) for n, b in units), **base)


def test_greedy_merges_when_one_collective_fewer_saves_more_than_the_wait():
    inst = _instance([(10, 0.0), (10, 0.001)], comm=LinearCost(1.0, 0.0))
    assert greedy_groups(inst) == ((0, 1),)


def test_greedy_splits_when_the_wait_is_longer_than_alpha():
    inst = _instance([(10, 0.0), (10, 1.0)], comm=LinearCost(1e-3, 0.0))
    assert greedy_groups(inst) == ((0,), (1,))


def test_greedy_discounts_the_time_a_group_would_queue_anyway():
    # unit 0's collective keeps the network busy for ~1 s; group [1] would wait for it,
    # so merging unit 2 (0.5 s of backward) costs nothing extra and saves alpha
    beta = 1.0 / (8 * 1000)
    units = [(1000, 0.0), (1, 0.1), (1, 0.5)]
    busy = _instance(units, comm=LinearCost(0.01, beta))
    assert greedy_groups(busy) == ((0,), (1, 2))
    # same units with an idle network: the 0.5 s wait is not worth 0.01 s of alpha
    idle = _instance(units, comm=LinearCost(0.01, 0.0))
    assert greedy_groups(idle) == ((0,), (1,), (2,))


def test_greedy_counts_the_extra_topk_cost_of_the_merged_size():
    # merging doubles a group whose top-k is superlinear: c2 * D log D grows by more than
    # the alpha saved, so the units stay apart
    units = [(1 << 20, 0.0), (1 << 20, 0.0)]
    cheap = _instance(units, comm=LinearCost(0.01, 0.0), topk=TopkCost(0.0, 0.0, 0.0))
    assert greedy_groups(cheap) == ((0, 1),)
    costly = _instance(units, comm=LinearCost(0.01, 0.0), topk=TopkCost(0.0, 0.0, 1e-6))
    assert greedy_groups(costly) == ((0,), (1,))


def test_layerwise_single_and_threshold_groupings():
    inst = _instance([(10, 0.1)] * 4, value_bytes=4)
    assert make_plan(inst, "layerwise").groups == ((0,), (1,), (2,), (3,))
    assert make_plan(inst, "single").groups == ((0, 1, 2, 3),)
    assert threshold_groups(inst, 80) == ((0, 1), (2, 3))  # 40 bytes per unit
    assert threshold_groups(inst, 81) == ((0, 1, 2), (3,))  # the last group may be smaller
    assert threshold_groups(inst, 1) == ((0,), (1,), (2,), (3,))
    assert make_plan(inst, "threshold:1000000").groups == ((0, 1, 2, 3),)
    assert make_plan(_instance([(10, 0.1)] * 4, value_bytes=2), "threshold:80").groups == (
        (0, 1, 2, 3),
    )
    with pytest.raises(ValueError, match="positive integer"):
        threshold_groups(inst, 0)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("optimal", "optimal"),
        (" Greedy ", "greedy"),
        ("LAYERWISE", "layerwise"),
        ("single", "single"),
        ("threshold:25000000", "threshold:25000000"),
        ("threshold: 2.5e7", "threshold:25000000"),
    ],
)
def test_parse_strategy_normalises(text, expected):
    assert parse_strategy(text) == expected


@pytest.mark.parametrize(
    "text", ["fastest", "", "threshold:", "threshold:0", "threshold:-5", "threshold:1.5",
             "threshold:abc", "threshold:inf", None, 3]
)
def test_parse_strategy_rejects_unknown_names(text):
    with pytest.raises(ValueError) as caught:
        parse_strategy(text)
    message = str(caught.value)
    assert "threshold:BYTES" in message or "positive integer" in message
    with pytest.raises(ValueError):
        make_plan(_instance([(10, 0.1)]), text)


# ----------------------------------------------------------------------- dense option


def test_dense_absent_gives_the_sparse_model_exactly():
    rng = np.random.default_rng(11)
    for _ in range(20):
        sparse = random_instance(rng, int(rng.integers(1, 9)), dense=False)
        # a dense cost so high that it never pays
        never = dataclasses.replace(sparse, dense=LinearCost(1e6, 1.0))
        for strategy in ("optimal", "greedy", "layerwise", "single"):
            a, b = make_plan(sparse, strategy), make_plan(never, strategy)
            assert a.groups == b.groups
            assert a.dense == b.dense == (False,) * len(a.groups)
            assert a.predicted_iteration_s == b.predicted_iteration_s


def test_dense_is_chosen_where_it_is_cheaper():
    # top-k is slow and the all-reduce cheap: every group goes dense
    inst = _instance(
        [(1000, 0.01)] * 3,
        density=0.01,
        topk=TopkCost(0.1, 0.0, 0.0),
        dense=LinearCost(0.001, 0.0),
    )
    plan = make_plan(inst)
    assert all(plan.dense)
    assert plan.predicted_iteration_s == pytest.approx(brute_force(inst), rel=REL)
    assert best_modes(inst, [[0], [1], [2]]) == (True, True, True)
    assert best_modes(_instance([(1000, 0.01)] * 3), [[0, 1], [2]]) == (False, False)


# ----------------------------------------------------------------------- evaluate, Plan


def test_evaluate_matches_the_plan_and_validates_groups():
    rng = np.random.default_rng(5)
    inst = random_instance(rng, 8, dense=True)
    plan = make_plan(inst)
    again = evaluate(inst, [list(g) for g in plan.groups], list(plan.dense))
    assert again.strategy == "fixed"
    assert dataclasses.replace(again, strategy="optimal") == plan
    chosen = evaluate(inst, plan.groups, strategy="mine")  # modes chosen by the planner
    assert chosen.strategy == "mine"
    assert chosen.predicted_iteration_s == pytest.approx(plan.predicted_iteration_s, rel=REL)
    with pytest.raises(InstanceError) as caught:
        evaluate(inst, [[0, 1], [3, 2], [4, 5, 6, 7]])
    assert caught.value.field == "groups[1]"
    with pytest.raises(InstanceError):
        evaluate(inst, plan.groups, dense=[True])
    with pytest.raises(TypeError):
        evaluate(inst.to_dict(), plan.groups)
    with pytest.raises(TypeError):
        make_plan(inst.to_dict())


def test_plan_to_dict():
    plan = Plan("optimal", ((0, 1), (2,)), (False, True), 1.5, 0.25)
    assert plan.num_groups == 2
    assert plan.to_dict() == {
        "strategy": "optimal",
        "groups": [[0, 1], [2]],
        "dense": [False, True],
        "predicted_iteration_s": 1.5,
        "non_overlapped_s": 0.25,
    }
    assert "dense" not in plan.to_dict(include_dense=False)


# ----------------------------------------------------------------------- determinism


def test_plans_are_deterministic_and_break_ties_the_same_way():
    # identical units: many partitions tie; the plan must not depend on anything but input
    tie = _instance([(1000, 1e-3)] * 10, density=0.01, comm=LinearCost(1e-3, 1e-9))
    first = make_plan(tie)
    for _ in range(3):
        assert make_plan(tie) == first
        assert make_plan(Instance.from_dict(tie.to_dict())) == first
    rng = np.random.default_rng(9)
    inst = random_instance(rng, 200, dense=True)
    assert make_plan(inst) == make_plan(Instance.from_dict(inst.to_dict()))


# ----------------------------------------------------------------------- search budget


def test_no_budget_and_no_warning_up_to_exact_units(monkeypatch):
    """Up to EXACT_UNITS units a sparse `optimal` is exact whatever SEARCH_BUDGET says: a
    tiny budget and race turns only make the two searches take more turns."""
    rng = np.random.default_rng(2)
    monkeypatch.setattr(planner, "SEARCH_BUDGET", 1)
    monkeypatch.setattr(planner, "_RACE_START_BUDGET", 4)
    for dense in (False,):
        for _ in range(6):
            inst = random_instance(rng, int(rng.integers(20, 60)), dense=dense)
            with warnings.catch_warnings():
                warnings.simplefilter("error", SearchBudgetWarning)
                plan = make_plan(inst)
            assert plan.predicted_iteration_s == pytest.approx(reference_optimum(inst), rel=REL)


def test_with_a_dense_cost_the_budget_always_bounds_the_search(monkeypatch):
    """Dense fronts can take minutes to search exhaustively; a plan that late would stall
    training, so with a dense cost SEARCH_BUDGET applies at every size."""
    rng = np.random.default_rng(2)
    inst = random_instance(rng, 40, dense=True)
    exact = make_plan(inst)  # the real budget suffices here
    assert exact.predicted_iteration_s == pytest.approx(reference_optimum(inst), rel=REL)
    monkeypatch.setattr(planner, "SEARCH_BUDGET", 1)
    monkeypatch.setattr(planner, "_RACE_START_BUDGET", 4)
    with pytest.warns(SearchBudgetWarning):
        bounded = make_plan(inst)
    assert exact.predicted_iteration_s <= bounded.predicted_iteration_s * (1 + 1e-12)


def test_search_budget_is_a_safety_valve_beyond_exact_units(monkeypatch):
    rng = np.random.default_rng(2)
    inst = random_instance(rng, 60, dense=False)
    exact = make_plan(inst)
    monkeypatch.setattr(planner, "EXACT_UNITS", 50)  # pretend 60 units is "very large"
    monkeypatch.setattr(planner, "SEARCH_BUDGET", 50)
    monkeypatch.setattr(planner, "_RACE_START_BUDGET", 10)
    with pytest.warns(SearchBudgetWarning, match="not proven optimal"):
        fallback = make_plan(inst)
    assert fallback.predicted_iteration_s == pytest.approx(
        resimulate(inst, fallback.groups, fallback.dense), rel=REL
    )
    assert exact.predicted_iteration_s <= fallback.predicted_iteration_s * (1 + 1e-12)
    assert fallback.predicted_iteration_s <= make_plan(inst, "greedy").predicted_iteration_s
    # with the valve out of reach no warning is raised
    monkeypatch.undo()
    with warnings.catch_warnings():
        warnings.simplefilter("error", SearchBudgetWarning)
        assert make_plan(inst) == exact


def test_the_dense_valve_shrinks_with_the_units_beyond_its_full_size():
    full = planner.SEARCH_BUDGET
    edge = planner.DENSE_FULL_BUDGET_UNITS
    assert planner.dense_valve_budget(1) == planner.dense_valve_budget(edge) == full
    assert planner.dense_valve_budget(edge + 1) < full
    # a tenth at 1000 units (the size measured in docs/cost-model.md)
    assert planner.dense_valve_budget(1000) == pytest.approx(full / 10, rel=0.01)
    sizes = [edge, 400, 500, 700, 1000, 2000, 5000, 10**5]
    budgets = [planner.dense_valve_budget(n) for n in sizes]
    assert budgets == sorted(budgets, reverse=True)
    # never below the first turn's own count
    assert budgets[-1] == planner._RACE_START_BUDGET


def test_valve_default_is_scaled_only_with_a_dense_cost_and_an_explicit_budget_wins():
    rng = np.random.default_rng(3)
    dense = random_instance(rng, 40, dense=True)
    sparse = random_instance(rng, 40, dense=False)
    big = dataclasses.replace(dense, layers=dense.layers * 30)  # 1200 units
    big_sparse = dataclasses.replace(sparse, layers=sparse.layers * 30)
    assert planner._valve(dense) == planner.SEARCH_BUDGET
    assert planner._valve(big) == planner.dense_valve_budget(1200) < planner.SEARCH_BUDGET
    assert planner._valve(big_sparse) == planner.SEARCH_BUDGET  # beyond EXACT_UNITS
    assert planner._valve(sparse) is None
    assert planner._valve(big, budget=7) == 7


def test_a_search_stopped_by_the_scaled_dense_valve_says_so_and_keeps_its_bounds(monkeypatch):
    rng = np.random.default_rng(2)
    inst = random_instance(rng, 40, dense=True)
    exact = make_plan(inst)
    monkeypatch.setattr(planner, "SEARCH_BUDGET", 400)
    monkeypatch.setattr(planner, "DENSE_FULL_BUDGET_UNITS", 20)
    monkeypatch.setattr(planner, "_RACE_START_BUDGET", 4)
    assert planner._valve(inst) == 100  # 400 * (20 / 40) ** 2
    with pytest.warns(SearchBudgetWarning, match="dense valve of 100"):
        bounded = make_plan(inst)
    assert exact.predicted_iteration_s <= bounded.predicted_iteration_s * (1 + 1e-12)
    with warnings.catch_warnings():  # greedy's mode search has the same small valve
        warnings.simplefilter("ignore", SearchBudgetWarning)
        greedy = make_plan(inst, "greedy")
    assert bounded.predicted_iteration_s <= greedy.predicted_iteration_s


def test_a_replan_searches_with_the_smaller_of_its_budget_and_the_first_plans():
    from omgs_hook import plan_job

    rng = np.random.default_rng(4)
    dense = random_instance(rng, 40, dense=True)
    assert plan_job.replan_budget(dense) == plan_job.REPLAN_SEARCH_BUDGET
    assert plan_job.replan_budget(random_instance(rng, 40, dense=False)) == (
        plan_job.REPLAN_SEARCH_BUDGET)
    big = dataclasses.replace(dense, layers=dense.layers * 25)  # 1000 units
    assert plan_job.replan_budget(big) == planner.dense_valve_budget(1000) < (
        plan_job.REPLAN_SEARCH_BUDGET)


@pytest.mark.parametrize("field,shift", [("tail_s", 0.125), ("level_s", -0.0375),
                                         ("level_s", 0.2)])
def test_the_tail_and_the_level_move_every_prediction_but_never_the_plan(field, shift):
    rng = np.random.default_rng(7)
    for dense in (False, True):
        for _ in range(20):
            inst = random_instance(rng, int(rng.integers(2, 30)), dense)
            moved = dataclasses.replace(inst, **{field: shift})
            for strategy in ("optimal", "greedy", "layerwise", "single"):
                a, b = make_plan(inst, strategy), make_plan(moved, strategy)
                assert (a.groups, a.dense) == (b.groups, b.dense)
                assert b.predicted_iteration_s == pytest.approx(a.predicted_iteration_s + shift)
                # the vectorised walk the hook's checks use agrees
                walked = planner.predicted_iteration_s(moved, b.groups, list(b.dense))
                assert walked == pytest.approx(b.predicted_iteration_s)


# ------------------------------------------------------------- the int32 index range


def _sparse_sizes(inst, plan):
    return [sum(inst.layers[u].numel for u in g) for g, d in zip(plan.groups, plan.dense) if not d]


def test_sparse_groups_never_exceed_the_int32_index_range():
    """Five 1e9-element buckets (a 5B-parameter model): one TopK-SGD group would need
    indices beyond int32. Every strategy cuts its sparse groups to fit, in ready order."""
    inst = _instance([(10**9, 0.01)] * 5, density=0.001,
                     comm=LinearCost(1e-3, 1e-9), topk=TopkCost(1e-4, 1e-10, 0.0))
    limit = 2**31 - 1
    for strategy in ("single", "optimal", "greedy", "layerwise", "threshold:1000000000000"):
        plan = make_plan(inst, strategy)
        assert [u for g in plan.groups for u in g] == [0, 1, 2, 3, 4], strategy
        assert all(size <= limit for size in _sparse_sizes(inst, plan)), (strategy, plan.groups)
        assert plan == evaluate(inst, plan.groups, plan.dense, strategy=strategy)
    # TopK-SGD's one group: as few pieces as fit, each as large as fits
    assert make_plan(inst, "single").groups == ((0, 1), (2, 3), (4,))
    # explicitly sparse groups given to evaluate are cut the same way
    assert evaluate(inst, [[0, 1, 2, 3, 4]], [False]).groups == ((0, 1), (2, 3), (4,))


def test_plans_that_fit_are_unchanged_and_cuts_respect_a_lowered_limit(monkeypatch):
    from omgs_hook import cost_model

    rng = np.random.default_rng(11)
    for trial in range(30):
        inst = random_instance(rng, int(rng.integers(2, 30)), dense=bool(trial % 2))
        plans = {s: make_plan(inst, s) for s in ("optimal", "greedy", "single", "layerwise")}
        largest = max(u.numel for u in inst.layers)
        limit = int(rng.integers(largest, 3 * largest + 1))
        monkeypatch.setattr(cost_model, "MAX_SPARSE_GROUP_NUMEL", limit)
        for strategy, unlimited in plans.items():
            plan = make_plan(inst, strategy)
            assert [u for g in plan.groups for u in g] == list(range(inst.num_units))
            assert all(size <= limit for size in _sparse_sizes(inst, plan)), (trial, strategy)
            if all(size <= limit for size in _sparse_sizes(inst, unlimited)):
                assert plan == unlimited, (trial, strategy)  # nothing to cut
            else:  # a group was cut: the plan has more groups
                assert plan.num_groups > unlimited.num_groups
        monkeypatch.undo()


def test_a_unit_beyond_the_index_range_is_a_group_of_its_own(monkeypatch):
    from omgs_hook import cost_model

    monkeypatch.setattr(cost_model, "MAX_SPARSE_GROUP_NUMEL", 100)
    units = [(50, 0.01), (40, 0.01), (150, 0.01), (30, 0.01)]
    for dense in (None, LinearCost(1e3, 0.0)):  # (dense far too slow to be chosen)
        plan = make_plan(_instance(units, density=0.01, dense=dense), "single")
        assert plan.groups == ((0, 1), (2,), (3,)) and plan.dense == (False,) * 3


def test_a_budget_caps_the_valve_where_it_applies_and_nowhere_else():
    """``make_plan(..., budget=N)``: a dense search stops after N candidates (the warning
    names that budget) and still returns a plan no worse than its start; a sparse
    instance up to EXACT_UNITS units stays exact whatever the budget; a bad budget is
    refused by name."""
    rng = np.random.default_rng(11)
    inst = random_instance(rng, 40, dense=True)
    full = make_plan(inst, "optimal")
    start = make_plan(inst, "greedy")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        capped = make_plan(inst, "optimal", start=(start.groups, start.dense), budget=10)
    messages = [str(w.message) for w in caught if issubclass(w.category, SearchBudgetWarning)]
    assert messages and "its budget of 10 " in messages[0]
    assert capped.predicted_iteration_s <= evaluate(inst, start.groups, start.dense).predicted_iteration_s
    assert capped.predicted_iteration_s >= full.predicted_iteration_s * (1 - REL)
    sparse = dataclasses.replace(inst, dense=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SearchBudgetWarning)
        assert make_plan(sparse, "optimal", budget=10) == make_plan(sparse, "optimal")
    for bad in (0, -5, 2.5, True, "10"):
        with pytest.raises(ValueError, match="budget must be a positive int"):
            make_plan(inst, "optimal", budget=bad)
