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
* ``predicted_iteration_s = forward_s + e_m + tail_s``
* ``non_overlapped_s = e_m - sum_j B_j`` (time the iteration spends on sparsification and
  communication beyond the backward pass itself)

``tail_s`` (optional, default 0) is everything from the end of the last collective to
the next forward pass: DDP's finalisation, the optimiser step, ``zero_grad`` and loading
the next batch. It is the same for every plan, so it never changes which plan is best;
it makes ``predicted_iteration_s`` comparable with a measured iteration (forward start
to forward start). The hook measures it while training.

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
    "Instance",
    "Timeline",
    "selected_k",
    "simulate",
    "Schedule",
    "schedule",
    "check_groups",
    "check_dense",
]


class InstanceError(ValueError):
    """Invalid planner input. ``field`` names the offending entry (``"layers[2].numel"``)."""

    def __init__(self, field: str, problem: str):
        self.field = field
        self.problem = problem
        super().__init__(f"{field}: {problem}")


# ---------------------------------------------------------------------------
# validation helpers: each returns the cleaned value or raises InstanceError(field)


def _number(value, field: str, *, positive: bool = False) -> float:
    """A finite, non-negative (or strictly positive) real number; bools are rejected."""
    # bool is an Integral in Python; `true` in JSON is never a meaningful time or rate.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InstanceError(field, f"must be a number, got {_describe(value)}")
    value = float(value)
    if not math.isfinite(value):
        raise InstanceError(field, f"must be finite, got {value!r}")
    if positive and value <= 0:
        raise InstanceError(field, f"must be positive, got {value!r}")
    if value < 0:
        raise InstanceError(field, f"must be non-negative, got {value!r}")
    return value


def _positive_int(value, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise InstanceError(field, f"must be a positive integer, got {_describe(value)}")
    return int(value)


def _list_like(value) -> bool:
    """A sized iterable that is not text or a mapping (lists, tuples, numpy arrays)."""
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
        for name, kind in (("comm", LinearCost), ("topk", TopkCost)):
            if not isinstance(getattr(self, name), kind):
                raise InstanceError(
                    name, f"must be a {kind.__name__}, got {_describe(getattr(self, name))}"
                )
        if self.dense is not None and not isinstance(self.dense, LinearCost):
            raise InstanceError("dense", f"must be a LinearCost, got {_describe(self.dense)}")
        object.__setattr__(self, "value_bytes", _positive_int(self.value_bytes, "value_bytes"))
        object.__setattr__(self, "index_bytes", _positive_int(self.index_bytes, "index_bytes"))

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

    @property
    def num_units(self) -> int:
        return len(self.layers)

    # -- JSON form ------------------------------------------------------------------------

    _KEYS = ("layers", "world_size", "density", "forward_s", "comm", "topk")
    _OPTIONAL = ("value_bytes", "index_bytes", "dense", "tail_s")

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
        return d


# ---------------------------------------------------------------------------
# timeline


@dataclass(frozen=True)
class Timeline:
    """Result of :func:`simulate`.

    ``compute_end_s`` (``c_m``) and ``comm_end_s`` (``e_m``) are measured from the start
    of backward; ``predicted_iteration_s = forward_s + comm_end_s + tail_s``.
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
            if isinstance(unit, bool) or not isinstance(unit, numbers.Integral):
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
        if is_dense:
            compute += backward
            network = max(network, compute) + inst.dense_comm_time(numel)
        else:
            compute += backward + inst.topk_time(numel)
            network = max(network, compute) + inst.sparse_comm_time(numel)
    return Timeline(
        predicted_iteration_s=inst.forward_s + network + inst.tail_s,
        non_overlapped_s=network - backward_total,
        compute_end_s=compute,
        comm_end_s=network,
    )


@dataclass(frozen=True)
class Schedule:
    """Every interval of one plan's timeline (seconds from the start of the forward pass).

    ``backward``: per unit ``(start, end)``; ``selection``: per group ``(start, end)`` of
    its top-k and the hook's own work on the compute stream (empty for a dense group);
    ``network``: per group ``(start, end)`` of its collective; ``dense``: per group flag;
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
        if is_dense:
            selection.append((origin + compute, origin + compute))
            duration = inst.dense_comm_time(numel)
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
