#!/usr/bin/env python3
"""Cluster-scale simulation: OMGS-SGD vs TopK-SGD vs LAGS vs dense, 2 .. 2048 workers.

The planner's timeline model (``omgs_hook.cost_model``) predicts the iteration time of
any grouping of a model's gradients. This script feeds it layer profiles of ResNet-50,
VGG-16 and Inception-v3 (``src/omgs_hook/data/*.json``, built by
scripts/make_layer_profiles.py, which states where every number comes from) and a
model of a 1 Gbit/s Ethernet cluster, for a range of world sizes W, and compares:

* ``optimal``   OMGS-SGD: the planner's optimal merge of layers into groups;
* ``greedy``    the planner's greedy merge;
* ``layerwise`` LAGS-SGD: every layer is its own group (top-k and all-gather per layer);
* ``single``    TopK-SGD: one group holding the whole model, sent after backward ends;
* ``dense``     plain S-SGD as DDP runs it: ring all-reduce of 25 MB buckets;
* ``optimal+dense`` (beyond the paper) the optimal plan when each group may also be
  sent as a dense all-reduce - what the hook's planner does with a dense cost.

Cluster model (``NetworkModel``) - one ring collective over W workers, each link with
goodput ``1/beta0`` bytes/s and per-step latency ``alpha0``:

* sparse all-gather, each rank contributing m bytes: every rank receives (W-1)*m bytes
  in W-1 ring steps, so ``t = (W-1)*alpha0 + (W-1)*beta0*m``. The planner's comm model
  is ``alpha + beta*m`` per instance, so each W gets its own instance with
  ``alpha = (W-1)*alpha0`` and ``beta = (W-1)*beta0``;
* dense ring all-reduce of m bytes (reduce-scatter + all-gather, 2(W-1) steps, each
  moving m/W bytes): ``t = 2(W-1)*alpha0 + 2(W-1)/W * beta0 * m``.

Defaults: 1 Gbit/s links at 94.1% TCP goodput (1448 payload bytes per 1538-byte
Ethernet frame incl. preamble and gap: 117.7 MB/s, so beta0 = 8.50 ns/B) and
alpha0 = 100 us per ring step (one small TCP message over a switch plus the
communication library's software overhead; an assumption, see ``--alpha0``).

GPU top-k (``--topk-c0/--topk-c1``): t = 100 us + 0.5 ns per element (12.8 ms for all
25.6M ResNet-50 gradients at once) - an assumed figure for an exact top-k on a
V100-class GPU, stated rather than measured (no GPU was available), c2 = 0.

Density 0.001 (the paper's). All numbers are predictions of the model, not measurements.

Two-level topology (``--topology NxL``, issue 12): N nodes of L GPUs, NVLink-class links
inside a node and one NIC per node (``--inter-gbit``, default 1 and 25 Gbit/s). It
compares flat OMGS (one packed sparse all-gather among all W = N*L ranks) with the
two-level exchange (intra-node reduce-scatter, top-k of the shard, sparse all-gather
among the N ranks of the same local rank, intra-node all-gather), both planned by the
optimal planner (``TopologyModel`` states the collective costs):

* flat all-gather, m bytes per rank: a ring over the W ranks (node by node) has W-1
  steps, and in every step one chunk crosses each node boundary, so the node's one NIC
  carries W-1 chunks per all-gather - the L GPUs of a node *share* it; the intra-node
  steps are far faster and hide under the NIC's. ``t = (W-1)*(alpha0 + beta0*m)``, the
  ``NetworkModel.allgather(W)`` cost;
* two-level inter-node all-gather, m bytes per rank: L rings of N ranks (one per local
  rank) run at once through the same NIC, so each of their N-1 steps moves L chunks
  through it: ``t = (N-1)*alpha0 + (N-1)*L*beta0*m``;
* intra-node reduce-scatter / all-gather, m bytes per rank: ``alpha_i + (L-1)*m / bw_i``
  (ring over L GPUs; defaults alpha_i = 10 us per collective, bw_i = 150 GB/s, see
  docs/simulation.md).

Usage::

    python scripts/simulate.py                               # print the tables
    python scripts/simulate.py --topology 16x8 --update-doc docs/simulation.md
    python scripts/simulate.py --update-doc docs/simulation.md --plot docs/simulation.png
    python scripts/simulate.py --models vgg16 --world-sizes 4 16 --json out.json
"""

