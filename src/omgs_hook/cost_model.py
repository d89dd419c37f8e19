"""Cost model and iteration timeline of merged gradient sparsification (OMGS-SGD).

This module is pure Python (numpy is not even needed here) and never imports torch, so
the planner and the ``omgs-plan`` command start in milliseconds.

What is modelled
----------------
Backward produces gradients in *units* (DDP gradient buckets), listed in gradient-ready
order: unit 0 is ready first. Unit ``u`` has ``numel`` elements and takes ``backward_s``
seconds of the backward pass. A plan merges contiguous runs of units into *groups*
``G_1 .. G_m``. For every group, once all of its gradients exist, the device selects the
top-k entries of the group's gradient (plus error-feedback residual) and the network
all-gathers the k values and k indices of every rank.

With ``B_j`` the summed ``backward_s`` and ``D_j`` the summed ``numel`` of group ``G_j``:

* selected entries:   ``k(D) = max(1, ceil(density * D))``                (:func:`selected_k`)
* top-k time:         ``t_s(D) = c0 + c1 * D + c2 * D * log2(D)``         (:class:`TopkCost`)
* sparse collective:  ``t_c(D) = alpha + beta * k(D) * (value_bytes + index_bytes)``
  (:class:`LinearCost`; the bytes are what *each rank contributes* to the all-gather, so
  ``beta`` is the fitted cost per contributed byte at this world size)

The device runs backward and top-k serially on one stream, the network runs one
collective at a time in group order, and a group's collective starts once its top-k is
done and the previous collective has finished:

* compute:  ``c_0 = 0``,  ``c_j = c_{j-1} + B_j + t_s(D_j)``
* network:  ``e_0 = 0``,  ``e_j = max(e_{j-1}, c_j) + t_c(D_j)``
* ``predicted_iteration_s = forward_s + e_m + tail_s + level_s``
* ``non_overlapped_s = e_m - sum_j B_j`` (time the iteration spends on sparsification and
  communication beyond the backward pass itself)

``tail_s`` (optional, default 0) is everything from the end of the last collective to
the next forward pass: DDP's finalisation, the optimiser step, ``zero_grad`` and loading
the next batch. It is the same for every plan, so it never changes which plan is best;
it makes ``predicted_iteration_s`` comparable with a measured iteration (forward start
to forward start). The hook measures it while training. ``level_s`` (optional, default
0, either sign) is a constant as well: the level the hook's measured correction is
centred on (docs/design.md), never a phase of the step.

The hook also folds its own per-group work on the compute stream (assembling gradient +
residual, the NaN check, packing, issuing the collective) into the top-k cost it plans
with: that work has the same form, a fixed part per group plus a part per element (see
docs/cost-model.md).

Optional dense mode (beyond the paper): when the instance carries ``dense`` (a second
:class:`LinearCost` fitted for all-reduce), a group may instead be sent as a dense
all-reduce of its gradient: it then costs no top-k time (``c_j = c_{j-1} + B_j``) and
``t_d(D) = alpha_d + beta_d * value_bytes * D`` on the network (``value_bytes`` = 4 for
fp32 gradients). Without ``dense`` every group is sparse and the formulas above are
exact.

Optional two-level (hierarchical) mode: when the instance carries ``hierarchy``
(:class:`Hierarchy`: ``ranks_per_node`` L, and two link classes ``intra``/``inter``), the
W ranks form N = W / L nodes and every group runs the two-level exchange of
``omgs_hook.hierarchical``. A sparse group: an intra-node reduce-scatter, the top-k of
the rank's shard, a packed sparse all-gather among the N ranks with the same local rank,
and an intra-node all-gather of those N payloads. With ``S(D) = ceil(D / L)`` (every shard has S elements,
the last one padded) and ``k_h(D) = selected_k(S(D), density)``:

* compute:  ``c_j = c_{j-1} + B_j + t_rs(D_j) + t_s(S(D_j))``, with the reduce-scatter
  ``t_rs(D) = intra.alpha + intra.beta * value_bytes * S(D)`` (the hook waits for it on
  its own thread before the shard's top-k, so it sits on the compute stream);
* network:  ``e_j = max(e_{j-1}, c_j) + t_inter(D_j) + t_ag(D_j)``, with the sparse
  all-gather ``t_inter(D) = inter.alpha + inter.beta * k_h(D) * (value_bytes + index_bytes)``
  and the intra-node all-gather of the N payloads
  ``t_ag(D) = intra.alpha + intra.beta * N * k_h(D) * (value_bytes + index_bytes)``.

Both link classes are priced per byte *each rank contributes* (as ``comm``): for the
reduce-scatter that is the rank's shard (``value_bytes * S``: the shard it receives and,
in a ring, the volume it sends), for the all-gathers the payload it puts in. ``inter`` is
fitted with all L local ranks running their all-gathers at once (they share the node's
network link). Dense groups run the two-level dense path of the exchange: the same
reduce-scatter (compute side, ``t_rs(D)``), then on the network an all-reduce of the
shard among the nodes ``t_ar(D) = inter_dense.alpha + inter_dense.beta * value_bytes *
S(D)`` and the intra-node all-gather of the reduced shards ``t_agd(D) = intra.alpha +
intra.beta * value_bytes * S(D)``: ``c_j = c_{j-1} + B_j + t_rs(D_j)``, ``e_j =
max(e_{j-1}, c_j) + t_ar(D_j) + t_agd(D_j)``. ``inter_dense`` defaults to the flat
``dense`` cost scaled to the inter-node rings (:meth:`Instance.inter_dense_cost`).
:func:`relaxed_instance` gives the flat instance the planner searches for a
hierarchical one (docs/cost-model.md).

Instances are validated on construction; bad input raises :class:`InstanceError`, whose
message starts with the offending field, e.g. ``layers[2].numel: must be a positive
integer``.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

__all__ = [
    "InstanceError",
    "LinearCost",
    "TopkCost",
    "Unit",
    "Hierarchy",
    "Instance",
    "Timeline",
    "relaxed_instance",
    "hierarchical_instance",
    "selected_k",
    "simulate",
    "Schedule",
    "schedule",
    "check_groups",
    "check_dense",
    "step_inter_node_bytes",
]


# The most elements one sparse group may hold: its indices travel as int32. A plan's
# sparse groups never exceed it (planner._fit_index_range); read at use time, so that a
# test can lower it.
MAX_SPARSE_GROUP_NUMEL = 2**31 - 1


def index_range_pieces(numels):
    """Cut a sequence of element counts into consecutive runs of positions, each summing
    to at most :data:`MAX_SPARSE_GROUP_NUMEL` where it can (a count too large alone is a
    run of its own), each as long as fits. Used for plan groups (units) and for the
    exchange's groups (parameters)."""
    limit = MAX_SPARSE_GROUP_NUMEL
    pieces, piece, size = [], [], 0
    for i, n in enumerate(numels):
        if piece and size + n > limit:
            pieces.append(piece)
            piece, size = [], 0
        piece.append(i)
        size += n
    if piece:
        pieces.append(piece)
    return pieces


