#!/usr/bin/env python3
"""An emulated cluster on one machine: N network namespaces behind a rate-limited switch.

Why: gradient sparsification only pays when the network, not the computation, is the
bottleneck - the paper's setting is 16 GPUs on 1 Gbit/s Ethernet. On a CPU-only machine
the same compute/communication ratio is reached by slowing the *network* down instead:
every rank runs in its own network namespace, and every namespace is connected to a
shared switch through a link shaped with ``tc``.

Topology (all of it lives inside namespaces this script creates; the host's own
network is never touched)::

    omgs<pid>c<n>-n0  eth0 10.213.0.1 --tbf-->  p0 \
    omgs<pid>c<n>-n1  eth0 10.213.0.2 --tbf-->  p1  +-- br0 (bridge) in omgs<pid>c<n>-hub
    ...                                         ...  /

* one *hub* namespace holds a Linux bridge (the switch);
* each node namespace gets one veth pair: ``eth0`` inside the node, ``p<rank>`` on the
  bridge;
* a token-bucket filter (``tbf``) shapes BOTH ends of every veth: ``eth0`` limits what
  the node sends (node -> switch) and ``p<rank>`` limits what the switch delivers to it
  (switch -> node). Each node therefore has a full-duplex link of the given rate to a
  non-blocking switch, and incast (several nodes sending to one) queues at the switch
  port exactly as on real hardware;
* the veths' ``gso_max_size`` is lowered together with the tbf ``burst`` (see
  :func:`shaping_parameters`): tbf cannot send a GSO super-packet bigger than its
  burst, and a large burst would let every small message through at memory speed.

Link delay needs the ``netem`` qdisc. It is optional and detected: kernels built
without ``sch_netem`` (such as the one this project was developed on) reject it, and
:class:`Cluster` then raises :class:`ClusterError` saying so instead of silently
running without delay. Without netem the per-message latency is this machine's own
(about 0.3 ms per collective at 2 ranks).

Python API (``scripts/`` on ``sys.path``)::

    from netem_cluster import Cluster
    with Cluster(nodes=4, rate="100mbit") as cluster:
        result = cluster.run_ranks([sys.executable, "train.py"], timeout=300)
        result.check()                      # raises ClusterRunError if a rank failed
        print(result.returncodes, result.stdout[0])

Command line::

    python scripts/netem_cluster.py --nodes 4 --rate 100mbit -- python train.py --epochs 1
    python scripts/netem_cluster.py --nodes 2 --rate 50mbit --check
    python scripts/netem_cluster.py --nodes 2 --ranks-per-node 2 --rate 100mbit -- python train.py
    python scripts/netem_cluster.py --teardown          # remove leftovers of a killed run

Each rank's command runs with the variables ``torchrun`` would set (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR = node 0's address,
MASTER_PORT, OMP_NUM_THREADS=1) plus ``GLOO_SOCKET_IFNAME=eth0``: without it gloo
resolves the host name to 127.0.0.1 inside the namespace and cannot connect.

Several ranks per node (``--ranks-per-node L``, ``Cluster(..., ranks_per_node=L)``): the
L ranks of a node share its namespace (ranks ``n*L .. n*L + L - 1`` on node ``n``, as
torchrun numbers them), so traffic between them stays inside the namespace (the kernel
delivers packets to a local address over loopback, unshaped) and only traffic between
nodes crosses the shaped links - a multi-GPU node's fast local links against its slower
network. ``LOCAL_WORLD_SIZE=L`` lets the hook's ``topology="auto"`` pick the two-level
exchange.

Requirements: root (namespaces and qdiscs), ``ip`` and ``tc`` from iproute2, and a
kernel with veth, bridge and tbf. Everything is removed on exit, on an exception and on
SIGTERM/SIGHUP/SIGINT; after a SIGKILL, ``--teardown`` removes the namespaces of dead
owners (the owner's pid is part of every namespace name).

Link rates that make this CPU machine resemble GPUs on 1 GbE are derived in
docs/emulated-cluster.md and available as :data:`RECOMMENDED_RATES`.
"""

import argparse
import atexit
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

NAME_PREFIX = "omgs"
# 10.213.0.0/24 only ever exists inside this script's namespaces, so clusters of
# different processes can all use it without clashing (each has its own bridge).
SUBNET_PREFIX = "10.213.0."
SUBNET_BITS = 24
MAX_NODES = 250
MAX_RANKS_PER_NODE = 64
NODE_IFACE = "eth0"
BRIDGE = "br0"
BASE_PORT = 29500

