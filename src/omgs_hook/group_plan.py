"""A merge plan expressed in parameters, so it survives any change of DDP's buckets.

The planner works on *units* (DDP buckets, in ready order) and returns groups of unit
indices. The hook turns that into groups of **parameter keys** in the order the
planned layout presents them. This canonical order is what a group's gradient is
concatenated in, whatever the current bucket layout is - so after DDP rebuilds its
buckets, or after a restart where DDP starts with a single bucket, the same group sees
the same vector, selects the same entries and produces bit-identical results. A group
is sent as soon as every parameter in it has arrived.
"""

import dataclasses
import hashlib
import json
from typing import Optional

#: the exchanges a plan can run on (``omgs_hook.topology`` kinds)
EXCHANGES = ("flat", "hierarchical")


def check_exchange(value, option="plan"):
    """``value`` if it is an exchange kind or None, else ValueError naming ``option``."""
    if value is not None and value not in EXCHANGES:
        raise ValueError(f"{option}: 'exchange' must be one of {EXCHANGES} or absent, "
                         f"got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class GroupPlan:
    """Groups of parameter keys, with the layout and strategy they were planned for.

    Attributes:
        groups: one tuple of parameter keys per group, in send order.
        dense: per group, True to send it as a dense all-reduce.
        layout: the bucket layout (tuple of buckets, each a tuple of keys) planned for.
        strategy: the planner strategy that produced it.
        predicted_iteration_s: the planner's prediction for one iteration.
        made_at_step: the hook step after which it was adopted.
        exchange: ``"flat"`` or ``"hierarchical"`` (the two-level exchange); None (a plan
            saved before plans carried it): the registration's topology.
    """

    groups: tuple
    dense: tuple
    layout: tuple
    strategy: str
    predicted_iteration_s: float
    made_at_step: int
    exchange: Optional[str] = None

    @classmethod
    def from_unit_plan(cls, plan, layout, made_at_step, exchange=None):
        """Translate a planner ``Plan`` over bucket indices into parameter groups."""
        groups = tuple(
            tuple(key for unit in unit_group for key in layout[unit]) for unit_group in plan.groups
        )
        return cls(
            groups=groups,
            dense=tuple(bool(d) for d in plan.dense),
            layout=tuple(tuple(bucket) for bucket in layout),
            strategy=plan.strategy,
            predicted_iteration_s=float(plan.predicted_iteration_s),
            made_at_step=int(made_at_step),
            exchange=check_exchange(exchange),
        )

    def checksum(self):
        """A 63-bit digest of what every rank must agree on (groups, modes, exchange)."""
        fields = [list(map(list, self.groups)), list(self.dense)]
        if self.exchange is not None:  # (a plan without one keeps its old digest)
            fields.append(self.exchange)
        text = json.dumps(fields, separators=(",", ":"))
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1

    def unit_groups(self):
        """Groups as lists of bucket indices of ``self.layout`` (for reports)."""
        owner = {}
        for index, bucket in enumerate(self.layout):
            for key in bucket:
                owner[key] = index
        out = []
        for group in self.groups:
            units = []
            for key in group:
                unit = owner.get(key)
                if unit is not None and (not units or units[-1] != unit):
                    units.append(unit)
            out.append(units)
        return out

    def to_dict(self):
        return {
            "groups": [list(g) for g in self.groups],
            "dense": list(self.dense),
            "layout": [list(b) for b in self.layout],
            "strategy": self.strategy,
            "predicted_iteration_s": self.predicted_iteration_s,
            "made_at_step": self.made_at_step,
            "exchange": self.exchange,
        }

    @classmethod
    def from_dict(cls, d, default_exchange=None):
        """``to_dict``'s inverse; a dict without ``"exchange"`` (saved before plans carried
        it) gets ``default_exchange``."""
        try:
            groups = tuple(tuple(str(k) for k in g) for g in d["groups"])
            dense = tuple(bool(x) for x in d["dense"])
            layout = tuple(tuple(str(k) for k in b) for b in d["layout"])
            if len(dense) != len(groups):
                raise ValueError("plan: 'dense' and 'groups' differ in length")
            return cls(
                groups=groups,
                dense=dense,
                layout=layout,
                strategy=str(d["strategy"]),
                predicted_iteration_s=float(d["predicted_iteration_s"]),
                made_at_step=int(d["made_at_step"]),
                exchange=check_exchange(d.get("exchange") or default_exchange),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"plan in state dict is malformed: {exc!r}") from None
