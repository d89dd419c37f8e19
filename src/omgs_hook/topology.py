"""Topology options of the hook: flat (every rank alike) or hierarchical (nodes of ranks).

``resolve_topology`` is pure (no torch.distributed): it turns the options
``topology="auto" | "flat" | "hierarchical"`` and ``ranks_per_node`` (default: torchrun's
``LOCAL_WORLD_SIZE``) into a :class:`Topology` for a given world size and rank, or raises
ValueError naming the option. Consecutive ranks form a node: with ``L`` ranks per node,
rank ``r`` is local rank ``r % L`` of node ``r // L`` (torchrun numbers ranks so, per
``GROUP_RANK``).

``"auto"`` is hierarchical when there is more than one node and more than one rank per
node, else flat. ``"hierarchical"`` asked for explicitly is also accepted with one node
(the two-level exchange within a node: top-k of the node's summed gradient) or with one
rank per node (the reduce-scatter and the final all-gather are then over one rank).

A DDP model may run on a *subgroup* of the job (two models side by side on one node,
data-parallel groups of a model-parallel job). Nodes are then the job's: member
``g`` (a global rank) is on node ``g // L`` of the job, whatever the subgroup's own
rank numbering. The two-level exchange needs node subgroups, which
``torch.distributed.new_group`` creates only when every rank of the job takes part, so a
subgroup always runs flat: ``"auto"`` resolves to flat there, and ``"hierarchical"`` is
refused with a ValueError. The flat topology still knows how many of the group's ranks
share this rank's node, which is what the flat byte counts need.

``build_subgroups`` creates the three families of process groups the two-level exchange
uses - one *intra-node* group per node (its L ranks), one *inter-node* group per local
rank (the N ranks with that local rank, one per node) and a second intra-node group per
node for the exchange's last stage (one communicator per stage, so that each sees its
collectives in group order however the stages of different groups interleave; see
``omgs_hook.hierarchical``) - once, with every rank calling
``torch.distributed.new_group`` for every subgroup in the same order (new_group must be
called by all ranks of the parent group, also for groups they are not in). Before it
creates any, it checks with :func:`check_agreement` (one small all-gather) that every
rank resolved the same topology: ranks that disagree would otherwise wait in
``new_group`` for each other until the process group's timeout.
"""

import dataclasses
import numbers
import os
from typing import Optional, Sequence, Tuple

TOPOLOGIES = ("auto", "flat", "hierarchical")


@dataclasses.dataclass(frozen=True)
class Topology:
    kind: str  # "flat" or "hierarchical"
    ranks_per_node: int  # L (1 when unknown, for flat); a subgroup: its ranks on this node
    nodes: int  # N = world_size / L; a subgroup: the job's nodes its ranks are on
    rank: int
    requested: str = "auto"
    # a subgroup of the job (flat only): (this rank's node and local rank in the job,
    # the group's size); None: nodes of consecutive ranks, as above
    placement: Optional[Tuple[int, int, int]] = None

    @property
    def world_size(self):
        if self.placement is not None:
            return self.placement[2]
        return self.ranks_per_node * self.nodes

    @property
    def local_rank(self):
        if self.placement is not None:
            return self.placement[1]
        return self.rank % self.ranks_per_node

    @property
    def node(self):
        if self.placement is not None:
            return self.placement[0]
        return self.rank // self.ranks_per_node

    @property
    def hierarchical(self):
        return self.kind == "hierarchical"

    def to_dict(self):
        """Plain values (for ``stats()`` and ``state_dict()``)."""
        out = {"kind": self.kind, "ranks_per_node": self.ranks_per_node, "nodes": self.nodes,
               "node": self.node, "local_rank": self.local_rank, "requested": self.requested}
        if self.placement is not None:
            out["subgroup_size"] = self.placement[2]
        return out

    def describe(self):
        text = f"{self.kind} {self.nodes}x{self.ranks_per_node}"
        if self.placement is not None:
            text += f" (a subgroup of {self.placement[2]} ranks)"
        return text


def check_topology_option(topology):
    if topology not in TOPOLOGIES:
        raise ValueError(f"topology must be one of {TOPOLOGIES}, got {topology!r}")
    return topology


def check_ranks_per_node_option(ranks_per_node):
    if ranks_per_node is None:
        return None
    if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, numbers.Integral) \
            or ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be a positive integer or None, got {ranks_per_node!r}")
    return int(ranks_per_node)  # (a NumPy integer too)