# omgs<owner pid>c<cluster sequence number>-<hub | n<rank>>
_NAMESPACE_RE = re.compile(r"^omgs(\d+)c(\d+)-(hub|n\d+)$")
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*(/s)?\s*$", re.IGNORECASE)
_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "kibit": 1024, "mibit": 1024 ** 2, "gibit": 1024 ** 3}
_DELAY_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(us|ms|s)\s*$", re.IGNORECASE)
_DELAY_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
MIN_RATE_BPS = 100e3
MAX_RATE_BPS = 100e9

# Link rates (bits/s) that give a CPU step on this machine a communication/computation
# ratio of about 4, as GPUs training ResNet-50-class models on 1 GbE have. Derivation
# (from measured DDP iteration times) in docs/emulated-cluster.md and matching_rate().
RECOMMENDED_RATES = {
    ("resnet20", 2): "20mbit",
    ("resnet20", 4): "14mbit",
    # 8 ranks on 2 cores: compute 0.775 s, DDP 3.493 s at 6 Mbit/s (measured 2026-12-01)
    ("resnet20", 8): "5mbit",
    ("vgg16", 2): "600mbit",
    ("vgg16", 4): "485mbit",
}


class ClusterError(RuntimeError):
    """The emulated cluster cannot be built, used or removed (message says why)."""


class ClusterRunError(ClusterError):
    """A command run on the ranks failed or timed out; ``.result`` holds the details."""

    def __init__(self, message, result):
        super().__init__(message)
        self.result = result


# --------------------------------------------------------------------------- parsing