class InstanceError(ValueError):
    """Invalid planner input. ``field`` names the offending entry (``"layers[2].numel"``)."""

    def __init__(self, field: str, problem: str):
        self.field = field
        self.problem = problem
        super().__init__(f"{field}: {problem}")


# ---------------------------------------------------------------------------
# validation helpers: each returns the cleaned value or raises InstanceError(field)


def _number(value, field: str, *, positive: bool = False, signed: bool = False) -> float:
    """A finite, non-negative (strictly positive with ``positive``, of either sign with
    ``signed``) real number; bools are rejected."""
    # bool is an Integral in Python; `true` in JSON is never a meaningful time or rate.
    # (exact float and int first: the ABC check costs microseconds, and the hook builds
    # instances of a thousand units on the training thread)
    if type(value) is not float and type(value) is not int and (
            isinstance(value, bool) or not isinstance(value, numbers.Real)):
        raise InstanceError(field, f"must be a number, got {_describe(value)}")
    try:
        value = float(value)
    except OverflowError:  # an integer no float holds (10**400 written out in JSON)
        raise InstanceError(field, _unrepresentable(value)) from None
    if not math.isfinite(value):
        raise InstanceError(field, f"must be finite, got {value!r}")
    if positive and value <= 0:
        raise InstanceError(field, f"must be positive, got {value!r}")
    if value < 0 and not signed:
        raise InstanceError(field, f"must be non-negative, got {value!r}")
    return value


#: integers from here on have no float: the planner's arithmetic on them overflows
_FLOAT_INT_LIMIT = 2 ** 1024


def _unrepresentable(value) -> str:
    return f"must be a finite number, got an integer of {int(value).bit_length()} bits"


def _positive_int(value, field: str) -> int:
    if type(value) is int and 0 < value < _FLOAT_INT_LIMIT:  # the common case, no ABC check
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise InstanceError(field, f"must be a positive integer, got {_describe(value)}")
    if value >= _FLOAT_INT_LIMIT:
        raise InstanceError(field, _unrepresentable(value))
    return int(value)


def _non_negative_int(value, field: str) -> int:
    if type(value) is int and 0 <= value < _FLOAT_INT_LIMIT:
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise InstanceError(field, f"must be a non-negative integer, got {_describe(value)}")
    if value >= _FLOAT_INT_LIMIT:
        raise InstanceError(field, _unrepresentable(value))
    return int(value)


def _list_like(value) -> bool:
    """A sized iterable that is not text or a mapping (lists, tuples, numpy arrays)."""
    if type(value) is list or type(value) is tuple:  # the common case, checked per group
        return True
    return (
        not isinstance(value, (str, bytes, dict))
        and hasattr(value, "__len__")
        and hasattr(value, "__iter__")
    )


def _describe(value) -> str:
    text = repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{text} ({type(value).__name__})"


def _mapping(value, field: str, keys: Sequence[str], optional: Sequence[str] = ()) -> dict:
    """Check that ``value`` is a dict with exactly ``keys`` (plus any of ``optional``)."""
    if not isinstance(value, dict):
        raise InstanceError(field, f"must be an object, got {_describe(value)}")
    prefix = f"{field}." if field else ""
    for key in keys:
        if key not in value:
            raise InstanceError(f"{prefix}{key}", "missing")
    for key in value:
        if key not in keys and key not in optional:
            # strict on purpose: a misspelt optional key ("densty") must not be ignored
            raise InstanceError(f"{prefix}{key}", "unknown field")
    return value


# ---------------------------------------------------------------------------
# cost terms


@dataclass(frozen=True)
class LinearCost:
    """Time of one collective: ``alpha_s + beta_s_per_byte * nbytes`` seconds."""

    alpha_s: float
    beta_s_per_byte: float

    def __post_init__(self):
        self._validate("")

    def _validate(self, field: str) -> None:
        prefix = f"{field}." if field else ""
        object.__setattr__(self, "alpha_s", _number(self.alpha_s, prefix + "alpha_s"))
        object.__setattr__(
            self, "beta_s_per_byte", _number(self.beta_s_per_byte, prefix + "beta_s_per_byte")
        )

    def time(self, nbytes: float) -> float:
        return self.alpha_s + self.beta_s_per_byte * nbytes

    def scaled(self, factor: float) -> "LinearCost":
        """This line times ``factor`` (both terms): a measured collective's factor."""
        return LinearCost(alpha_s=self.alpha_s * factor,
                          beta_s_per_byte=self.beta_s_per_byte * factor)

    def to_dict(self) -> dict:
        return {"alpha_s": self.alpha_s, "beta_s_per_byte": self.beta_s_per_byte}

    @classmethod
    def from_dict(cls, d, field: str = "") -> "LinearCost":
        d = _mapping(d, field, ("alpha_s", "beta_s_per_byte"))
        prefix = f"{field}." if field else ""
        return cls(
            _number(d["alpha_s"], prefix + "alpha_s"),
            _number(d["beta_s_per_byte"], prefix + "beta_s_per_byte"),
        )


