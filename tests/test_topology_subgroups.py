"""A DDP model on a subgroup of the job: two models side by side on one node, or the
data-parallel groups of a model-parallel job (``DDP(..., process_group=subgroup)``).

Before, ``register()`` with the default options failed on such a model: the topology was
resolved as if the subgroup were the whole job, so torchrun's ``LOCAL_WORLD_SIZE=4``
"did not divide the world size 2", and nodes were numbered by subgroup rank (a group of
ranks 0 and 2 on two nodes was counted as one node). Now nodes are the job's and a
subgroup always exchanges flat (the two-level exchange's node groups need every rank of
the job).
"""

import os

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import omgs_hook
from omgs_hook.topology import Topology, resolve_topology

from ddp_harness import run_ranks

WORLD = 4
STEPS = 8


# ------------------------------------------------------------------------ pure resolution
def test_a_subgroup_on_one_node_resolves_flat_with_the_jobs_node_layout():
    env = {"LOCAL_WORLD_SIZE": "4"}
    topo = resolve_topology("auto", None, 2, 1, env, group_ranks=[2, 3], job_world_size=4)
    assert topo.kind == "flat"
    assert (topo.ranks_per_node, topo.nodes, topo.node, topo.local_rank) == (2, 1, 0, 3)
    assert topo.world_size == 2
    assert topo.to_dict()["subgroup_size"] == 2
    assert "subgroup" in topo.describe()


def test_a_subgroup_across_nodes_counts_the_jobs_nodes():
    env = {"LOCAL_WORLD_SIZE": "2"}
    # ranks 1 and 3 of a 2 x 2 job: one on each node
    topo = resolve_topology("auto", None, 2, 1, env, group_ranks=[1, 3], job_world_size=4)
    assert (topo.kind, topo.ranks_per_node, topo.nodes, topo.node, topo.local_rank) == (
        "flat", 1, 2, 1, 1)
    # a data-parallel group of an 8-rank, 2-node job with 2 of its ranks on each node: two
    # levels would apply, but the node groups cannot be made by the subgroup alone
    topo = resolve_topology("auto", 4, 4, 2, {}, group_ranks=[0, 2, 4, 6], job_world_size=8)
    assert (topo.kind, topo.ranks_per_node, topo.nodes, topo.node) == ("flat", 2, 2, 1)
    # uneven: ranks 0, 1 on node 0 and rank 2 on node 1
    topo0 = resolve_topology("auto", 2, 3, 0, {}, group_ranks=[0, 1, 2], job_world_size=4)
    topo2 = resolve_topology("auto", 2, 3, 2, {}, group_ranks=[0, 1, 2], job_world_size=4)
    assert (topo0.ranks_per_node, topo2.ranks_per_node, topo0.nodes) == (2, 1, 2)


def test_the_whole_job_as_a_group_is_the_default_groups_topology():
    env = {"LOCAL_WORLD_SIZE": "2"}
    whole = resolve_topology("auto", None, 4, 3, env, group_ranks=[0, 1, 2, 3], job_world_size=4)
    assert whole == resolve_topology("auto", None, 4, 3, env)
    assert whole == Topology("hierarchical", 2, 2, 3, "auto")


def test_bad_subgroup_options_name_the_option():
    with pytest.raises(ValueError, match="topology='hierarchical'.*2 of the job's 4 ranks"):
        resolve_topology("hierarchical", 2, 2, 0, {}, group_ranks=[0, 1], job_world_size=4)
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE.*job's world size 6"):
        resolve_topology("auto", None, 2, 0, {"LOCAL_WORLD_SIZE": "4"}, group_ranks=[0, 1],
                         job_world_size=6)
    with pytest.raises(ValueError, match="job_world_size"):
        resolve_topology("auto", None, 2, 0, {}, group_ranks=[0, 1])


# ------------------------------------------------------------------------ on gloo ranks
def _replica_group(rank, groups):
    """This rank's process group of ``groups``; every rank creates every group, in the
    same order (as dist.new_group requires)."""
    mine = None
    for members in groups:
        group = dist.new_group(members)
        if rank in members:
            mine = group
    return mine


