"""Tests for scripts/netem_cluster.py (the emulated cluster of network namespaces).

Parsing and rate arithmetic run everywhere; everything that builds namespaces needs
root, `ip` and `tc` and is skipped with the reason otherwise (CI runs as root).
"""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from script_loader import load_script

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"




netem_cluster = load_script("netem_cluster")
Cluster, ClusterError = netem_cluster.Cluster, netem_cluster.ClusterError

UNAVAILABLE = netem_cluster.unavailable_reason()
needs_netns = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"emulated cluster: {UNAVAILABLE}")


def namespaces_of(pid):
    prefix = f"{netem_cluster.NAME_PREFIX}{pid}c"
    return [n for n in netem_cluster.list_namespaces() if n.startswith(prefix)]


# ----------------------------------------------------------------- no root needed


@pytest.mark.parametrize("text, bits", [
    ("100mbit", 100_000_000), ("1gbit", 1_000_000_000), ("1Gbit", 1_000_000_000),
    ("50 mbit/s", 50_000_000), ("2.5gbit", 2_500_000_000), ("512kbit", 512_000),
    ("1mibit", 1_048_576),
])
def test_parse_rate_accepts_tc_bit_units(text, bits):
    assert netem_cluster.parse_rate(text) == bits


@pytest.mark.parametrize("text, message", [
    ("100", "no unit"), ("100mbps", "bytes/s"), ("fast", "not a number"),
    ("100furlongs", "unknown unit"), ("0mbit", "outside"), ("-5mbit", "not a number"),
    ("1tbit", "outside"), (100, "with a unit"),
])
def test_parse_rate_rejects_bad_rates_with_clear_error(text, message):
    with pytest.raises(ClusterError, match=message):
        netem_cluster.parse_rate(text)


def test_invalid_cluster_arguments_fail_before_touching_the_system():
    with pytest.raises(ClusterError, match="rate 'lots'"):
        Cluster(nodes=2, rate="lots")
    with pytest.raises(ClusterError, match="nodes must be between 2"):
        Cluster(nodes=1)
    with pytest.raises(ClusterError, match="delay"):
        Cluster(nodes=2, delay="soon")
    with pytest.raises(ClusterError, match="not set up"):
        Cluster(nodes=2).run_ranks(["true"])


def test_shaping_parameters_follow_the_measured_recipe():
    gso, burst, limit = netem_cluster.shaping_parameters(1e9)
    assert gso == 16384 and burst == 25_000  # 1 ms = 125 kB -> 16 KiB; 0.2 ms = 25 kB > 1.25 * gso
    gso, burst, _ = netem_cluster.shaping_parameters(14e6)
    assert gso == 4096 and burst == 5120  # 1 ms = 1750 B, clamped up to 4 KiB
    gso, burst, _ = netem_cluster.shaping_parameters(50e6)
    assert gso == 6250 and burst == 7812
    gso, burst, _ = netem_cluster.shaping_parameters(10e9)
    assert gso == 65536 and burst == 250_000  # 0.2 ms of 10 gbit beats 1.25 * 64 KiB
    assert limit >= 2 * burst


def test_matching_rate_reproduces_the_recommended_rates():
    # measured slowest-rank DDP iterations (docs/emulated-cluster.md): compute alone,
    # and the iteration at a measured rate -> rate for a comm/compute ratio of 4
    cases = {("resnet20", 2): (0.138, 0.241, 100e6), ("resnet20", 4): (0.281, 0.438, 100e6),
             ("resnet20", 8): (0.775, 3.493, 6e6), ("vgg16", 2): (0.293, 0.993, 1e9), ("vgg16", 4): (0.618, 1.816, 1e9)}
    for key, (compute, iteration, rate) in cases.items():
        derived = netem_cluster.matching_rate(compute, iteration, rate, target_ratio=4)
        recommended = netem_cluster.parse_rate(netem_cluster.RECOMMENDED_RATES[key])
        assert abs(derived - recommended) / recommended < 0.08, (key, derived)
    with pytest.raises(ValueError, match="must exceed"):
        netem_cluster.matching_rate(0.3, 0.2, 1e9)