@dataclass(frozen=True)
class TopkCost:
    """Time of one exact top-k over D elements: ``c0 + c1*D + c2*D*log2(D)`` seconds.

    ``c0`` is the launch/setup cost, ``c1`` the per-element scan, ``c2`` the sort-like
    part of selection algorithms that are not linear.
    """

    c0: float
    c1: float
    c2: float

    def __post_init__(self):
        self._validate("")

    def _validate(self, field: str) -> None:
        prefix = f"{field}." if field else ""
        for name in ("c0", "c1", "c2"):
            object.__setattr__(self, name, _number(getattr(self, name), prefix + name))

    def time(self, numel: float) -> float:
        return self.c0 + self.c1 * numel + self.c2 * numel * math.log2(numel)

    def scaled(self, factor: float) -> "TopkCost":
        """This cost times ``factor`` (every term): the top-k as training runs it."""
        return TopkCost(c0=self.c0 * factor, c1=self.c1 * factor, c2=self.c2 * factor)

    def to_dict(self) -> dict:
        return {"c0": self.c0, "c1": self.c1, "c2": self.c2}

    @classmethod
    def from_dict(cls, d, field: str = "") -> "TopkCost":
        d = _mapping(d, field, ("c0", "c1", "c2"))
        prefix = f"{field}." if field else ""
        return cls(*(_number(d[name], prefix + name) for name in ("c0", "c1", "c2")))


@dataclass(frozen=True)
class Unit:
    """One unit of gradient (a DDP bucket): its element count and its share of backward."""

    numel: int
    backward_s: float

    def __post_init__(self):
        self._validate("")

    def _validate(self, field: str) -> None:
        prefix = f"{field}." if field else ""
        object.__setattr__(self, "numel", _positive_int(self.numel, prefix + "numel"))
        object.__setattr__(self, "backward_s", _number(self.backward_s, prefix + "backward_s"))


def units_of(numels, backward_s) -> Tuple[Unit, ...]:
    """``Unit(numel, backward_s)`` for each pair, validated like the constructor.

    The hook builds an instance of up to a thousand units on the training thread at
    every re-plan: checked as two arrays, the units skip their one-by-one checks (about
    3 us each); any bad value falls back to the constructor, whose error names it."""
    numels, backward_s = list(numels), list(backward_s)
    if len(numels) != len(backward_s):
        raise ValueError(f"units_of: {len(numels)} sizes for {len(backward_s)} backward times")
    plain = (all(type(n) is int and n > 0 for n in numels)
             and all((type(b) is float or type(b) is int) and 0 <= b < math.inf
                     for b in backward_s))  # (NaN fails the comparison too)
    if not plain:
        return tuple(Unit(numel=n, backward_s=b) for n, b in zip(numels, backward_s))
    new = object.__new__
    units = []
    for n, b in zip(numels, backward_s):
        unit = new(Unit)
        unit.__dict__.update(numel=n, backward_s=float(b))  # (what the frozen __init__ sets)
        units.append(unit)
    return tuple(units)


@dataclass(frozen=True)
class Hierarchy:
    """Two-level topology of an instance: ``ranks_per_node`` consecutive ranks per node.

    Fields:
        ranks_per_node: L >= 2; the instance's ``world_size`` must be a multiple of it.
        intra: cost of an intra-node collective (reduce-scatter, all-gather) among the
            node's L ranks, per byte each rank contributes (fast links, e.g. NVLink).
        inter: cost of the packed sparse all-gather among the ``world_size / L`` ranks
            with the same local rank, per byte each rank contributes, measured while
            all L local ranks of a node run theirs at the same time.
        inter_dense: optional cost of the inter-node *all-reduce* of a dense group's
            shard among those ranks, per byte of the shard (``value_bytes * S``), with
            all L local ranks reducing theirs at once. None (default): derived from the
            instance's flat ``dense`` cost (:meth:`Instance.inter_dense_cost`).
    """

    ranks_per_node: int
    intra: LinearCost
    inter: LinearCost
    inter_dense: Optional[LinearCost] = None

    def __post_init__(self):
        self._validate("hierarchy")

    def _validate(self, field: str) -> None:
        prefix = f"{field}." if field else ""
        L = _positive_int(self.ranks_per_node, prefix + "ranks_per_node")
        if L < 2:
            raise InstanceError(prefix + "ranks_per_node",
                                f"must be at least 2 (one rank per node is the flat model), "
                                f"got {L}")
        object.__setattr__(self, "ranks_per_node", L)
        for name in ("intra", "inter"):
            if not isinstance(getattr(self, name), LinearCost):
                raise InstanceError(prefix + name, f"must be a LinearCost, got "
                                                   f"{_describe(getattr(self, name))}")
        if self.inter_dense is not None and not isinstance(self.inter_dense, LinearCost):
            raise InstanceError(prefix + "inter_dense", f"must be a LinearCost, got "
                                                        f"{_describe(self.inter_dense)}")

    def to_dict(self) -> dict:
        d = {"ranks_per_node": self.ranks_per_node, "intra": self.intra.to_dict(),
             "inter": self.inter.to_dict()}
        if self.inter_dense is not None:
            d["inter_dense"] = self.inter_dense.to_dict()
        return d

    @classmethod
    def from_dict(cls, d, field: str = "hierarchy") -> "Hierarchy":
        d = _mapping(d, field, ("ranks_per_node", "intra", "inter"), ("inter_dense",))
        inter_dense = d.get("inter_dense")
        return cls(
            _positive_int(d["ranks_per_node"], field + ".ranks_per_node"),
            LinearCost.from_dict(d["intra"], field + ".intra"),
            LinearCost.from_dict(d["inter"], field + ".inter"),
            None if inter_dense is None else LinearCost.from_dict(inter_dense,
                                                                 field + ".inter_dense"),
        )


def selected_k(numel: int, density: float) -> int:
    """Entries a group of ``numel`` elements sends: ``max(1, ceil(density * numel))``.

    Computed exactly as written (one float64 product, then ceil) so that the planner, the
    hook and the vectorised planner code agree bit for bit on every rank.
    """
    return max(1, math.ceil(density * numel))


