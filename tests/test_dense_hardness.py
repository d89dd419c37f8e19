"""The dense option makes planning NP-hard: a reduction from PARTITION, checked.

docs/cost-model.md ("The dense option is NP-hard") proves that choosing groups *and*
sparse/dense modes to minimise ``predicted_iteration_s`` encodes PARTITION: for positive
integers ``a_1 .. a_n`` with sum ``2S``, the instance built by
:func:`partition_instance` has optimum ``W + S + 1/Q`` when some subset of the ``a_i`` sums
to ``S``, and at least ``W + S + 1/2`` otherwise. These tests check both
directions against the brute force of tests/test_planner.py (every contiguous partition
and every mode choice) and against ``make_plan(inst, "optimal")``, on yes- and
no-instances. Were the reduction wrong (a merge that pays, a sentinel that goes the
other way, an intermediate term of the timeline that dominates), the optimum would
differ from the partition formula and they would fail.
"""

import itertools
import warnings

import numpy as np
import pytest
from test_planner import brute_force

from omgs_hook.cost_model import Instance, LinearCost, TopkCost, Unit, simulate
from omgs_hook.planner import SearchBudgetWarning, make_plan

Q = 4  # elements per unit of an item: the last sentinel then costs 1/Q, a binary fraction


def sentinel_seconds(items):
    """``W``: each sentinel's seconds, more than every item term of the timeline."""
    return 2 * sum(items) + 2


def partition_instance(items):
    """The planning instance that encodes PARTITION for the positive integers ``items``.

    Units in ready order: a sentinel ``F`` of ``Q * W`` elements, one unit of ``Q * a_i``
    elements per item, a sentinel ``Z`` of 1 element with ``W`` seconds of backward, where
    ``W = 2 * sum(items) + 2``. Costs: density 1, a free sparse all-gather, top-k ``1/Q`` s
    per element, dense all-reduce ``1/Q`` s per element, no fixed costs. So an item sent
    sparse costs ``a_i`` seconds of compute and no network, sent dense ``a_i`` seconds of
    network and no compute."""
    items = [int(a) for a in items]
    if not items or min(items) < 1:
        raise ValueError("items must be positive integers")
    W = sentinel_seconds(items)
    units = ([Unit(Q * W, 0.0)] + [Unit(Q * a, 0.0) for a in items] + [Unit(1, float(W))])
    return Instance(
        layers=tuple(units), world_size=2, density=1.0, forward_s=0.0,
        comm=LinearCost(0.0, 0.0), topk=TopkCost(0.0, 1.0 / Q, 0.0),
        dense=LinearCost(0.0, 1.0 / (4 * Q)),  # value_bytes 4: 1/Q s per element
    )


def partition_value(items):
    """``min over subsets of max(sum in, sum out)``: S exactly on a yes-instance."""
    total = sum(items)
    return min(max(sum(c), total - sum(c))
               for r in range(len(items) + 1) for c in itertools.combinations(items, r))


def predicted_optimum(items):
    """What the reduction says the planning optimum is: ``W + max(V, S + 1/Q)`` with
    ``V = partition_value``, i.e. ``W + S + 1/Q`` on a yes-instance (``V = S``) and
    ``W + V >= W + S + 1/2`` on a no-instance (the sentinel ``Z``'s ``1/Q`` then falls on
    the shorter side)."""
    return sentinel_seconds(items) + max(partition_value(items), sum(items) / 2 + 1.0 / Q)


def is_yes_instance(items):
    return partition_value(items) * 2 == sum(items)


CASES = [
    [3, 1, 1, 2, 2, 1],   # yes: 3 + 2 = 1 + 1 + 2 + 1
    [5, 4, 3, 2],         # yes: 5 + 2 = 4 + 3
    [7, 3, 2, 2],         # yes: 7 = 3 + 2 + 2
    [9, 4, 4, 1],         # yes: 9 = 4 + 4 + 1
    [8, 3, 2, 1],         # no: sum 14, best split 8 / 6
    [6, 5, 4, 1],         # no: sum 16, best split 9 / 7
    [10, 1, 1, 2],        # no: sum 14, best split 10 / 4
    [2, 2, 2, 2, 3],      # no: odd sum 11, best split 6 / 5
]


@pytest.mark.parametrize("items", CASES, ids=lambda c: "-".join(map(str, c)))
def test_the_planning_optimum_is_the_partition_optimum(items):
    inst = partition_instance(items)
    exact = brute_force(inst)
    assert exact == pytest.approx(predicted_optimum(items), abs=1e-9)
    # a yes-instance lies 1/2 - 1/Q below every no-instance of the same sum
    W = sentinel_seconds(items)
    if is_yes_instance(items):
        assert exact == pytest.approx(W + sum(items) / 2 + 1.0 / Q, abs=1e-9)
    else:
        assert exact >= W + sum(items) / 2 + 0.5 - 1e-9


@pytest.mark.parametrize("items", CASES, ids=lambda c: "-".join(map(str, c)))
def test_the_planner_finds_it_and_its_dense_items_are_a_best_split(items):
    inst = partition_instance(items)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SearchBudgetWarning)  # tiny: the search finishes
        plan = make_plan(inst, "optimal")
    assert plan.predicted_iteration_s == pytest.approx(predicted_optimum(items), abs=1e-9)
    # the first sentinel always goes dense (sparse, its W seconds of top-k delay all)
    assert plan.groups[0][0] == 0 and plan.dense[0]
    # read the split off the plan: item i (unit i + 1) is dense or sparse with its group
    dense_items = [items[u - 1] for group, flag in zip(plan.groups, plan.dense)
                   for u in group if flag and 1 <= u <= len(items)]
    sent_dense, total = sum(dense_items), sum(items)
    assert max(sent_dense, total - sent_dense) == partition_value(items)


def test_a_random_batch_of_partition_instances_reduces_exactly():
    """Random multisets, yes and no: the brute-force optimum is the partition formula."""
    rng = np.random.default_rng(7)
    seen = set()
    for _ in range(12):
        items = [int(a) for a in rng.integers(1, 12, size=int(rng.integers(3, 7)))]
        exact = brute_force(partition_instance(items))
        assert exact == pytest.approx(predicted_optimum(items), abs=1e-9), items
        seen.add(is_yes_instance(items))
    assert seen == {True, False}  # both kinds were drawn


def test_splitting_an_additive_group_never_costs_time():
    """The lemma the reduction rests on: with no fixed costs a merged group is never
    faster than the same units as groups of their own, in the same mode."""
    rng = np.random.default_rng(3)
    for _ in range(30):
        n = int(rng.integers(2, 6))
        units = tuple(Unit(int(rng.integers(1, 50)), float(rng.uniform(0, 5))) for _ in range(n))
        inst = Instance(layers=units, world_size=2, density=1.0, forward_s=0.0,
                        comm=LinearCost(0.0, float(rng.uniform(0, 0.1))),
                        topk=TopkCost(0.0, float(rng.uniform(0, 0.2)), 0.0),
                        dense=LinearCost(0.0, float(rng.uniform(0, 0.1))))
        for mode in (False, True):
            merged = simulate(inst, [tuple(range(n))], [mode]).predicted_iteration_s
            split = simulate(inst, [(u,) for u in range(n)], [mode] * n).predicted_iteration_s
            assert split <= merged + 1e-9