# --------------------------------------------------------------------- root needed


@needs_netns
@pytest.mark.netns
def test_setup_and_teardown_leave_no_namespaces_even_when_the_command_fails():
    with Cluster(nodes=3, rate="1gbit") as cluster:
        names = cluster.namespaces + [cluster.hub]
        assert set(names) <= set(netem_cluster.list_namespaces())
        assert cluster.addresses == ["10.213.0.1", "10.213.0.2", "10.213.0.3"]
        # rank 1 fails at once; the others would wait for 60 s and must be killed
        code = "import os, sys, time\nif os.environ['RANK'] == '1': sys.exit(3)\ntime.sleep(60)"
        start = time.monotonic()
        result = cluster.run_ranks([sys.executable, "-c", code], timeout=30, failure_grace_s=0.5)
        assert time.monotonic() - start < 10
        assert not result.ok and result.first_failure == 1 and not result.timed_out
        assert result.returncodes[1] == 3
        assert result.returncodes[0] < 0 and result.returncodes[2] < 0  # killed
        with pytest.raises(netem_cluster.ClusterRunError, match="rank 1 failed first"):
            result.check()
    assert not set(names) & set(netem_cluster.list_namespaces())

    with pytest.raises(RuntimeError, match="boom"):
        with Cluster(nodes=2, rate="100mbit") as cluster:
            names = cluster.namespaces + [cluster.hub]
            raise RuntimeError("boom")
    assert not set(names) & set(netem_cluster.list_namespaces())


@needs_netns
@pytest.mark.netns
def test_run_ranks_sets_torchrun_environment_and_times_out():
    show = ("import os; print(' '.join(os.environ[k] for k in ('RANK', 'WORLD_SIZE', "
            "'LOCAL_RANK', 'LOCAL_WORLD_SIZE', 'MASTER_ADDR', 'GLOO_SOCKET_IFNAME', "
            "'OMP_NUM_THREADS', 'EXTRA')))")
    with Cluster(nodes=2, rate="1gbit") as cluster:
        result = cluster.run_ranks([sys.executable, "-c", show], env={"EXTRA": "x"}, timeout=30)
        result.check()
        for rank in range(2):
            assert result.stdout[rank].split() == [str(rank), "2", "0", "1", "10.213.0.1",
                                                   cluster.iface(rank), "1", "x"]
        result = cluster.run_ranks(["sleep", "30"], timeout=1.0)
        assert result.timed_out and not result.ok and result.elapsed_s < 5
        assert all(code < 0 for code in result.returncodes)


GLOO_ALL_REDUCE = textwrap.dedent("""
    import os, time, torch, torch.distributed as dist
    from datetime import timedelta
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank = dist.get_rank()
    small = torch.full((4,), float(rank + 1))
    dist.all_reduce(small)
    big = torch.ones(250_000)  # 1 MB: every rank must send at least 1 MB at W=2
    dist.all_reduce(big)  # warm-up (connections, allocation)
    start = time.perf_counter()
    dist.all_reduce(big)
    elapsed = time.perf_counter() - start
    print(f"sum={small.tolist()} big={big[0].item()} seconds={elapsed:.4f}", flush=True)
    dist.destroy_process_group()
""")


@needs_netns
@pytest.mark.netns
@pytest.mark.multiprocess
def test_two_node_gloo_all_reduce_goes_through_the_shaped_links():
    rate = "50mbit"
    with Cluster(nodes=2, rate=rate) as cluster:
        result = cluster.run_ranks([sys.executable, "-c", GLOO_ALL_REDUCE], timeout=60)
        result.check()
    for rank in range(2):
        line = result.stdout[rank].strip().splitlines()[-1]
        assert "sum=[3.0, 3.0, 3.0, 3.0]" in line
        assert "big=4.0" in line  # ones, all-reduced twice over 2 ranks
        seconds = float(line.split("seconds=")[1])
        # 1 MB per rank at 50 Mbit/s is >= 0.16 s; loopback would take ~1 ms
        assert seconds > 0.5 * 1e6 * 8 / netem_cluster.parse_rate(rate), line