@dataclass(frozen=True)
class Instance:
    """One planning problem.

    Fields:
        layers: the units in gradient-ready order (unit 0 is ready first).
        world_size: number of ranks (informational: ``comm`` is fitted for it).
        density: fraction of a group's elements that are sent, in (0, 1].
        forward_s: forward-pass time added in front of the backward timeline.
        comm: cost of the sparse all-gather per byte each rank contributes.
        topk: cost of one top-k selection.
        value_bytes, index_bytes: bytes per selected value / index on the wire (4 + 4 for
            float32 values with int32 indices); ``value_bytes`` is also the size of one
            gradient element for the dense mode and for ``threshold:BYTES`` plans.
        dense: optional cost of a dense all-reduce; when given, the planner may send a
            group dense where that is cheaper.
        tail_s: time from the end of the last collective to the next forward (DDP's
            finalisation, optimiser step, data); added to every plan's prediction.
        level_s: a constant of either sign added to every plan's prediction (the hook's
            centring of its measured correction); like ``tail_s`` it ranks no plan.
        hierarchy: optional :class:`Hierarchy`; when given, every group (sparse or
            dense) uses the two-level timeline of the module docstring (``comm`` is then unused by the
            timeline; it stays the flat all-gather cost, for comparison).
        min_sparse_numel: the planner's floor for sparse groups (needs ``dense``): a group
            of fewer elements that a plan would send sparse is sent dense instead
            (:func:`omgs_hook.planner.small_groups_dense`). 0 (the default) has no floor.
            A convergence guard, not a cost: a small normalisation tensor alone in a
            sparse group gets ``k`` of 1-3 entries a step and trains badly with
            momentum (docs/convergence.md). Ignored without ``dense``.
    """

    layers: Tuple[Unit, ...]
    world_size: int
    density: float
    forward_s: float
    comm: LinearCost
    topk: TopkCost
    value_bytes: int = 4
    index_bytes: int = 4
    dense: Optional[LinearCost] = None
    tail_s: float = 0.0
    hierarchy: Optional[Hierarchy] = None
    level_s: float = 0.0
    min_sparse_numel: int = 0

    def __post_init__(self):
        layers = self.layers
        if not _list_like(layers):
            raise InstanceError("layers", f"must be a list of units, got {_describe(layers)}")
        if len(layers) == 0:
            raise InstanceError("layers", "must contain at least one unit")
        for i, unit in enumerate(layers):
            if not isinstance(unit, Unit):
                raise InstanceError(f"layers[{i}]", f"must be a Unit, got {_describe(unit)}")
        object.__setattr__(self, "layers", tuple(layers))
        object.__setattr__(self, "world_size", _positive_int(self.world_size, "world_size"))
        density = _number(self.density, "density", positive=True)
        if density > 1:
            raise InstanceError("density", f"must be in (0, 1], got {density!r}")
        object.__setattr__(self, "density", density)
        object.__setattr__(self, "forward_s", _number(self.forward_s, "forward_s"))
        object.__setattr__(self, "tail_s", _number(self.tail_s, "tail_s"))
        object.__setattr__(self, "level_s", _number(self.level_s, "level_s", signed=True))
        for name, kind in (("comm", LinearCost), ("topk", TopkCost)):
            if not isinstance(getattr(self, name), kind):
                raise InstanceError(
                    name, f"must be a {kind.__name__}, got {_describe(getattr(self, name))}"
                )
        if self.dense is not None and not isinstance(self.dense, LinearCost):
            raise InstanceError("dense", f"must be a LinearCost, got {_describe(self.dense)}")
        object.__setattr__(self, "value_bytes", _positive_int(self.value_bytes, "value_bytes"))
        object.__setattr__(self, "index_bytes", _positive_int(self.index_bytes, "index_bytes"))
        object.__setattr__(self, "min_sparse_numel",
                           _non_negative_int(self.min_sparse_numel, "min_sparse_numel"))
        if self.hierarchy is not None:
            if not isinstance(self.hierarchy, Hierarchy):
                raise InstanceError("hierarchy", f"must be a Hierarchy, got "
                                                 f"{_describe(self.hierarchy)}")
            L = self.hierarchy.ranks_per_node
            if self.world_size % L:
                raise InstanceError("hierarchy.ranks_per_node",
                                    f"world_size {self.world_size} is not divisible by "
                                    f"ranks_per_node {L}")
        self._check_priced()

    def _check_priced(self):
        """Every sum the planner forms must stay finite: element counts exact in float64
        (below 2**53), and one group of every unit priced finitely by each cost (finite
        coefficients near 1e308 overflow to inf, and the planner would compare inf and
        NaN)."""
        total = sum(unit.numel for unit in self.layers)
        if total >= 2**53:
            raise InstanceError("layers", f"the total numel must be below 2**53, got {total}")
        if not math.isfinite(sum(unit.backward_s for unit in self.layers)):
            raise InstanceError("layers", "the backward times' sum overflows to inf")
        entry = self.value_bytes + self.index_bytes
        costs = [("topk", self.topk, total),
                 ("comm", self.comm, float(entry) * total * self.world_size)]
        if self.dense is not None:
            costs.append(("dense", self.dense, float(self.value_bytes) * total))
        for name, cost, size in costs:
            if not math.isfinite(cost.time(size)):
                raise InstanceError(name, f"prices a group of all {total} elements at inf: "
                                          "the coefficients are beyond any physical range "
                                          "(seconds, bytes)")

    # -- the three cost terms of one group of `numel` elements ---------------------------

    def topk_time(self, numel: int) -> float:
        """``t_s(D)``: top-k selection time of a group of ``numel`` elements."""
        return self.topk.time(numel)

    def sparse_comm_time(self, numel: int) -> float:
        """``t_c(D)``: all-gather time of a sparse group of ``numel`` elements."""
        k = selected_k(numel, self.density)
        return self.comm.time(k * (self.value_bytes + self.index_bytes))

    def dense_comm_time(self, numel: int) -> float:
        """``t_d(D)``: all-reduce time of a dense group; needs ``dense``."""
        if self.dense is None:
            raise InstanceError("dense", "this instance has no dense cost")
        return self.dense.time(self.value_bytes * numel)

    # -- the two-level terms (need ``hierarchy``) -----------------------------------------

    def _hierarchy(self) -> Hierarchy:
        if self.hierarchy is None:
            raise InstanceError("hierarchy", "this instance has no hierarchy")
        return self.hierarchy

    @property
    def nodes(self) -> int:
        """N = world_size / ranks_per_node (1 rank per node without a hierarchy)."""
        if self.hierarchy is None:
            return self.world_size
        return self.world_size // self.hierarchy.ranks_per_node

    def shard_numel(self, numel: int) -> int:
        """``S(D) = ceil(D / L)``: elements of each rank's shard of a group."""
        L = self._hierarchy().ranks_per_node
        return -(-int(numel) // L)

    def shard_k(self, numel: int) -> int:
        """``k_h(D) = selected_k(S(D), density)``: entries each rank's shard sends."""
        return selected_k(self.shard_numel(numel), self.density)

    def reduce_scatter_time(self, numel: int) -> float:
        """``t_rs(D)``: the intra-node reduce-scatter of a group (shard bytes)."""
        h = self._hierarchy()
        return h.intra.time(self.value_bytes * self.shard_numel(numel))

    def hierarchical_compute_time(self, numel: int) -> float:
        """``t_rs(D) + t_s(S(D))``: a two-level sparse group's work on the compute stream."""
        return self.reduce_scatter_time(numel) + self.topk.time(self.shard_numel(numel))

    def inter_allgather_time(self, numel: int) -> float:
        """``t_inter(D)``: the sparse all-gather among the nodes."""
        h = self._hierarchy()
        return h.inter.time(self.shard_k(numel) * (self.value_bytes + self.index_bytes))

    def intra_allgather_time(self, numel: int) -> float:
        """``t_ag(D)``: the intra-node all-gather of the N gathered payloads."""
        h = self._hierarchy()
        return h.intra.time(
            self.nodes * self.shard_k(numel) * (self.value_bytes + self.index_bytes))

    def hierarchical_comm_time(self, numel: int) -> float:
        """``t_inter(D) + t_ag(D)``: a two-level sparse group's time on the network."""
        return self.inter_allgather_time(numel) + self.intra_allgather_time(numel)

    def inter_dense_cost(self) -> LinearCost:
        """The inter-node all-reduce of a dense group's shard, per shard byte: the
        hierarchy's ``inter_dense``, else derived from the flat ``dense`` cost. A ring
        all-reduce over all W ranks (numbered node by node) is limited by the ring edge
        that leaves each node, which carries ``2 (W-1)/W`` times the group's bytes, so
        ``dense.beta = 2 (W-1)/W * b`` with ``b`` the node link's seconds per byte. The
        two-level all-reduce runs L rings of N ranks at once, one per local rank, each
        putting ``2 (N-1)/N`` times its shard's bytes on the same node link: per shard
        byte ``L * 2 (N-1)/N * b``. Hence ``beta = dense.beta * L ((N-1)/N) / ((W-1)/W)``
        and ``alpha = dense.alpha`` (one all-reduce's startup). Needs ``dense``."""
        h = self._hierarchy()
        if h.inter_dense is not None:
            return h.inter_dense
        if self.dense is None:
            raise InstanceError("dense", "this instance has no dense cost")
        L, N, W = h.ranks_per_node, self.nodes, self.world_size
        scale = L * ((N - 1) / N) / ((W - 1) / W)
        return LinearCost(self.dense.alpha_s, self.dense.beta_s_per_byte * scale)

    def hierarchical_dense_compute_time(self, numel: int) -> float:
        """``t_rs(D)``: a two-level dense group's work on the compute stream (the hook
        waits for its intra-node reduce-scatter on its own thread, as for a sparse group)."""
        return self.reduce_scatter_time(numel)

    def inter_allreduce_time(self, numel: int) -> float:
        """``t_ar(D)``: the inter-node all-reduce of a dense group's shard (S elements)."""
        return self.inter_dense_cost().time(self.value_bytes * self.shard_numel(numel))

    def intra_dense_allgather_time(self, numel: int) -> float:
        """``t_agd(D)``: the intra-node all-gather of the reduced shards (S elements each)."""
        return self._hierarchy().intra.time(self.value_bytes * self.shard_numel(numel))

    def hierarchical_dense_comm_time(self, numel: int) -> float:
        """``t_ar(D) + t_agd(D)``: a two-level dense group's time on the network."""
        return self.inter_allreduce_time(numel) + self.intra_dense_allgather_time(numel)

    def inter_node_bytes(self, numel: int, dense: bool = False,
                         ranks_per_node: Optional[int] = None) -> int:
        """Bytes one rank sends to ranks on other nodes for one group, by the algorithm's
        own count (the ``stats()["last"]["inter_node_bytes"]`` of issue 12, without the
        4-byte status word): two-level sparse ``(N - 1) * k_h(D) * entry``; flat sparse
        ``(W - L) * k(D) * entry`` (its payload goes to every rank on another node), with
        ``L = ranks_per_node`` (default: the hierarchy's, else 1). Dense groups, flat:
        what a rank sends in a ring all-reduce, ``2 (W - 1) / W * value_bytes * D`` (an
        upper bound: not every ring link leaves the node); two-level: the inter-node
        all-reduce of its shard, ``2 (N - 1) / N * value_bytes * S(D)``."""
        entry = self.value_bytes + self.index_bytes
        W = self.world_size
        if dense and self.hierarchy is not None:
            N = self.nodes
            return int(round(2 * (N - 1) / N * self.value_bytes * self.shard_numel(numel)))
        if dense:
            return int(round(2 * (W - 1) / W * self.value_bytes * numel))
        if self.hierarchy is None:
            L = 1 if ranks_per_node is None else _positive_int(ranks_per_node,
                                                                "ranks_per_node")
            return (W - L) * selected_k(numel, self.density) * entry
        return (self.nodes - 1) * self.shard_k(numel) * entry

    @property
    def num_units(self) -> int:
        return len(self.layers)

    # -- JSON form ------------------------------------------------------------------------

    _KEYS = ("layers", "world_size", "density", "forward_s", "comm", "topk")
    _OPTIONAL = ("value_bytes", "index_bytes", "dense", "tail_s", "hierarchy", "level_s",
                 "min_sparse_numel")

    @classmethod
    def from_dict(cls, d) -> "Instance":
        """Build and validate an instance from its JSON form (see the module docstring).

        Raises :class:`InstanceError` naming the first bad field.
        """
        # the layers first: "no layers" is the more useful message for a bare stub
        _mapping(d, "", ("layers",), cls._KEYS + cls._OPTIONAL)
        raw_layers = d["layers"]
        if not isinstance(raw_layers, list):
            raise InstanceError("layers", f"must be a list, got {_describe(raw_layers)}")
        if not raw_layers:
            raise InstanceError("layers", "must contain at least one unit")
        layers = []
        for i, raw in enumerate(raw_layers):
            field = f"layers[{i}]"
            raw = _mapping(raw, field, ("numel", "backward_s"))
            layers.append(
                Unit(
                    _positive_int(raw["numel"], field + ".numel"),
                    _number(raw["backward_s"], field + ".backward_s"),
                )
            )
        _mapping(d, "", cls._KEYS, cls._OPTIONAL)
        dense = d.get("dense")
        hierarchy = d.get("hierarchy")
        return cls(
            layers=tuple(layers),
            world_size=_positive_int(d["world_size"], "world_size"),
            density=d["density"],  # range-checked in __post_init__
            forward_s=_number(d["forward_s"], "forward_s"),
            comm=LinearCost.from_dict(d["comm"], "comm"),
            topk=TopkCost.from_dict(d["topk"], "topk"),
            value_bytes=_positive_int(d.get("value_bytes", 4), "value_bytes"),
            index_bytes=_positive_int(d.get("index_bytes", 4), "index_bytes"),
            dense=None if dense is None else LinearCost.from_dict(dense, "dense"),
            tail_s=_number(d.get("tail_s", 0.0), "tail_s"),
            hierarchy=None if hierarchy is None else Hierarchy.from_dict(hierarchy),
            level_s=_number(d.get("level_s", 0.0), "level_s", signed=True),
            min_sparse_numel=_non_negative_int(d.get("min_sparse_numel", 0), "min_sparse_numel"),
        )

    def to_dict(self) -> dict:
        d = {
            "layers": [{"numel": u.numel, "backward_s": u.backward_s} for u in self.layers],
            "world_size": self.world_size,
            "density": self.density,
            "forward_s": self.forward_s,
            "comm": self.comm.to_dict(),
            "topk": self.topk.to_dict(),
            "value_bytes": self.value_bytes,
            "index_bytes": self.index_bytes,
        }
        if self.dense is not None:
            d["dense"] = self.dense.to_dict()
        if self.tail_s:
            d["tail_s"] = self.tail_s
        if self.hierarchy is not None:
            d["hierarchy"] = self.hierarchy.to_dict()
        if self.level_s:
            d["level_s"] = self.level_s
        if self.min_sparse_numel:
            d["min_sparse_numel"] = self.min_sparse_numel
        return d

    @property
    def fixed_s(self) -> float:
        """What every plan's prediction adds to the end of its last collective:
        ``forward_s + tail_s + level_s``."""
        return self.forward_s + self.tail_s + self.level_s


# ---------------------------------------------------------------------------
# timeline


@dataclass(frozen=True)
class Timeline:
    """Result of :func:`simulate`.

    ``compute_end_s`` (``c_m``) and ``comm_end_s`` (``e_m``) are measured from the start
    of backward; ``predicted_iteration_s = forward_s + comm_end_s + tail_s + level_s``.
    """

    predicted_iteration_s: float
    non_overlapped_s: float
    compute_end_s: float
    comm_end_s: float


def check_groups(groups, num_units: int) -> Tuple[Tuple[int, ...], ...]:
    """Validate a partition: contiguous runs that cover ``0 .. num_units-1`` in order.

    Returns it as a tuple of tuples of ints; raises :class:`InstanceError` (field
    ``groups[j]``) otherwise.
    """
    if not _list_like(groups):
        raise InstanceError("groups", f"must be a list of lists of unit indices, got "
                                      f"{_describe(groups)}")
    if len(groups) == 0:
        raise InstanceError("groups", "must contain at least one group")
    result = []
    expected = 0
    for j, group in enumerate(groups):
        field = f"groups[{j}]"
        if not _list_like(group) or len(group) == 0:
            raise InstanceError(field, f"must be a non-empty list of unit indices, got "
                                       f"{_describe(group)}")
        units = []
        for unit in group:
            # (exact int first: the ABC check costs microseconds per unit, and the hook
            # prices plans of a thousand units on the training thread)
            if type(unit) is not int and (isinstance(unit, bool)
                                          or not isinstance(unit, numbers.Integral)):
                raise InstanceError(field, f"unit indices must be integers, got {_describe(unit)}")
            if not 0 <= unit < num_units:
                raise InstanceError(
                    field, f"unit index {unit} out of range (the instance has {num_units} units)"
                )
            if unit != expected:
                raise InstanceError(
                    field,
                    f"expected unit {expected} next (groups must be contiguous runs covering "
                    f"units 0..{num_units - 1} in ready order), got {unit}",
                )
            units.append(int(unit))
            expected += 1
        result.append(tuple(units))
    if expected != num_units:
        raise InstanceError(
            "groups", f"cover units 0..{expected - 1} but the instance has {num_units} units"
        )
    return tuple(result)


def check_dense(dense, inst: Instance, num_groups: int) -> Tuple[bool, ...]:
    """Validate per-group dense flags (None means all sparse)."""
    if dense is None:
        return (False,) * num_groups
    if not _list_like(dense):
        raise InstanceError("dense", f"must be a list of booleans, got {_describe(dense)}")
    if len(dense) != num_groups:
        raise InstanceError("dense", f"has {len(dense)} flags for {num_groups} groups")
    flags = []
    for j, flag in enumerate(dense):
        is_flag = (
            isinstance(flag, bool)
            or getattr(getattr(flag, "dtype", None), "kind", None) == "b"  # numpy bool
            or (isinstance(flag, numbers.Integral) and flag in (0, 1))
        )
        if not is_flag:
            raise InstanceError(f"dense[{j}]", f"must be a boolean, got {_describe(flag)}")
        flags.append(bool(flag))
    if any(flags) and inst.dense is None:
        raise InstanceError("dense", "a group is marked dense but the instance has no dense cost")
    return tuple(flags)


def simulate(inst: Instance, groups, dense=None) -> Timeline:
    """Run the timeline recurrence of the module docstring for one plan.

    Args:
        inst: the instance.
        groups: contiguous runs of unit indices in ready order, e.g. ``[[0, 1], [2]]``.
        dense: optional per-group booleans; ``True`` sends that group as a dense
            all-reduce (requires ``inst.dense``). ``None`` means all groups sparse.
    """
    groups = check_groups(groups, inst.num_units)
    flags = check_dense(dense, inst, len(groups))
    hierarchical = inst.hierarchy is not None
    compute = 0.0
    network = 0.0
    backward_total = 0.0
    for group, is_dense in zip(groups, flags):
        numel = 0
        backward = 0.0
        for u in group:
            numel += inst.layers[u].numel
            backward += inst.layers[u].backward_s
        backward_total += backward
        if is_dense and hierarchical:
            compute += backward + inst.hierarchical_dense_compute_time(numel)
            network = max(network, compute) + inst.hierarchical_dense_comm_time(numel)
        elif is_dense:
            compute += backward
            network = max(network, compute) + inst.dense_comm_time(numel)
        elif hierarchical:
            compute += backward + inst.hierarchical_compute_time(numel)
            network = max(network, compute) + inst.hierarchical_comm_time(numel)
        else:
            compute += backward + inst.topk_time(numel)
            network = max(network, compute) + inst.sparse_comm_time(numel)
    return Timeline(
        predicted_iteration_s=network + inst.fixed_s,
        non_overlapped_s=network - backward_total,
        compute_end_s=compute,
        comm_end_s=network,
    )


@dataclass(frozen=True)
class Schedule:
    """Every interval of one plan's timeline (seconds from the start of the forward pass).

    ``backward``: per unit ``(start, end)``; ``selection``: per group ``(start, end)`` of
    its top-k and the hook's own work on the compute stream (empty for a flat dense
    group; with a hierarchy: the reduce-scatter and, for a sparse group, the shard's
    top-k); ``network``: per group ``(start, end)`` of its collective (with a hierarchy:
    the inter-node all-gather, or all-reduce for a dense group, and then the intra-node
    all-gather); ``dense``: per group flag;
    ``forward`` and ``tail``: ``(start, end)``. The ends agree with :func:`simulate`
    (``tail[1] == predicted_iteration_s``). Used to draw the timeline.
    """

    forward: Tuple[float, float]
    backward: Tuple[Tuple[float, float], ...]
    selection: Tuple[Tuple[float, float], ...]
    network: Tuple[Tuple[float, float], ...]
    groups: Tuple[Tuple[int, ...], ...]
    dense: Tuple[bool, ...]
    tail: Tuple[float, float]


def schedule(inst: Instance, groups, dense=None) -> Schedule:
    """The intervals behind :func:`simulate`'s recurrence, for plotting a plan."""
    groups = check_groups(groups, inst.num_units)
    flags = check_dense(dense, inst, len(groups))
    origin = inst.forward_s
    compute = network = 0.0
    backward, selection, comm = [], [], []
    for group, is_dense in zip(groups, flags):
        numel = 0
        for u in group:
            numel += inst.layers[u].numel
            end = compute + inst.layers[u].backward_s
            backward.append((origin + compute, origin + end))
            compute = end
        if is_dense and inst.hierarchy is not None:  # the reduce-scatter
            end = compute + inst.hierarchical_dense_compute_time(numel)
            selection.append((origin + compute, origin + end))
            compute = end
            duration = inst.hierarchical_dense_comm_time(numel)
        elif is_dense:
            selection.append((origin + compute, origin + compute))
            duration = inst.dense_comm_time(numel)
        elif inst.hierarchy is not None:  # reduce-scatter + the shard's top-k
            end = compute + inst.hierarchical_compute_time(numel)
            selection.append((origin + compute, origin + end))
            compute = end
            duration = inst.hierarchical_comm_time(numel)
        else:
            end = compute + inst.topk_time(numel)
            selection.append((origin + compute, origin + end))
            compute = end
            duration = inst.sparse_comm_time(numel)
        start = max(network, compute)
        network = start + duration
        comm.append((origin + start, origin + network))
    end = origin + network
    return Schedule(forward=(0.0, origin), backward=tuple(backward), selection=tuple(selection),
                    network=tuple(comm), groups=groups, dense=tuple(flags),
                    tail=(end, end + inst.tail_s))


def step_inter_node_bytes(inst: Instance, groups, dense=None,
                          ranks_per_node: Optional[int] = None) -> int:
    """Inter-node bytes one rank sends per step for a plan: the sum of
    :meth:`Instance.inter_node_bytes` over its groups."""
    groups = check_groups(groups, inst.num_units)
    flags = check_dense(dense, inst, len(groups))
    total = 0
    for group, is_dense in zip(groups, flags):
        numel = sum(inst.layers[u].numel for u in group)
        total += inst.inter_node_bytes(numel, dense=is_dense, ranks_per_node=ranks_per_node)
    return total


# ---------------------------------------------------------------------------
# two-level instances: construction and the relaxation the planner searches


def hierarchical_instance(flat: Instance, ranks_per_node: int, intra: LinearCost,
                          inter: LinearCost, inter_dense: Optional[LinearCost] = None
                          ) -> Instance:
    """``flat`` with a :class:`Hierarchy` added (the same units, top-k, density, dense
    all-reduce and ``comm``; every group then follows the two-level timeline).

    ``intra``: the intra-node collective cost per contributed byte; ``inter``: the
    inter-node sparse all-gather among the ``world_size / ranks_per_node`` ranks with the
    same local rank, per contributed byte (with all local ranks exchanging at once);
    ``inter_dense``: optional, the inter-node all-reduce of a dense group's shard per
    shard byte (default: derived from ``flat.dense``, :meth:`Instance.inter_dense_cost`).
    Raises :class:`InstanceError` (``hierarchy.*``) for bad values.
    """
    if not isinstance(flat, Instance):
        raise TypeError(f"hierarchical_instance expects an Instance, got {type(flat).__name__}")
    return _replace(flat, hierarchy=Hierarchy(ranks_per_node, intra, inter, inter_dense))


def _replace(inst: Instance, **changes) -> Instance:
    fields = dict(layers=inst.layers, world_size=inst.world_size, density=inst.density,
                  forward_s=inst.forward_s, comm=inst.comm, topk=inst.topk,
                  value_bytes=inst.value_bytes, index_bytes=inst.index_bytes,
                  dense=inst.dense, tail_s=inst.tail_s, hierarchy=inst.hierarchy,
                  level_s=inst.level_s, min_sparse_numel=inst.min_sparse_numel)
    fields.update(changes)
    return Instance(**fields)


def _unchecked_topk(c0: float, c1: float, c2: float) -> TopkCost:
    """A TopkCost whose ``c1`` may be negative (only :func:`relaxed_instance` makes one:
    its ``c0 + c1 D + c2 D log2 D`` is still non-negative and non-decreasing for every
    group size it is used on)."""
    cost = object.__new__(TopkCost)
    for name, value in (("c0", c0), ("c1", c1), ("c2", c2)):
        object.__setattr__(cost, name, float(value))
    return cost


# k of the relaxation is computed from density / L shrunk by this factor, so that float
# rounding of (density / L) * D can never make it exceed selected_k(ceil(D / L), density)
_RELAXED_DENSITY_SHRINK = 1.0 - 1e-12


def relaxed_instance(inst: Instance) -> Instance:
    """The flat instance whose group costs are lower bounds of a two-level instance's.

    With L ranks per node, N nodes, ``rs = intra.beta * value_bytes`` (reduce-scatter per
    shard element) and shards of the real size ``D / L`` instead of ``ceil(D / L)``:

    * top-k: ``t_rs(D) + t_s(D/L) = c0' + c1' D + c2' D log2 D`` with
      ``c0' = c0 + intra.alpha``, ``c2' = c2 / L`` and
      ``c1' = (c1 + rs) / L - c2 log2(L) / L`` (may be negative; the sum is not). When
      some unit has fewer than L elements, ``c2' = 0`` and ``c1' = (c1 + rs) / L``
      instead, so that the cost stays non-decreasing in D (``x log x`` falls below x = 1/e);
    * all-gathers: ``alpha' = inter.alpha + intra.alpha``, ``beta' = inter.beta + N *
      intra.beta`` per byte, ``density' = density / L`` (times ``1 - 1e-12`` against float
      rounding), so ``k' = max(1, ceil(density' D)) <= k_h(D)``.

    Every group's compute and network terms of the relaxation are at most the exact
    two-level ones (``ceil(D/L) >= D/L``, the cost is non-decreasing in the shard size),
    and the timeline is non-decreasing in every term, so the relaxation's optimum is a
    lower bound of the exact optimum. When every unit's ``numel`` is a multiple of L
    (so every group's is), the two agree up to float rounding (and a ``k`` whose
    ``density * S`` lies within 1e-12 of an integer) and the relaxation's optimum is the
    exact one. The relaxation has the form the planner's exact searches assume (``c2' >=
    0``; non-decreasing, convex top-k cost; non-decreasing ``k'``).

    Dense groups (two-level: reduce-scatter on the compute side, inter-node all-reduce
    and intra-node all-gather of S elements on the network side): the relaxed ``dense``
    is ``alpha' = inter_dense.alpha + intra.alpha``, ``beta' = (inter_dense.beta +
    intra.beta) / L`` per byte of the whole group, at most the exact network term
    (``S >= D / L``); the reduce-scatter is left out (a flat dense group has no compute
    term), so for plans with dense groups the relaxation is a lower bound but not exact.
    ``comm``, ``topk`` and ``dense`` of the result are the relaxed ones, the result has
    no hierarchy. A flat instance is returned as it is.
    """
    h = inst.hierarchy
    if h is None:
        return inst
    L = h.ranks_per_node
    N = inst.world_size // L
    c1_shard = inst.topk.c1 + h.intra.beta_s_per_byte * inst.value_bytes
    c0 = inst.topk.c0 + h.intra.alpha_s
    if min(u.numel for u in inst.layers) >= L:
        topk = _unchecked_topk(c0, c1_shard / L - inst.topk.c2 * math.log2(L) / L,
                               inst.topk.c2 / L)
    else:
        topk = TopkCost(c0, c1_shard / L, 0.0)
    comm = LinearCost(h.inter.alpha_s + h.intra.alpha_s,
                      h.inter.beta_s_per_byte + N * h.intra.beta_s_per_byte)
    dense = None
    if inst.dense is not None:
        inter_dense = inst.inter_dense_cost()
        dense = LinearCost(inter_dense.alpha_s + h.intra.alpha_s,
                           (inter_dense.beta_s_per_byte + h.intra.beta_s_per_byte) / L)
    # (no floor for sparse groups: it is applied after a search, and would make the
    # relaxation's plans dearer - no lower bound - while the exact plan gets it anyway)
    return _replace(inst, topk=topk, comm=comm, dense=dense,
                    density=inst.density / L * _RELAXED_DENSITY_SHRINK, hierarchy=None,
                    min_sparse_numel=0)
