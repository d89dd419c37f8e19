"""Planner speed: ``optimal`` and ``greedy`` on realistic and random instances, and the
cost of handing a plan to the background planner.

Run with ``pytest benchmarks/test_bench_planner.py --benchmark-only`` (CPU time:
``--benchmark-timer=time.process_time``). Realistic instances come from
``scripts/compare_strategies.py`` (layers of the shipped ResNet-50, VGG-16 and
Inception-v3 profiles, ring-algorithm network costs; see its docstring), five seeds per
group:

* ``optimal, 1000 units, linear top-k``: selectors with ``c2 = 0`` (the shipped
  ``sampled`` and ``cupy`` backends). Target: under 100 ms per plan. Met (about 30 ms,
  at most about 45 ms, on 2 loaded cores).
* ``optimal, 1000 units, n log n top-k``: ``c2 > 0`` (e.g. ``torch.topk`` on a CPU).
  Target: under 100 ms per plan. Met in the median and on seeds 0-3 (80-99 ms at load
  0.7-2.7); seed 4 (231 groups in its optimum) takes about 96-120 ms (was 160-230 ms):
  its backward search examines 0.25 million candidates (was 1.4 million), and the
  first forward turn with its beam takes about 45 ms of it.
* ``greedy, 1000 units``.
* ``optimal, 1000 units, dense cost`` (and the random dense classes below, at 1000
  units). Target for the dense option: exact (no ``SearchBudgetWarning``) and under
  200 ms per plan. NOT MET, and not attainable for every instance: choosing groups and
  modes is NP-hard (a reduction from PARTITION, docs/cost-model.md "The dense option is
  NP-hard", checked by tests/test_dense_hardness.py), so with a dense cost the
  planner's search budget always applies. The realistic dense and "dense close to sparse" searches all end
  there (310-530 ms; even with the optimum itself as the bound, the forward search alone
  takes 32 s on realistic seed 0 and the backward search 197 s, and 100 million
  candidates do not finish random dense seed 4 or dense-close seed 0: the fronts are
  knapsack-like, docs/cost-model.md); "random dense" ends there on 1 of 5 seeds (40-80
  ms on the others), "slow network, dense" never (90-125 ms, seed 4 about 280-340 ms).
  Since 2026-12-06 the valve shrinks with the units beyond 316 (a tenth at 1000 units,
  ``planner.dense_valve_budget``): the same plans on all 20 instances, and 18 of 20
  under 200 ms on a quiet host (8 of 20 before; the two left, dense close to sparse
  seeds 3 and 4, 228-233 ms; docs/cost-model.md, "A smaller valve for larger dense
  instances"). A speed-up of the searches the same day, with the same plans (the dense
  beam with fewer numpy calls, the polish pricing a whole pass at once, the last
  forward turn giving up as soon as its count must run out), brings all 20 under
  200 ms: 34-164 ms per plan (medians, 2 shared cores at load 1.8-2.9), where the
  previous planner took 36-196 ms in the same runs, alternating with it in one process
  (dense close to sparse seed 4: 196 -> 135-142 ms; docs/cost-model.md, "Planner time
  with the dense option: the same plans, faster").
  So these benchmarks are marked ``xfail`` (not strict: the instances that
  finish within the budget pass); they still record the time per plan. How far the
  stopped plans are from the optimum: ``scripts/dense_plan_gap.py`` (realistic seeds 0-4,
  with the polish at the valve: +0.0012%, +0.033%, +0.00004%, +0.17%, +0.013%; before it
  up to +3.5%; docs/cost-model.md).

Random instances (:func:`random_case`, the adversarial classes of docs/cost-model.md):
wide-ranging sparse instances with ``c2 = 0`` and ``c2 > 0``, a network 10-200x slower
than the realistic ones with an ``n log n`` selector, and dense costs that trade
closely against sparse ones. Every ``optimal`` benchmark checks that no
``SearchBudgetWarning`` was raised (``optimal`` is exact up to 1000 units) and that the
plan is no worse than ``greedy``.

``background submit`` measures how long ``BackgroundPlanner.submit`` holds the caller
when it hands over a 1000-unit plan (target: under 20 ms; the planning itself runs on
the worker thread). Run it with the default wall-clock timer: ``process_time`` would
also count the worker thread's CPU time.
"""

import importlib.util
import sys
import warnings
from pathlib import Path

import dataclasses
import math

import numpy as np
import pytest

from omgs_hook.background_planner import BackgroundPlanner
from omgs_hook.cost_model import Instance, LinearCost, TopkCost, Unit
from omgs_hook.planner import SearchBudgetWarning, make_plan

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "compare_strategies.py"
SEEDS = (0, 1, 2, 3, 4)