def resolve_topology(topology, ranks_per_node, world_size, rank, env=None,
                     group_ranks: Optional[Sequence[int]] = None, job_world_size=None):
    """The :class:`Topology` for these options (see the module docstring).

    ``env`` defaults to ``os.environ`` (``LOCAL_WORLD_SIZE`` gives the default
    ``ranks_per_node``). ``group_ranks``: the global rank of every member of the process
    group, in group-rank order, and ``job_world_size`` the job's world size, when the
    group is not the whole job (None: it is). Raises ValueError naming ``topology`` or
    ``ranks_per_node``."""
    check_topology_option(topology)
    check_ranks_per_node_option(ranks_per_node)
    env = os.environ if env is None else env
    subgroup = _proper_subgroup(group_ranks, job_world_size)
    job_size = job_world_size if subgroup else world_size
    source = "ranks_per_node"
    if ranks_per_node is None:
        raw = env.get("LOCAL_WORLD_SIZE")
        if raw is not None:
            try:
                ranks_per_node = int(raw)
            except ValueError:
                raise ValueError(f"ranks_per_node: LOCAL_WORLD_SIZE={raw!r} is not an integer") from None
            if ranks_per_node < 1:
                raise ValueError(f"ranks_per_node: LOCAL_WORLD_SIZE={raw!r} is not positive")
            source = "ranks_per_node (from LOCAL_WORLD_SIZE)"
    if subgroup and topology == "hierarchical":
        raise ValueError(
            f"topology='hierarchical': the DDP model's process group holds {world_size} of "
            f"the job's {job_size} ranks; the two-level exchange creates node subgroups, "
            "which needs every rank of the job (torch.distributed.new_group), so it runs "
            "on the default process group only. Pass topology='flat' (or 'auto', which "
            "runs flat on a subgroup)")
    if ranks_per_node is None:
        if topology == "hierarchical":
            raise ValueError("ranks_per_node: topology='hierarchical' needs ranks_per_node "
                             "(or torchrun's LOCAL_WORLD_SIZE)")
        return Topology("flat", 1, world_size, rank, topology)
    if ranks_per_node > job_size or job_size % ranks_per_node:
        what = "the job's world size" if subgroup else "the world size"
        raise ValueError(f"{source}={ranks_per_node} does not divide {what} {job_size} "
                         "(every node must have the same number of ranks)")
    if subgroup:
        return _subgroup_topology(ranks_per_node, group_ranks, rank, topology)
    nodes = world_size // ranks_per_node
    if topology == "auto":
        kind = "hierarchical" if nodes > 1 and ranks_per_node > 1 else "flat"
    else:
        kind = topology
    return Topology(kind, ranks_per_node, nodes, rank, topology)


def _proper_subgroup(group_ranks, job_world_size):
    """Whether ``group_ranks`` (global ranks in group order) is less than the whole job."""
    if group_ranks is None:
        return False
    if job_world_size is None:
        raise ValueError("job_world_size is needed with group_ranks")
    return list(group_ranks) != list(range(job_world_size))