import argparse
import json
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from omgs_hook.cost_model import (
    Instance,
    LinearCost,
    TopkCost,
    Unit,
    hierarchical_instance,
    selected_k,
    simulate,
    step_inter_node_bytes,
)

MODEL_NAMES = ("resnet50", "vgg16", "inception_v3")
SPARSE_STRATEGIES = ("optimal", "greedy", "layerwise", "single")
STRATEGY_LABELS = {"optimal": "OMGS (optimal)", "greedy": "greedy merge",
                   "layerwise": "LAGS (layer-wise)", "single": "TopK-SGD (single)",
                   "dense": "dense S-SGD", "optimal+dense": "OMGS + dense groups"}
DEFAULT_WORLD_SIZES = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
PAPER_WORLD_SIZE = 16
DEFAULT_DENSITY = 0.001
DDP_BUCKET_BYTES = 25 * 1024 * 1024
GOODPUT_FRACTION = 1448 / 1538  # TCP payload per Ethernet frame on the wire (MTU 1500)
DOC_BEGIN = "<!-- BEGIN simulate.py output -->"
DOC_END = "<!-- END simulate.py output -->"
TOPOLOGY_BEGIN = "<!-- BEGIN simulate.py topology output -->"
TOPOLOGY_END = "<!-- END simulate.py topology output -->"
DEFAULT_TOPOLOGY = (16, 8)
DEFAULT_INTER_GBIT = (1.0, 25.0)
INTRA_ALPHA_S = 10e-6
INTRA_BANDWIDTH_BPS = 150e9  # bytes/s per GPU and direction (NCCL bus bandwidth, NVLink)


class SimulationError(ValueError):
    """Bad simulation input (message names the offending option or file field)."""


# ------------------------------------------------------------------- network model


@dataclass(frozen=True)
class NetworkModel:
    """Ring collectives over W workers on links of ``bandwidth_bps`` (see module docstring).

    Args:
        bandwidth_bps: line rate of every worker's link in bits/s (1e9 = 1 GbE).
        alpha0_s: latency of one ring step (one message between neighbours).
        goodput_fraction: share of the line rate left for payload after protocol headers.
    """

    bandwidth_bps: float = 1e9
    alpha0_s: float = 100e-6
    goodput_fraction: float = GOODPUT_FRACTION

    def __post_init__(self):
        if not self.bandwidth_bps > 0:
            raise SimulationError(f"bandwidth must be positive, got {self.bandwidth_bps!r}")
        if not self.alpha0_s >= 0:
            raise SimulationError(f"alpha0 must be non-negative, got {self.alpha0_s!r}")
        if not 0 < self.goodput_fraction <= 1:
            raise SimulationError(f"goodput fraction must be in (0, 1], got "
                                  f"{self.goodput_fraction!r}")

    @property
    def beta0_s_per_byte(self):
        return 8.0 / (self.bandwidth_bps * self.goodput_fraction)

    def allgather(self, world_size):
        """Ring all-gather where each rank contributes m bytes: (W-1)(alpha0 + beta0*m)."""
        _check_world_size(world_size)
        steps = world_size - 1
        return LinearCost(steps * self.alpha0_s, steps * self.beta0_s_per_byte)

    def allreduce(self, world_size):
        """Ring all-reduce of m bytes: 2(W-1)*alpha0 + 2(W-1)/W * beta0 * m."""
        _check_world_size(world_size)
        steps = 2 * (world_size - 1)
        return LinearCost(steps * self.alpha0_s, steps / world_size * self.beta0_s_per_byte)


def _check_world_size(world_size):
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 2:
        raise SimulationError(f"world size must be an integer >= 2, got {world_size!r}")


DEFAULT_TOPK = TopkCost(c0=100e-6, c1=0.5e-9, c2=0.0)


# ------------------------------------------------------------------- layer profiles


def profile_path(name):
    """Path of a shipped layer profile (``resnet50``, ``vgg16``, ``inception_v3``)."""
    if name not in MODEL_NAMES:
        raise SimulationError(f"unknown model {name!r}; shipped profiles: "
                              f"{', '.join(MODEL_NAMES)} (or give a path to a JSON file)")
    return resources.files("omgs_hook").joinpath("data", f"{name}.json")