def _load_compare():
    # by path: scripts/ is not a package, and putting it on sys.path could shadow modules
    name = "compare_strategies"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _instance(seed, num_units, dense=False, topk="linear"):
    rng = np.random.default_rng(seed)
    return _load_compare().realistic_instance(rng, num_units, dense, topk)


def _check_optimal(inst, plan):
    greedy = make_plan(inst, "greedy")
    assert plan.predicted_iteration_s <= greedy.predicted_iteration_s * (1 + 1e-12)


@pytest.mark.parametrize("seed", SEEDS)
def test_bench_optimal_1000_units(benchmark, seed):
    inst = _instance(seed, 1000)
    benchmark.group = "optimal, 1000 units, linear top-k"
    with warnings.catch_warnings():
        warnings.simplefilter("error", SearchBudgetWarning)  # must be the exact optimum
        plan = benchmark.pedantic(make_plan, args=(inst, "optimal"), rounds=10, warmup_rounds=1)
    _check_optimal(inst, plan)


@pytest.mark.parametrize("seed", SEEDS)
def test_bench_optimal_1000_units_nlogn_topk(benchmark, seed):
    inst = _instance(seed, 1000, topk="nlogn")
    benchmark.group = "optimal, 1000 units, n log n top-k"
    with warnings.catch_warnings():
        warnings.simplefilter("error", SearchBudgetWarning)
        plan = benchmark.pedantic(make_plan, args=(inst, "optimal"), rounds=3, warmup_rounds=0)
    _check_optimal(inst, plan)


@pytest.mark.parametrize("seed", SEEDS)
def test_bench_greedy_1000_units(benchmark, seed):
    inst = _instance(seed, 1000)
    benchmark.group = "greedy, 1000 units"
    plan = benchmark.pedantic(make_plan, args=(inst, "greedy"), rounds=10, warmup_rounds=1)
    assert sum(len(g) for g in plan.groups) == 1000


DENSE_NOT_EXACT = pytest.mark.xfail(
    strict=False,  # some instances do finish within the budget
    reason="open target, NP-hard in general: with a dense cost SEARCH_BUDGET always applies",
)