@needs_netns
@pytest.mark.netns
def test_measured_throughput_is_within_20_percent_of_the_rate():
    with Cluster(nodes=2, rate="50mbit") as cluster:
        measured = cluster.measure_throughput(0, 1, seconds=1.0)
    assert measured.nbytes > 1_000_000
    assert abs(measured.bits_per_s - cluster.rate_bps) / cluster.rate_bps < 0.20, measured


@needs_netns
@pytest.mark.netns
def test_switch_port_is_shaped_too_so_incast_shares_the_receivers_link():
    # two senders into one node: each sender's own link allows the full rate, so only
    # the shaping of the switch -> receiver direction keeps the sum at one link's rate
    import threading

    with Cluster(nodes=3, rate="50mbit") as cluster:
        results = {}

        def send(src, port):
            results[src] = cluster.measure_throughput(src, 1, seconds=1.5, port=port)

        threads = [threading.Thread(target=send, args=(src, 5300 + src)) for src in (0, 2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
    total = sum(r.bits_per_s for r in results.values())
    assert len(results) == 2
    assert abs(total - cluster.rate_bps) / cluster.rate_bps < 0.20, results
    assert all(r.bits_per_s < 0.75 * cluster.rate_bps for r in results.values()), results


@needs_netns
@pytest.mark.netns
def test_delay_is_applied_or_refused_clearly():
    if netem_cluster.netem_available():
        with Cluster(nodes=2, rate="1gbit", delay="2ms") as cluster:
            qdiscs = subprocess.run(["tc", "-n", cluster.namespaces[0], "qdisc", "show"],
                                    capture_output=True, text=True).stdout
            assert "netem" in qdiscs and "tbf" in qdiscs
    else:
        cluster = Cluster(nodes=2, rate="1gbit", delay="2ms")
        with pytest.raises(ClusterError, match="no sch_netem"):
            cluster.setup()
        assert not set(cluster.namespaces + [cluster.hub]) & set(netem_cluster.list_namespaces())


OWNER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {scripts!r})
    from netem_cluster import Cluster
    cluster = Cluster(nodes=2, rate="10mbit").setup()
    print("up", flush=True)
    time.sleep(60)
""")


def _start_owner():
    proc = subprocess.Popen([sys.executable, "-c", OWNER.format(scripts=str(SCRIPTS))],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "up"
    assert len(namespaces_of(proc.pid)) == 3
    return proc


@needs_netns
@pytest.mark.netns
def test_sigterm_tears_down_and_teardown_removes_leftovers_of_a_killed_run():
    owner = _start_owner()
    owner.send_signal(signal.SIGTERM)
    assert owner.wait(timeout=10) == 128 + signal.SIGTERM
    assert namespaces_of(owner.pid) == []

    owner = _start_owner()
    owner.kill()  # SIGKILL: nothing can clean up
    owner.wait(timeout=10)
    assert len(namespaces_of(owner.pid)) == 3
    removed = netem_cluster.teardown_leftovers()
    assert set(namespaces_of(owner.pid)) == set()
    assert len([n for n in removed if n.startswith(f"omgs{owner.pid}c")]) == 3


@needs_netns
@pytest.mark.netns
def test_cli_runs_the_command_per_rank_and_returns_the_failure():
    rank_code = ("import os, sys; print('hello', os.environ['RANK']); "
                 "sys.exit(int(os.environ['RANK']) * 5)")
    cmd = [sys.executable, str(SCRIPTS / "netem_cluster.py"), "--nodes", "2", "--rate", "1gbit",
           "--timeout", "30", "--", sys.executable, "-c", rank_code]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 5, proc.stderr
    assert "[rank 0] hello 0" in proc.stdout and "[rank 1] hello 1" in proc.stdout
    assert "rank 1 failed first" in proc.stderr
    proc = subprocess.run([sys.executable, str(SCRIPTS / "netem_cluster.py"), "--rate", "9mbps",
                           "--check"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "bytes/s" in proc.stderr
