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
    """

    groups: tuple
    dense: tuple
    layout: tuple
    strategy: str
    predicted_iteration_s: float
    made_at_step: int

    @classmethod
    def from_unit_plan(cls, plan, layout, made_at_step):
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
        )

    def checksum(self):
        """A 63-bit digest of what every rank must agree on (groups and modes)."""
        text = json.dumps([list(map(list, self.groups)), list(self.dense)], separators=(",", ":"))
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
        }

    @classmethod
    def from_dict(cls, d):
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
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"plan in state dict is malformed: {exc!r}") from None