def parse_rate(text):
    """Parse a tc-style link rate such as ``"100mbit"`` or ``"1gbit"`` into bits/s.

    Accepted units (case-insensitive, optional ``/s``): bit, kbit, mbit, gbit, tbit
    (powers of 1000) and kibit, mibit, gibit (powers of 1024). tc's byte units (kbps,
    mbps, ...) are rejected on purpose: tc reads ``mbps`` as megaBYTES per second, which
    is rarely what is meant. The rate must lie between 100 kbit and 100 gbit.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        raise ClusterError(f"rate {text!r}: give a string with a unit, e.g. '100mbit'")
    if not isinstance(text, str):
        raise ClusterError(f"rate must be a string such as '100mbit', got {type(text).__name__}")
    match = _RATE_RE.match(text)
    if not match:
        raise ClusterError(f"rate {text!r} is not a number followed by a unit, e.g. '100mbit'")
    number, unit = float(match.group(1)), match.group(2).lower()
    if unit == "":
        raise ClusterError(f"rate {text!r} has no unit; write e.g. '{match.group(1)}mbit'")
    if unit not in _RATE_UNITS:
        hint = " (tc reads *bps as bytes/s; write the rate in bits, e.g. '100mbit')" \
            if unit.endswith("bps") else ""
        raise ClusterError(f"rate {text!r}: unknown unit {unit!r}; use one of "
                           f"{', '.join(_RATE_UNITS)}{hint}")
    bits = number * _RATE_UNITS[unit]
    if not MIN_RATE_BPS <= bits <= MAX_RATE_BPS:
        raise ClusterError(f"rate {text!r} = {bits:.0f} bit/s is outside the supported "
                           f"range 100kbit .. 100gbit")
    return int(round(bits))


def format_rate(bits_per_s):
    """Human-readable rate: 50000000 -> '50 Mbit/s'."""
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits_per_s >= scale:
            return f"{bits_per_s / scale:.4g} {unit}"
    return f"{bits_per_s:.4g} bit/s"


def parse_delay(text):
    """Parse a one-way link delay such as ``"5ms"`` or ``"200us"`` into seconds."""
    if not isinstance(text, str):
        raise ClusterError(f"delay must be a string such as '5ms', got {type(text).__name__}")
    match = _DELAY_RE.match(text)
    if not match:
        raise ClusterError(f"delay {text!r} is not a number followed by us, ms or s")
    seconds = float(match.group(1)) * _DELAY_UNITS[match.group(2).lower()]
    if not 0 < seconds <= 10:
        raise ClusterError(f"delay {text!r} must be positive and at most 10 s")
    return seconds


def shaping_parameters(rate_bps):
    """Return ``(gso_max_size, burst_bytes, limit_bytes)`` for a link of ``rate_bps``.

    tbf releases at most ``burst`` bytes back to back; a GSO super-packet larger than
    the burst is split in software (costing half of this machine's CPU at 1 gbit), and
    a burst far larger than a small message lets that message pass at memory speed
    after an idle gap (so small sparse messages would look free). Measured recipe:

    * up to 2.5 gbit: GSO size = 1 ms of line time clamped to [4 KiB, 16 KiB], and
      burst = max(1.25 * GSO size, 0.2 ms of line time);
    * faster links keep the default 64 KiB GSO size and the same burst rule.

    The timing error on small messages is then about burst / rate (0.2 ms at 1 gbit).
    The queue limit is 100 ms of line time (at least 256 KiB): deep enough that TCP
    never loses packets to a shallow local queue, like a switch port's buffer.
    """
    bytes_per_s = rate_bps / 8.0
    if rate_bps <= 2.5e9:
        gso = int(min(16384, max(4096, bytes_per_s * 1e-3)))
    else:
        gso = 65536
    burst = int(max(1.25 * gso, bytes_per_s * 0.2e-3))
    limit = int(max(256 * 1024, bytes_per_s * 0.1, 2 * burst))
    return gso, burst, limit


def matching_rate(compute_s, iteration_s, measured_rate_bps, target_ratio=4.0):
    """Link rate at which communication takes ``target_ratio`` times the computation.

    ``compute_s`` is the computation time of one iteration without communication and
    ``iteration_s`` a measured DDP iteration at link rate ``measured_rate_bps``; their
    difference is the communication the rate adds. That time scales as 1/rate when
    bandwidth dominates, so the rate giving ``comm = target_ratio * compute_s`` is
    ``measured_rate * (iteration_s - compute_s) / (target_ratio * compute_s)``.
    Measure at a rate where communication is clearly visible (not loopback speed).
    """
    if not compute_s > 0 or not target_ratio > 0 or not measured_rate_bps > 0:
        raise ValueError("compute_s, target_ratio and measured_rate_bps must be positive")
    comm_s = iteration_s - compute_s
    if not comm_s > 0:
        raise ValueError(f"iteration_s={iteration_s} must exceed compute_s={compute_s}: "
                         "no communication time is visible at that rate")
    return measured_rate_bps * comm_s / (target_ratio * compute_s)


# ------------------------------------------------------------------ host requirements


def unavailable_reason():
    """Why an emulated cluster cannot be built here, or None if it can (for test skips)."""
    if os.name != "posix" or not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "needs root to create network namespaces and qdiscs"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"iproute2 tool(s) not found on PATH: {', '.join(missing)}"
    return None


def _command(argv, what):
    """Run an iproute2 command; raise ClusterError with its stderr if it fails."""
    proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise ClusterError(f"{what} failed: `{' '.join(argv)}`: "
                           f"{(proc.stderr or proc.stdout).strip()}")
    return proc.stdout


def list_namespaces():
    """Names of all network namespaces registered under /run/netns."""
    out = _command(["ip", "netns", "list"], "listing network namespaces")
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _delete_namespace(name):
    """Kill whatever still runs inside one of our namespaces, then delete it.

    Only namespaces named by this script reach here, so the processes inside are ranks
    this script started (by an earlier, killed run when called from --teardown).
    """
    pids = subprocess.run(["ip", "netns", "pids", name], stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _command(["ip", "netns", "delete", name], f"deleting namespace {name}")


def leftover_namespaces(include_live=False):
    """Namespaces created by this script whose owning process is gone.

    With ``include_live=True`` also those of running owners (other users' clusters!).
    """
    found = []
    for name in list_namespaces():
        match = _NAMESPACE_RE.match(name)
        if match and (include_live or not _pid_alive(int(match.group(1)))):
            found.append(name)
    return found


def teardown_leftovers(include_live=False):
    """Delete :func:`leftover_namespaces`; return the names removed."""
    removed = []
    for name in leftover_namespaces(include_live):
        _delete_namespace(name)
        removed.append(name)
    return removed


def netem_available():
    """Whether this kernel has the netem qdisc (needed for link delay).

    Probes with a throwaway namespace, so it needs the same rights as a cluster.
    """
    probe = f"{NAME_PREFIX}{os.getpid()}c{next(_CLUSTER_SEQUENCE)}-hub"
    _command(["ip", "netns", "add", probe], "creating a probe namespace")
    try:
        return _qdisc_supported(probe, "netem delay 1ms")
    finally:
        _delete_namespace(probe)


def _qdisc_supported(namespace, qdisc):
    proc = subprocess.run(["tc", "-n", namespace, "qdisc", "add", "dev", "lo", "root"]
                          + qdisc.split(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)
    if proc.returncode == 0:
        subprocess.run(["tc", "-n", namespace, "qdisc", "del", "dev", "lo", "root"],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return True
    return False


def _sequence():
    n = 0
    while True:
        yield n
        n += 1


_CLUSTER_SEQUENCE = _sequence()


# ------------------------------------------------------------------------ run results


@dataclass
class RunResult:
    """Outcome of :meth:`Cluster.run_ranks`: one entry per rank in every list.

    ``returncodes[r]`` is the exit status of rank r (negative: killed by that signal -
    after a timeout, or because another rank failed first). ``first_failure`` is the
    rank that failed first (None if all succeeded or the run timed out).
    """

    argv: list
    returncodes: list
    stdout: list
    stderr: list
    timed_out: bool
    elapsed_s: float
    first_failure: object = None

    @property
    def ok(self):
        return not self.timed_out and all(code == 0 for code in self.returncodes)

    def output(self, rank):
        """stdout followed by stderr of one rank."""
        return self.stdout[rank] + self.stderr[rank]

    def summary(self):
        if self.ok:
            return f"all {len(self.returncodes)} ranks exited 0 in {self.elapsed_s:.1f} s"
        head = (f"timed out after {self.elapsed_s:.1f} s" if self.timed_out
                else f"rank {self.first_failure} failed first")
        lines = [f"`{' '.join(map(str, self.argv))}`: {head}; exit codes {self.returncodes}"]
        for rank, code in enumerate(self.returncodes):
            if code != 0:
                tail = self.output(rank).strip().splitlines()[-8:]
                lines.append(f"--- rank {rank} (exit {code}), last lines:")
                lines.extend("    " + line for line in tail)
        return "\n".join(lines)

    def check(self):
        """Return self if every rank exited 0, else raise :class:`ClusterRunError`."""
        if not self.ok:
            raise ClusterRunError(self.summary(), self)
        return self


@dataclass
class Throughput:
    """A measured one-way TCP transfer: payload bytes over the receiver's elapsed time."""

    bits_per_s: float
    nbytes: int
    seconds: float


# The receiver times the transfer from its first to its last received byte, so the
# connection set-up and the sender's start-up do not count.
_RECEIVER = r"""
import json, socket, sys, time
host, port, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((host, port)); srv.listen(1); srv.settimeout(timeout)
print("ready", flush=True)
conn, _ = srv.accept(); conn.settimeout(timeout)
buf = bytearray(1 << 20); counted = 0; first = last = None
while True:
    n = conn.recv_into(buf)
    if not n:
        break
    now = time.perf_counter()
    if first is None:
        first = now  # bytes of the first read arrived before the clock started
    else:
        counted += n; last = now
print(json.dumps({"bytes": counted, "seconds": (last - first) if last else 0.0}), flush=True)
"""

_SENDER = r"""
import socket, sys, time
host, port, seconds, max_bytes = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
sock = socket.create_connection((host, port), timeout=seconds + 30)
chunk = b"\0" * (256 * 1024); sent = 0; end = time.perf_counter() + seconds
while sent < max_bytes and time.perf_counter() < end:
    sent += sock.send(chunk[: max_bytes - sent])
sock.shutdown(socket.SHUT_WR); sock.recv(1); sock.close()
"""


# ---------------------------------------------------------------------------- cluster


class Cluster:
    """N network namespaces, one per rank, joined by a shaped bridge. Use as a context.

    Args:
        nodes: number of namespaces (nodes), 2 .. 250.
        ranks_per_node: ranks sharing each node's namespace (default 1); rank ``r``
            runs on node ``r // ranks_per_node``.
        rate: link rate of every node, a tc-style string ("1gbit", "100mbit", see
            :func:`parse_rate`), applied in both directions of each node's link.
        delay: optional one-way delay added to each node's outgoing traffic ("5ms");
            needs the netem qdisc - raises :class:`ClusterError` where it is missing.
        handle_signals: while the cluster exists, turn SIGTERM and SIGHUP into
            SystemExit so that the namespaces are removed (only from the main thread;
            previous handlers are restored afterwards).

    Attributes (after entering): ``namespaces`` (node namespace names, index = rank),
    ``addresses`` (IPv4 address of each rank), ``hub`` (the switch's namespace),
    ``rate_bps``, ``rate``, ``delay_s``.
    """

    def __init__(self, nodes=2, rate="1gbit", delay=None, handle_signals=True,
                 ranks_per_node=1):
        if isinstance(nodes, bool) or not isinstance(nodes, int):
            raise ClusterError(f"nodes must be an integer, got {nodes!r}")
        if not 2 <= nodes <= MAX_NODES:
            raise ClusterError(f"nodes must be between 2 and {MAX_NODES}, got {nodes}")
        if (isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int)
                or not 1 <= ranks_per_node <= MAX_RANKS_PER_NODE):
            raise ClusterError(f"ranks_per_node must be an integer between 1 and "
                               f"{MAX_RANKS_PER_NODE}, got {ranks_per_node!r}")
        self.nodes = nodes
        self.ranks_per_node = ranks_per_node
        self.world_size = nodes * ranks_per_node
        self.rate_bps = parse_rate(rate)
        self.rate = f"{self.rate_bps}bit"
        self.delay_s = None if delay is None else parse_delay(delay)
        self.handle_signals = handle_signals
        self.gso_max_size, self.burst_bytes, self.limit_bytes = shaping_parameters(self.rate_bps)
        tag = f"{NAME_PREFIX}{os.getpid()}c{next(_CLUSTER_SEQUENCE)}"
        self.hub = f"{tag}-hub"
        self.namespaces = [f"{tag}-n{rank}" for rank in range(nodes)]
        self.addresses = [f"{SUBNET_PREFIX}{rank + 1}" for rank in range(nodes)]
        self._created = []  # namespaces that exist, in creation order
        self._procs = set()  # live rank processes, killed on teardown
        self._lock = threading.Lock()
        self._saved_handlers = {}
        self._next_port = BASE_PORT
        self.active = False

    # -- naming
    def iface(self, rank):
        """Interface name of ``rank`` inside its namespace (its GLOO_SOCKET_IFNAME)."""
        self._check_rank(rank)
        return NODE_IFACE

    def namespace(self, rank):
        """The namespace ``rank`` runs in (its node's)."""
        return self.namespaces[self.node_of(rank)]

    def node_of(self, rank):
        """The node (namespace index) of ``rank``: ``rank // ranks_per_node``."""
        self._check_rank(rank)
        return rank // self.ranks_per_node

    def _check_rank(self, rank):
        if (isinstance(rank, bool) or not isinstance(rank, int)
                or not 0 <= rank < self.world_size):
            raise ClusterError(f"rank must be an integer in [0, {self.world_size}), got {rank!r}")

    # -- lifecycle
    def __enter__(self):
        self.setup()
        return self

    def __exit__(self, *exc):
        self.teardown()
        return False

    def setup(self):
        """Create namespaces, bridge, veths and qdiscs. Removes everything on failure."""
        reason = unavailable_reason()
        if reason:
            raise ClusterError(f"cannot build an emulated cluster: {reason}")
        if self.active:
            raise ClusterError("cluster is already set up")
        self._install_signal_handlers()
        # also covers setup() without `with`: interpreter exit (SystemExit from a
        # signal included) still removes the namespaces
        atexit.register(self.teardown)
        try:
            self._build()
        except BaseException:
            self.teardown()
            raise
        self.active = True
        return self

    def _build(self):
        hub = self.hub
        self._add_namespace(hub)
        _command(["ip", "-n", hub, "link", "set", "lo", "up"], "bringing up hub loopback")
        if self.delay_s is not None and not _qdisc_supported(hub, "netem delay 1ms"):
            raise ClusterError(
                "link delay needs the netem qdisc, but this kernel has no sch_netem "
                "(tc: 'Specified qdisc kind is unknown'); run without a delay - the "
                "latency is then this machine's own")
        _command(["ip", "-n", hub, "link", "add", BRIDGE, "type", "bridge"], "creating bridge")
        _command(["ip", "-n", hub, "link", "set", BRIDGE, "up"], "bringing up bridge")
        gso = str(self.gso_max_size)
        for rank, (ns, addr) in enumerate(zip(self.namespaces, self.addresses)):
            port = f"p{rank}"
            self._add_namespace(ns)
            # create the pair inside the hub and move one end into the node at once:
            # the host namespace never sees either interface.
            _command(["ip", "-n", hub, "link", "add", port, "gso_max_size", gso, "type", "veth",
                      "peer", "name", NODE_IFACE, "netns", ns, "gso_max_size", gso],
                     f"creating veth for rank {rank}")
            _command(["ip", "-n", hub, "link", "set", port, "master", BRIDGE],
                     f"attaching rank {rank} to the bridge")
            _command(["ip", "-n", ns, "addr", "add", f"{addr}/{SUBNET_BITS}", "dev", NODE_IFACE],
                     f"addressing rank {rank}")
            for where, dev in ((ns, "lo"), (ns, NODE_IFACE), (hub, port)):
                _command(["ip", "-n", where, "link", "set", dev, "up"], f"bringing up {dev}")
            # node -> switch on eth0 (with the delay, if any); switch -> node on the port
            self._shape(ns, NODE_IFACE, self.delay_s)
            self._shape(hub, port, None)

    def _shape(self, namespace, dev, delay_s):
        tbf = ["tbf", "rate", self.rate, "burst", str(self.burst_bytes),
               "limit", str(self.limit_bytes)]
        base = ["tc", "-n", namespace, "qdisc", "add", "dev", dev]
        if delay_s is None:
            _command(base + ["root", "handle", "1:"] + tbf, f"shaping {dev} in {namespace}")
        else:
            # netem delays, its child tbf limits the rate of what leaves the delay line
            _command(base + ["root", "handle", "1:", "netem", "delay", f"{delay_s * 1e6:.0f}us",
                             "limit", "100000"], f"adding delay on {dev} in {namespace}")
            _command(base + ["parent", "1:1", "handle", "10:"] + tbf,
                     f"shaping {dev} in {namespace}")

    def _add_namespace(self, name):
        _command(["ip", "netns", "add", name], f"creating namespace {name}")
        self._created.append(name)

    def teardown(self):
        """Kill running ranks and delete every namespace created. Safe to call twice."""
        atexit.unregister(self.teardown)
        ignored = self._ignore_signals()
        try:
            with self._lock:
                procs = list(self._procs)
            for proc in procs:
                _kill_group(proc)
            errors = []
            for name in reversed(self._created):
                try:
                    _delete_namespace(name)
                except ClusterError as exc:
                    errors.append(str(exc))
            self._created = []
            self.active = False
        finally:
            _restore_signals(ignored)
            self._restore_signal_handlers()
        if errors:
            raise ClusterError("teardown left namespaces behind (remove them with "
                               "`netem_cluster.py --teardown`): " + "; ".join(errors))

    # -- signals: turn SIGTERM/SIGHUP into SystemExit so the finally/with cleanup runs
    def _install_signal_handlers(self):
        if not self.handle_signals or threading.current_thread() is not threading.main_thread():
            return
        for signum in (signal.SIGTERM, signal.SIGHUP):
            self._saved_handlers[signum] = signal.signal(signum, _exit_on_signal)

    def _restore_signal_handlers(self):
        for signum, handler in self._saved_handlers.items():
            signal.signal(signum, handler)
        self._saved_handlers = {}

    def _ignore_signals(self):
        """Ignore termination signals during teardown so it cannot be cut short."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {s: signal.signal(s, signal.SIG_IGN)
                for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}

    # -- running commands
    def _require_active(self):
        if not self.active:
            raise ClusterError("cluster is not set up; use `with Cluster(...) as c:`")

    def rank_env(self, rank, master_port, env=None):
        """Environment for ``rank``: os.environ, then ``env``, then the torchrun variables.

        OMP_NUM_THREADS defaults to 1 (as torchrun sets it) unless ``env`` names it.
        """
        self._check_rank(rank)
        merged = dict(os.environ)
        merged["OMP_NUM_THREADS"] = "1"
        merged.update({str(k): str(v) for k, v in (env or {}).items()})
        merged.update({
            "RANK": str(rank), "WORLD_SIZE": str(self.world_size),
            "GROUP_RANK": str(rank // self.ranks_per_node),
            "LOCAL_RANK": str(rank % self.ranks_per_node),
            "LOCAL_WORLD_SIZE": str(self.ranks_per_node),
            "MASTER_ADDR": self.addresses[0], "MASTER_PORT": str(master_port),
            "GLOO_SOCKET_IFNAME": NODE_IFACE, "TP_SOCKET_IFNAME": NODE_IFACE,
            "OMGS_NETEM_RATE_BPS": str(self.rate_bps),
        })
        return merged

    def popen(self, rank, argv, **kwargs):
        """Start ``argv`` inside rank's namespace (a subprocess.Popen; caller waits)."""
        self._require_active()
        self._check_rank(rank)
        return subprocess.Popen(["ip", "netns", "exec", self.namespace(rank)] + list(argv),
                                **kwargs)

    def run_ranks(self, argv, env=None, timeout=600.0, cwd=None, master_port=None,
                  echo=False, failure_grace_s=3.0):
        """Run ``argv`` once per rank, each in its namespace, like torchrun would.

        Args:
            argv: the command (list of strings), identical for every rank.
            env: extra environment variables for every rank.
            timeout: seconds until all ranks are killed and the result marked timed out.
            cwd: working directory of the ranks (default: the current one).
            master_port: rendezvous port on rank 0; default: a fresh one per call (the
                namespaces are private, so no other program can hold it).
            echo: also print each output line as it arrives, prefixed ``[rank r]``.
            failure_grace_s: once a rank exits non-zero, the others get this long to
                notice and exit on their own (their error messages are often the
                useful ones) before they are killed.

        Returns a :class:`RunResult`; it does not raise when ranks fail - call
        ``result.check()`` for that.
        """
        self._require_active()
        argv = [str(a) for a in argv]
        if not argv:
            raise ClusterError("run_ranks needs a command")
        if not timeout or timeout <= 0:
            raise ClusterError(f"timeout must be positive, got {timeout!r}")
        if master_port is None:
            master_port = self._next_port
            self._next_port += 1
        stdout = [[] for _ in range(self.world_size)]
        stderr = [[] for _ in range(self.world_size)]
        procs, readers = [], []
        start = time.monotonic()
        timed_out, first_failure = False, None
        try:
            for rank in range(self.world_size):
                proc = self.popen(rank, argv, env=self.rank_env(rank, master_port, env),
                                  cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, start_new_session=True)
                with self._lock:
                    self._procs.add(proc)
                procs.append(proc)
                for stream, sink, out in ((proc.stdout, stdout[rank], sys.stdout),
                                          (proc.stderr, stderr[rank], sys.stderr)):
                    reader = threading.Thread(target=_pump, daemon=True,
                                              args=(stream, sink, out if echo else None,
                                                    f"[rank {rank}] "))
                    reader.start()
                    readers.append(reader)
            kill_at = None
            while True:
                codes = [p.poll() for p in procs]
                now = time.monotonic()
                if first_failure is None:
                    failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
                    if failed:
                        first_failure, kill_at = failed[0], now + failure_grace_s
                if all(c is not None for c in codes):
                    break
                if now - start >= timeout:
                    timed_out = True
                    break
                if kill_at is not None and now >= kill_at:
                    break
                time.sleep(0.02)
        finally:
            for proc in procs:  # the survivors of a failure or timeout, or all on Ctrl-C
                if proc.poll() is None:
                    _kill_group(proc)
            for proc in procs:
                proc.wait()
                with self._lock:
                    self._procs.discard(proc)
            for reader in readers:
                reader.join(timeout=5)
        return RunResult(argv=argv, returncodes=[p.returncode for p in procs],
                         stdout=["".join(s) for s in stdout], stderr=["".join(s) for s in stderr],
                         timed_out=timed_out, elapsed_s=time.monotonic() - start,
                         first_failure=None if timed_out else first_failure)

    def measure_throughput(self, src=0, dst=1, seconds=1.0, max_bytes=None, port=5201):
        """Measure one TCP stream from rank ``src`` to rank ``dst``; return a Throughput.

        The sender stops after ``seconds`` or ``max_bytes`` (default: 1.5x what the link
        can carry in that time, at most 1 GiB), whichever comes first.
        """
        self._require_active()
        self._check_rank(src)
        self._check_rank(dst)
        if src == dst:
            raise ClusterError("measure_throughput needs two different ranks")
        if self.node_of(src) == self.node_of(dst):
            raise ClusterError("measure_throughput needs ranks on two different nodes")
        if not 0 < seconds <= 60:
            raise ClusterError(f"seconds must be in (0, 60], got {seconds!r}")
        if max_bytes is None:
            max_bytes = int(min(1 << 30, 1.5 * self.rate_bps / 8 * seconds))
        limit = seconds + 30
        address = self.addresses[self.node_of(dst)]
        receiver = self.popen(dst, [sys.executable, "-c", _RECEIVER, address,
                                    str(port), str(limit)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
        sender = None
        try:
            if receiver.stdout.readline().strip() != "ready":
                raise ClusterError(f"throughput receiver failed: {receiver.stderr.read()}")
            sender = self.popen(src, [sys.executable, "-c", _SENDER, address,
                                      str(port), str(seconds), str(max_bytes)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
            _, sender_err = sender.communicate(timeout=limit)
            out, receiver_err = receiver.communicate(timeout=limit)
        except subprocess.TimeoutExpired as exc:
            raise ClusterError(f"throughput measurement timed out after {limit} s") from exc
        finally:
            for proc in (receiver, sender):
                if proc is not None and proc.poll() is None:
                    _kill_group(proc)
                    proc.wait()
        if sender.returncode != 0 or receiver.returncode != 0:
            raise ClusterError(f"throughput measurement failed: {sender_err} {receiver_err}")
        report = json.loads(out.strip().splitlines()[-1])
        if report["seconds"] <= 0:
            raise ClusterError("throughput measurement received too little data to time")
        return Throughput(bits_per_s=8 * report["bytes"] / report["seconds"],
                          nbytes=report["bytes"], seconds=report["seconds"])


def _pump(stream, sink, echo_to, prefix):
    """Copy a child's output into ``sink`` (and optionally echo it) line by line."""
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", errors="replace")
        sink.append(line)
        if echo_to is not None:
            echo_to.write(prefix + line)
            echo_to.flush()
    stream.close()


def _kill_group(proc):
    """SIGKILL a rank and anything it spawned (each rank leads its own session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            proc.kill()
        except ProcessLookupError:
            pass


def _exit_on_signal(signum, frame):
    raise SystemExit(128 + signum)


def _restore_signals(saved):
    for signum, handler in saved.items():
        signal.signal(signum, handler)


# -------------------------------------------------------------------------------- CLI


def build_parser():
    parser = argparse.ArgumentParser(
        description="Run a command once per rank in an emulated cluster of network "
                    "namespaces behind a rate-limited switch (see module docstring).",
        epilog="example: netem_cluster.py --nodes 4 --rate 100mbit -- python train.py")
    parser.add_argument("--nodes", type=int, default=2,
                        help="number of nodes (network namespaces; default 2)")
    parser.add_argument("--ranks-per-node", type=int, default=1,
                        help="ranks sharing each node's namespace: traffic between them "
                             "stays on loopback, between nodes it crosses the shaped links "
                             "(default 1)")
    parser.add_argument("--rate", default="1gbit",
                        help="link rate per node, both directions, e.g. 1gbit, 100mbit")
    parser.add_argument("--delay", default=None,
                        help="one-way delay per link, e.g. 5ms (needs the netem qdisc)")
    parser.add_argument("--timeout", type=float, default=3600.0,
                        help="seconds before all ranks are killed (default 3600)")
    parser.add_argument("--check", action="store_true",
                        help="measure TCP throughput from node 0 to node 1 and compare it "
                             "with --rate")
    parser.add_argument("--check-seconds", type=float, default=2.0,
                        help="duration of the --check transfer (default 2)")
    parser.add_argument("--teardown", action="store_true",
                        help="remove namespaces left by killed runs, then exit")
    parser.add_argument("--all", action="store_true",
                        help="with --teardown: also remove clusters of running processes")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="-- followed by the command each rank runs")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        if args.teardown:
            reason = unavailable_reason()
            if reason:
                raise ClusterError(f"cannot tear down: {reason}")
            removed = teardown_leftovers(include_live=args.all)
            print(f"removed {len(removed)} namespace(s)" + (": " + " ".join(removed)
                                                             if removed else ""))
            return 0
        if not command and not args.check:
            raise ClusterError("nothing to do: give --check and/or `-- command ...`")
        cluster = Cluster(nodes=args.nodes, rate=args.rate, delay=args.delay,
                          ranks_per_node=args.ranks_per_node)
        with cluster:
            print(f"emulated cluster: {cluster.nodes} nodes"
                  + (f" x {cluster.ranks_per_node} ranks" if cluster.ranks_per_node > 1 else "")
                  + f" at {format_rate(cluster.rate_bps)}"
                  f" per link (tbf burst {cluster.burst_bytes} B, gso_max_size "
                  f"{cluster.gso_max_size} B)"
                  + (f", one-way delay {cluster.delay_s * 1e3:g} ms" if cluster.delay_s else
                     ", no added delay"), flush=True)
            if args.check:
                result = cluster.measure_throughput(0, cluster.ranks_per_node,
                                                    seconds=args.check_seconds)
                print(f"node 0 -> node 1: {format_rate(result.bits_per_s)} achieved vs "
                      f"{format_rate(cluster.rate_bps)} configured "
                      f"({100 * result.bits_per_s / cluster.rate_bps:.1f}%, "
                      f"{result.nbytes} B in {result.seconds:.2f} s)", flush=True)
            if command:
                result = cluster.run_ranks(command, timeout=args.timeout, echo=True)
                print(result.summary(), file=sys.stderr if not result.ok else sys.stdout)
                if result.timed_out:
                    return 124
                return next((c if c > 0 else 128 - c for c in result.returncodes if c != 0), 0)
        return 0
    except ClusterError as exc:
        print(f"netem_cluster: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
