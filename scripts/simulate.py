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

Usage::

    python scripts/simulate.py                               # print the tables
    python scripts/simulate.py --update-doc docs/simulation.md --plot docs/simulation.png
    python scripts/simulate.py --models vgg16 --world-sizes 4 16 --json out.json
"""

import argparse
import json
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from omgs_hook.cost_model import Instance, LinearCost, TopkCost, Unit, simulate

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


def update_doc(path, report):
    """Replace the text between the simulate.py markers in ``path`` with ``report``."""
    path = Path(path)
    text = path.read_text()
    begin, end = text.find(DOC_BEGIN), text.find(DOC_END)
    if begin < 0 or end < begin:
        raise SimulationError(f"{path}: needs the markers {DOC_BEGIN} and {DOC_END}")
    path.write_text(text[: begin + len(DOC_BEGIN)] + "\n" + report.strip() + "\n"
                    + text[end:])


# ------------------------------------------------------------------------------ CLI


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
    args = parser.parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