def load_layer_profile(name_or_path):
    """Load and validate a layer profile by shipped name or JSON path.

    A profile needs ``model`` (str), ``forward_s`` (>= 0) and ``layers``: a non-empty
    list of objects with ``numel`` (positive int) and ``backward_s`` (>= 0) in
    gradient-ready order; other fields (names, sources) are documentation.
    """
    text_name = str(name_or_path)
    if text_name in MODEL_NAMES:
        path = profile_path(text_name)
    else:
        path = Path(text_name)
        if not path.suffix == ".json":
            raise SimulationError(f"unknown model {text_name!r}; shipped profiles: "
                                  f"{', '.join(MODEL_NAMES)} (or give a path to a JSON file)")
    try:
        profile = json.loads(path.read_text())
    except FileNotFoundError:
        raise SimulationError(f"layer profile {text_name}: file not found") from None
    except json.JSONDecodeError as exc:
        raise SimulationError(f"layer profile {text_name}: not valid JSON ({exc})") from None
    if not isinstance(profile, dict):
        raise SimulationError(f"layer profile {text_name}: must be a JSON object")
    for key in ("model", "forward_s", "layers"):
        if key not in profile:
            raise SimulationError(f"layer profile {text_name}: {key}: missing")
    layers = profile["layers"]
    if not isinstance(layers, list) or not layers:
        raise SimulationError(f"layer profile {text_name}: layers: must be a non-empty list")
    for i, layer in enumerate(layers):
        try:
            Unit(layer["numel"], layer["backward_s"])
        except (KeyError, TypeError) as exc:
            raise SimulationError(f"layer profile {text_name}: layers[{i}]: needs numel and "
                                  f"backward_s ({exc!r})") from None
        except ValueError as exc:
            raise SimulationError(f"layer profile {text_name}: layers[{i}].{exc}") from None
    return profile


def build_instance(profile, world_size, density=DEFAULT_DENSITY, network=NetworkModel(),
                   topk=DEFAULT_TOPK, with_dense=False):
    """The planner instance for ``profile`` on ``world_size`` workers of ``network``.

    ``with_dense`` adds the ring all-reduce cost, which lets the planner send a group
    dense where that is cheaper (and is needed to evaluate the dense baseline).
    """
    _check_world_size(world_size)
    return Instance.from_dict({
        "layers": [{"numel": layer["numel"], "backward_s": layer["backward_s"]}
                   for layer in profile["layers"]],
        "world_size": world_size,
        "density": density,
        "forward_s": profile["forward_s"],
        "comm": network.allgather(world_size).to_dict(),
        "topk": topk.to_dict(),
        **({"dense": network.allreduce(world_size).to_dict()} if with_dense else {}),
    })


def ddp_bucket_groups(inst, bucket_bytes=DDP_BUCKET_BYTES):
    """Groups as DDP's buckets: consecutive ready-order layers up to ``bucket_bytes``."""
    groups, current, size = [], [], 0
    for index, unit in enumerate(inst.layers):
        nbytes = unit.numel * inst.value_bytes
        if current and size + nbytes > bucket_bytes:
            groups.append(current)
            current, size = [], 0
        current.append(index)
        size += nbytes
    groups.append(current)
    return groups


