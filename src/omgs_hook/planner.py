"""Choosing the groups: which DDP buckets to merge before sparsifying (OMGS-SGD).

Given an :class:`~omgs_hook.cost_model.Instance` (units in gradient-ready order and the
fitted cost terms), a *plan* splits the units into contiguous groups and, when the
instance has a dense cost, says which groups go dense. The timeline of a plan is the
recurrence of :mod:`omgs_hook.cost_model`; this module only decides the groups.

Strategies (:func:`make_plan`; names accepted by :func:`parse_strategy`):

``optimal``
    The exact minimum of ``predicted_iteration_s`` over all ``2**(L-1)`` contiguous
    partitions (and, with a dense cost, over every sparse/dense choice per group), found
    by a dynamic program over Pareto fronts of timeline states (:class:`_FrontierSearch`
    explains the algorithm and why it is exact).
``greedy``
    The paper's rule: walk the units in ready order and merge the next unit into the
    current group when the extra wait that merging causes is smaller than the
    communication time one collective fewer saves (:func:`greedy_groups`).
``layerwise``
    Every unit alone (LAGS-SGD).
``single``
    One group with everything (TopK-SGD).
``threshold:BYTES``
    Walk in ready order and close a group as soon as it holds at least ``BYTES`` bytes of
    gradient (``value_bytes * numel``); the last group may be smaller
    (:func:`threshold_groups`).

Dense option: when the instance has a ``dense`` cost, ``optimal`` chooses the mode of
every group inside the same exact search. The other strategies choose their groups by
their own rule (which looks at the sparse costs only) and then take, for those fixed
groups, the sparse/dense modes that minimise the predicted iteration time - again
exactly, with the same search restricted to the given group boundaries
(:func:`best_modes`). Without a dense cost every group is sparse and all results are
those of the sparse model. With a dense cost and ``min_sparse_numel``, every plan that
:func:`make_plan` returns then sends its sparse groups of fewer elements dense
(:func:`small_groups_dense`: a convergence guard applied after the search).

Exactness and the safety valve: without a dense cost, up to :data:`EXACT_UNITS` (1000)
units, ``optimal`` is always the exact optimum - two exact searches, forward over
``(c, e)`` fronts (:class:`_FrontierSearch`) and backward over ``(Ys, G)`` fronts
(:class:`_SuffixSearch`), take turns with growing candidate budgets until one finishes,
each joining its states to what the other (or a beam search) found (:func:`_search`).
Beyond that size, and always with a dense cost (whose fronts can take
minutes to search exhaustively: choosing the modes is NP-hard, a reduction from
PARTITION in docs/cost-model.md), :data:`SEARCH_BUDGET` stops a search that has not
finished; ``optimal`` then returns the best plan found, improved by a local search
(:func:`_polish`), and emits :class:`SearchBudgetWarning`.

Two-level instances (``inst.hierarchy``, see :mod:`omgs_hook.cost_model`): the searches
run on :func:`~omgs_hook.cost_model.relaxed_instance`, a flat instance whose per-group
costs are lower bounds of the exact two-level ones (shards of ``D / L`` instead of
``ceil(D / L)`` elements) and equal to them when every unit's ``numel`` is a multiple of
the ranks per node. ``optimal`` takes the relaxation's optimal groups, the greedy, single
and layer-wise groups (up to 4096 units), gives each the exactly best modes for the
two-level timeline, and returns the one with the least exact time (:func:`_hierarchical_plan`).
Hence: where the relaxation is exact (all ``numel`` multiples of L) ``optimal`` is the
exact optimum (same exactness and valve as for flat instances); otherwise its exact time
exceeds the optimum by at most its exact time minus :func:`relaxed_lower_bound`. With a
dense cost, dense groups are priced as the two-level dense path; the relaxation leaves
out their intra-node reduce-scatter (a lower bound, not exact), the exact mode search
(:func:`_exact_modes`) prices it. Every reported time is the exact two-level
:func:`~omgs_hook.cost_model.simulate`.

Index range: a sparse group's indices travel as int32, so every plan's sparse groups hold
at most :data:`~omgs_hook.cost_model.MAX_SPARSE_GROUP_NUMEL` (2**31 - 1) elements. After
any strategy (and in :func:`evaluate`), a larger sparse group is cut at unit boundaries
into consecutive pieces, each as large as fits (:func:`_fit_index_range`); a unit larger
than that on its own stays a piece of its own (the hook cuts it at parameter boundaries).
The searches do not see the limit, so for such instances "exact" means: the exact optimum
of the unlimited model, cut to fit. At those sizes one more collective's startup is
negligible beside the gigabytes each piece sends.

Determinism: a plan depends only on the instance - no randomness, timing or object
hashing - and ties are broken by fixed orders (stable sorts; among equal states the one
generated first wins: earlier group start, sparse before dense), so every rank that
plans the same instance with the same software gets the same plan.

Floating point: "exact" means exact up to rounding. Two search states whose times differ
by less than ``1e-12`` of the instance's time scale (:func:`_time_scale`) are treated as
equal, which removes duplicates that differ only by rounding noise; the reported times
are always those of :func:`~omgs_hook.cost_model.simulate` on the chosen plan.
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

from omgs_hook import cost_model
from omgs_hook.cost_model import (
    Instance,
    InstanceError,
    check_dense,
    check_groups,
    relaxed_instance,
    simulate,
)

__all__ = [
    "Plan",
    "STRATEGIES",
    "parse_strategy",
    "make_plan",
    "evaluate",
    "small_groups_dense",
    "predicted_iteration_s",
    "greedy_groups",
    "threshold_groups",
    "best_modes",
    "SearchBudgetWarning",
    "SEARCH_BUDGET",
    "DENSE_FULL_BUDGET_UNITS",
    "dense_valve_budget",
    "default_valve_budget",
    "EXACT_UNITS",
    "relaxed_lower_bound",
]

STRATEGIES = ("optimal", "greedy", "layerwise", "single", "threshold:BYTES")

Groups = Tuple[Tuple[int, ...], ...]

# States closer than this fraction of the instance's time scale count as equal (see the
# module docstring): far above float64 rounding noise, far below anything measurable.
_RELATIVE_TIE = 1e-12


@dataclass(frozen=True)
class Plan:
    """A grouping of the units and its predicted timeline.

    Fields:
        strategy: the normalised strategy that produced it (``"fixed"`` for
            :func:`evaluate` unless told otherwise).
        groups: contiguous runs of unit indices in ready order, e.g. ``((0, 1), (2,))``.
        dense: one flag per group, ``True`` where the group is sent as a dense
            all-reduce (always all ``False`` without a dense cost).
        predicted_iteration_s: ``forward_s + e_m + tail_s + level_s`` of the timeline.
        non_overlapped_s: ``e_m - sum(backward_s)``.
    """

    strategy: str
    groups: Groups
    dense: Tuple[bool, ...]
    predicted_iteration_s: float
    non_overlapped_s: float

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def to_dict(self, include_dense: bool = True) -> dict:
        """JSON form. ``include_dense=False`` leaves out the dense flags (``omgs-plan``
        does that for instances without a dense cost)."""
        d = {
            "strategy": self.strategy,
            "groups": [list(g) for g in self.groups],
            "predicted_iteration_s": self.predicted_iteration_s,
            "non_overlapped_s": self.non_overlapped_s,
        }
        if include_dense:
            d["dense"] = list(self.dense)
        return d


# ---------------------------------------------------------------------------
# strategy names

_THRESHOLD = re.compile(r"^threshold:(.*)$")


def parse_strategy(text) -> str:
    """Normalise a strategy name (case and surrounding blanks do not matter).

    ``threshold:BYTES`` takes a positive integer number of bytes, written as an integer
    or as a number with an integral value (``25000000``, ``2.5e7``); it is normalised to
    ``threshold:<integer>``. Raises ``ValueError`` naming the valid choices otherwise.
    """
    valid = ", ".join(STRATEGIES)
    if not isinstance(text, str):
        raise ValueError(f"strategy must be a string, one of: {valid}; got {text!r}")
    name = text.strip().lower()
    if name in ("optimal", "greedy", "layerwise", "single"):
        return name
    match = _THRESHOLD.match(name)
    if match:
        try:
            value = float(match.group(1).strip())
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value >= 1 and value == int(value)):
            raise ValueError(
                f"strategy {text!r}: BYTES in threshold:BYTES must be a positive integer"
            )
        return f"threshold:{int(value)}"
    raise ValueError(f"unknown strategy {text!r}; valid choices: {valid}")


# ---------------------------------------------------------------------------
# public entry points


def make_plan(inst: Instance, strategy: str = "optimal", start=None, budget=None) -> Plan:
    """Plan ``inst`` with ``strategy`` (see the module docstring for the strategies).

    ``start``: optional ``(groups, dense flags)`` of a plan known to be good for a similar
    instance (the hook passes the plan in use at each re-plan). With ``optimal`` on a
    flat instance its time on ``inst`` is one more upper bound for the search, and a
    search stopped by the valve returns a plan no worse than it; the optimum found is the
    same with or without it. Ignored by the other strategies, and when it does not fit
    ``inst`` (another number of units).

    ``budget``: the safety valve's candidate count for this search where the valve
    applies (a dense cost, or beyond :data:`EXACT_UNITS` units); default
    :data:`SEARCH_BUDGET`, with a dense cost :func:`dense_valve_budget` (smaller beyond
    :data:`DENSE_FULL_BUDGET_UNITS` units). Sparse instances up to ``EXACT_UNITS`` units
    stay exact."""
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool)
                               or budget < 1):
        raise ValueError(f"make_plan: budget must be a positive int, got {budget!r}")
    if not isinstance(inst, Instance):
        raise TypeError(f"make_plan expects an Instance, got {type(inst).__name__}")
    strategy = parse_strategy(strategy)
    if inst.hierarchy is not None:
        return small_groups_dense(inst, _hierarchical_plan(inst, strategy))
    num_units = inst.num_units
    if strategy == "optimal":
        prefix_sums = _prefix_sums(inst)
        L = num_units
        known = [np.cumsum([len(g) for g in greedy_groups(inst)]), np.array([L])]
        if L <= _LAYERWISE_BOUND_UNITS:
            known.append(np.arange(1, L + 1))
        bounds, modes = _search(inst, prefix_sums, known, boundaries=None,
                                start=_start_plan(inst, start), valve_budget=budget)
        plan = _finish(inst, strategy, _groups_from_bounds(bounds), modes)
    else:
        groups = _rule_groups(inst, strategy, inst)
        plan = _finish(inst, strategy, groups, best_modes(inst, groups))
    return small_groups_dense(inst, plan)


def small_groups_dense(inst: Instance, plan: Plan) -> Plan:
    """``plan`` with every sparse group of fewer than ``inst.min_sparse_numel`` elements
    sent dense instead, re-simulated on ``inst`` (``plan`` itself where none is, or where
    ``inst`` has no dense cost or no floor).

    A convergence guard, not an optimisation: a small tensor alone in a sparse group -
    a LayerNorm's gain, a bias - sends ``k`` of 1-3 of its entries a step, each entry
    about every ``1 / density`` steps with that many steps of residual at once, which
    momentum then repeats; the held-out language model of docs/convergence.md diverges
    that way (LAGS-SGD's per-tensor top-k does the same without this hook). Sent dense,
    such a group costs about what its sparse all-gather costs (both are the collective's
    startup), and its entries are exact every step. The groups and the other groups'
    modes are the plan's: :func:`make_plan` applies this to the plan its strategy chose
    (so ``optimal`` is the model's optimum with its small groups made dense, not a new
    search under the floor), and the measured selection to every candidate it times.
    Plans whose modes are given (``evaluate`` with flags, a pinned plan) are not
    changed."""
    floor = inst.min_sparse_numel
    if not floor or inst.dense is None:
        return plan
    numels = [sum(inst.layers[u].numel for u in group) for group in plan.groups]
    dense = tuple(bool(d) or n < floor for d, n in zip(plan.dense, numels))
    if dense == tuple(plan.dense):
        return plan
    return _finish(inst, plan.strategy, plan.groups, dense)


def _start_plan(inst: Instance, start):
    """``start`` as ``(bounds, modes)`` for :func:`_search`, or None where it does not fit
    ``inst`` (it is only a hint: a plan of another layout is no bound for this one)."""
    if start is None:
        return None
    try:
        groups, dense = start
    except (TypeError, ValueError):
        raise TypeError(f"make_plan: start must be (groups, dense flags), got "
                        f"{type(start).__name__}") from None
    try:
        groups = check_groups(groups, inst.num_units)
    except InstanceError:
        return None
    dense = [bool(d) for d in dense] if inst.dense is not None else [False] * len(groups)
    if len(dense) != len(groups):
        return None
    return tuple(g[-1] + 1 for g in groups), tuple(dense)


def _rule_groups(inst: Instance, strategy: str, greedy_inst: Instance) -> Groups:
    """The groups of a simple-rule strategy (greedy on ``greedy_inst``'s costs)."""
    num_units = inst.num_units
    if strategy == "greedy":
        return greedy_groups(greedy_inst)
    if strategy == "layerwise":
        return tuple((u,) for u in range(num_units))
    if strategy == "single":
        return (tuple(range(num_units)),)
    return threshold_groups(inst, int(strategy.split(":", 1)[1]))


def evaluate(inst: Instance, groups, dense=None, strategy: str = "fixed") -> Plan:
    """Predict the timeline of given groups (e.g. a plan fixed by the user).

    Args:
        inst: the instance.
        groups: contiguous runs of unit indices covering all units in ready order.
        dense: per-group booleans; ``None`` lets the planner choose the cheapest modes
            when the instance has a dense cost (all sparse otherwise), then applies the
            instance's floor for sparse groups (:func:`small_groups_dense`).
        strategy: label stored in the returned plan.

    Raises :class:`~omgs_hook.cost_model.InstanceError` for malformed groups or flags.
    """
    if not isinstance(inst, Instance):
        raise TypeError(f"evaluate expects an Instance, got {type(inst).__name__}")
    groups = check_groups(groups, inst.num_units)
    if dense is None:
        return small_groups_dense(inst, _finish(inst, strategy, groups, best_modes(inst, groups)))
    modes = check_dense(dense, inst, len(groups))
    return _finish(inst, strategy, groups, modes)


def predicted_iteration_s(inst: Instance, groups, dense=None) -> float:
    """``evaluate(inst, groups, dense).predicted_iteration_s``, up to rounding, at a
    fraction of the cost for a flat instance: the planner's vectorised walk over group
    prefix sums (about 0.2 ms for a 1000-group plan of 1000 units, against 2.8 ms) - what
    the hook prices plans with on the training thread. ``groups`` must be contiguous runs
    in order, as every plan's are (anything else goes to :func:`evaluate`); two-level
    instances, free modes with a dense cost, dense flags without one, and sparse groups
    the index range would cut go to :func:`evaluate`."""
    if inst.hierarchy is not None or (dense is None and inst.dense is not None):
        return evaluate(inst, groups, dense).predicted_iteration_s
    modes = (False,) * len(groups) if dense is None else tuple(bool(d) for d in dense)
    bounds, start = [], 0
    contiguous = len(modes) == len(groups) and len(groups) > 0
    for group in groups if contiguous else ():
        if list(group) != list(range(start, start + len(group))) or len(group) == 0:
            contiguous = False
            break
        start += len(group)
        bounds.append(start)
    if not contiguous or start != inst.num_units or (inst.dense is None and any(modes)):
        return evaluate(inst, groups, dense).predicted_iteration_s
    numel_prefix, backward_prefix = _prefix_sums(inst)
    ends = np.asarray(bounds)
    sizes = numel_prefix[ends] - numel_prefix[np.concatenate(([0], ends[:-1]))]
    if any(size > cost_model.MAX_SPARSE_GROUP_NUMEL and not dense_flag
           for size, dense_flag in zip(sizes.tolist(), modes)):
        return evaluate(inst, groups, dense).predicted_iteration_s
    comm_end, _ = _comm_end(inst, (numel_prefix, backward_prefix), bounds, modes)
    return comm_end + inst.fixed_s


def _finish(inst: Instance, strategy: str, groups, modes) -> Plan:
    groups, modes = _fit_index_range(inst, groups, modes)
    # the reported times always come from the reference simulation, whatever the search
    # computed internally, so that evaluate(inst, plan.groups, plan.dense) == plan
    timeline = simulate(inst, groups, modes)
    return Plan(
        strategy=strategy,
        groups=tuple(tuple(g) for g in groups),
        dense=tuple(bool(x) for x in modes),
        predicted_iteration_s=timeline.predicted_iteration_s,
        non_overlapped_s=timeline.non_overlapped_s,
    )


def _fit_index_range(inst: Instance, groups, modes):
    """Cut every sparse group of more than
    :data:`~omgs_hook.cost_model.MAX_SPARSE_GROUP_NUMEL` elements (its indices travel as
    int32) into consecutive pieces, each as large as fits, in ready order; the pieces
    stay sparse. A unit too large on its own is a piece of its own (the hook cuts it at
    parameter boundaries). Such sizes (2**31 elements, 8 GB of fp32 gradient in one
    group) make one more collective's startup negligible, so the cut costs nothing the
    model could measure; plans that fit are returned as they are."""
    limit = cost_model.MAX_SPARSE_GROUP_NUMEL
    numel = [u.numel for u in inst.layers]
    if all(dense or sum(numel[u] for u in group) <= limit
           for group, dense in zip(groups, modes)):
        return groups, modes
    out_groups, out_modes = [], []
    for group, dense in zip(groups, modes):
        if dense or sum(numel[u] for u in group) <= limit:
            out_groups.append(tuple(group))
            out_modes.append(bool(dense))
            continue
        group = tuple(group)
        for piece in cost_model.index_range_pieces([numel[u] for u in group]):
            out_groups.append(tuple(group[i] for i in piece))
            out_modes.append(False)
    return tuple(out_groups), tuple(out_modes)


# ---------------------------------------------------------------------------
# heuristic groupings


def greedy_groups(inst: Instance) -> Groups:
    """The OMGS-SGD paper's greedy merge rule, in ready order.

    With the current group ``G`` (``D`` elements, ``B`` seconds of backward) and the
    timeline state ``(c, e)`` before it, closing ``G`` now would finish its compute at
    ``c_G = c + B + t_s(D)``, and its collective would first wait ``queued = max(0, e -
    c_G)`` for the network. Merging the next unit ``u`` delays that collective by

        ``extra_wait = backward_s[u] + t_s(D + numel[u]) - t_s(D) - queued``

    (the part of the delay that the queue would have cost anyway is free) and saves the
    cost of one collective:

        ``saved = t_c(D) + t_c(numel[u]) - t_c(D + numel[u])``

    (``alpha`` plus the bytes of the selected entries that rounding ``k`` up no longer
    duplicates). The unit is merged when ``extra_wait < saved``; otherwise ``G`` is
    closed (the state advances by the timeline recurrence) and ``u`` starts the next
    group. Only the sparse costs are consulted; modes are chosen afterwards by
    :func:`best_modes`.
    """
    c0, c1, c2 = inst.topk.c0, inst.topk.c1, inst.topk.c2
    alpha, beta = inst.comm.alpha_s, inst.comm.beta_s_per_byte
    entry_bytes = inst.value_bytes + inst.index_bytes
    density = inst.density
    log2 = math.log2

    # the same float expressions as TopkCost.time / Instance.sparse_comm_time, inlined
    # because this loop runs once per unit
    def topk_time(numel):
        return c0 + c1 * numel + c2 * numel * log2(numel)

    def comm_time(numel):
        return alpha + beta * (max(1, math.ceil(density * numel)) * entry_bytes)

    layers = inst.layers
    compute = network = 0.0
    groups: List[Tuple[int, ...]] = []
    start = 0
    numel = layers[0].numel
    backward = layers[0].backward_s
    numel_topk = topk_time(numel)
    numel_comm = comm_time(numel)
    for u in range(1, len(layers)):
        unit = layers[u]
        closed_compute = compute + backward + numel_topk
        queued = network - closed_compute
        if queued < 0.0:
            queued = 0.0
        merged = numel + unit.numel
        merged_topk = topk_time(merged)
        merged_comm = comm_time(merged)
        extra_wait = unit.backward_s + merged_topk - numel_topk - queued
        saved = numel_comm + comm_time(unit.numel) - merged_comm
        if extra_wait < saved:
            numel, backward = merged, backward + unit.backward_s
            numel_topk, numel_comm = merged_topk, merged_comm
            continue
        groups.append(tuple(range(start, u)))
        compute = closed_compute
        network = max(network, compute) + numel_comm
        start, numel, backward = u, unit.numel, unit.backward_s
        numel_topk, numel_comm = topk_time(numel), comm_time(numel)
    groups.append(tuple(range(start, len(layers))))
    return tuple(groups)


def threshold_groups(inst: Instance, threshold_bytes: int) -> Groups:
    """Close a group once it holds at least ``threshold_bytes`` bytes of gradient.

    A group's gradient bytes are ``value_bytes * numel``; the last group may be smaller.
    """
    if isinstance(threshold_bytes, bool) or not isinstance(threshold_bytes, int) or (
        threshold_bytes <= 0
    ):
        raise ValueError(f"threshold_bytes must be a positive integer, got {threshold_bytes!r}")
    groups: List[Tuple[int, ...]] = []
    start = 0
    gradient_bytes = 0
    for u, unit in enumerate(inst.layers):
        gradient_bytes += inst.value_bytes * unit.numel
        if gradient_bytes >= threshold_bytes:
            groups.append(tuple(range(start, u + 1)))
            start, gradient_bytes = u + 1, 0
    if start < inst.num_units:
        groups.append(tuple(range(start, inst.num_units)))
    return tuple(groups)


def best_modes(inst: Instance, groups) -> Tuple[bool, ...]:
    """Per-group sparse/dense choice that minimises the predicted time of fixed groups.

    Without a dense cost every group is sparse. With one, this runs the exact search of
    :class:`_FrontierSearch` with the group boundaries fixed, so only the modes are free;
    ties prefer sparse.
    """
    groups = check_groups(groups, inst.num_units)
    if inst.dense is None:
        return (False,) * len(groups)
    if inst.hierarchy is not None:
        return _exact_modes(inst, groups)
    bounds = np.cumsum([len(g) for g in groups])
    _, modes = _search(inst, _prefix_sums(inst), [bounds], boundaries=bounds)
    return modes


# ---------------------------------------------------------------------------
# two-level instances


def relaxed_lower_bound(inst: Instance) -> float:
    """A lower bound of the least predicted iteration time of a two-level instance: the
    optimum of :func:`~omgs_hook.cost_model.relaxed_instance` (whose group costs are at
    most the exact ones). It is a proven bound when that search is exact (no dense cost,
    at most :data:`EXACT_UNITS` units); it equals the exact optimum (up to rounding) when
    every unit's ``numel`` is a multiple of the ranks per node. For a flat instance it is
    ``make_plan(inst).predicted_iteration_s``."""
    return make_plan(relaxed_instance(inst), "optimal").predicted_iteration_s


def _hierarchical_plan(inst: Instance, strategy: str) -> Plan:
    """Plan a two-level instance (see the module docstring)."""
    relaxed = relaxed_instance(inst)
    num_units = inst.num_units
    if strategy != "optimal":
        groups = _rule_groups(inst, strategy, relaxed)
        return _finish(inst, strategy, groups, best_modes(inst, groups))
    candidates = [make_plan(relaxed, "optimal").groups, greedy_groups(relaxed),
                  (tuple(range(num_units)),)]
    if num_units <= _LAYERWISE_BOUND_UNITS:
        candidates.append(tuple((u,) for u in range(num_units)))
    best = None
    seen = set()
    for groups in candidates:  # the relaxation's optimum first: it wins ties
        if groups in seen:
            continue
        seen.add(groups)
        plan = _finish(inst, strategy, groups, best_modes(inst, groups))
        if best is None or plan.predicted_iteration_s < best.predicted_iteration_s:
            best = plan
    return best


# Pareto states the exact mode search of a two-level instance keeps per group boundary
# before it falls back to the best ones (SearchBudgetWarning).
_MODE_STATES = 1 << 16


def _exact_modes(inst: Instance, groups) -> Tuple[bool, ...]:
    """Best sparse/dense flags for fixed groups under the exact timeline (any instance):
    a forward pass over Pareto fronts of ``(c, e)`` states, as in :class:`_FrontierSearch`
    (both coordinates of an image grow with both of the state's), with the costs of
    :func:`~omgs_hook.cost_model.simulate`. States that cannot beat the best of three
    simple mode rules (all sparse, all dense, each group's cheaper mode alone) are
    dropped: every completion needs at least the remaining groups' cheaper collectives on
    the network, and the remaining backward plus one collective on the compute side.
    Ties prefer sparse and earlier states."""
    hierarchical = inst.hierarchy is not None
    terms = []
    for group in groups:
        numel = sum(inst.layers[u].numel for u in group)
        backward = sum(inst.layers[u].backward_s for u in group)
        if hierarchical:
            x_sparse = backward + inst.hierarchical_compute_time(numel)
            y_sparse = inst.hierarchical_comm_time(numel)
            x_dense = backward + inst.hierarchical_dense_compute_time(numel)
            y_dense = inst.hierarchical_dense_comm_time(numel)
        else:
            x_sparse = backward + inst.topk_time(numel)
            y_sparse = inst.sparse_comm_time(numel)
            x_dense, y_dense = backward, inst.dense_comm_time(numel)
        terms.append((backward, x_sparse, y_sparse, x_dense, y_dense))
    m = len(terms)
    rules = [[False] * m, [True] * m,
             [x_dense + y_dense < x_sparse + y_sparse
              for _, x_sparse, y_sparse, x_dense, y_dense in terms]]
    upper = min(simulate(inst, groups, flags).comm_end_s for flags in rules)
    limit = upper + _RELATIVE_TIE * _time_scale(inst) * (m + 2)
    rest_net = [0.0] * (m + 1)
    rest_cpu = [0.0] * (m + 1)
    for j in range(m - 1, -1, -1):
        backward, _, y_sparse, _, y_dense = terms[j]
        rest_net[j] = rest_net[j + 1] + min(y_sparse, y_dense)
        rest_cpu[j] = rest_cpu[j + 1] + backward
    last = min(terms[-1][2], terms[-1][4])
    tie = _RELATIVE_TIE * _time_scale(inst)
    C = np.zeros(1)
    E = np.zeros(1)
    history = []  # per group: (parent index, dense flag) of every kept state
    capped = False
    for j, (backward, x_sparse, y_sparse, x_dense, y_dense) in enumerate(terms):
        net_left, cpu_left = rest_net[j + 1], rest_cpu[j + 1] + (last if j + 1 < m else 0.0)
        cs, cd = C + x_sparse, C + x_dense
        cand_c = np.concatenate((cs, cd))
        cand_e = np.concatenate((np.maximum(E, cs) + y_sparse, np.maximum(E, cd) + y_dense))
        viable = np.flatnonzero((cand_e + net_left <= limit) & (cand_c + cpu_left <= limit))
        if viable.size == 0:  # rounding only: the bound is an actual plan's time
            return tuple(min(rules, key=lambda f: simulate(inst, groups, f).comm_end_s))
        # Pareto front: by c (stable: sparse images first), keep a state when its e is
        # clearly below every e before it
        order = viable[np.argsort(cand_c[viable], kind="stable")]
        e_sorted = cand_e[order]
        best_before = np.concatenate(([np.inf], np.minimum.accumulate(e_sorted)[:-1]))
        kept = order[e_sorted < best_before - tie]
        if kept.size > _MODE_STATES:
            capped = True
            kept = np.sort(kept[np.argsort(cand_e[kept], kind="stable")[:_MODE_STATES]])
            kept = kept[np.argsort(cand_c[kept], kind="stable")]
        size = C.size
        history.append((kept % size, kept >= size))
        C, E = cand_c[kept], cand_e[kept]
    if capped:
        warnings.warn(
            f"omgs_hook planner: the exact mode search kept more than {_MODE_STATES} "
            f"states per group; using the best modes among those kept (not proven optimal)",
            SearchBudgetWarning, stacklevel=3)
    state = int(np.argmin(E))  # first minimum wins ties
    flags = []
    for parents, dense in reversed(history):
        flags.append(bool(dense[state]))
        state = int(parents[state])
    return tuple(reversed(flags))


class SearchBudgetWarning(UserWarning):
    """With a dense cost, or beyond :data:`EXACT_UNITS` units: the exact searches hit
    :data:`SEARCH_BUDGET`; the plan returned is the best one a bounded (beam) search, the
    heuristics and the ``start`` plan gave, improved by a local search (:func:`_polish`),
    not a proven optimum."""


# Up to this many units `optimal` without a dense cost is always exact: no budget, no
# fallback (with a dense cost the SEARCH_BUDGET valve always applies).
EXACT_UNITS = 1000
# The safety valve beyond EXACT_UNITS units: candidate states all the searches of one
# plan may examine before `optimal` returns the best plan found so far
# (SearchBudgetWarning). A count, not a time, so that every rank stops at the same
# point (about half a second to a second of work here).
SEARCH_BUDGET = 10_000_000
# With a dense cost, instances of more units than this get a smaller valve:
# SEARCH_BUDGET * (DENSE_FULL_BUDGET_UNITS / units) ** 2, a tenth at 1000 units
# (dense_valve_budget). There the exact search never finishes within 10 million, and
# the turns beyond one million found no better plan on any of the 60 realistic and
# adversarial instances of 500-1000 units measured (docs/cost-model.md, "A smaller
# valve for larger dense instances"), while each candidate costs more the more units
# there are. At 300 units the full budget still matters (8 of 61 plans were worse with
# one million, by up to 1.5%).
DENSE_FULL_BUDGET_UNITS = 316
# Candidate budget of the forward search's first turn in the race of `_search`.
_RACE_START_BUDGET = 250_000
# The first turn's factor without a dense cost and with c2 = 0 (see _search).
_LINEAR_START_FACTOR = 4
# Factor by which the turns' budgets grow each round. A turn that finishes stops there,
# so only the turns that run out are wasted work: about 1 / (growth - 1) of the winner's.
_RACE_GROWTH = 4
# States kept per prefix by the beam search that supplies upper bounds.
_BEAM_WIDTH = 4
# The beam looks at this many times its width candidates per target (those with the
# least bound; see _FrontierSearch._beam_select).
_BEAM_PICK = 2
# Live states the beam search keeps at most (the most promising by lower bound): a beam
# whose live set grows with the prefixes costs more than the exact search it prepares.
_BEAM_LIVE = 256
# With a dense cost the beam's plan is usually the one the valve returns (the exact
# searches rarely finish there), so its beam is wider. On the realistic dense instances
# of 300 and 1000 units that the valve stopped (docs/cost-model.md, "Safety valve"),
# polished both: (4, 256) up to 3.1% above the optimum, (8, 512) at most 0.17%,
# (16, 1024) no better than (8, 512) and slower.
_DENSE_BEAM_WIDTH = 8
_DENSE_BEAM_LIVE = 512
# Up to this many units the layerwise plan is one of the upper-bound candidates.
_LAYERWISE_BOUND_UNITS = 4096


def _search(inst: Instance, prefix_sums, known_bounds, boundaries, start=None,
            valve_budget=None):
    """Best (bounds, modes): always exact up to :data:`EXACT_UNITS` units.

    ``known_bounds`` are groupings (as group end prefixes) whose simple-rule plans give
    the first upper bound. With fixed ``boundaries`` (:func:`best_modes`) the forward
    search over those boundaries decides the modes. Otherwise two exact searches race:
    the forward search over ``(c, e)`` fronts (:class:`_FrontierSearch`) and the
    backward search over ``(Ys, G)`` fronts (:class:`_SuffixSearch`). Each is fast on
    instances where the other can be slow, so they take turns, the candidate budget
    growing by :data:`_RACE_GROWTH` every round, and the first to finish returns the
    optimum (both are exact, so which one finishes does not change the plan's time;
    ties between equal plans are broken by a fixed order). The turns depend on counts
    only, never on a clock, so every rank takes the same turns.

    The turns share what they learn:

    * the first forward turn, once out of budget, goes on as a beam search (one pass
      for both), whose plan tightens the bound and whose states at every prefix are
      actual groupings;
    * every backward turn joins its suffix states to those prefix states (a prefix
      state ``(c, e)`` and a suffix state ``(Ys, G)`` make a plan of time
      ``max(e + Ys, c + G)``) and tightens its own bound on the way - its work grows
      steeply with the gap between bound and optimum - and hands the tighter bound on;
    * every forward turn after a backward turn that ran out of budget joins the suffix
      fronts that turn finished: plans whose first boundary past the point where it
      stopped is ``t`` are priced exactly from the front at ``t`` and not stored;
    * the backward search also joins the exact fronts that the first forward turn
      made before it turned into a beam: the suffix starts up to there are priced
      against them instead of searched (*Join to exact prefixes* in
      :class:`_SuffixSearch`).

    Without a dense cost the backward search, joined to the beam's prefixes, ends the
    race on every benchmark instance that the first forward turn does not finish, so its
    turns get twice the forward turn's count (the first one 2 million candidates: the
    forward turn in between would be wasted work); with a dense cost (where it rarely
    wins) a quarter.

    With a dense cost, or beyond :data:`EXACT_UNITS` units, once the turns together have
    examined :data:`SEARCH_BUDGET` candidates (``valve_budget`` when given), the best
    plan found so far is returned with a :class:`SearchBudgetWarning` (the documented
    safety valve). Setting ``EXACT_UNITS = 0`` applies that valve at every size.
    """
    rules = ("sparse",) if inst.dense is None else ("sparse", "dense", "cheaper")
    best_value, best_plan = math.inf, None
    for bounds in known_bounds:
        for rule in rules:
            value, modes = _comm_end(inst, prefix_sums, bounds, rule)
            if value < best_value:
                best_value, best_plan = value, (tuple(int(b) for b in bounds), modes)
    if start is not None and boundaries is None:
        value, modes = _comm_end(inst, prefix_sums, start[0], start[1])
        if value < best_value:
            best_value, best_plan = value, (tuple(int(b) for b in start[0]), modes)

    if boundaries is not None:
        exact = _FrontierSearch(
            inst, upper_bound=best_value, boundaries=boundaries,
            budget=_valve(inst, valve_budget)
        ).solve()
        return exact if exact is not None else _budget_exceeded(inst, best_plan, valve_budget)

    # the safety valve (dense, or beyond EXACT_UNITS units) caps the candidates of all turns
    # together, counted as budgets granted
    valve = _valve(inst, valve_budget)
    granted = 0

    def grant(count):
        nonlocal granted
        if valve is not None:
            count = min(count, valve - granted)
        granted += count
        return count

    def valve_closed():
        return valve is not None and granted >= valve

    # first turn: the forward search, which tolerates a loose bound best
    budget = _RACE_START_BUDGET
    if inst.topk.c2 == 0.0 and inst.dense is None:
        # linear top-k: the forward fronts stay small (no c2 D log D sums to tell states
        # apart), so the forward search is the likely winner and gets a longer first turn
        budget *= _LINEAR_START_FACTOR
    # once out of budget it goes on as a beam search, which tightens the bound (the
    # backward search needs a tight one)
    beam_search = _FrontierSearch(
        inst, upper_bound=best_value, budget=grant(budget),
        then_beam=((_BEAM_WIDTH, _BEAM_LIVE) if inst.dense is None
                   else (_DENSE_BEAM_WIDTH, _DENSE_BEAM_LIVE)),
    )
    beam = beam_search.solve()
    if beam is not None and beam_search.exact:
        return beam
    if beam is not None:
        value, _ = _comm_end(inst, prefix_sums, beam[0], beam[1])
        if value < best_value:
            best_value, best_plan = value, beam
    # the beam's states at every prefix are actual groupings: the backward search joins
    # its suffix states to them, and so finds plans (and bounds) long before it ends
    prefix_states = beam_search.beam_states
    # the bound of the exact searches: the best plan's time, or less once a backward
    # turn has seen a better plan (which it does not reconstruct)
    bound = best_value
    least_topk = (
        _least_topk_time(inst, prefix_sums[0]) if inst.dense is None else None
    )
    least_compute = prefix_sums[1] + least_topk if inst.dense is None else prefix_sums[1]
    network_floor = _prefix_network_floor(inst, prefix_sums[0], prefix_sums[1], least_compute)
    backward = None
    while not valve_closed():
        budget *= _RACE_GROWTH
        # the backward turn's share of the count (see the docstring)
        share = grant(max(1, budget * 2 if inst.dense is None else budget // 4))
        if backward is None:
            backward = _SuffixSearch(
                inst,
                bound,
                budget=share,
                least_topk=least_topk,
                network_floor=network_floor,
                prefix_states=prefix_states,
                exact_prefix=beam_search,
            )
            found = backward.solve()
        else:  # it goes on where it stopped: no work is done twice
            found = backward.resume(share, bound)
        if found is not None:
            return found
        if backward.outcome == "none":
            # nothing better than the known plan exists (up to rounding)
            return best_plan
        if backward.best_found < bound:
            # a plan the backward turn saw but did not reconstruct: the forward search
            # may lose a tie per group on the way to it (its own bound adds only one)
            bound = backward.best_found + _RELATIVE_TIE * _time_scale(inst) * (
                inst.num_units + 2)
        if valve_closed():
            break
        # the forward turn joins the fronts the backward turn finished
        found = _FrontierSearch(
            inst, upper_bound=bound, budget=grant(budget), suffix=backward
        ).solve()
        if found is not None:
            return found
    # the valve closed: the best plan found, polished by a local search
    return _budget_exceeded(inst, _polish(inst, prefix_sums, best_plan), valve_budget)


def dense_valve_budget(num_units: int) -> int:
    """The valve's default candidate count for a plan with a dense cost over
    ``num_units`` units: :data:`SEARCH_BUDGET` up to :data:`DENSE_FULL_BUDGET_UNITS`
    units, then falling as ``1 / units**2`` (a tenth at 1000 units), never below
    ``min(SEARCH_BUDGET, _RACE_START_BUDGET)`` (the first turn's own count)."""
    full = SEARCH_BUDGET
    if num_units <= DENSE_FULL_BUDGET_UNITS:
        return full
    scaled = int(full * (DENSE_FULL_BUDGET_UNITS / num_units) ** 2)
    return max(min(full, _RACE_START_BUDGET), scaled)


def default_valve_budget(inst: Instance) -> int:
    """The valve's candidate count for ``inst`` when no budget is given:
    :data:`SEARCH_BUDGET`, with a dense cost :func:`dense_valve_budget`."""
    return SEARCH_BUDGET if inst.dense is None else dense_valve_budget(inst.num_units)


def _valve(inst: Instance, budget=None) -> Optional[int]:
    """The search budget: none (exact) for sparse instances up to EXACT_UNITS units,
    ``budget`` where given, otherwise :data:`SEARCH_BUDGET` (:func:`dense_valve_budget`
    with a dense cost). With a dense cost the fronts can hold hundreds of thousands
    of states (minutes of search on 100-1000 units), and a plan that arrives minutes late
    stalls training - the hook waits for it at the agreed step - so there the valve
    always applies (about a second of work); the measured selection then checks the
    plan against its alternatives anyway."""
    if inst.dense is None and inst.num_units <= EXACT_UNITS:
        return None
    return default_valve_budget(inst) if budget is None else budget


# Windows the polish (_polish) of a budget-stopped plan may price in all: a count, so
# every rank stops at the same point, and its time bounded (a window costs about 0.1 ms
# of numpy calls, so at most about 0.1 s; on the realistic dense instances the valve
# stopped, 1000 and 5000 gave the same plans). Without it a plan of 200 groups took 4 s.
_POLISH_WINDOWS = 1000
# The polish re-covers windows of up to this many consecutive groups with one or two.
_POLISH_WINDOW = 3


def _group_terms(inst: Instance, prefix_sums, lo, hi):
    """``((X, Y) sparse, (X, Y) dense)`` of the groups of units ``lo .. hi-1`` (arrays
    broadcast): the compute-stream and network times :func:`_comm_end` uses (dense
    ``None`` without a dense cost). Every group must hold at least one unit."""
    backward, topk, sparse_comm, dense_comm = _group_costs(inst, prefix_sums, lo, hi)
    return (backward + topk, sparse_comm), (
        None if dense_comm is None else (backward, dense_comm))


def _heads_and_tails(inst: Instance, prefix_sums, bounds, modes):
    """Per group boundary ``j``: the state ``(c, e)`` after the groups before ``j``, and
    the suffix ``(Ys, G)`` of the groups from ``j`` on (``Ys`` their network time, ``G``
    the latest network end counted from their first compute)."""
    m = len(bounds)
    x, y, _ = _group_times(inst, prefix_sums, bounds, tuple(modes))
    head_c, head_e = [0.0], [0.0]
    for j in range(m):
        c = head_c[-1] + x[j]
        head_c.append(c)
        head_e.append(max(head_e[-1], c) + y[j])
    tail_ys, tail_g = [0.0] * (m + 1), [0.0] * (m + 1)
    for j in range(m - 1, -1, -1):
        tail_ys[j] = tail_ys[j + 1] + y[j]
        tail_g[j] = x[j] + max(tail_g[j + 1], tail_ys[j])
    return head_c, head_e, tail_ys, tail_g


def _best_move(inst: Instance, prefix_sums, bounds, modes, windows, heads_tails, below):
    """The pass's best move: the best re-cover of a window ``(j, width)`` of ``windows``
    - groups ``j .. j+width-1`` - by one group or two (every cut position, every mode
    pair) whose plan time is below ``below``, as ``(time, bounds, modes)``, or None; the
    first window in order, then the first choice (one group by mode, then the mode pairs
    by cut), among equal times. Priced by ``max(e + Ys, c + G)`` with the state before
    the window and the suffix after it, every window at once: a few numpy calls per pass
    instead of a few dozen per window (a pass of a 27-group plan prices 78 windows;
    tests/test_planner_polish.py holds the window-by-window reference)."""
    if not windows:
        return None
    head_c, head_e, tail_ys, tail_g = heads_tails
    starts = [0] + list(bounds[:-1])
    choices = (False,) if inst.dense is None else (False, True)
    lo = np.array([starts[j] for j, _ in windows], dtype=np.int64)
    hi = np.array([bounds[j + w - 1] for j, w in windows], dtype=np.int64)
    c0 = np.array([head_c[j] for j, _ in windows])
    e0 = np.array([head_e[j] for j, _ in windows])
    ys = np.array([tail_ys[j + w] for j, w in windows])
    g = np.array([tail_g[j + w] for j, w in windows])
    # one group per window, per mode
    one = _group_terms(inst, prefix_sums, lo, hi)
    single = []
    for dense in choices:
        x1, y1 = one[dense]
        c = c0 + x1
        single.append(np.maximum(np.maximum(e0, c) + y1 + ys, c + g))
    # two groups: every cut of every window of 2 units or more, flattened
    sizes = np.maximum(hi - lo - 1, 0)
    owner = np.repeat(np.arange(len(windows)), sizes)
    offsets = np.concatenate(([0], np.cumsum(sizes)))
    cut = lo[owner] + 1 + (np.arange(owner.size) - offsets[owner])
    pairs = []
    if cut.size:
        first = _group_terms(inst, prefix_sums, lo[owner], cut)
        second = _group_terms(inst, prefix_sums, cut, hi[owner])
        c0_cut, e0_cut, ys_cut, g_cut = c0[owner], e0[owner], ys[owner], g[owner]
        for dense1 in choices:
            x1, y1 = first[dense1]
            c1 = c0_cut + x1
            e1 = np.maximum(e0_cut, c1) + y1
            for dense2 in choices:
                x2, y2 = second[dense2]
                c2 = c1 + x2
                pairs.append(((dense1, dense2),
                              np.maximum(np.maximum(e1, c2) + y2 + ys_cut, c2 + g_cut)))
    least = min(float(np.min(v)) for v in single)
    if pairs:
        least = min(least, min(float(np.min(v)) for _, v in pairs))
    if not least < below:
        return None
    # the first window (in order) where the least time occurs, then the first choice
    # there: one group by mode, then the mode pairs by cut
    hits = [np.flatnonzero(v == least) for v in single]
    hits += [owner[np.flatnonzero(v == least)] for _, v in pairs]
    k = min(int(h[0]) for h in hits if h.size)
    j, width = windows[k]
    found = None
    for dense, v in zip(choices, single):
        if v[k] == least:
            found = ([int(hi[k])], [dense])
            break
    if found is None:
        for (dense1, dense2), v in pairs:
            segment = v[offsets[k]:offsets[k + 1]]
            at = np.flatnonzero(segment == least)
            if at.size:
                found = ([int(cut[offsets[k] + at[0]]), int(hi[k])], [dense1, dense2])
                break
    return (least, list(bounds[:j]) + found[0] + list(bounds[j + width:]),
            list(modes[:j]) + found[1] + list(modes[j + width:]))


def _polish(inst: Instance, prefix_sums, plan):
    """A budget-stopped plan ``(bounds, modes)`` improved by local search (never worse).

    The plan the valve returns is the best one a beam search and the heuristics found;
    on realistic 1000-unit dense instances it was up to 3.5% above the optimum, with the
    optimum's boundaries hundreds of units away from its own. Each pass prices every
    window of 1 to :data:`_POLISH_WINDOW` consecutive groups re-covered by one group or
    by two (every cut position at once, every mode pair) - which moves a boundary
    anywhere between its neighbours, splits, merges and flips modes - and takes the best
    move; the polish stops at a pass without one or after :data:`_POLISH_WINDOWS`
    windows in all. (Taking each window's move at once instead ended higher: 0.36%
    against 0.17% on the worst instance.) A window is priced without walking the plan:
    the groups before it end in a state ``(c, e)`` and those after it form a suffix
    ``(Ys, G)``, and the plan's time is ``max(e + Ys, c + G)`` (the flow-shop identity
    of docs/cost-model.md), so all windows of a pass, with all their cut positions, are
    priced in a few numpy operations (:func:`_best_move`; one window at a time took up to
    47 ms on a 28-group plan, now 5 ms). A move is taken only when :func:`_comm_end`
    confirms that it beats the plan by more than a tie. Pure arithmetic on the instance and counts: every rank takes the same
    moves."""
    bounds, modes = [int(b) for b in plan[0]], [bool(d) for d in plan[1]]
    best, _ = _comm_end(inst, prefix_sums, bounds, tuple(modes))
    tie = _RELATIVE_TIE * _time_scale(inst)
    left = _POLISH_WINDOWS
    while left > 0:
        heads_tails = _heads_and_tails(inst, prefix_sums, bounds, modes)
        windows = [(j, width) for j in range(len(bounds))
                   for width in range(1, min(_POLISH_WINDOW, len(bounds) - j) + 1)][:left]
        left -= len(windows)
        move = _best_move(inst, prefix_sums, bounds, modes, windows, heads_tails,
                          best - tie)
        if move is None:
            break  # a local optimum of these moves
        value, _ = _comm_end(inst, prefix_sums, move[1], tuple(move[2]))
        if not value < best - tie:  # (rounding between the identity and the walk)
            break
        best, bounds, modes = value, move[1], move[2]
    return tuple(bounds), tuple(modes)


def _budget_exceeded(inst: Instance, best_plan, budget=None):
    default = default_valve_budget(inst)
    if budget is not None:
        name = f"its budget of {budget}"
    elif default != SEARCH_BUDGET:
        name = (f"the dense valve of {default} (SEARCH_BUDGET={SEARCH_BUDGET} scaled to "
                f"{inst.num_units} units)")
    else:
        name = f"SEARCH_BUDGET={SEARCH_BUDGET}"
    warnings.warn(
        f"omgs_hook planner: the exact search over {inst.num_units} units exceeded "
        f"{name} candidate states; using the best plan found by a "
        f"beam search and the heuristics, improved by a local search (not proven optimal)",
        SearchBudgetWarning,
        stacklevel=4,
    )
    return best_plan


def _groups_from_bounds(bounds: Sequence[int]) -> Groups:
    starts = [0] + list(bounds[:-1])
    return tuple(tuple(range(a, b)) for a, b in zip(starts, bounds))


def _group_costs(inst: Instance, prefix_sums, lo, hi):
    """``(backward, top-k, sparse collective, dense collective or None)`` seconds of the
    groups of units ``lo .. hi-1`` (arrays broadcast; every group at least one unit): the
    per-group terms of the timeline, with numpy, for many groups at once."""
    numel_prefix, backward_prefix = prefix_sums
    numel = numel_prefix[hi] - numel_prefix[lo]
    backward = backward_prefix[hi] - backward_prefix[lo]
    topk = inst.topk.c0 + inst.topk.c1 * numel + inst.topk.c2 * numel * np.log2(numel)
    k = np.maximum(1.0, np.ceil(inst.density * numel))
    sparse_comm = inst.comm.alpha_s + inst.comm.beta_s_per_byte * (
        k * (inst.value_bytes + inst.index_bytes)
    )
    if inst.dense is None:
        return backward, topk, sparse_comm, None
    dense_comm = inst.dense.alpha_s + inst.dense.beta_s_per_byte * (inst.value_bytes * numel)
    return backward, topk, sparse_comm, dense_comm


def _group_times(inst: Instance, prefix_sums, bounds, modes):
    """``(X, Y, modes)`` of the groups ending at prefixes ``bounds``: per group its time on
    the compute stream and on the network (lists), and its dense flags. ``modes`` as in
    :func:`_comm_end`."""
    ends = np.asarray(bounds, dtype=np.int64)
    starts = np.concatenate(([0], ends[:-1]))
    backward, topk, comm, dense_comm = _group_costs(inst, prefix_sums, starts, ends)
    if modes == "sparse" or dense_comm is None:
        use_dense = np.zeros(ends.size, dtype=bool)
    else:
        if modes == "dense":
            use_dense = np.ones(ends.size, dtype=bool)
        elif modes == "cheaper":
            use_dense = dense_comm < topk + comm
        else:
            use_dense = np.asarray(modes, dtype=bool)
        comm = np.where(use_dense, dense_comm, comm)
    step_compute = np.where(use_dense, backward, backward + topk)
    return step_compute.tolist(), comm.tolist(), tuple(use_dense.tolist())


def _comm_end(inst: Instance, prefix_sums, bounds, modes) -> Tuple[float, Tuple[bool, ...]]:
    """``(e_m, modes)`` of the groups ending at prefixes ``bounds``.

    ``modes`` is a tuple of per-group dense flags, or a rule: ``"sparse"`` (all sparse),
    ``"dense"`` (all dense) or ``"cheaper"`` (dense where the dense all-reduce takes less
    than top-k plus all-gather of that group alone). Used for upper bounds, so the
    per-group terms are computed with numpy at once; the result agrees with
    :func:`simulate` up to rounding.
    """
    step_compute, comm, use_dense = _group_times(inst, prefix_sums, bounds, modes)
    compute = network = 0.0
    for x, y in zip(step_compute, comm):
        compute += x
        network = (network if network > compute else compute) + y
    return network, use_dense


def _unit_arrays(inst: Instance):
    """(numel, backward, numel prefix sums, backward prefix sums) as float64 arrays,
    prefix index 0 = the empty prefix. Element counts are exact in float64 below 2**53,
    which every Instance is checked for when it is built."""
    L = inst.num_units
    numel = np.fromiter((u.numel for u in inst.layers), dtype=np.float64, count=L)
    backward = np.fromiter((u.backward_s for u in inst.layers), dtype=np.float64, count=L)
    numel_prefix = np.concatenate(([0.0], np.cumsum(numel)))
    return numel, backward, numel_prefix, np.concatenate(([0.0], np.cumsum(backward)))


def _prefix_sums(inst: Instance):
    """(numel prefix sums as float64, backward prefix sums), index 0 = empty prefix."""
    return _unit_arrays(inst)[2:]


def _time_scale(inst: Instance) -> float:
    """The time of a plan no worse than the all-sparse ones (for tie tolerances).

    Every state the exact search keeps finishes below the best known plan, which is at
    most this, so it bounds all the times that are compared. (The dense cost is left out
    on purpose: an absurd dense cost must not make the tolerance coarse.)
    """
    total_numel = sum(u.numel for u in inst.layers)
    return (
        sum(u.backward_s for u in inst.layers)
        + inst.num_units * (inst.topk.c0 + inst.sparse_comm_time(total_numel))
        + inst.topk.time(total_numel)
        + inst.forward_s
    )


# ---------------------------------------------------------------------------
# the exact search


def _grown(states, ids, live, end):
    """The live-state arrays with room for twice ``end`` states, the first ``live`` kept."""
    grown = np.zeros((4, 2 * end))
    grown[:, :live] = states[:, :live]
    return grown, np.concatenate((ids[:live], np.zeros(2 * end - live, np.int64)))


class _FrontierSearch:
    """Exact minimum of the predicted iteration time over all plans.

    **States.** After the units ``0..s-1`` are grouped, the rest of the timeline depends
    only on the pair ``(c, e)`` of the recurrence (compute-stream and network times).
    Closing one more group ``s..t-1`` (``D`` elements, ``B`` seconds of backward) maps a
    state to

    * sparse: ``c' = c + X``, ``e' = max(e, c') + Y``, with ``X = B + t_s(D)`` and ``Y = t_c(D)``
    * dense:  ``c' = c + B``, ``e' = max(e, c') + t_d(D)``

    Both coordinates of an image grow with ``c`` and with ``e``; the rest of the
    timeline is a composition of such maps. Hence a state that is no better than another
    state of the same prefix in both coordinates has no completion better than the
    other's, and it is enough to keep, for every prefix ``t``, the *Pareto front* of
    non-dominated ``(c, e)`` pairs. The front at ``t`` is the Pareto front of the images
    of all kept states of all prefixes ``s < t``; the optimum is the smallest ``e`` in
    the front at ``L``. (A greedy that keeps one state per prefix is not exact: a state
    with a later ``c`` but an earlier ``e`` can win later.)

    **Vectorisation.** All live states are columns of one numpy array, stored in order
    of their prefix ``s``. For a target ``t`` the images of every live state in both
    modes are a dozen array operations; the front is extracted with one sort and one
    running minimum.

    **Pruning.** Nothing below removes a state that could still lead to a better plan,
    so the search stays exact:

    1. *Bound.* ``upper_bound`` is the ``e_m`` of a known plan (cheap heuristics; with a
       dense cost also a beam search). Every completion of a state ``(c, e)`` at prefix
       ``t`` needs, on the network, at least one more collective (``alpha_min``) plus the
       bytes of the remaining elements (``k >= density * D``; elements sent dense cost
       the dense bytes instead); on the compute stream, the remaining backward plus the
       top-k of the elements that stay sparse (at least ``c1 * D + c2 * D * log2 D``
       summed over single units, since ``D log D`` is superadditive; plus ``c0`` when
       every group is sparse) plus a last collective. The final ``e_m`` is at least the
       larger of the two; minimising it over how many elements go dense (a maximum of
       two linear functions: an endpoint or the crossing) gives a lower bound, and
       states whose bound exceeds ``upper_bound`` are not stored.
    2. *Same prefix.* Let ``B`` be a state of the same prefix with a smaller ``c`` (in a
       front it has a larger ``e``). Once ``e_B <= c'_A`` (``A``'s compute image for
       the current target), ``B``'s image ``(c_B + X, max(e_B, c_B + X) + Y)`` is no
       worse than ``A``'s ``(c_A + X, max(e_A, c_A + X) + Y)`` in both coordinates, and
       ``c'_A`` only grows with later targets: ``A`` is dropped. (With a dense cost the
       smaller dense ``c'`` is used, which covers both modes.)
    3. *Later prefix.* Let ``B`` be a state of a later prefix than ``A``'s with
       ``c'_B <= c'_A`` and ``e_B <= c'_A`` for the current target. ``B``'s group is
       contained in ``A``'s, so its ``Y`` is no larger and its top-k term grows no faster
       (``c2 * D log D`` is convex): both inequalities, and hence ``e'_B <= e'_A``,
       hold for every later target, and ``A`` is dropped in that mode; a state is
       removed when this holds in every mode it has. Two cheap searches find such
       ``B``: any later compute-bound state (a running minimum), and the newest
       prefix's front (a binary search).

    Rules 2 and 3 run every few prefixes (they are permanent, so running them lazily
    only keeps a few extra columns for a while).

    **Budget.** ``budget`` caps the number of candidate states examined (a count, so
    every rank stops at the same point); :func:`_search` uses it to take turns with
    :class:`_SuffixSearch`, and as the safety valve beyond :data:`EXACT_UNITS` units. A
    joined turn (below) returns None as soon as its budget must run out before its last
    target: until the next prune its live set only grows, so each of the next targets
    examines at least as many candidates as this one (:attr:`stopped_early`; the same
    outcome, a few targets' work sooner).

    **Fixed groups.** With ``boundaries`` given, only those prefixes are targets and only
    the front of the previous boundary is a source: the same search then chooses only
    the modes (:func:`best_modes`).

    **Join.** Given ``suffix``, a :class:`_SuffixSearch` that ran out of budget while at
    suffix start ``r``, the fronts it created for every ``t > r`` are exact (within its
    bound). Every plan has a first boundary ``t > r``; its part before is a candidate of
    this search at target ``t`` and its part after is (or is dominated by) a state of
    the front at ``t``, so the least ``max(e + Ys, c + G)`` over both is that plan's
    best completion. For targets ``r < t < L`` the candidates are therefore only priced
    against the front at ``t`` (a binary search on ``Ys - G``, ascending along a front,
    for where it crosses ``c - e``) and not stored; the live set stops growing at ``r``.
    The plan is the best priced one, unless a candidate at ``L`` is better.

    **Beam.** With ``beam``, or ``then_beam`` once the budget is spent, the search is a
    heuristic: it keeps the ``beam`` states of each target's front with the least lower
    bound (without a dense cost, where the beam only supplies bounds: at most ``beam``
    non-dominated ones among the ``2 * beam`` candidates with the least bound, without
    sorting the rest, :meth:`_beam_select`) and at most ``beam_live`` live states, and
    records the states it keeps per target in :attr:`beam_states` (for the backward
    search's join). With a dense cost, a search over free groups that turns into a beam
    goes on in :meth:`_dense_beam` (the same values, fewer numpy calls per target).

    **Exact fronts.** While a search over free groups without a join is still exact, it
    records the front created at every target in :attr:`exact_fronts` (and keeps the
    chains of parents in :attr:`chains`). A search that then runs out of budget and
    goes on as a beam leaves the exact fronts of its first prefixes: every grouping of
    ``0..t-1`` that can still beat the bound is one of those states or dominated by
    one, which is what the backward search's *join to exact prefixes* needs.
    """

    _PRUNE_EVERY = 8
    # A joined exact turn returns None as soon as its budget will certainly run out
    # before its last target (see solve); False: only once it has (the tests compare).
    _STOP_EARLY = True

    def __init__(
        self,
        inst: Instance,
        upper_bound: float = math.inf,
        boundaries=None,
        beam: Optional[int] = None,
        budget: Optional[int] = None,
        beam_live: int = 0,
        then_beam: Optional[Tuple[int, int]] = None,
        suffix: Optional["_SuffixSearch"] = None,
    ):
        """``then_beam``: ``(width, live states)`` of a beam search that takes over
        when the budget runs out (instead of returning None); :attr:`exact` then turns
        False. ``suffix``: a backward search that ran out of budget; its fronts are
        joined (see *Join* in the class docstring)."""
        self.inst = inst
        self.suffix = suffix
        self.used_join = False  # whether the plan found is a joined one
        self.stopped_early = False  # whether it gave up before its budget ran out
        self.beam = beam
        self.beam_live = beam_live or _BEAM_LIVE
        self.then_beam = then_beam
        self.exact = beam is None
        # beam mode: per prefix, (c, e) of the states kept there (actual groupings)
        self.beam_states = (
            [None] * (inst.num_units + 1) if beam is not None or then_beam else None
        )
        # exact mode (no join, free groups): per target t, (c, e, first id) of the front
        # created there, while the search is still exact (see *Exact fronts*); with
        # :attr:`chains`, any of those states can be turned back into its grouping
        self.exact_fronts = {}
        self.chains = None
        self.budget = budget
        L = inst.num_units
        numel, backward, self.numel_prefix, self.backward_prefix = _unit_arrays(inst)
        self.tie = _RELATIVE_TIE * _time_scale(inst)
        self.upper_bound = float(upper_bound)
        if boundaries is None:
            self.targets = range(1, L + 1)
            self.fixed = False
        else:
            self.targets = [int(b) for b in boundaries]
            self.fixed = True
        self._rest_cpu = None
        self._prepare_bound(numel, backward)

    # -- rule 1: the lower bound of every completion -----------------------------------

    def _prepare_bound(self, numel, backward):
        inst = self.inst

        def suffix(x):  # suffix[t] = sum of x[t:], suffix[L] = 0
            return np.concatenate((np.cumsum(x[::-1])[::-1], [0.0]))

        c1, c2 = inst.topk.c1, inst.topk.c2
        self.rest_numel = suffix(numel)
        self.rest_backward = suffix(backward)
        per_element_topk = c1 + c2 * np.log2(numel)
        self.rest_topk = suffix(per_element_topk * numel)
        # the most top-k time one element sent dense can save: at the largest unit left
        largest_left = np.concatenate((np.maximum.accumulate(numel[::-1])[::-1], [1.0]))
        self.topk_saving = c1 + c2 * np.log2(largest_left)
        self.sparse_bytes_time = (
            inst.comm.beta_s_per_byte * (inst.value_bytes + inst.index_bytes) * inst.density
        )
        if inst.dense is None:
            self.alpha_min = inst.comm.alpha_s
            self.extra_per_dense_element = None
            self.last_topk = inst.topk.c0  # at least one more top-k call
        else:
            self.alpha_min = min(inst.comm.alpha_s, inst.dense.alpha_s)
            self.extra_per_dense_element = (
                inst.dense.beta_s_per_byte * inst.value_bytes - self.sparse_bytes_time
            )
            self.last_topk = 0.0

    def _bound_lists(self):
        """The per-prefix terms of :meth:`lower_bound` as lists of Python floats (the same
        values): remaining elements, remaining compute, top-k saving per dense element."""
        if self._rest_cpu is None:
            self._rest_numel_list = self.rest_numel.tolist()
            self._rest_cpu = (
                self.rest_backward + self.rest_topk + self.last_topk + self.alpha_min
            ).tolist()
            self._topk_saving_list = self.topk_saving.tolist()
        return self._rest_numel_list, self._rest_cpu, self._topk_saving_list

    def lower_bound(self, t: int, c, e):
        """Lower bound on the final ``e_m`` of any completion of states at prefix ``t``."""
        if t == self.inst.num_units:
            return e
        if self._rest_cpu is None:
            self._bound_lists()
        rest_numel = self._rest_numel_list[t]
        network = e + (self.alpha_min + self.sparse_bytes_time * rest_numel)
        compute = c + self._rest_cpu[t]
        if self.extra_per_dense_element is None:
            return np.maximum(network, compute)
        # d elements sent dense: network + extra * d versus compute - saving * d
        extra = self.extra_per_dense_element
        saving = self._topk_saving_list[t]
        bound = np.maximum(network, compute)
        np.minimum(bound, np.maximum(network + extra * rest_numel,
                                     compute - saving * rest_numel), out=bound)
        if extra + saving > 0:
            d = compute - network
            d /= extra + saving
            np.maximum(d, 0.0, out=d)  # (np.clip, without its overhead)
            np.minimum(d, rest_numel, out=d)
            more_network = extra * d
            more_network += network
            d *= saving
            np.subtract(compute, d, out=d)
            np.maximum(more_network, d, out=more_network)
            np.minimum(bound, more_network, out=bound)
        return bound

    # -- the search -------------------------------------------------------------------

    def solve(self) -> Optional[Tuple[Tuple[int, ...], Tuple[bool, ...]]]:
        """Return (group end prefixes, dense flags) of an optimal plan.

        Returns None when the search examined more than ``budget`` candidate states, or
        (beam mode only) when no kept state beats ``upper_bound``.
        """
        inst = self.inst
        # Python floats: scalar arithmetic on numpy scalars is several times slower
        Dp = self.numel_prefix.tolist()
        Bp = self.backward_prefix.tolist()
        c0, c1, c2 = inst.topk.c0, inst.topk.c1, inst.topk.c2
        alpha = inst.comm.alpha_s
        beta_k = inst.comm.beta_s_per_byte * (inst.value_bytes + inst.index_bytes)
        density = inst.density
        # k = max(1, ceil(density * D)) needs the max only if some group can be that small
        clamp_k = density * float(min(u.numel for u in inst.layers)) < 1.0
        has_dense = inst.dense is not None
        if has_dense:
            alpha_d = inst.dense.alpha_s
            beta_d = inst.dense.beta_s_per_byte * inst.value_bytes
        tie = self.tie
        limit = self.upper_bound + tie
        # sparse-only bound (rule 1) folded into two thresholds per target
        sparse_only = not has_dense
        net_rest = self.alpha_min + self.sparse_bytes_time * self.rest_numel
        cpu_rest = self.rest_backward + self.rest_topk + self.last_topk + self.alpha_min
        net_rest[-1] = cpu_rest[-1] = 0.0
        net_limit = (limit - net_rest).tolist()
        cpu_limit = (limit - cpu_rest).tolist()
        last_target = self.targets[-1]
        beam = self.beam
        budget = self.budget if self.budget is not None else math.inf
        # targets after join_from are joined to the backward search's fronts, not stored
        join_from = math.inf
        if self.suffix is not None and self.suffix.stopped_at is not None and not self.fixed:
            join_from = self.suffix.stopped_at
            fronts = self.suffix.fronts
        best_join = math.inf
        joined = None  # (target, parent id, dense flag, backward state id) of best_join
        switched = False

        # Live states are the columns of `states`, kept in order of their prefix s:
        #   GS = c - B(0..s) - c1 * D(0..s)   (so the sparse image is c' = GS + a(t))
        #   E = e, DS = D(0..s)
        #   GD = c - B(0..s)                  (dense image c' = GD + B(0..t); dense only)
        # and `ids` holds their ids (for reconstructing the plan).
        GS, E, DS, GD = range(4)
        states = np.zeros((4, 64))
        ids = np.zeros(64, np.int64)
        live = 1  # the empty prefix: c = e = 0, id 0
        # per target: the first id of its front, the parents' ids and the dense flags
        first_ids = [0]
        parents: List[np.ndarray] = [np.full(1, -1, np.int64)]
        modes: List[Optional[np.ndarray]] = [None]
        next_id = 1
        since_prune = 0
        examined = 0
        self.chains = (first_ids, parents, modes)
        record_fronts = self.exact and not self.fixed and join_from == math.inf
        # a joined exact turn (no beam to go on with) may stop as soon as its budget
        # will certainly run out (below)
        stops_early = (self._STOP_EARLY and self.then_beam is None and beam is None
                       and not self.fixed and join_from < math.inf and budget < math.inf)
        if record_fronts:
            self.exact_fronts[0] = (np.zeros(1), np.zeros(1), 0)  # the empty prefix

        for t in self.targets:
            Dp_t, Bp_t = Dp[t], Bp[t]
            rows = states[:, :live]
            e = rows[E]
            group_numel = Dp_t - rows[DS]
            # (with a dense cost the two modes' images are written into one array each)
            cand_c = np.empty(2 * live if has_dense else live)
            cand_e = np.empty(cand_c.size)
            cs, es = cand_c[:live], cand_e[:live]
            np.add(rows[GS], Bp_t + c0 + c1 * Dp_t, out=cs)
            if c2:
                cs += c2 * group_numel * np.log2(group_numel)
            ys = np.ceil(density * group_numel)  # k(D), exactly as selected_k computes it
            if clamp_k:
                np.maximum(ys, 1.0, out=ys)
            np.maximum(e, cs, out=es)
            ys *= beta_k
            es += ys
            es += alpha
            if has_dense:
                cd, ed = cand_c[live:], cand_e[live:]
                np.add(rows[GD], Bp_t, out=cd)
                np.maximum(e, cd, out=ed)
                ed += alpha_d + beta_d * group_numel
            else:
                cd = None
            size = cand_c.size
            if size == 0:  # fixed groups: the previous boundary kept no state
                if beam is not None:
                    return None
                raise RuntimeError("omgs_hook planner: no plan reaches the upper bound")
            examined += size
            if examined > budget:
                if self.then_beam is None:
                    return None
                # out of budget: finish as a beam search (one pass instead of two)
                beam, self.beam_live = self.then_beam
                self.then_beam = None
                self.exact = False
                switched = True
                budget = math.inf
                if has_dense and join_from == math.inf and not self.fixed:
                    # the same beam, with fewer numpy calls per target (_dense_beam)
                    return self._dense_beam(t, beam, limit, states, ids, live, first_ids,
                                            parents, modes, next_id, since_prune)
            elif stops_early and since_prune < self._PRUNE_EVERY - 1:
                # until the next prune the live set only grows, so each of the next
                # targets examines at least `size` candidates: if they overrun the budget
                # before the last target, this turn ends as it would there (it keeps
                # nothing that outlives it)
                overrun = (budget - examined) // size + 1
                if overrun < self._PRUNE_EVERY - since_prune and t + overrun <= last_target:
                    self.stopped_early = True
                    return None

            if join_from < t < last_target:
                # every plan whose first boundary after join_from is t: this candidate,
                # then a suffix state of the front at t (the least of max(e + Ys, c + G)
                # is where Ys - G crosses c - e)
                front = fronts.get(t)
                if front is not None:
                    front_y, front_g, front_ids = front
                    value, pick = _join_values(front_y, front_g, front_y.size, cand_c, cand_e)
                    i = int(value.argmin())
                    if value[i] < best_join:  # (the first target and candidate win ties)
                        best_join = float(value[i])
                        j = int(pick[i])
                        joined = (t, int(ids[i % live]), bool(has_dense and i >= live),
                                  int(front_ids[j]))
                        limit = min(limit, best_join + tie)
                viable = np.zeros(size, dtype=bool)  # none is stored
            elif beam is not None and sparse_only:
                # (with a dense cost the beam's plan may be the one returned at the
                # budget: there it keeps the full selection below)
                viable = None  # the beam's own selection, below
            # rule 1 first: candidates that cannot beat the known plan (their images
            # cannot either, the bound only grows along a plan) are not even sorted
            elif sparse_only:
                viable = cand_e <= net_limit[t]
                viable &= cand_c <= cpu_limit[t]
            else:
                candidate_bound = self.lower_bound(t, cand_c, cand_e)
                viable = candidate_bound <= limit
            if viable is None:
                chosen, new_c, new_e = self._beam_select(t, cand_c, cand_e, beam, limit)
            elif np.count_nonzero(viable) == size:  # (ndarray.all() is slower on tiny arrays)
                pool = None
            else:
                pool = viable.nonzero()[0]
                cand_c, cand_e = cand_c[pool], cand_e[pool]
                size = pool.size

            # Pareto front: sort by c (stable, so earlier candidates win ties) and keep a
            # state when its e is clearly below the e of every state before it
            if viable is None:
                pass  # the beam chose already
            elif size > _PREFILTER_SIZE:
                kept = _undominated(cand_c, cand_e)
                if kept.size < size:
                    cand_c, cand_e = cand_c[kept], cand_e[kept]
                    pool = kept if pool is None else pool[kept]
                    size = kept.size
            if viable is None:
                pass
            elif size > 1:
                chosen, new_c, new_e = _pareto_front(
                    cand_c, cand_e, cand_c.argsort(kind="stable"), tie)
            else:
                chosen = np.zeros(size, np.int64)
                new_c, new_e = cand_c, cand_e
            if viable is not None and pool is not None:
                chosen = pool[chosen]  # back to candidate numbers
            if viable is not None and beam is not None and chosen.size > beam:
                # heuristic mode: keep the most promising states, still sorted by c
                # (their bounds are among the candidates' - with a dense cost; without
                # one the lean selection above chose already)
                bound = candidate_bound[chosen]
                best = bound.argsort(kind="stable")[:beam]
                best.sort()
                chosen, new_c, new_e = chosen[best], new_c[best], new_e[best]
            count = chosen.size
            if beam is not None:
                self.beam_states[t] = (new_c, new_e)
            elif record_fronts:
                self.exact_fronts[t] = (new_c, new_e, next_id)
            first_ids.append(next_id)
            if has_dense:
                is_dense = chosen >= live
                parents.append(ids[chosen - live * is_dense])
                modes.append(is_dense)
            else:
                parents.append(ids[chosen])
                modes.append(None)
            if t == last_target:
                if joined is not None and (count == 0 or best_join < float(new_e.min())):
                    target, parent, dense_flag, state = joined
                    self.used_join = True
                    head = self._reconstruct(parent, first_ids, self.targets, parents, modes)
                    tail = _SuffixSearch._reconstruct(
                        state, *self.suffix.chains, self.inst.num_units)
                    return (head[0] + (target,) + tail[0], head[1] + (dense_flag,) + tail[1])
                if count == 0:
                    if beam is not None:
                        return None  # the beam dropped every state that beats the bound
                    # impossible in the exact search: upper_bound is an actual plan's time
                    raise RuntimeError("omgs_hook planner: no plan reaches the upper bound")
                final_id = next_id + int(np.argmin(new_e))  # first minimum wins ties
                break

            if self.fixed:
                live = 0  # only the newest front is a source for the next boundary
            else:
                since_prune += 1
                if since_prune == self._PRUNE_EVERY:
                    since_prune = 0
                    live = self._prune(states, ids, live, cs, cd)
                    if beam is not None and live > self.beam_live:
                        live = self._thin_beam(states, ids, live, t)
                elif switched and live > self.beam_live:
                    switched = False  # an exact search just turned into a beam
                    live = self._thin_beam(states, ids, live, t)
            if count == 0:  # every state of this prefix is beyond the bound
                continue
            end = live + count
            if end > ids.size:
                states, ids = _grown(states, ids, live, end)
            np.subtract(new_c, Bp_t + c1 * Dp_t, out=states[GS, live:end])
            states[E, live:end] = new_e
            states[DS, live:end] = Dp_t
            if has_dense:
                np.subtract(new_c, Bp_t, out=states[GD, live:end])
            ids[live:end] = np.arange(next_id, next_id + count)
            next_id += count
            live = end

        return self._reconstruct(final_id, first_ids, self.targets, parents, modes)

    def _dense_beam(self, t_from, beam, limit, states, ids, live, first_ids, parents,
                    modes, next_id, since_prune):
        """The rest of :meth:`solve` once a search over free groups with a dense cost and
        no join has turned into a beam at target ``t_from`` (which it redoes): the same
        candidates, bounds, fronts, selections and prunes, computed by the same
        floating-point operations, so the same states and plan. At 1000 units the beam
        covers about 950 targets of about 1100 candidates, where a target's time is
        mostly the count of numpy calls (about a microsecond each): here the images are
        written into one array instead of concatenated, the bound is computed inline,
        only the selected states' ``e`` are gathered, and the thinning reuses the
        dense images' bounds and the sparse images' ``c``. (About 10% less time than
        the general loop; its sort and Pareto front, about 40 us a target, are most of
        what is left.)"""
        inst = self.inst
        L = inst.num_units
        tie = self.tie
        c0, c1, c2 = inst.topk.c0, inst.topk.c1, inst.topk.c2
        alpha = inst.comm.alpha_s
        beta_k = inst.comm.beta_s_per_byte * (inst.value_bytes + inst.index_bytes)
        density = inst.density
        clamp_k = density * float(min(u.numel for u in inst.layers)) < 1.0
        alpha_d = inst.dense.alpha_s
        beta_d = inst.dense.beta_s_per_byte * inst.value_bytes
        Dp, Bp = self.numel_prefix.tolist(), self.backward_prefix.tolist()
        rest_numel, rest_cpu, saving_list = self._bound_lists()
        extra = self.extra_per_dense_element
        alpha_min, sparse_bytes_time = self.alpha_min, self.sparse_bytes_time
        largest = np.maximum.reduce
        prune_every = self._PRUNE_EVERY
        # the constants that meet arrays, as 0-d arrays: numpy converts a Python float
        # on every call (about 0.3 us; the same float64 value either way)
        c2_, density_, beta_k_, alpha_ = (np.array(v) for v in (c2, density, beta_k, alpha))
        alpha_d_, beta_d_, extra_, tie_ = (np.array(v) for v in (alpha_d, beta_d, extra, tie))
        one_, zero_ = np.array(1.0), np.array(0.0)
        switched = True
        final_id = None
        for t in range(t_from, L + 1):
            Dp_t, Bp_t = Dp[t], Bp[t]
            e = states[1, :live]
            group_numel = Dp_t - states[2, :live]
            # the images (solve's expressions), sparse then dense, in one array each
            size = 2 * live
            if size == 0:
                return None
            cand_c = np.empty(size)
            cand_e = np.empty(size)
            cs, cd = cand_c[:live], cand_c[live:]
            es, ed = cand_e[:live], cand_e[live:]
            np.add(states[0, :live], Bp_t + c0 + c1 * Dp_t, out=cs)
            if c2:
                cs += c2_ * group_numel * np.log2(group_numel)
            ys = np.ceil(density_ * group_numel)  # k(D), exactly as selected_k computes it
            if clamp_k:
                np.maximum(ys, one_, out=ys)
            np.maximum(e, cs, out=es)
            ys *= beta_k_
            es += ys
            es += alpha_
            np.add(states[3, :live], Bp_t, out=cd)
            np.maximum(e, cd, out=ed)
            ed += alpha_d_ + beta_d_ * group_numel
            # rule 1: lower_bound(t, cand_c, cand_e), inline
            if t == L:
                candidate_bound = cand_e
            else:
                rest = rest_numel[t]
                saving = saving_list[t]
                network = cand_e + (alpha_min + sparse_bytes_time * rest)
                compute = cand_c + rest_cpu[t]
                candidate_bound = np.maximum(network, compute)
                np.minimum(candidate_bound, np.maximum(network + extra * rest,
                                                       compute - saving * rest),
                           out=candidate_bound)
                if extra + saving > 0:
                    d = compute - network
                    d /= extra + saving
                    np.maximum(d, zero_, out=d)
                    np.minimum(d, rest, out=d)
                    more_network = extra_ * d
                    more_network += network
                    d *= saving
                    np.subtract(compute, d, out=d)
                    np.maximum(more_network, d, out=more_network)
                    np.minimum(candidate_bound, more_network, out=candidate_bound)
            pool = None
            pool_c, pool_e = cand_c, cand_e
            if largest(candidate_bound) > limit:  # (else every candidate is viable)
                pool = (candidate_bound <= limit).nonzero()[0]
                pool_c, pool_e = cand_c[pool], cand_e[pool]
                size = pool.size
            if size > _PREFILTER_SIZE:
                kept = _undominated(pool_c, pool_e)
                if kept.size < size:
                    pool_c, pool_e = pool_c[kept], pool_e[kept]
                    pool = kept if pool is None else pool[kept]
                    size = kept.size
            if size > 1:  # _pareto_front, without the e of states the beam drops
                order = pool_c.argsort(kind="stable")
                second = pool_e[order]
                keep = np.empty(size, dtype=bool)
                keep[0] = True
                np.less(second[1:], np.minimum.accumulate(second)[:-1] - tie_, out=keep[1:])
                chosen = order[keep]
                new_c = pool_c[chosen]
                if chosen.size > 1:
                    distinct = np.empty(chosen.size, dtype=bool)
                    distinct[-1] = True
                    np.greater(new_c[1:] - new_c[:-1], tie_, out=distinct[:-1])
                    if np.count_nonzero(distinct) < chosen.size:
                        chosen, new_c = chosen[distinct], new_c[distinct]
            else:
                chosen = np.zeros(size, np.int64)
                new_c = pool_c
            if pool is not None:
                chosen = pool[chosen]  # back to candidate numbers
            if chosen.size > beam:
                # keep the most promising states, still sorted by c
                best = candidate_bound[chosen].argsort(kind="stable")[:beam]
                best.sort()
                chosen, new_c = chosen[best], new_c[best]
            new_e = cand_e[chosen]
            count = chosen.size
            self.beam_states[t] = (new_c, new_e)
            first_ids.append(next_id)
            parents.append(ids[chosen % live])  # (candidates below 2 * live)
            modes.append(chosen >= live)
            if t == L:
                if count == 0:
                    return None  # the beam dropped every state that beats the bound
                final_id = next_id + int(np.argmin(new_e))  # first minimum wins ties
                break

            since_prune += 1
            if since_prune == prune_every:
                since_prune = 0
                before = live
                live, keep = self._prune(states, ids, live, cs, cd, return_keep=True)
                if live > self.beam_live:
                    dense_bound = candidate_bound[before:]
                    sparse_c = cs
                    if keep is not None:
                        dense_bound, sparse_c = dense_bound[keep], sparse_c[keep]
                    live = self._thin_beam(states, ids, live, t, dense_bound, sparse_c)
            elif switched and live > self.beam_live:
                switched = False  # an exact search just turned into a beam
                live = self._thin_beam(states, ids, live, t, candidate_bound[live:], cs)
            if count == 0:  # every state of this prefix is beyond the bound
                continue
            end = live + count
            if end > ids.size:
                states, ids = _grown(states, ids, live, end)
            np.subtract(new_c, Bp_t + c1 * Dp_t, out=states[0, live:end])
            states[1, live:end] = new_e
            states[2, live:end] = Dp_t
            np.subtract(new_c, Bp_t, out=states[3, live:end])
            ids[live:end] = np.arange(next_id, next_id + count)
            next_id += count
            live = end

        return self._reconstruct(final_id, first_ids, self.targets, parents, modes)

    def _prune(self, states, ids, live, cs, cd, return_keep=False):
        """Rules 2 and 3 for the current target; compacts the columns, returns the count
        (with ``return_keep``, and the mask of the columns kept, or None if all are).

        ``cs``/``cd`` are the sparse/dense compute images ``c'`` of the live states for
        the current target.
        """
        e, prefix_numel = states[1, :live], states[2, :live]
        images = cs if cd is None else cd  # the dense c' is the smaller one
        # columns are in prefix order, so the newest prefix's front is the last block
        newest = int(prefix_numel.searchsorted(prefix_numel[-1]))
        # rule 2: a state with smaller c of the same prefix (the column before, if it has
        # the same prefix) dominates this one's image as soon as its e <= this one's c'
        keep = np.empty(live, dtype=bool)
        keep[0] = True
        np.logical_or(
            prefix_numel[1:] != prefix_numel[:-1], e[:-1] > images[1:], out=keep[1:]
        )
        # rule 3: a state B of a later prefix with c'_B <= c'_A and e_B <= c'_A
        dropped = _dominated_by_later(cs, e, newest)
        if cd is not None:
            dropped &= _dominated_by_later(cd, e, newest)
        keep &= ~dropped
        kept = int(np.count_nonzero(keep))
        if kept < live:
            states[:, :kept] = states[:, :live][:, keep]
            ids[:kept] = ids[:live][keep]
        if return_keep:
            return kept, (keep if kept < live else None)
        return kept

    def _beam_select(self, t, cand_c, cand_e, beam, limit):
        """Beam mode: of the candidates whose lower bound is within ``limit``, the
        (at most) ``beam`` non-dominated ones with the least bound, sorted by ``c``
        (a heuristic; every one is an actual grouping's state). Looks at the
        ``_BEAM_PICK * beam`` candidates with the least bound only: dominated ones have
        no smaller bound than the candidate that dominates them, so few are lost. The
        few are handled in Python (numpy calls on tiny arrays cost more)."""
        bound = self.lower_bound(t, cand_c, cand_e)
        few = _BEAM_PICK * beam
        if bound.size > few:
            pick = np.argpartition(bound, few)[:few]
        else:
            pick = np.arange(bound.size)
        c_list = cand_c[pick].tolist()
        e_list = cand_e[pick].tolist()
        b_list = bound[pick].tolist()
        # by c, equal c by candidate number (the stable order of _pareto_front)
        items = sorted(zip(c_list, pick.tolist(), e_list, b_list))
        tie = self.tie
        front = []
        least_e = math.inf
        for item in items:
            if item[3] <= limit:
                e = item[2]
                if e < least_e - tie:
                    front.append(item)
                if e < least_e:
                    least_e = e
        # of states whose c is equal up to the tie, only the later one (as _pareto_front)
        front = [item for k, item in enumerate(front)
                 if k + 1 == len(front) or front[k + 1][0] - item[0] > tie]
        if len(front) > beam:
            best = sorted(sorted(range(len(front)), key=lambda k: front[k][3])[:beam])
            front = [front[k] for k in best]
        chosen = np.array([item[1] for item in front], dtype=np.int64)
        return (chosen, np.array([item[0] for item in front]),
                np.array([item[2] for item in front]))

    def _thin_beam(self, states, ids, live, t, dense_bound=None, sparse_c=None):
        """Beam mode only: keep the ``beam_live`` live states whose images at target
        ``t`` have the least lower bound (in prefix order); a heuristic, like the beam.
        ``dense_bound`` and ``sparse_c``: the bounds of the live states' dense images and
        their sparse images' ``c`` at ``t``, where the caller has them (the same values,
        by the same expressions; :meth:`_dense_beam`)."""
        inst = self.inst
        c0, c1, c2 = inst.topk.c0, inst.topk.c1, inst.topk.c2
        Dp_t = float(self.numel_prefix[t])
        Bp_t = float(self.backward_prefix[t])
        rows = states[:, :live]
        numel = Dp_t - rows[2]
        if sparse_c is not None:
            c = sparse_c
        else:
            c = rows[0] + (Bp_t + c0 + c1 * Dp_t)
            if c2:
                c += c2 * numel * np.log2(numel)
        k = np.maximum(1.0, np.ceil(inst.density * numel))
        e = np.maximum(rows[1], c) + (inst.comm.alpha_s + _entry_time(inst) * k)
        bound = self.lower_bound(t, c, e)
        if inst.dense is not None:
            if dense_bound is None:
                cd = rows[3] + Bp_t
                ed = np.maximum(rows[1], cd) + (
                    inst.dense.alpha_s + inst.dense.beta_s_per_byte * inst.value_bytes * numel
                )
                dense_bound = self.lower_bound(t, cd, ed)
            np.minimum(bound, dense_bound, out=bound)
        keep = bound.argsort(kind="stable")[:self.beam_live]
        keep.sort()
        states[:, :keep.size] = rows[:, keep]
        ids[:keep.size] = ids[:live][keep]
        return keep.size

    @staticmethod
    def _reconstruct(final_id, first_ids, targets, parents, modes):
        parent = np.concatenate(parents)
        dense = np.concatenate(
            [np.zeros(p.size, bool) if m is None else m for p, m in zip(parents, modes)]
        )
        # first_ids[i + 1] is the first id created for targets[i]
        prefix_starts = np.asarray(first_ids[1:], dtype=np.int64)
        bounds = []
        flags = []
        state = final_id
        while state > 0:
            target_index = int(np.searchsorted(prefix_starts, state, side="right")) - 1
            bounds.append(int(targets[target_index]))
            flags.append(bool(dense[state]))
            state = int(parent[state])
        return tuple(reversed(bounds)), tuple(reversed(flags))


# The backward search retires live states (its rules 2 and 3) at every this many
# suffix starts.
_RETIRE_EVERY = 8

# Candidate sets larger than this are thinned by _undominated before the sort.
_PREFILTER_SIZE = 2048


def _join_values(front_y, front_g, size, c, e):
    """Per prefix state ``(c, e)``: the best plan time ``max(e + Ys, c + G)`` over the first
    ``size`` states of a suffix front sorted by ``Ys`` ascending (``G`` descending), and
    the index of the suffix state that gives it. The optimum is where ``Ys - G`` crosses
    ``c - e``: the state at the crossing or the one before it (inf where there is none).
    """
    cut = (front_y - front_g).searchsorted(c - e)
    last = size - 1
    above = e + front_y[np.minimum(cut, last)]
    above[cut > last] = math.inf
    below = c + front_g[np.maximum(cut - 1, 0)]
    below[cut == 0] = math.inf
    return np.minimum(above, below), np.where(above <= below, cut, cut - 1)


def _undominated(first, second):
    """Indices of the candidates that survive a cheap dominance test (for large sets).

    The candidates are put in buckets by ``first`` (a fixed grid from its minimum to its
    maximum; a lower bucket means a strictly smaller ``first``, since the rounded
    mapping is monotone), and a candidate ``i`` is dropped when some candidate ``a`` of
    a lower bucket has ``second[a] <= second[i]``. This changes nothing that
    :func:`_pareto_front` returns: sorted by ``first``, ``a`` comes before ``i``, so
    ``i`` would not be kept (its ``second`` is not below ``second[a] - tie``); and for
    every later candidate the running minimum of ``second`` before it includes
    ``second[a] <= second[i]``, so removing ``i`` leaves that minimum as it was. The
    result is the same as without the test; only the sort is smaller.
    """
    low = float(np.minimum.reduce(first))
    high = float(np.maximum.reduce(first))
    if not high > low:
        return np.arange(first.size)
    buckets = max(64, first.size // 4)
    index = ((first - low) * ((buckets - 1) / (high - low))).astype(np.intp)
    lowest = np.full(buckets + 1, np.inf)
    np.minimum.at(lowest, index + 1, second)
    np.minimum.accumulate(lowest, out=lowest)  # lowest[b]: over the buckets below b
    return (lowest[index] > second).nonzero()[0]


def _pareto_front(first, second, order, tie):
    """The Pareto front of candidate states ``(first, second)`` (both to be minimised),
    given ``order``, the candidates sorted by ``first`` with ties in the order that
    should win. A state is kept when its ``second`` is clearly (by more than ``tie``)
    below that of every state before it; of states whose ``first`` is equal up to
    ``tie`` only the later one (smaller ``second``) is kept. Returns the kept candidates'
    indices and their ``first`` and ``second``, in front order."""
    second_sorted = second[order]
    keep = np.empty(order.size, dtype=bool)
    keep[0] = True
    np.less(second_sorted[1:], np.minimum.accumulate(second_sorted)[:-1] - tie, out=keep[1:])
    chosen = order[keep]
    new_second = second_sorted[keep]
    new_first = first[chosen]
    if chosen.size > 1:
        distinct = np.empty(chosen.size, dtype=bool)
        distinct[-1] = True
        np.greater(new_first[1:] - new_first[:-1], tie, out=distinct[:-1])
        if np.count_nonzero(distinct) < chosen.size:
            chosen, new_first, new_second = chosen[distinct], new_first[distinct], new_second[distinct]
    return chosen, new_first, new_second


def _dominated_by_later(images, e, newest):
    """States whose image is dominated, now and for every later target, by the image of a
    state of a later prefix (rule 3): some B with ``c'_B <= c'_A`` and ``e_B <= c'_A``.

    Two cheap sufficient searches for such a B (columns are in prefix order):

    * among compute-bound states (``e_B <= c'_B``), any later one with ``c'_B <= c'_A``
      (a running minimum from the right);
    * among the newest prefix's front (sorted by c, so ``c'`` ascends and ``e``
      descends), the state with the largest ``c'_B <= c'_A`` has the smallest ``e_B``.
    """
    size = images.size
    later_min = np.where(e <= images, images, np.inf)
    later_min = np.minimum.accumulate(later_min[::-1])[::-1]
    dropped = np.zeros(size, dtype=bool)
    # a compute-bound B at or after A's column: it must be at a later prefix, since the
    # states after A in its own prefix have larger c
    np.less_equal(later_min[1:], images[:-1], out=dropped[:-1])
    if 0 < newest < size:
        older = images[:newest]
        front = images[newest:]
        best = front.searchsorted(older, side="right")
        best -= 1
        # where no c'_B <= c'_A, best is -1: front[0] > c'_A then, so (clipped to 0)
        # the test below fails there as it should
        np.maximum(best, 0, out=best)
        found = e[newest:][best] <= older
        found &= front[best] <= older
        dropped[:newest] |= found
    return dropped


# ---------------------------------------------------------------------------
# the exact search, from the last unit backwards


class _SuffixSearch:
    """Exact minimum of the predicted iteration time, by a DP over suffixes.

    **Suffix states.** Group the units ``s..L-1`` by some plan and start its timeline at
    ``c = e = 0``. Two numbers describe that suffix plan completely:

    * ``Ys``, the sum of its collectives' times (the network work still to do), and
    * ``G``, its own final network time (``e_m`` of the suffix alone).

    Put in front of it a prefix that ends in state ``(c, e)``; the final network time is
    ``max(e + Ys, c + G)`` (the network is either busy to the end from ``e``, or it waits
    for the compute stream at some group, after which the suffix runs as it would from
    ``(c, c)``: ``e_m = max_j (P_j + S_j)`` with ``P_j`` the compute prefix sum up to and
    ``S_j`` the network suffix sum from group ``j``, a two-machine flow shop in a fixed
    order). Prepending one group ``s..t-1`` (compute ``X``, collective ``Y``) to a
    suffix plan at ``t`` gives ``(Y + Ys, X + max(Y + Ys, G))``: both coordinates grow
    with ``Ys`` and with ``G``, so at every ``s`` only the Pareto front of
    non-dominated ``(Ys, G)`` pairs matters, and the optimum is the smallest ``G`` at
    ``s = 0``. It is the mirror image of the forward search of :class:`_FrontierSearch`
    and exact for the same reason.

    **Why backwards.** ``Ys`` does not depend on the top-k cost at all: for sparse groups
    it is ``m * alpha`` plus the bytes of the selected entries, nearly the same for all
    suffix plans with the same number of groups ``m``. The fronts therefore stay small
    (a few states per suffix, however large ``c2``), whereas the forward fronts over
    ``(c, e)`` grow with every distinct ``c2 * D log D`` sum.

    **Pruning** (none of it removes a state that could still lead to a plan at least as
    good as ``upper_bound``, the time of a known plan):

    1. *Bound.* A prefix ending at ``s`` has ``c >= C(s)`` and ``e >= E(s)`` (lower
       bounds: its backward, plus the per-element top-k of units that might be sparse
       and one ``c0``; and one collective after that, all its bytes at the cheapest
       rate, or :func:`_prefix_network_floor`, whichever is largest), so a candidate
       whose ``max(E(s) + Ys, C(s) + G)`` exceeds the bound is not stored.
    2. *Retirement.* A live state at ``t`` yields a candidate at every ``s < t``. For
       group ``s..t-1`` and every plan through it, the final time is at least
       ``M(s) = max(C0(s) + X + max(Y + Ys, G), R(s) + Y0 + Ys)`` (``C0`` is ``C``
       less one ``c0``, or the sum of the prefix's one-unit top-k terms without
       ``c0`` where that is more; ``Y0`` is ``Y`` without the rounding up of ``k``;
       ``R(s)`` prices the prefix's bytes at the cheapest rate). ``M(s)`` bounds the
       plans through every group ``s'..t-1`` with ``s' <= s``, not only ``s``: ``Y``
       and ``Y0`` grow at least as fast as ``R`` shrinks, ``X`` at least as fast as the
       one-unit sums shrink (``D log D`` is superadditive), and with ``f(D) = c1 D +
       c2 D log2 D`` (superadditive) and ``lt`` the least top-k time of a prefix,
       ``lt(s) <= lt(s') + c0 + f(D(s'..s))`` and ``X(s'..t) >= B(s'..s) + X(s..t) +
       f(D(s'..s))``, so ``C(s') + X(s'..t) >= C(s) - c0 + X(s..t)``. Once ``M``
       exceeds the bound in every mode, the state is dropped for good.
    3. *Same suffix.* For two states of one front with ``Ys_B < Ys_A`` (so
       ``G_B > G_A``), once ``G_B <= Y + Ys_A`` for the group ``s..t-1`` (in both modes),
       ``B``'s image is no worse than ``A``'s in both coordinates, and stays so for
       every later (smaller) ``s``, since ``Y`` only grows: ``A`` is dropped.

    Rules 2 and 3 are permanent, so they run every :data:`_RETIRE_EVERY` suffix starts
    only: a state they would have dropped earlier only yields a few more candidates,
    which can neither lead below the bound (rule 2) nor beat those of the state that
    dominates it (rule 3).

    **Join to known prefixes.** Given ``prefix_states`` (actual groupings' ``(c, e)``
    per prefix, e.g. the beam's), every front created at ``s`` is joined to the states
    known at ``s``: ``max(e + Ys, c + G)`` is an actual plan's time, so the bound drops
    to the least one seen (plus a tie against rounding) and prunes the rest of the
    search. The plan is still the one this search finds at ``s = 0``, which the tighter
    bound never excludes (it is never below the optimum).

    **Join to exact prefixes.** Given ``exact_prefix``, a forward search whose exact
    fronts (:attr:`_FrontierSearch.exact_fronts`) cover every prefix ``0..r``, the
    suffix starts ``s <= r`` are not searched. Every plan has a last boundary ``s <= r``
    and its next boundary ``t > r``; its part before ``s`` is (or is dominated by) a
    state of the exact front at ``s``, and its part from ``s`` on is a candidate of this
    search at ``s`` made from a live state at ``t`` (or is dominated by one). So from
    ``s = r`` down to 0 the candidates are only priced against the exact front at ``s``
    (``max(e + Ys, c + G)``, least where ``Ys - G``, ascending along the candidates'
    front, crosses ``c - e``: one binary search per prefix state) and not stored; the
    live set stops growing at ``r`` and only shrinks, and the plan is the best priced
    one (the first ``s`` and prefix state win ties). A search that stops there for its
    budget reports ``stopped_at = r``: a forward search joined to it stores its own
    states up to ``r``, since no fronts are created below.

    Ties: states whose times differ by less than ``tie`` are equal; the Pareto front is
    taken with a stable sort over candidates in a fixed order (live states in order of
    creation, sparse before dense), so the plan depends only on the instance.
    """

    def __init__(
        self,
        inst: Instance,
        upper_bound: float,
        budget: Optional[int] = None,
        least_topk: Optional[np.ndarray] = None,
        network_floor: Optional[np.ndarray] = None,
        prefix_states=None,
        exact_prefix: Optional["_FrontierSearch"] = None,
    ):
        """``least_topk``: :func:`_least_topk_time` of the instance, and
        ``network_floor``: :func:`_prefix_network_floor`, when the caller has them
        already (they are the same for every search of one instance).
        ``prefix_states``: per prefix ``s``, ``None`` or arrays ``(c, e)`` of states of
        actual groupings of ``0..s-1`` (the beam's), which tighten the bound on the way
        (:attr:`best_found`). ``exact_prefix``: a forward search, run with a bound no
        lower than ``upper_bound``, whose :attr:`_FrontierSearch.exact_fronts` reach
        prefix ``r``; the suffix starts ``s <= r`` are then joined to them instead of
        searched (*Join to exact prefixes* in the class docstring)."""
        self.inst = inst
        self.upper_bound = float(upper_bound)
        self.prefix_states = prefix_states
        self.exact_prefix = exact_prefix
        # the exact prefix fronts reach join_to: every front at 0..join_to is there
        self.join_to = -1
        if exact_prefix is not None:
            while self.join_to + 1 in exact_prefix.exact_fronts:
                self.join_to += 1
        self.used_join = False  # whether the plan found is a joined one
        # the least time of a plan seen so far (a known prefix + a suffix state), plus a tie
        self.best_found = math.inf
        # per suffix start s: (Ys, G, ids) of the front created there (sorted by Ys, so
        # Ys - G ascends); a search out of budget sets stopped_at, the s it did not finish
        self.fronts = {}
        self.stopped_at = None
        self.chains = None
        self._steps = None
        self._result = None
        self.budget = budget
        L = inst.num_units
        numel, backward, self.numel_prefix, self.backward_prefix = _unit_arrays(inst)
        self.tie = _RELATIVE_TIE * _time_scale(inst)
        self.min_numel = float(numel.min())
        self.outcome = None
        self.examined = 0
        c1, c2 = inst.topk.c1, inst.topk.c2
        topk_prefix = np.concatenate(([0.0], np.cumsum((c1 + c2 * np.log2(numel)) * numel)))
        sparse_rate = (
            inst.comm.beta_s_per_byte * (inst.value_bytes + inst.index_bytes) * inst.density
        )
        if inst.dense is None:
            self.alpha_min = inst.comm.alpha_s
            self.cheapest_rate = sparse_rate
            compute_no_c0 = self.backward_prefix + topk_prefix
            if least_topk is None:
                least_topk = _least_topk_time(inst, self.numel_prefix)
            compute = self.backward_prefix + least_topk
            # less one c0, the least compute bounds every group s'..t-1 with s' <= s
            # (rule 2); it is never below the one-unit sums
            np.maximum(compute_no_c0, compute - inst.topk.c0, out=compute_no_c0)
            compute_no_c0[0] = 0.0
        else:
            dense_rate = inst.dense.beta_s_per_byte * inst.value_bytes
            self.alpha_min = min(inst.comm.alpha_s, inst.dense.alpha_s)
            self.cheapest_rate = min(sparse_rate, dense_rate)
            compute_no_c0 = self.backward_prefix.copy()
            compute = compute_no_c0
        self.sparse_rate = sparse_rate
        network = np.maximum(
            compute + self.alpha_min, self.alpha_min + self.cheapest_rate * self.numel_prefix
        )
        compute = compute.copy()
        if inst.dense is None:
            # the fewest bytes: one group (k rounds up at most once)
            # (shrunk by 1e-12 first: float rounding must not push the ceil up)
            one_group = inst.comm.alpha_s + _entry_time(inst) * np.maximum(
                1.0, np.ceil(inst.density * self.numel_prefix * (1.0 - 1e-12))
            )
            np.maximum(network, one_group, out=network)
        # a state at t reached through any group s..t-1 has compute >= compute[t]
        self.compute_at = compute.copy()
        if network_floor is None:
            network_floor = _prefix_network_floor(
                inst, self.numel_prefix, self.backward_prefix, compute
            )
        np.maximum(network, network_floor, out=network)
        network[0] = compute[0] = 0.0  # the empty prefix
        self.prefix_compute = compute.tolist()
        self.prefix_network = network.tolist()
        self.prefix_compute_no_c0 = compute_no_c0.tolist()
        self.prefix_bytes = (self.cheapest_rate * self.numel_prefix).tolist()

    def solve(self) -> Optional[Tuple[Tuple[int, ...], Tuple[bool, ...]]]:
        """(group end prefixes, dense flags) of an optimal plan; None past the budget
        (then :meth:`resume` can go on from where it stopped)."""
        if self._steps is None:
            self._steps = self._search()
        elif self.outcome != "budget":
            return self._result  # finished: the same answer again
        self._result = next(self._steps)
        return self._result

    def resume(self, extra_budget: int, upper_bound: float = math.inf):
        """Go on after the budget ran out, with ``extra_budget`` more candidates and the
        bound lowered to ``upper_bound`` if that is less (a later bound of an actual
        plan; nothing found so far is lost); returns as :meth:`solve`."""
        assert self.outcome == "budget"
        self.budget += extra_budget
        self.upper_bound = min(self.upper_bound, float(upper_bound))
        self._result = next(self._steps)
        return self._result

    def _search(self):
        """The search as a generator: yields None each time the budget runs out, and
        finally the result of :meth:`solve`."""
        inst = self.inst
        L = inst.num_units
        Dp = self.numel_prefix
        Bp = self.backward_prefix
        c0, c1, c2 = inst.topk.c0, inst.topk.c1, inst.topk.c2
        alpha = inst.comm.alpha_s
        beta_k = inst.comm.beta_s_per_byte * (inst.value_bytes + inst.index_bytes)
        density = inst.density
        sparse_rate = self.sparse_rate
        has_dense = inst.dense is not None
        if has_dense:
            alpha_d = inst.dense.alpha_s
            beta_d = inst.dense.beta_s_per_byte * inst.value_bytes
        tie = self.tie
        # every dominance decision may lose up to `tie`, once per group: the optimum is
        # within L ties of the bound even when the bound is the optimum itself
        limit = self.upper_bound + tie * (L + 2)
        budget = self.budget if self.budget is not None else math.inf

        # live states, in order of creation (so by decreasing suffix start t; each
        # front sorted by Ys): suffix start, Ys, G, id, and the numel and backward
        # prefix sums at the suffix start (Dp[T], Bp[T]); the first `live` entries of
        # buffers that grow by doubling, so that a suffix start appends its front
        # instead of copying every live state
        buf_t = np.full(64, L, np.int64)
        buf_y = np.zeros(64)
        buf_g = np.zeros(64)
        buf_id = np.zeros(64, np.int64)
        buf_dp = np.full(64, Dp[L])
        buf_bp = np.full(64, Bp[L])
        buffers = [buf_t, buf_y, buf_g, buf_id, buf_dp, buf_bp]
        live = 1
        # per id: the start of its suffix, its parent's id and its first group's mode
        starts: List[np.ndarray] = [np.array([L], np.int64)]
        parents: List[np.ndarray] = [np.array([-1], np.int64)]
        modes: List[np.ndarray] = [np.zeros(1, bool)]
        # for a forward search that joins these fronts (see :attr:`fronts`)
        self.chains = (starts, parents, modes)
        next_id = 1
        examined = 0
        final_id = -1
        join_to = self.join_to
        exact_fronts = self.exact_prefix.exact_fronts if join_to >= 0 else None
        best_join = math.inf
        joined = None  # (s, prefix state id, first group's end, its suffix id, dense)

        for s in range(L - 1, -1, -1):
            if live == 0:
                break
            T, YS, G, ID = buf_t[:live], buf_y[:live], buf_g[:live], buf_id[:live]
            D = buf_dp[:live] - Dp[s]
            Bg = buf_bp[:live] - Bp[s]
            xs = Bg + (c0 + c1 * D)
            if c2:
                xs += c2 * D * np.log2(D)
            ks = np.ceil(density * D)  # k(D), as selected_k computes it
            if density * self.min_numel < 1.0:
                np.maximum(ks, 1.0, out=ks)
            ys = alpha + beta_k * ks
            ys_sum = ys + YS
            gs = xs + np.maximum(ys_sum, G)
            if has_dense:
                yd = alpha_d + beta_d * D
                yd_sum = yd + YS
                gd = Bg + np.maximum(yd_sum, G)
                cand_y = np.concatenate((ys_sum, yd_sum))
                cand_g = np.concatenate((gs, gd))
            else:
                cand_y, cand_g = ys_sum, gs
            size = cand_y.size
            examined += size
            self.examined = examined
            while examined > budget:
                self.outcome = "budget"
                # (no fronts are created at s <= join_to: a forward search joined to
                # this one must store its states up to there)
                self.stopped_at = max(s, join_to)
                yield None
                budget = self.budget  # resumed: the candidates at s are still here
                limit = min(limit, self.upper_bound + tie * (L + 2))
                self.outcome = None
                self.stopped_at = None

            # rule 1: only candidates that can still beat the known plan
            if s > 0:
                viable = np.maximum(
                    cand_y + self.prefix_network[s], cand_g + self.prefix_compute[s]
                ) <= limit
            else:
                viable = cand_g <= limit
            pool = viable.nonzero()[0]
            count = pool.size
            if count > _PREFILTER_SIZE:
                kept = _undominated(cand_y[pool], cand_g[pool])
                if kept.size < count:
                    pool = pool[kept]
                    count = pool.size
            if count > 1:
                py, pg = cand_y[pool], cand_g[pool]
                # by Ys, equal Ys by G, then first come
                chosen, new_y, new_g = _pareto_front(py, pg, np.lexsort((pg, py)), tie)
                chosen = pool[chosen]
            else:
                chosen = pool
                new_y, new_g = cand_y[pool], cand_g[pool]
            count = chosen.size
            if s <= join_to:
                # every plan has a last boundary s <= join_to, after which its next
                # boundary is a live state's start t > join_to: price these candidates
                # against the exact prefix front at s (the least max(e + Ys, c + G) is
                # where Ys - G, ascending along the front, crosses c - e); none is stored
                pc, pe, first_id = exact_fronts[s]
                if count and pc.size:
                    value, pick = _join_values(new_y, new_g, count, pc, pe)
                    i = int(value.argmin())
                    if value[i] < best_join:  # (the first s and prefix state win ties)
                        best_join = float(value[i])
                        j = int(pick[i])
                        k = int(chosen[j])
                        src = k - live if k >= live else k
                        joined = (s, first_id + i, int(T[src]), int(ID[src]), k >= live)
                        limit = min(limit, best_join + tie * (L + 2))
                        self.best_found = min(self.best_found, best_join + tie)
                if s == 0:
                    break
                count = 0  # nothing is stored
                new_y, new_g = new_y[:0], new_g[:0]
            elif count and s > 0 and self.prefix_states is not None:
                known = self.prefix_states[s]
                if known is not None and known[0].size:
                    # a known prefix ending at s + a suffix state: an actual plan's time,
                    # so a bound as valid as the first (one tie against rounding; the
                    # limit adds the ties this search may lose on the way)
                    pc, pe = known
                    found = float(np.minimum.reduce(np.maximum(
                        pe[:, None] + new_y[None, :], pc[:, None] + new_g[None, :]),
                        axis=None)) + tie
                    if found < self.best_found:
                        self.best_found = found
                        limit = min(limit, found + tie * (L + 2))
            if count:
                is_dense = chosen >= live
                source = chosen - live * is_dense
                ids = np.arange(next_id, next_id + count, dtype=np.int64)
                next_id += count
                starts.append(np.full(count, s, np.int64))
                parents.append(ID[source])
                modes.append(is_dense)
                self.fronts[s] = (new_y, new_g, ids)
            if s == 0:
                if count == 0:
                    self.outcome = "none"
                    yield None  # no plan within the bound
                    return
                final_id = int(ids[int(np.argmin(new_g))])  # first minimum wins ties
                break

            if s % _RETIRE_EVERY:
                # rules 2 and 3 are permanent, so they run every few suffix starts only
                if count:
                    buffers = self._append(buffers, live, s, new_y, new_g, ids)
                    buf_t, buf_y, buf_g, buf_id, buf_dp, buf_bp = buffers
                    live += count
                continue
            # rule 2: retire live states that can never again lead below the bound
            c_floor = self.prefix_compute_no_c0[s]
            c_at = self.compute_at[T]
            bytes_floor = self.prefix_bytes[s]
            alive = np.maximum(
                np.maximum(gs + c_floor, c_at + np.maximum(ys_sum, G)),
                (alpha + sparse_rate * D) + YS + bytes_floor,
            ) <= limit
            if has_dense:
                alive |= np.maximum(
                    np.maximum(gd + c_floor, c_at + np.maximum(yd_sum, G)), yd_sum + bytes_floor
                ) <= limit
            # rule 3: within one front, the state before (smaller Ys, larger G) dominates
            # this one from now on once its G <= Y + Ys of this one, in both modes
            if live > 1:
                y_min = np.minimum(ys, yd) if has_dense else ys
                dominated = (T[1:] == T[:-1]) & (G[:-1] <= y_min[1:] + YS[1:])
                alive[1:] &= ~dominated
            kept = int(np.count_nonzero(alive))
            if kept < live:
                for buf in buffers:
                    buf[:kept] = buf[:live][alive]
                live = kept
            if count:
                buffers = self._append(buffers, live, s, new_y, new_g, ids)
                buf_t, buf_y, buf_g, buf_id, buf_dp, buf_bp = buffers
                live += count

        if join_to >= 0:
            if joined is None:
                self.outcome = "none"
                yield None  # no plan within the bound
                return
            s, prefix_id, end, suffix_id, dense_flag = joined
            forward = self.exact_prefix
            first_ids, fparents, fmodes = forward.chains
            head = forward._reconstruct(prefix_id, first_ids, forward.targets, fparents, fmodes)
            tail = ((), ()) if suffix_id == 0 else self._reconstruct(
                suffix_id, starts, parents, modes, L)
            self.used_join = True
            self.outcome = "found"
            yield (head[0] + (end,) + tail[0], head[1] + (bool(dense_flag),) + tail[1])
            return
        if final_id < 0:
            self.outcome = "none"
            yield None  # every state was beyond the bound
            return
        self.outcome = "found"
        yield self._reconstruct(final_id, starts, parents, modes, L)

    def _append(self, buffers, live, s, new_y, new_g, ids):
        """The live-state buffers of :meth:`_search` (suffix start, Ys, G, id, numel and
        backward prefix sums at the start) with a front created at suffix start ``s``
        stored after the first ``live`` entries (doubled first where full)."""
        end = live + ids.size
        if end > buffers[0].size:
            grown = []
            for buf in buffers:
                bigger = np.empty(2 * end, buf.dtype)
                bigger[:live] = buf[:live]
                grown.append(bigger)
            buffers = grown
        buf_t, buf_y, buf_g, buf_id, buf_dp, buf_bp = buffers
        buf_t[live:end] = s
        buf_y[live:end] = new_y
        buf_g[live:end] = new_g
        buf_id[live:end] = ids
        buf_dp[live:end] = self.numel_prefix[s]
        buf_bp[live:end] = self.backward_prefix[s]
        return buffers

    @staticmethod
    def _reconstruct(final_id, starts, parents, modes, L):
        start = np.concatenate(starts)
        parent = np.concatenate(parents)
        dense = np.concatenate(modes)
        bounds, flags = [], []
        state = final_id
        while True:
            up = int(parent[state])
            if up < 0:
                break
            bounds.append(int(start[up]))
            flags.append(bool(dense[state]))
            state = up
        assert bounds and bounds[-1] == L
        return tuple(bounds), tuple(flags)


def _entry_time(inst: Instance) -> float:
    """Seconds per selected entry (value and index) of a sparse collective."""
    return inst.comm.beta_s_per_byte * (inst.value_bytes + inst.index_bytes)


def _prefix_network_floor(inst: Instance, numel_prefix, backward_prefix, least_compute):
    """For every prefix ``t``: a lower bound ``E[t]`` of the network end ``e`` of any
    grouping (and any modes) of units ``0..t-1`` (``E[0] = 0``).

    ``least_compute[s]`` must be a lower bound of the compute end of every grouping of
    ``0..s-1``. The last group ``s..t-1`` of a grouping maps its state ``(c, e)`` at
    ``s`` to ``e' = max(e, c + X) + Y``, which grows with ``c`` and ``e``; so
    ``E[t] = min_s max(E[s], least_compute[s] + X) + Y`` over every ``s < t`` and mode is
    a lower bound by induction. Unlike a bound of the network work alone, it sees that a
    collective cannot start before its group's compute is done, which is what makes
    network-bound instances' suffix fronts small. Shrunk by ``1e-12`` against float
    rounding (the searches compare with a tolerance of many ties anyway).
    """
    L = numel_prefix.size - 1
    topk = inst.topk
    c0, c1, c2 = topk.c0, topk.c1, topk.c2
    beta_k = inst.comm.beta_s_per_byte * (inst.value_bytes + inst.index_bytes)
    density = inst.density
    has_dense = inst.dense is not None
    floor = np.zeros(L + 1)
    # least_compute[s] + X(s..t-1) = shifted[s] + (B(0..t) + c0 + c1 * D(0..t)) + c2 term
    shifted = least_compute - backward_prefix - c1 * numel_prefix
    for rows, D in _row_blocks(numel_prefix):
        # per block of targets, everything that does not depend on the floor at once
        # (masked entries, s >= t, are +inf); then three operations per target and mode
        width = D.shape[1]
        masked = _row_mask(rows, width)
        compute = shifted[None, :width] + (
            backward_prefix[rows] + c0 + c1 * numel_prefix[rows])[:, None]
        if c2:
            compute += c2 * D * np.log2(D)
        compute[masked] = math.inf
        k = np.ceil(density * D)
        np.maximum(k, 1.0, out=k)
        extra = inst.comm.alpha_s + beta_k * k
        if has_dense:
            dense_compute = least_compute[None, :width] + (
                backward_prefix[rows, None] - backward_prefix[None, :width])
            dense_compute[masked] = math.inf
            dense_extra = inst.dense.alpha_s + inst.dense.beta_s_per_byte * (
                inst.value_bytes * D)
        source = floor[:width]
        for i, t in enumerate(rows.tolist()):
            e = np.maximum(source, compute[i])
            e += extra[i]
            best = np.minimum.reduce(e)
            if has_dense:
                e = np.maximum(source, dense_compute[i])
                e += dense_extra[i]
                best = min(best, np.minimum.reduce(e))
            floor[t] = best
    floor *= 1.0 - 1e-12
    return floor


# Targets per block of the prefix network floor's recursion (_row_blocks).
_ROW_BLOCK = 64


def _row_blocks(numel_prefix):
    """Blocks of targets ``rows`` (``1..L``) with ``D[i, s] = numel_prefix[rows[i]] -
    numel_prefix[s]`` for ``s < rows[-1]``; entries with ``s >= rows[i]`` are set to 1
    (callers mask them with :func:`_row_mask`), so logarithms stay finite."""
    L = numel_prefix.size - 1
    for a in range(1, L + 1, _ROW_BLOCK):
        rows = np.arange(a, min(a + _ROW_BLOCK, L + 1))
        width = int(rows[-1])
        D = numel_prefix[rows, None] - numel_prefix[None, :width]
        D[D <= 0.0] = 1.0
        yield rows, D


def _row_mask(rows, width):
    """True where a column ``s`` is not before the row's target (``s >= t``)."""
    return np.arange(width)[None, :] >= rows[:, None]


def _least_topk_time(inst: Instance, numel_prefix) -> np.ndarray:
    """For every prefix ``t``: the least total top-k time of any grouping of units
    ``0..t-1`` into sparse groups (``least[0] = 0``).

    With ``c2 = 0`` one group is best (``c0 + c1 * D``); otherwise a DP over the last
    group's start, ``least[t] = min_s least[s] + t_s(D(s..t))``.
    """
    topk = inst.topk
    L = numel_prefix.size - 1
    if topk.c2 == 0.0:
        least = topk.c0 + topk.c1 * numel_prefix
        least[0] = 0.0
        return least
    least = np.zeros(L + 1)
    c0, c2 = topk.c0, topk.c2
    for t in range(1, L + 1):
        D = numel_prefix[t] - numel_prefix[:t]
        least[t] = np.minimum.reduce(least[:t] + c2 * D * np.log2(D)) + c0
    least += topk.c1 * numel_prefix
    return least


