#!/usr/bin/env python
"""How far is ``optimal``'s plan with a dense cost from the exact optimum?

With a dense cost the planner's search stops at ``planner.SEARCH_BUDGET`` candidates and
returns the best plan its bounded searches found (``SearchBudgetWarning``; see
docs/cost-model.md, "Safety valve"). This script plans each instance twice - once as the
hook does, once with the budget lifted so the exact search runs to the end (seconds to
minutes of CPU at 1000 units) - and prints the relative excess of the first plan's
predicted iteration time over the exact optimum, with both CPU times.

Instances: the realistic dense ones of ``benchmarks/test_bench_planner.py``
(``compare_strategies.realistic_instance(rng(seed), units, dense=True, topk="mixed")``).

Usage::

    python scripts/dense_plan_gap.py --seeds 0,1,2 [--units 1000] [--budget 1e12]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

import numpy as np

from omgs_hook import planner
from omgs_hook.planner import SearchBudgetWarning, make_plan

# as in bench_cluster.py: scripts/profile.py must not shadow the standard library's
_SCRIPT_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _SCRIPT_DIR]
sys.path.append(_SCRIPT_DIR)

import compare_strategies  # noqa: E402  (after sys.path)


def instance(seed, units):
    """The benchmark's realistic dense instance for ``seed``."""
    return compare_strategies.realistic_instance(np.random.default_rng(seed), units, True,
                                                 "mixed")


def _timed_plan(inst):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SearchBudgetWarning)
        started = time.process_time()
        plan = make_plan(inst, "optimal")
        seconds = time.process_time() - started
    capped = any(issubclass(w.category, SearchBudgetWarning) for w in caught)
    return plan, seconds, capped


def gap(inst, budget):
    """``(as the hook plans, with the budget lifted to ``budget``)``, each a dict of the
    plan's predicted seconds, groups, CPU seconds and whether the budget stopped it; and
    the first's relative excess over the second."""
    hook_plan, hook_s, hook_capped = _timed_plan(inst)
    saved = planner.SEARCH_BUDGET
    planner.SEARCH_BUDGET = int(budget)
    try:
        exact_plan, exact_s, exact_capped = _timed_plan(inst)
    finally:
        planner.SEARCH_BUDGET = saved

    def row(plan, seconds, capped):
        return {"predicted_s": plan.predicted_iteration_s, "groups": len(plan.groups),
                "dense_groups": int(sum(plan.dense)), "cpu_s": seconds,
                "stopped_by_budget": capped}

    excess = hook_plan.predicted_iteration_s / exact_plan.predicted_iteration_s - 1
    return row(hook_plan, hook_s, hook_capped), row(exact_plan, exact_s, exact_capped), excess


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated (default 0,1,2)")
    parser.add_argument("--units", type=int, default=1000, help="units per instance (default 1000)")
    parser.add_argument("--budget", type=float, default=1e12,
                        help="the lifted search budget in candidates (default 1e12: unbounded)")
    args = parser.parse_args(argv)
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--seeds: comma-separated integers, got {args.seeds!r}")
    if not seeds:
        parser.error("--seeds: at least one seed")
    if args.units < 1:
        parser.error(f"--units: must be >= 1, got {args.units}")
    if not args.budget >= planner.SEARCH_BUDGET:
        parser.error(f"--budget: must be at least the hook's {planner.SEARCH_BUDGET}")
    rows = []
    for seed in seeds:
        hook_row, exact_row, excess = gap(instance(seed, args.units), args.budget)
        rows.append({"seed": seed, "hook": hook_row, "exact": exact_row, "excess": excess})
        print(json.dumps(rows[-1]), flush=True)
    return rows


if __name__ == "__main__":
    main()
