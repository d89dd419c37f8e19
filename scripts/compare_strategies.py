#!/usr/bin/env python
"""How much worse than the optimal plan are the other strategies?

Plans many random *realistic* instances with every strategy and prints, per strategy,
the relative excess of its predicted iteration time over ``optimal``
(``predicted / optimal - 1``): median, 90th percentile and maximum, the share of
instances where it is optimal (within 1e-9), and the mean planning time.

Realistic instances (:func:`realistic_instance`, also used by
``benchmarks/test_bench_planner.py``): the units are the layers of the shipped layer
profiles (ResNet-50, VGG-16, Inception-v3; ``omgs_hook/data``), concatenated in random
order and each scaled by a random factor in [0.5, 2] (size and backward together), with
the backward pass sped up or slowed down as a whole (a random device speed, 0.1x to 3x
the profiles' V100-class estimates). The network follows the ring algorithms: on ``W``
ranks an all-gather costs ``(W-1) * (alpha0 + bytes / bandwidth)`` and an all-reduce
``2 (W-1) * (alpha0 + bytes / (W * bandwidth))``, with ``W`` in {2, 4, ..., 64},
``alpha0`` in [20 us, 1 ms] and ``bandwidth`` in [100 MB/s, 12.5 GB/s] (log-uniform).
Top-k: ``c0`` in [10 us, 200 us] and ``c1`` in [5 ps, 5 ns] per element; ``c2 = 0`` (a
linear-time selector, like the shipped ``sampled`` and ``cupy`` backends) in 70% of the
instances, else ``c2`` in [1e-14, 3e-10] (an n log n selector such as ``torch.topk`` on a
CPU, whose fit is ``c1 = 0, c2 = 2.85e-10``; ``topk="linear"`` or ``"nlogn"`` forces one
family). Density 0.001, 0.005 or 0.01.

Usage::

    python scripts/compare_strategies.py [--count 1000] [--min-units 10]
        [--max-units 300] [--dense] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from importlib import resources

import numpy as np

from omgs_hook.cost_model import Instance, LinearCost, TopkCost, Unit
from omgs_hook.planner import SearchBudgetWarning, make_plan

MODELS = ("resnet50", "vgg16", "inception_v3")
COMPARED = ("greedy", "layerwise", "single", "threshold:25000000")


def _log_uniform(rng, low, high):
    return math.exp(rng.uniform(math.log(low), math.log(high)))


_PROFILES = {}


def model_layers(name):
    """[(numel, backward_s)] of a shipped layer profile, in gradient-ready order."""
    if name not in _PROFILES:
        text = (resources.files("omgs_hook") / "data" / f"{name}.json").read_text()
        _PROFILES[name] = [(x["numel"], x["backward_s"]) for x in json.loads(text)["layers"]]
    return _PROFILES[name]


def realistic_instance(rng, num_units, dense=False, topk="mixed"):
    """A random instance shaped like real models on real networks (module docstring).

    ``topk``: ``"mixed"`` (70% linear-time selectors), ``"linear"`` or ``"nlogn"``.
    """
    if topk not in ("mixed", "linear", "nlogn"):
        raise ValueError(f"topk must be 'mixed', 'linear' or 'nlogn', got {topk!r}")
    speed = _log_uniform(rng, 0.1, 3.0)
    layers = []
    while len(layers) < num_units:
        for numel, backward in model_layers(MODELS[int(rng.integers(len(MODELS)))]):
            scale = _log_uniform(rng, 0.5, 2.0)
            layers.append(Unit(max(1, int(numel * scale)), backward * scale * speed))
    layers = tuple(layers[:num_units])
    world = int(rng.choice([2, 4, 8, 16, 32, 64]))
    step_alpha = _log_uniform(rng, 2e-5, 1e-3)
    bandwidth = _log_uniform(rng, 1e8, 1.25e10)
    linear = rng.random() < 0.7 if topk == "mixed" else topk == "linear"
    c2 = 0.0 if linear else _log_uniform(rng, 1e-14, 3e-10)
    return Instance(
        layers=layers,
        world_size=world,
        density=float(rng.choice([0.001, 0.005, 0.01])),
        forward_s=sum(u.backward_s for u in layers) / 2,
        comm=LinearCost((world - 1) * step_alpha, (world - 1) / bandwidth),
        topk=TopkCost(_log_uniform(rng, 1e-5, 2e-4), _log_uniform(rng, 5e-12, 5e-9), c2),
        dense=(
            LinearCost(2 * (world - 1) * step_alpha, 2 * (world - 1) / (world * bandwidth))
            if dense
            else None
        ),
    )


def compare(count, min_units, max_units, dense, seed, progress=None):
    """Plan ``count`` instances; returns ({strategy: excess array}, {strategy: seconds},
    number of optimal searches that hit the budget)."""
    rng = np.random.default_rng(seed)
    excess = {s: [] for s in COMPARED}
    seconds = {s: 0.0 for s in ("optimal",) + COMPARED}
    budget_hits = 0
    for i in range(count):
        inst = realistic_instance(rng, int(rng.integers(min_units, max_units + 1)), dense)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", SearchBudgetWarning)
            start = time.perf_counter()
            optimal = make_plan(inst, "optimal").predicted_iteration_s
            seconds["optimal"] += time.perf_counter() - start
        budget_hits += any(issubclass(w.category, SearchBudgetWarning) for w in caught)
        for strategy in COMPARED:
            start = time.perf_counter()
            value = make_plan(inst, strategy).predicted_iteration_s
            seconds[strategy] += time.perf_counter() - start
            excess[strategy].append(value / optimal - 1.0)
        if progress:
            progress(i + 1)
    return {s: np.array(v) for s, v in excess.items()}, seconds, budget_hits


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=1000, help="instances (default 1000)")
    parser.add_argument("--min-units", type=int, default=10)
    parser.add_argument("--max-units", type=int, default=300)
    parser.add_argument("--dense", action="store_true", help="give every instance a dense cost")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not 1 <= args.min_units <= args.max_units or args.count < 1:
        parser.error("need count >= 1 and 1 <= min-units <= max-units")

    def progress(done):
        if done % 100 == 0 or done == args.count:
            print(f"  {done}/{args.count} instances", file=sys.stderr)

    excess, seconds, budget_hits = compare(
        args.count, args.min_units, args.max_units, args.dense, args.seed, progress
    )
    print(
        f"{args.count} realistic instances, {args.min_units}-{args.max_units} units, "
        f"{'with' if args.dense else 'without'} a dense cost, seed {args.seed}"
    )
    print("relative excess of the predicted iteration time over `optimal`:")
    print(f"{'strategy':<20} {'median':>10} {'p90':>10} {'max':>10} {'optimal':>9} {'ms/plan':>9}")
    for strategy, values in excess.items():
        print(
            f"{strategy:<20} {np.median(values):>10.3%} {np.percentile(values, 90):>10.3%} "
            f"{values.max():>10.3%} {np.mean(values <= 1e-9):>9.1%} "
            f"{1e3 * seconds[strategy] / args.count:>9.2f}"
        )
    print(f"{'optimal':<20} {'':>10} {'':>10} {'':>10} {'':>9} "
          f"{1e3 * seconds['optimal'] / args.count:>9.2f}")
    if budget_hits:
        print(f"{budget_hits} optimal searches hit SEARCH_BUDGET (best plan found, not proven)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