def _subgroup_topology(per_node, group_ranks, rank, requested):
    """The flat :class:`Topology` of member ``rank`` of a subgroup of the job, whose nodes
    hold ``per_node`` consecutive global ranks each."""
    nodes = [g // per_node for g in group_ranks]
    mine = group_ranks[rank]
    return Topology("flat", nodes.count(nodes[rank]), len(set(nodes)), rank, requested,
                    placement=(mine // per_node, mine % per_node, len(group_ranks)))


@dataclasses.dataclass
class Subgroups:
    """This rank's intra-node group (its node's L ranks, in local-rank order), inter-node
    group (the N ranks of its local rank, in node order) and a second intra-node group
    over the same ranks for the exchange's last stage (None: use ``intra``)."""

    intra: object
    inter: object
    intra_gather: object = None


_KIND_CODES = {"flat": 0, "hierarchical": 1}
_REQUESTED_CODES = {name: i for i, name in enumerate(TOPOLOGIES)}


def gpu_only_backend(backend):
    """True for a process-group backend that only takes GPU tensors (NCCL without a CPU
    backend beside it, e.g. ``"nccl"``); False for gloo, ``"cpu:gloo,cuda:nccl"`` etc."""
    backend = str(backend).lower()
    return "nccl" in backend and "gloo" not in backend and "cpu:" not in backend


def _agreement_device(process_group):
    """Where the agreement's tensor must live: for an NCCL-only group the GPU it is bound
    to (``init_process_group(device_id=...)``), else the current one - as torch's own
    object collectives do, so set the device first; the CPU otherwise (gloo, or a group
    with a CPU backend besides NCCL)."""
    import torch
    import torch.distributed as dist

    if gpu_only_backend(dist.get_backend(process_group)):
        group = process_group if process_group is not None else dist.group.WORLD
        bound = getattr(group, "bound_device_id", None)
        return bound if bound is not None else torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _describe_values(kind, ranks_per_node, requested):
    return f"{kind} with ranks_per_node={ranks_per_node} (topology={requested!r})"


def _rank_ranges(ranks):
    """``[0, 1, 2, 5]`` -> ``"ranks 0-2, 5"``."""
    spans, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            spans.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(spans)


def check_agreement(topo, process_group=None):
    """Check that every rank of ``process_group`` (default: the default group) resolved
    the same topology kind and - for the two-level exchange - the same ranks per node,
    with one all-gather of three integers. Collective: every rank must call it, flat or
    not. Raises the same ValueError on every rank, naming the option(s) that differ
    (``topology``, ``ranks_per_node``) and each rank's values. Flat ranks may differ in
    ``ranks_per_node`` (it only labels their byte counts)."""
    import torch
    import torch.distributed as dist

    device = _agreement_device(process_group)
    mine = torch.tensor([_KIND_CODES[topo.kind], topo.ranks_per_node,
                         _REQUESTED_CODES.get(topo.requested, -1)],
                        dtype=torch.int64, device=device)
    world = dist.get_world_size(process_group)
    table = torch.empty(world * mine.numel(), dtype=torch.int64, device=device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(table, mine, group=process_group)
    rows = [tuple(int(v) for v in row) for row in table.view(world, -1).cpu().tolist()]
    kinds = {row[0] for row in rows}
    per_node = {row[1] for row in rows if row[0] == _KIND_CODES["hierarchical"]}
    if len(kinds) == 1 and len(per_node) <= 1:
        return
    options = ([] if len(kinds) == 1 else ["topology"]) + (
        ["ranks_per_node"] if len(per_node) > 1 or len({row[1] for row in rows}) > 1 else [])
    kind_names = {code: name for name, code in _KIND_CODES.items()}
    requested_names = {code: name for name, code in _REQUESTED_CODES.items()}
    by_values = {}
    for rank, (kind, per, requested) in enumerate(rows):
        values = _describe_values(kind_names[kind], per, requested_names.get(requested, "?"))
        by_values.setdefault(values, []).append(rank)
    detail = "; ".join(f"{_rank_ranges(ranks)}: {values}" for values, ranks in by_values.items())
    raise ValueError(
        f"{'/'.join(options)}: the ranks resolved different topologies ({detail}); every "
        "rank must pass the same topology and ranks_per_node (with torchrun: every node "
        "the same LOCAL_WORLD_SIZE)")


def build_subgroups(topo, process_group=None):
    """Create every intra- and inter-node group (collective over ``process_group``: every
    rank calls this, in the same order) and return this rank's :class:`Subgroups`.
    Checks first that every rank resolved the same topology (:func:`check_agreement`),
    so that disagreeing ranks fail with a ValueError instead of waiting in ``new_group``."""
    import torch.distributed as dist

    check_agreement(topo, process_group)
    L, N = topo.ranks_per_node, topo.nodes

    def global_rank(r):
        if process_group is None:
            return r
        return dist.get_global_rank(process_group, r)

    # the last stage's own groups serve the CPU's non-blocking stage driver only (on CUDA
    # stage 3 stays on the intra-node group): an NCCL-only world makes none (the same
    # decision on every rank: one backend)
    gather_groups = not gpu_only_backend(dist.get_backend(process_group))
    intra = inter = intra_gather = None
    for node in range(N):  # every rank creates every group, in this order
        ranks = [global_rank(node * L + l) for l in range(L)]
        group = dist.new_group(ranks)
        gather = dist.new_group(ranks) if gather_groups else None
        if node == topo.node:
            intra, intra_gather = group, gather
    for local in range(L):
        ranks = [global_rank(node * L + local) for node in range(N)]
        group = dist.new_group(ranks)
        if local == topo.local_rank:
            inter = group
    return Subgroups(intra=intra, inter=inter, intra_gather=intra_gather)