def _plan_recording_budget_hits(benchmark, inst, rounds):
    """Benchmark `optimal` on inst; returns (plan, whether any round hit the budget).

    Warnings are recorded rather than raised, so that the time is measured either way."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SearchBudgetWarning)
        plan = benchmark.pedantic(make_plan, args=(inst, "optimal"), rounds=rounds,
                                  warmup_rounds=0)
    return plan, any(issubclass(w.category, SearchBudgetWarning) for w in caught)


@DENSE_NOT_EXACT
@pytest.mark.parametrize("seed", SEEDS)
def test_bench_optimal_1000_units_dense(benchmark, seed):
    inst = _instance(seed, 1000, dense=True, topk="mixed")
    benchmark.group = "optimal, 1000 units, dense cost"
    plan, budget_hit = _plan_recording_budget_hits(benchmark, inst, rounds=3)
    assert len(plan.dense) == len(plan.groups)
    _check_optimal(inst, plan)
    assert not budget_hit, "SearchBudgetWarning: the dense plan is not proven optimal"


# ----------------------------------------------------------------------- random instances


def _log_uniform(rng, low, high):
    return math.exp(rng.uniform(math.log(low), math.log(high)))


def _wide_random(rng, num_units, dense, c2_positive):
    """Tiny bias vectors to 2e7-element layers, alpha 1e-5..2e-2 (as tests/test_planner)."""
    speed = _log_uniform(rng, 1e-11, 1e-8)
    layers = []
    for _ in range(num_units):
        numel = int(_log_uniform(rng, 1, 2e7))
        backward = 0.0 if rng.random() < 0.05 else numel * speed * rng.uniform(0.3, 3.0) + 1e-6
        layers.append(Unit(numel, backward))
    return Instance(
        layers=tuple(layers),
        world_size=int(rng.choice([2, 4, 16, 64])),
        density=float(rng.choice([1e-3, 1e-2, 0.1, 1.0])),
        forward_s=float(rng.uniform(0.0, 0.05)),
        comm=LinearCost(_log_uniform(rng, 1e-5, 2e-2), _log_uniform(rng, 1e-11, 1e-8)),
        topk=TopkCost(
            _log_uniform(rng, 1e-6, 1e-3),
            _log_uniform(rng, 1e-12, 1e-8),
            _log_uniform(rng, 1e-15, 1e-10) if c2_positive else 0.0,
        ),
        dense=(
            LinearCost(_log_uniform(rng, 1e-5, 2e-2), _log_uniform(rng, 1e-12, 1e-8))
            if dense
            else None
        ),
    )


def _slow_network(rng, num_units, dense):
    """A realistic instance with an n log n selector on a network 10-200x slower."""
    base = _load_compare().realistic_instance(rng, num_units, dense, "nlogn")
    slow = _log_uniform(rng, 10, 200)
    comm = LinearCost(base.comm.alpha_s * _log_uniform(rng, 0.5, 5),
                      base.comm.beta_s_per_byte * slow)
    dense_cost = None
    if dense:
        dense_cost = LinearCost(base.dense.alpha_s, base.dense.beta_s_per_byte * slow)
    return dataclasses.replace(base, comm=comm, dense=dense_cost)


def _dense_close(rng, num_units):
    """A dense cost equal to the sparse cost (top-k + all-gather) of a typical group."""
    base = _load_compare().realistic_instance(rng, num_units, True, "mixed")
    numel = float(np.median([u.numel for u in base.layers])) * _log_uniform(rng, 1, 30)
    sparse = base.topk.time(numel) + base.sparse_comm_time(int(numel))
    share = rng.uniform(0.1, 0.9)
    return dataclasses.replace(
        base,
        dense=LinearCost(share * sparse, (1 - share) * sparse / (base.value_bytes * numel)),
    )


RANDOM_CASES = {
    "random sparse, c2 = 0": (1000, lambda rng, n: _wide_random(rng, n, False, False)),
    "random sparse, c2 > 0": (1000, lambda rng, n: _wide_random(rng, n, False, True)),
    "slow network, n log n top-k": (1000, lambda rng, n: _slow_network(rng, n, False)),
    "random dense": (1000, lambda rng, n: _wide_random(rng, n, True, bool(rng.random() < 0.5))),
    "slow network, dense": (1000, lambda rng, n: _slow_network(rng, n, True)),
    "dense close to sparse": (1000, lambda rng, n: _dense_close(rng, n)),
}
DENSE_CASES = ("random dense", "slow network, dense", "dense close to sparse")


def random_case(name, seed):
    num_units, make = RANDOM_CASES[name]
    return make(np.random.default_rng(1000 * seed + num_units), num_units)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
    "case", [c if c not in DENSE_CASES else pytest.param(c, marks=DENSE_NOT_EXACT)
             for c in RANDOM_CASES]
)
def test_bench_optimal_random_instances(benchmark, case, seed):
    inst = random_case(case, seed)
    benchmark.group = f"optimal, {inst.num_units} units, {case}"
    plan, budget_hit = _plan_recording_budget_hits(benchmark, inst, rounds=3)
    _check_optimal(inst, plan)
    assert not budget_hit, "SearchBudgetWarning: the plan is not proven optimal"


# ----------------------------------------------------------------------- background planning


def test_bench_background_submit_does_not_block(benchmark):
    """submit() of a 1000-unit plan returns at once; the plan is made on the worker."""
    inst = _instance(0, 1000, topk="nlogn")
    planners = []

    def setup():
        planner = BackgroundPlanner(name="bench-submit")
        planners.append(planner)
        return (planner,), {}

    def submit(planner):
        planner.submit(make_plan, inst, "optimal", apply_at_step=1)

    benchmark.group = "background submit, 1000 units"
    try:
        benchmark.pedantic(submit, setup=setup, rounds=5, warmup_rounds=0)
        # the plan itself arrives at the agreed step, and is the inline plan
        assert planners[-1].poll(1) == make_plan(inst, "optimal")
    finally:
        for planner in planners:
            assert planner.close(timeout=120)
    if benchmark.stats is not None:  # None with --benchmark-disable
        assert benchmark.stats.stats.max < 0.020


@pytest.mark.parametrize("isolate", [False, True], ids=["thread", "process"])
def test_bench_training_thread_beside_a_background_plan(benchmark, isolate):
    """What a plan in the background costs the training thread's Python: a loop of small
    torch calls (what DDP's and the hook's code do at every bucket), timed while a
    realistic 1000-unit plan with the dense option (~1 s) is computed on the planner's
    thread or in its worker process (docs/design.md, "Thread or process"). Compare the
    two ids side by side (the process needs a spare core: run it on a machine with one
    more core than its busy threads)."""
    import torch

    torch.set_num_threads(1)
    inst = _instance(0, 1000, dense=True)
    x, y = torch.randn(4096), torch.empty(4096)

    def python_heavy_loop():
        for _ in range(3000):
            torch.add(x, x, out=y)
            y.abs_()
            float(y[0])

    planners = []

    def setup():
        planner = BackgroundPlanner(name="bench-beside")
        planners.append(planner)
        if isolate:
            planner.start_process()
            planner.submit(math.sqrt, 4.0, apply_at_step=0, isolate=True)  # warm it
            planner.poll(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SearchBudgetWarning)
            planner.submit(make_plan, inst, "optimal", apply_at_step=1, isolate=isolate)
        return (), {}

    benchmark.group = "training thread beside a 1000-unit dense plan"
    try:
        benchmark.pedantic(python_heavy_loop, setup=setup, rounds=3, warmup_rounds=0)
    finally:
        for planner in planners:
            assert planner.close(timeout=120)
