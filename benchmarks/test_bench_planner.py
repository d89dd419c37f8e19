"""Planner speed: ``optimal`` and ``greedy`` on realistic 1000-unit instances.

Run with ``pytest benchmarks/test_bench_planner.py --benchmark-only``. The instances
come from ``scripts/compare_strategies.py`` (layers of the shipped ResNet-50, VGG-16
and Inception-v3 profiles, ring-algorithm network costs; see its docstring), five seeds
per group:

* ``optimal, 1000 units, linear top-k``: selectors with ``c2 = 0`` (the shipped
  ``sampled`` and ``cupy`` backends). Target: under 50 ms per plan.
* ``optimal, 1000 units, n log n top-k``: ``c2 > 0`` (e.g. ``torch.topk`` on a CPU). The
  state fronts are larger here (distinct ``c2 * D log D`` terms do not collapse); may
  end at the search budget, which is reported, not failed.
* ``greedy, 1000 units`` and ``optimal, 100 units, dense cost`` (the upper range of
  what the hook plans with DDP's default buckets).
"""

import importlib.util
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

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
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SearchBudgetWarning)
        plan = benchmark.pedantic(make_plan, args=(inst, "optimal"), rounds=3, warmup_rounds=0)
    benchmark.extra_info["search_budget_hit"] = bool(caught)
    _check_optimal(inst, plan)


@pytest.mark.parametrize("seed", SEEDS)
def test_bench_greedy_1000_units(benchmark, seed):
    inst = _instance(seed, 1000)
    benchmark.group = "greedy, 1000 units"
    plan = benchmark.pedantic(make_plan, args=(inst, "greedy"), rounds=10, warmup_rounds=1)
    assert sum(len(g) for g in plan.groups) == 1000


@pytest.mark.parametrize("seed", SEEDS)
def test_bench_optimal_100_units_dense(benchmark, seed):
    inst = _instance(seed, 100, dense=True, topk="mixed")
    benchmark.group = "optimal, 100 units, dense cost"
    plan = benchmark.pedantic(make_plan, args=(inst, "optimal"), rounds=10, warmup_rounds=1)
    assert len(plan.dense) == len(plan.groups)
    _check_optimal(inst, plan)