@dataclass(frozen=True)
class TopologyModel:
    """N nodes of L GPUs: NVLink-class links inside a node, one NIC per node (module
    docstring). ``network`` models the NIC and the switch (per ring step)."""

    nodes: int = DEFAULT_TOPOLOGY[0]
    ranks_per_node: int = DEFAULT_TOPOLOGY[1]
    network: NetworkModel = NetworkModel()
    intra_alpha_s: float = INTRA_ALPHA_S
    intra_bandwidth_Bps: float = INTRA_BANDWIDTH_BPS

    def __post_init__(self):
        for name in ("nodes", "ranks_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 2:
                raise SimulationError(f"topology: {name} must be an integer >= 2, got "
                                      f"{value!r}")
        if not self.intra_alpha_s >= 0 or not self.intra_bandwidth_Bps > 0:
            raise SimulationError("topology: intra-node alpha must be >= 0 and bandwidth > 0")

    @property
    def world_size(self):
        return self.nodes * self.ranks_per_node

    def flat_allgather(self):
        """The flat all-gather among all W ranks: W-1 ring steps, each bound by the NIC."""
        return self.network.allgather(self.world_size)

    def inter_allgather(self):
        """L concurrent all-gathers among N ranks sharing the NIC:
        ``(N-1)*alpha0 + (N-1)*L*beta0`` per contributed byte."""
        steps = self.nodes - 1
        return LinearCost(steps * self.network.alpha0_s,
                          steps * self.ranks_per_node * self.network.beta0_s_per_byte)

    def intra_collective(self):
        """Intra-node reduce-scatter / all-gather: ``alpha_i + (L-1)/bw_i`` per byte."""
        return LinearCost(self.intra_alpha_s,
                          (self.ranks_per_node - 1) / self.intra_bandwidth_Bps)


def parse_topology(text):
    """``"16x8"`` -> (16, 8)."""
    try:
        nodes, ranks = (int(part) for part in str(text).lower().split("x"))
    except ValueError:
        raise SimulationError(f"topology must be NODESxRANKS_PER_NODE (e.g. 16x8), got "
                              f"{text!r}") from None
    TopologyModel(nodes, ranks)  # validates
    return nodes, ranks


def build_topology_instances(profile, topology, density=DEFAULT_DENSITY, topk=DEFAULT_TOPK):
    """(flat instance, two-level instance) of ``profile`` on ``topology``."""
    flat = build_instance(profile, topology.world_size, density, topology.network, topk)
    two_level = hierarchical_instance(flat, topology.ranks_per_node,
                                      topology.intra_collective(), topology.inter_allgather())
    return flat, two_level


def simulate_topology(profile, topology, density=DEFAULT_DENSITY, topk=DEFAULT_TOPK):
    """Flat vs two-level OMGS (both ``optimal``) for one model on one topology: a dict
    with both iteration times, inter-node bytes per rank and step, group counts, the
    speed-up, and the flat plan's all-gather time as a share of backward."""
    from omgs_hook.planner import make_plan

    flat, two_level = build_topology_instances(profile, topology, density, topk)
    flat_plan = make_plan(flat, "optimal")
    two_plan = make_plan(two_level, "optimal")
    backward = sum(layer["backward_s"] for layer in profile["layers"])
    allgather = sum(flat.sparse_comm_time(sum(flat.layers[u].numel for u in g))
                    for g in flat_plan.groups)
    return {
        "model": profile["model"], "nodes": topology.nodes,
        "ranks_per_node": topology.ranks_per_node,
        "inter_gbit": topology.network.bandwidth_bps / 1e9,
        "flat_s": flat_plan.predicted_iteration_s,
        "hierarchical_s": two_plan.predicted_iteration_s,
        "speedup": flat_plan.predicted_iteration_s / two_plan.predicted_iteration_s,
        "flat_inter_node_bytes": step_inter_node_bytes(
            flat, flat_plan.groups, ranks_per_node=topology.ranks_per_node),
        "hierarchical_inter_node_bytes": step_inter_node_bytes(two_level, two_plan.groups),
        "flat_nic_bytes": _nic_bytes(flat, flat_plan.groups, topology, two_level=False),
        "hierarchical_nic_bytes": _nic_bytes(two_level, two_plan.groups, topology,
                                             two_level=True),
        "flat_groups": flat_plan.num_groups, "hierarchical_groups": two_plan.num_groups,
        "flat_allgather_share_of_backward": allgather / backward,
        "compute_s": profile["forward_s"] + backward,
    }


def _nic_bytes(inst, groups, topology, two_level):
    """Bytes one node's NIC receives per step under the ring model of the module
    docstring: flat ``(W-1) * payload``; two-level ``L * (N-1) * shard payload``."""
    entry = inst.value_bytes + inst.index_bytes
    total = 0
    for group in groups:
        numel = sum(inst.layers[u].numel for u in group)
        if two_level:
            total += topology.ranks_per_node * (topology.nodes - 1) * inst.shard_k(numel) * entry
        else:
            total += (topology.world_size - 1) * selected_k(numel, inst.density) * entry
    return total


def run_topology(models=MODEL_NAMES, topology=DEFAULT_TOPOLOGY, inter_gbit=DEFAULT_INTER_GBIT,
                 density=DEFAULT_DENSITY, alpha0_s=NetworkModel.alpha0_s, topk=DEFAULT_TOPK,
                 intra_alpha_s=INTRA_ALPHA_S, intra_bandwidth_Bps=INTRA_BANDWIDTH_BPS):
    """Rows of :func:`simulate_topology` for every model and inter-node bandwidth."""
    if not 0 < density <= 1:
        raise SimulationError(f"density must be in (0, 1], got {density!r}")
    rows = []
    for name in models:
        profile = load_layer_profile(name)
        for gbit in inter_gbit:
            network = NetworkModel(bandwidth_bps=gbit * 1e9, alpha0_s=alpha0_s)
            model = TopologyModel(*topology, network=network, intra_alpha_s=intra_alpha_s,
                                  intra_bandwidth_Bps=intra_bandwidth_Bps)
            rows.append(simulate_topology(profile, model, density, topk))
    return rows


def topology_report(rows, topology=TopologyModel(), density=DEFAULT_DENSITY):
    """Markdown table of :func:`run_topology` rows."""
    intra = topology.intra_collective()
    out = [f"Flat vs two-level OMGS (both `optimal`) on {rows[0]['nodes']} nodes x "
           f"{rows[0]['ranks_per_node']} GPUs (W = {rows[0]['nodes'] * rows[0]['ranks_per_node']}),"
           f" one NIC per node; intra-node collectives {intra.alpha_s * 1e6:g} us + "
           f"{topology.ranks_per_node - 1}/({topology.intra_bandwidth_Bps / 1e9:g} GB/s) per "
           f"byte; alpha0 = {topology.network.alpha0_s * 1e6:g} us per inter-node ring step; "
           f"density {density:g}; top-k as above, on the shard.", "",
           "| model | inter-node | compute (ms) | flat OMGS (ms; groups) | two-level (ms; groups) "
           "| speed-up | flat all-gather / backward | MB per rank to other nodes (count): flat "
           "| two-level | NIC MB per node (ring): flat | two-level | NIC cut |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(
            f"| {r['model']} | {r['inter_gbit']:g} GbE | {r['compute_s'] * 1e3:.1f} | "
            f"{r['flat_s'] * 1e3:.1f} ({r['flat_groups']}) | "
            f"{r['hierarchical_s'] * 1e3:.1f} ({r['hierarchical_groups']}) | "
            f"{r['speedup']:.2f}x | {100 * r['flat_allgather_share_of_backward']:.0f}% | "
            f"{r['flat_inter_node_bytes'] / 1e6:.2f} | "
            f"{r['hierarchical_inter_node_bytes'] / 1e6:.3f} | "
            f"{r['flat_nic_bytes'] / 1e6:.1f} | {r['hierarchical_nic_bytes'] / 1e6:.2f} | "
            f"{r['flat_nic_bytes'] / r['hierarchical_nic_bytes']:.1f}x |")
    return "\n".join(out)


# ------------------------------------------------------------------------ simulation


def simulate_model(profile, world_sizes, density=DEFAULT_DENSITY, network=NetworkModel(),
                   topk=DEFAULT_TOPK, strategies=SPARSE_STRATEGIES):
    """One row per (world size, strategy) plus the dense baseline, as dicts.

    Row fields: model, world_size, strategy, iteration_s, non_overlapped_s, groups
    (number of groups), dense_groups (how many of them are dense all-reduces),
    compute_s (forward + backward).
    """
    # imported here so that loading profiles and building instances work on their own
    from omgs_hook.planner import make_plan

    compute_s = profile["forward_s"] + sum(layer["backward_s"] for layer in profile["layers"])
    rows = []
    for world_size in world_sizes:
        inst = build_instance(profile, world_size, density, network, topk)
        for strategy in strategies:
            plan = make_plan(inst, strategy)
            rows.append(_row(profile, world_size, strategy, plan.predicted_iteration_s,
                             plan.non_overlapped_s, len(plan.groups), 0, compute_s))
        dense_inst = build_instance(profile, world_size, density, network, topk,
                                    with_dense=True)
        groups = ddp_bucket_groups(dense_inst)
        timeline = simulate(dense_inst, groups, dense=[True] * len(groups))
        rows.append(_row(profile, world_size, "dense", timeline.predicted_iteration_s,
                         timeline.non_overlapped_s, len(groups), len(groups), compute_s))
        plan = make_plan(dense_inst, "optimal")
        rows.append(_row(profile, world_size, "optimal+dense", plan.predicted_iteration_s,
                         plan.non_overlapped_s, len(plan.groups), sum(plan.dense), compute_s))
    return rows


def _row(profile, world_size, strategy, iteration_s, non_overlapped_s, groups, dense_groups,
         compute_s):
    return {"model": profile["model"], "world_size": world_size, "strategy": strategy,
            "iteration_s": iteration_s, "non_overlapped_s": non_overlapped_s,
            "groups": groups, "dense_groups": dense_groups, "compute_s": compute_s}


def run(models=MODEL_NAMES, world_sizes=DEFAULT_WORLD_SIZES, density=DEFAULT_DENSITY,
        network=NetworkModel(), topk=DEFAULT_TOPK):
    """Simulate every model; returns (profiles by name, rows)."""
    if not 0 < density <= 1:
        raise SimulationError(f"density must be in (0, 1], got {density!r}")
    if not world_sizes:
        raise SimulationError("give at least one world size")
    for world_size in world_sizes:
        _check_world_size(world_size)
    profiles = {}
    rows = []
    for name in models:
        profile = load_layer_profile(name)
        profiles[profile["model"]] = profile
        rows.extend(simulate_model(profile, world_sizes, density, network, topk))
    return profiles, rows


# -------------------------------------------------------------------------- reports


def _by_key(rows):
    return {(r["model"], r["world_size"], r["strategy"]): r for r in rows}


def markdown_report(profiles, rows, density, network, topk):
    """Markdown: the paper's setting in detail, then iteration time vs world size."""
    table = _by_key(rows)
    world_sizes = sorted({r["world_size"] for r in rows})
    strategies = list(SPARSE_STRATEGIES) + ["dense", "optimal+dense"]
    out = [f"Settings: density {density:g}; links {network.bandwidth_bps / 1e9:g} Gbit/s at "
           f"{100 * network.goodput_fraction:.1f}% goodput (beta0 = "
           f"{network.beta0_s_per_byte * 1e9:.2f} ns/B), alpha0 = "
           f"{network.alpha0_s * 1e6:g} us per ring step; top-k = {topk.c0 * 1e6:g} us + "
           f"{topk.c1 * 1e9:g} ns/element" + (f" + {topk.c2 * 1e9:g} ns * D log2 D"
                                               if topk.c2 else "") + ".", ""]
    if PAPER_WORLD_SIZE in world_sizes:
        w = PAPER_WORLD_SIZE
        out += [f"**The paper's setting: {w} workers on 1 GbE** (iteration time in ms; in "
                "brackets: time not hidden behind backward, ms; groups)", "",
                "| model | params | compute (fwd+bwd) | " +
                " | ".join(STRATEGY_LABELS[s] for s in strategies) +
                " | OMGS speed-up vs TopK / LAGS / dense |",
                "|---|---|---|" + "---|" * len(strategies) + "---|"]
        for model, profile in profiles.items():
            cells = []
            for s in strategies:
                r = table[(model, w, s)]
                cells.append(f"{r['iteration_s'] * 1e3:.1f} ({r['non_overlapped_s'] * 1e3:.1f}; "
                             f"{r['groups']})")
            best = table[(model, w, "optimal")]["iteration_s"]
            speedups = " / ".join(f"{table[(model, w, s)]['iteration_s'] / best:.2f}x"
                                  for s in ("single", "layerwise", "dense"))
            out.append(f"| {model} | {profile['total_numel'] / 1e6:.1f}M | "
                       f"{table[(model, w, 'optimal')]['compute_s'] * 1e3:.1f} | "
                       + " | ".join(cells) + f" | {speedups} |")
        out.append("")
    out += ["**Iteration time (s) vs number of workers W**", ""]
    for model in profiles:
        out += [f"*{model}*", "", "| W | " + " | ".join(STRATEGY_LABELS[s] for s in strategies)
                + " | OMGS groups | OMGS vs TopK | OMGS vs dense | OMGS+dense groups (dense) |",
                "|---:|" + "---:|" * (len(strategies) + 4)]
        for w in world_sizes:
            times = [table[(model, w, s)]["iteration_s"] for s in strategies]
            best = table[(model, w, "optimal")]
            vs_single = table[(model, w, "single")]["iteration_s"] / best["iteration_s"]
            vs_dense = table[(model, w, "dense")]["iteration_s"] / best["iteration_s"]
            hybrid = table[(model, w, "optimal+dense")]
            out.append(f"| {w} | " + " | ".join(_fmt_s(t) for t in times) +
                       f" | {best['groups']} | {vs_single:.2f}x | {vs_dense:.2f}x"
                       f" | {hybrid['groups']} ({hybrid['dense_groups']}) |")
        out.append("")
    return "\n".join(out)


def _fmt_s(seconds):
    return f"{seconds:.3f}" if seconds < 10 else f"{seconds:.1f}"


def plot(profiles, rows, path):
    """Iteration time vs W, one panel per model, one line per strategy (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = _by_key(rows)
    world_sizes = sorted({r["world_size"] for r in rows})
    fig, axes = plt.subplots(1, len(profiles), figsize=(5 * len(profiles), 4.2), squeeze=False)
    styles = {"optimal": ("C0", "o", "-"), "greedy": ("C1", "s", "--"),
              "layerwise": ("C2", "^", "-"), "single": ("C3", "v", "-"),
              "dense": ("k", "x", ":"), "optimal+dense": ("C4", "D", "-.")}
    for ax, (model, profile) in zip(axes[0], profiles.items()):
        for strategy, (color, marker, line) in styles.items():
            ys = [table[(model, w, strategy)]["iteration_s"] for w in world_sizes]
            ax.plot(world_sizes, ys, color=color, marker=marker, linestyle=line,
                    markersize=4, label=STRATEGY_LABELS[strategy])
        compute = table[(model, world_sizes[0], "optimal")]["compute_s"]
        ax.axhline(compute, color="grey", linewidth=0.8, label="compute only")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{model} ({profile['total_numel'] / 1e6:.1f}M parameters)")
        ax.set_xlabel("workers W (1 GbE, ring collectives)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("predicted iteration time (s)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def update_doc(path, report, markers=(DOC_BEGIN, DOC_END)):
    """Replace the text between the simulate.py markers in ``path`` with ``report``."""
    path = Path(path)
    text = path.read_text()
    doc_begin, doc_end = markers
    begin, end = text.find(doc_begin), text.find(doc_end)
    if begin < 0 or end < begin:
        raise SimulationError(f"{path}: needs the markers {doc_begin} and {doc_end}")
    path.write_text(text[: begin + len(doc_begin)] + "\n" + report.strip() + "\n"
                    + text[end:])


# ------------------------------------------------------------------------------ CLI


def check_output_options(args):
    """Refuse, before simulating, output paths the writes at the end would fail on (a
    directory, a missing folder), and an --update-doc that is not a file to read."""
    for option, path in (("--json", args.json), ("--markdown", args.markdown),
                         ("--plot", args.plot)):
        if path is None:
            continue
        if path.is_dir():
            raise SimulationError(f"{option} {path}: is a directory; give a file path")
        folder = path.parent
        if not folder.is_dir():
            raise SimulationError(f"{option} {path}: the folder {folder} does not exist")
    if args.update_doc is not None and not args.update_doc.is_file():
        raise SimulationError(f"--update-doc {args.update_doc}: not a file "
                              f"(it must exist, with the markers)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODEL_NAMES),
                        help=f"shipped profiles ({', '.join(MODEL_NAMES)}) or JSON paths")
    parser.add_argument("--world-sizes", nargs="+", type=int, default=list(DEFAULT_WORLD_SIZES),
                        metavar="W")
    parser.add_argument("--density", type=float, default=DEFAULT_DENSITY)
    parser.add_argument("--bandwidth-gbit", type=float, default=1.0,
                        help="link line rate in Gbit/s (default 1: the paper's 1 GbE)")
    parser.add_argument("--alpha0", type=float, default=NetworkModel.alpha0_s,
                        help="latency of one ring step in seconds (default 100e-6)")
    parser.add_argument("--topk-c0", type=float, default=DEFAULT_TOPK.c0)
    parser.add_argument("--topk-c1", type=float, default=DEFAULT_TOPK.c1)
    parser.add_argument("--topk-c2", type=float, default=DEFAULT_TOPK.c2)
    parser.add_argument("--json", type=Path, help="write all rows to this JSON file")
    parser.add_argument("--markdown", type=Path, help="write the markdown tables to this file")
    parser.add_argument("--update-doc", type=Path,
                        help=f"replace the text between {DOC_BEGIN} and {DOC_END} in this file")
    parser.add_argument("--plot", type=Path, help="write the PNG plot to this file")
    parser.add_argument("--topology", metavar="NxL",
                        help="compare flat and two-level OMGS on N nodes of L GPUs instead "
                             "(e.g. 16x8; --update-doc then fills the topology markers)")
    parser.add_argument("--inter-gbit", nargs="+", type=float, default=list(DEFAULT_INTER_GBIT),
                        help="inter-node NIC line rates in Gbit/s for --topology (default 1 25)")
    parser.add_argument("--intra-gbyte", type=float, default=INTRA_BANDWIDTH_BPS / 1e9,
                        help="intra-node bandwidth per GPU in GB/s for --topology (default 150)")
    parser.add_argument("--intra-alpha", type=float, default=INTRA_ALPHA_S,
                        help="intra-node collective latency in s for --topology (default 10e-6)")
    args = parser.parse_args(argv)
    try:
        check_output_options(args)
    except SimulationError as exc:
        print(f"simulate: error: {exc}", file=sys.stderr)
        return 2
    if args.topology:
        return _main_topology(args)
    try:
        network = NetworkModel(bandwidth_bps=args.bandwidth_gbit * 1e9, alpha0_s=args.alpha0)
        try:
            topk = TopkCost(args.topk_c0, args.topk_c1, args.topk_c2)
        except ValueError as exc:
            raise SimulationError(f"top-k cost: {exc}") from None
        profiles, rows = run(args.models, args.world_sizes, args.density, network, topk)
        report = markdown_report(profiles, rows, args.density, network, topk)
        if args.update_doc:
            update_doc(args.update_doc, report)
    except SimulationError as exc:
        print(f"simulate: error: {exc}", file=sys.stderr)
        return 2
    print(report)
    if args.json:
        args.json.write_text(json.dumps({"density": args.density,
                                         "network": {"bandwidth_bps": network.bandwidth_bps,
                                                     "alpha0_s": network.alpha0_s,
                                                     "beta0_s_per_byte": network.beta0_s_per_byte},
                                         "topk": topk.to_dict(), "rows": rows}, indent=1))
    if args.markdown:
        args.markdown.write_text(report + "\n")
    if args.plot:
        plot(profiles, rows, args.plot)
    return 0


def _main_topology(args):
    try:
        nodes, ranks = parse_topology(args.topology)
        for gbit in args.inter_gbit:
            if not gbit > 0:
                raise SimulationError(f"inter-node bandwidth must be positive, got {gbit!r}")
        try:
            topk = TopkCost(args.topk_c0, args.topk_c1, args.topk_c2)
        except ValueError as exc:
            raise SimulationError(f"top-k cost: {exc}") from None
        intra = dict(intra_alpha_s=args.intra_alpha, intra_bandwidth_Bps=args.intra_gbyte * 1e9)
        model = TopologyModel(nodes, ranks, NetworkModel(alpha0_s=args.alpha0), **intra)
        rows = run_topology(args.models, (nodes, ranks), args.inter_gbit, args.density,
                            args.alpha0, topk, **intra)
        report = topology_report(rows, model, args.density)
        if args.update_doc:
            update_doc(args.update_doc, report, (TOPOLOGY_BEGIN, TOPOLOGY_END))
    except SimulationError as exc:
        print(f"simulate: error: {exc}", file=sys.stderr)
        return 2
    print(report)
    if args.json:
        args.json.write_text(json.dumps({"density": args.density, "topology": [nodes, ranks],
                                         "rows": rows}, indent=1))
    if args.markdown:
        args.markdown.write_text(report + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
