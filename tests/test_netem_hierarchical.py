"""The emulated cluster with several ranks per node (``--ranks-per-node``): a node's ranks
share its namespace, so traffic between them stays off the shaped link, and the two-level
exchange puts fewer bytes on it than the flat one. Bytes are read from each node's tc
qdisc counters (no timing). Needs root, ``ip`` and ``tc``; skipped otherwise."""

import json
import sys
from pathlib import Path

import pytest
from script_loader import load_script

ROOT = Path(__file__).resolve().parents[1]
netem_cluster = load_script("netem_cluster")
Cluster, ClusterError = netem_cluster.Cluster, netem_cluster.ClusterError
UNAVAILABLE = netem_cluster.unavailable_reason()
needs_netns = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"emulated cluster: {UNAVAILABLE}")


def test_ranks_per_node_is_validated_and_maps_ranks_to_nodes():
    with pytest.raises(ClusterError, match="ranks_per_node"):
        Cluster(nodes=2, ranks_per_node=0)
    cluster = Cluster(nodes=2, ranks_per_node=3)
    assert cluster.world_size == 6
    assert [cluster.node_of(r) for r in range(6)] == [0, 0, 0, 1, 1, 1]
    assert cluster.namespace(4) == cluster.namespaces[1]
    env = cluster.rank_env(4, 29500)
    assert (env["RANK"], env["WORLD_SIZE"], env["GROUP_RANK"], env["LOCAL_RANK"],
            env["LOCAL_WORLD_SIZE"]) == ("4", "6", "1", "1", "3")
    with pytest.raises(ClusterError, match=r"rank must be an integer in \[0, 6\)"):
        cluster.rank_env(6, 29500)


@needs_netns
@pytest.mark.netns
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_node_local_traffic_is_unshaped_and_two_level_sends_less_between_nodes():
    env = {"PYTHONPATH": str(ROOT / "src")}
    with Cluster(nodes=2, ranks_per_node=2, rate="200mbit") as cluster:
        result = cluster.run_ranks([sys.executable, str(ROOT / "tests" / "netem_hook_bytes.py")],
                                   env=env, timeout=200, cwd=str(ROOT))
        result.check()
    reports = [json.loads(line.split("REPORT ", 1)[1]) for out in result.stdout
               for line in out.splitlines() if line.startswith("REPORT ")]
    assert sorted(r["rank"] for r in reports) == [0, 1, 2, 3]
    for r in reports:
        rank = r["rank"]
        assert r["env"] == [str(rank), "4", str(rank // 2), str(rank % 2), "2"]
        # 1 MB all-reduced inside the node: only the barriers' bytes on the link (and the
        # ACKs of other traffic: up to 58 kB seen), far below the 1 MB it would put there
        assert r["intra_all_reduce"] < 150_000, r
        assert r["world_all_reduce"] > 1_000_000, r
        flat, two = r["flat"], r["hierarchical"]
        assert (flat["kind"], two["kind"]) == ("flat", "hierarchical")
        # the algorithm's own count: 4x fewer per rank on 2 x 2 (docs/hierarchical.md)
        assert flat["counted_per_step"] > 3.5 * two["counted_per_step"], r
        # on the wire (the node's link): fewer too (gloo's ring all-gather crosses each
        # node boundary with 3 payloads; the two-level all-gather with the node's 2 halves)
        assert flat["wire_per_step"] > 2 * two["wire_per_step"], r