def subgroup_worker(rank, world_size, local_world_size, groups, topology="auto"):
    """Each group of ranks trains its own DDP model with the default register() options
    (sparse from the second step); returns its parameters, stats and any error."""
    os.environ["LOCAL_WORLD_SIZE"] = str(local_world_size)
    mine = _replica_group(rank, groups)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    ddp = DDP(model, process_group=mine, bucket_cap_mb=0.001)
    try:
        state = omgs_hook.register(ddp, density=0.1, warmup_steps=1, allow_dense=False,
                                   log_every=0, topology=topology)
    except ValueError as exc:
        return {"error": str(exc)}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        ddp(torch.randn(8, 16, generator=generator)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    stats = state.stats()
    last = stats["last"]
    state.close()
    return {"params": [p.detach().clone() for p in model.parameters()],
            "topology": stats["topology"], "sparse": last["dense_groups"] < last["groups"],
            "bytes": last["bytes_sent"], "inter": last["inter_node_bytes"],
            "intra": last["intra_node_bytes"]}


def _train_groups(local_world_size, groups):
    """Run subgroup_worker on every rank; check that it trained and that each group's
    ranks agree; return the per-rank results."""
    results = run_ranks("test_topology_subgroups", "subgroup_worker", world_size=WORLD,
                        timeout=150, local_world_size=local_world_size, groups=groups)
    assert all("error" not in r for r in results), [r.get("error") for r in results]
    _same_within_groups(results, groups)
    return results


def _same_within_groups(results, groups):
    for members in groups:
        first = results[members[0]]["params"]
        for r in members[1:]:
            for a, b in zip(first, results[r]["params"]):
                assert torch.equal(a, b), f"ranks {members[0]} and {r} differ"
    # the groups trained on different data: a model shared by accident would agree
    assert not all(torch.equal(a, b) for a, b in
                   zip(results[groups[0][0]]["params"], results[groups[1][0]]["params"]))


def test_two_models_side_by_side_on_one_node_train_with_the_default_options():
    """torchrun --nproc_per_node=4 with a DDP model per pair of ranks: this registration
    used to fail ("LOCAL_WORLD_SIZE=4 does not divide the world size 2")."""
    for rank, r in enumerate(_train_groups(local_world_size=4, groups=[[0, 1], [2, 3]])):
        assert r["sparse"]
        assert r["topology"]["kind"] == "flat"
        assert (r["topology"]["nodes"], r["topology"]["local_rank"]) == (1, rank)
        assert r["inter"] == 0 and r["intra"] == r["bytes"] > 0  # the peer is on this node


def test_data_parallel_groups_across_nodes_count_inter_node_bytes_by_the_jobs_nodes():
    """2 nodes x 2 ranks, DDP over ranks {0, 2} and {1, 3} (one rank per node in each):
    every byte goes to the other node. Numbering nodes by subgroup rank counted both
    ranks of a group as one node and reported no inter-node bytes at all."""
    for rank, r in enumerate(_train_groups(local_world_size=2, groups=[[0, 2], [1, 3]])):
        assert r["topology"]["kind"] == "flat"
        assert (r["topology"]["nodes"], r["topology"]["node"]) == (2, rank // 2)
        assert r["inter"] == r["bytes"] > 0 and r["intra"] == 0


def test_an_explicit_two_level_exchange_on_a_subgroup_is_refused_on_every_rank():
    groups = [[0, 1], [2, 3]]
    results = run_ranks("test_topology_subgroups", "subgroup_worker", world_size=WORLD,
                        timeout=150, local_world_size=2, groups=groups,
                        topology="hierarchical")
    for r in results:
        assert "topology='hierarchical'" in r["error"] and "Pass topology='flat'" in r["error"]


def rank_zero_checkpoint_worker(rank, world_size, path):
    """Two replica groups, [0, 1] and [2, 3]; global rank 0 alone writes the hook's state
    (the usual pattern for model weights) and every rank loads it."""
    mine = _replica_group(rank, ([0, 1], [2, 3]))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    ddp = DDP(model, process_group=mine, bucket_cap_mb=0)
    options = dict(density=0.1, warmup_steps=1, allow_dense=False, log_every=0)
    state = omgs_hook.register(ddp, **options)
    generator = torch.Generator().manual_seed(100 + rank)
    for _ in range(4):
        ddp(torch.randn(8, 16, generator=generator)).square().mean().backward()
        model.zero_grad()
    if rank == 0:
        torch.save(state.state_dict(), path)
    dist.barrier()
    saved = torch.load(path, weights_only=True)
    out = {}
    try:
        omgs_hook.OMGSState(module=model, process_group=mine, **options).load_state_dict(saved)
        out["error"] = None
    except ValueError as exc:
        out["error"] = str(exc)
    reset = omgs_hook.OMGSState(module=model, process_group=mine,
                                on_world_size_change="reset", **options)
    reset.load_state_dict(saved)
    out["reset_residuals"] = len(reset.memory)
    state.close()
    return out


@pytest.mark.timeout(150)
def test_a_checkpoint_of_global_rank_zero_is_refused_on_every_other_rank(tmp_path):
    """Residuals are each rank's own. The check compared ranks within the DDP model's
    process group only, so rank 0 of the second group ([2, 3]) - global rank 2 - took
    global rank 0's residuals without a word (its own error feedback lost, rank 0's
    applied twice), and rank 3 was told the state was "loaded on rank 1"."""
    results = run_ranks("test_topology_subgroups", "rank_zero_checkpoint_worker",
                        world_size=WORLD, timeout=150, path=str(tmp_path / "hook.pt"))
    assert results[0]["error"] is None and results[0]["reset_residuals"] > 0
    accepted = [rank for rank in (1, 2, 3) if results[rank]["error"] is None]
    assert not accepted, f"ranks {accepted} loaded global rank 0's residuals"
    for rank in (1, 2, 3):
        error = results[rank]["error"]
        assert error.startswith(f"rank: state saved by global rank 0 (rank 0 of its process "
                                f"group), loaded on global rank {rank} (rank {rank % 2} of "
                                "its process group)"), error
        assert "on_world_size_change='reset'" in error
        assert results[rank]["reset_residuals"] == 0
