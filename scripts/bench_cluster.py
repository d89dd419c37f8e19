#!/usr/bin/env python
"""OMGS-SGD against its peers on an emulated slow-network cluster: iteration time per hook.

What is compared (one DDP model per variant, all built from the same initial weights)::

    compute    the allreduce variant's model inside DDP's ``no_sync()``: forward,
               backward and optimiser step with no communication at all (a reference
               row: what an infinitely fast network would give)
    allreduce  DDP's built-in dense all-reduce, DDP's default buckets (25 MiB)
    powersgd   PyTorch's powerSGD_hook (rank --powersgd-rank, error feedback), all
               gradients in ONE bucket - the configuration scripts/train.py documents:
               the stock hook waits on a collective inside a future callback, which
               deadlocks gloo as soon as a second bucket is in flight
    topk       omgs_hook strategy "single"    - TopK-SGD, one group of all gradients
    lags       omgs_hook strategy "layerwise" - LAGS-SGD, one group per DDP bucket
    greedy     omgs_hook strategy "greedy"    - the paper's greedy merge rule
    omgs       omgs_hook strategy "optimal"   - OMGS-SGD, groups chosen by the planner
    omgs_dense strategy "optimal", allow_dense=True - the planner may also send groups
               as dense all-reduces (the hook's extension beyond the paper)
    default    ``omgs_hook.register(ddp, density=..., profile=...)``: nothing else set,
               so whatever the installed library does by default (e.g. a measured
               selection among the plans above, ``select="measured"``)
    topk_again on request only (``--hooks ...,topk_again``): TopK-SGD again, as a model
               of its own - an A/A control whose difference from topk is the run's
               noise floor, reported beside the default's ratios

The omgs_hook variants share the same DDP buckets (``--sparse-bucket-cap-mb``, 0 = one
parameter tensor per bucket, the units the original OMGS/LAGS code works with), the
same density, top-k backend and error feedback; they differ only in how buckets are
merged into groups. The fixed variants (topk, lags, greedy, omgs, omgs_dense) plan with
the cost model (``select="model"``): they are the
candidates the default chooses among. Every group of topk/lags/greedy/omgs is sparse, as
the algorithms are published; with ``--allow-dense`` they too may send groups dense
(result files then end in ``_dense``). The default variant runs untimed steps until its
plan has settled (no selection trial in progress, the same plan for
DEFAULT_STABLE_STEPS steps on every rank, and the hook's settled model check of that
plan made, so that its ``predicted`` comes from the check the table names; at most
``--default-max-settle-steps``).

How one configuration (model, N ranks, link rate, density) is measured:

1. An emulated cluster (``scripts/netem_cluster.py``) of N network namespaces behind a
   switch whose links are shaped to the rate is built once.
2. ``scripts/profile.py`` (``omgs-profile``) runs inside it: the packed all-gather,
   the all-reduce and the CPU top-k are timed on the same links and cores, so the
   planner plans - and predicts - with this cluster's measured alpha, beta and top-k
   cost. Message and top-k sizes are chosen to span what this model sends.
3. One launch of this script per rank (``--worker``) builds every variant, runs each
   through its warm-up (DDP's first two iterations, the hooks' dense warm-up steps, and
   a few steps on the final plan), then times ``--rounds`` rounds; in each round every
   variant runs ``--steps`` steps back to back, in an order drawn afresh for each round
   (the same on every rank: :func:`round_order`), so slow drifts of the machine (other
   load, thermal) hit all variants alike and no variant always follows the same one.
4. Every step is timed on every rank (forward, backward incl. waiting for the
   gradients, optimiser step); after each block the per-step times are all-reduced with
   MAX, because a synchronous step is as slow as its slowest rank. The sparse hooks'
   top-k time (``topk_s``) and all the work the hook does on the autograd thread
   (``hook_s``: top-k plus assembling, checking and packing each group) come from the
   hook's own per-step timers (``stats()["last"]``) and are reported separately, as is
   the optimiser step.

Fairness rules: ``broadcast_buffers`` is off for every variant (it would add one
collective per forward for BatchNorm buffers); one thread per rank; identical
synthetic CIFAR-shaped data (3x32x32, random labels - timing only) per rank for all
variants; DDP's initial parameter broadcast is skipped (``init_sync=False``) because
every rank builds identical weights from the same seed.

Outputs: one JSON file per configuration under ``--results-dir``
(``bench_<model>_n<N>_d<density>.json``: every slowest-rank step time, medians, spread,
predictions, plans, the profile used, load averages; the full profile file beside it as
``profile_<model>_n<N>_d<density>.json``), and - from all JSON files found
there - the generated section of ``--doc`` (a Markdown table per configuration and the
targets) and a bar plot ``--plot``. Text in ``--doc`` outside the generated markers
is kept, so the analysis written around the tables survives re-runs.

Usage (needs root, ``ip`` and ``tc``; see docs/emulated-cluster.md)::

    python scripts/bench_cluster.py                         # full run, ~15 min
    python scripts/bench_cluster.py --models resnet20 --nodes 4 --densities 0.001,0.01
    python scripts/bench_cluster.py --report-only           # re-render doc + plot
    python scripts/bench_cluster.py --matched-rates         # rates for ratio 4 here
    python scripts/bench_cluster.py --quick --results-dir /tmp/r --doc /tmp/b.md \
        --plot /tmp/b.png                                   # smoke run, < 1 min

Link rates (``default_rate``) give every configuration a communication/computation
ratio of about 4 for dense all-reduce, as GPUs on 1 GbE have (docs/emulated-cluster.md):
:data:`BENCH_RATES`, re-derived on 2026-12-07 from this benchmark's own rows when the
host had become twice as fast; other configurations fall back to :data:`VGG16_RATES`
(VGG-16 N = 2) and netem_cluster's ``RECOMMENDED_RATES``.
``--rate MODEL:N=RATE`` overrides one configuration. The ratio depends on the host's
compute speed: ``--matched-rates`` reads the compute-only and all-reduce rows of a run in
``--results-dir`` and prints the ``--rate`` arguments that give ratio 4 on that host
(on a host 1.6x slower than the one BENCH_RATES were derived on, they measured
2.0-2.3). ``--wait-load X`` waits (up to ``--wait-load-max-s``) for the 1-minute load
average to fall below X before each configuration, because other processes on a small
machine distort every timing.
"""

import argparse
import contextlib
import datetime
import gc
import json
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

# scripts/ holds profile.py, which would shadow the standard library's `profile` (torch
# imports it through cProfile) if this folder stayed first on sys.path. Keep the folder
# importable for netem_cluster, but behind the standard library.
_SCRIPT_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _SCRIPT_DIR]
sys.path.append(_SCRIPT_DIR)

from omgs_hook.cli_types import integer_at_least, non_negative_number, positive_number  # noqa: E402
from omgs_hook.generated_docs import write_generated_section  # noqa: E402  (after sys.path)
from omgs_hook.plan_selection import SPELL_FACTOR, clamped_pace  # noqa: E402

REPO_ROOT = os.path.dirname(_SCRIPT_DIR)
PROFILE_SCRIPT = os.path.join(_SCRIPT_DIR, "profile.py")

HOOKS = ("allreduce", "powersgd", "topk", "lags", "greedy", "omgs", "omgs_dense", "default",
         "topk_again")
# run only when --hooks names them: "topk_again" is an A/A control, TopK-SGD a second
# time as a model of its own; its difference from "topk" is the host's noise floor for
# every ratio of one run (two identical variants differ by that much by chance alone)
ON_REQUEST = ("topk_again",)
DEFAULT_HOOKS = tuple(h for h in HOOKS if h not in ON_REQUEST)
REFERENCE = "compute"
VARIANTS = (REFERENCE,) + HOOKS
# omgs_hook variants with a fixed planner strategy (selection by the cost model)
SPARSE_STRATEGIES = {"topk": "single", "lags": "layerwise", "greedy": "greedy",
                     "omgs": "optimal", "omgs_dense": "optimal", "topk_again": "single"}
# every variant built on omgs_hook.register (the fixed ones and the library's default)
OMGS_VARIANTS = tuple(SPARSE_STRATEGIES) + ("default",)
# the fixed plans the default's selection chooses among (the ones benchmarked here)
CANDIDATES = ("topk", "lags", "greedy", "omgs", "omgs_dense")
# prediction error is reported per strategy: the variant measuring each one
PREDICTION_STRATEGIES = {"single": "topk", "layerwise": "lags", "optimal": "omgs",
                         "optimal+dense": "omgs_dense"}
MODELS = ("resnet20", "vgg16")
# a model the user brings (--user-model FILE:FUNCTION), benchmarked under this name
USER_MODEL = "user"
HOOK_LABELS = {
    "compute": "compute only (no communication)",
    "allreduce": "allreduce (DDP default)",
    "powersgd": "PowerSGD",
    "topk": "TopK-SGD (single group)",
    "lags": "LAGS-SGD (layer-wise)",
    "greedy": "greedy merge",
    "omgs": "OMGS-SGD (optimal merge)",
    "omgs_dense": "OMGS-SGD + dense groups",
    "default": "omgs_hook default",
    "topk_again": "TopK-SGD again (A/A control)",
}
# netem_cluster.RECOMMENDED_RATES for vgg16 were derived for a 23M-parameter VGG-style
# model computing 0.293 s (2 ranks) / 0.618 s (4 ranks) per step. The vgg16 benchmarked
# here (full VGG-16 convolution stack, fc_width 2048: 20.0M parameters, 80 MB of
# gradient) computes ~0.65 s per step with 2 ranks and ~1.3 s with 4 ranks sharing the
# 2 cores (measured, batch 32, one thread per rank). Ratio 4 then needs the bytes a
# ring all-reduce moves per rank, 2 (N-1)/N x 80 MB, to take 4 x compute:
#   N=2: 640 Mbit / (4 x 0.65 s) = 246 Mbit/s;  N=4: 960 Mbit / (4 x 1.3 s) = 185 Mbit/s
# (the same formula gives 15.6 and 11.5 Mbit/s for ResNet-20, whose measured derivation
# chose 20 and 14: it runs ~20% lower, which is within the spread of this estimate).
VGG16_RATES = {2: "240mbit", 4: "185mbit"}
# The rates above (and RECOMMENDED_RATES for ResNet-20) were derived while this host
# computed ResNet-20 at 124 ms per step on 2 ranks. On 2026-12-07 it computed twice as
# fast, and the benchmark's own compute-only and all-reduce rows (docs/results at
# e05da0a) measured ratios of 7.0-7.5 (ResNet-20 N=2, 20 Mbit/s), 7.3-8.1 (N=4, 14),
# 10.0-10.2 (N=8, 5) and 6.5 (VGG-16 N=4, 185). netem_cluster.matching_rate() of those
# rows (compute, all-reduce step, rate; the two densities' medians averaged) for ratio 4:
#   ResNet-20 N=2: 64.2 ms, 529.7 ms, 20 Mbit/s -> 36.3 Mbit/s
#   ResNet-20 N=4: 146.3 ms, 1273.2 ms, 14 Mbit/s -> 27.0 Mbit/s
#   ResNet-20 N=8: 342.5 ms, 3803.7 ms, 5 Mbit/s -> 12.6 Mbit/s
#   VGG-16 N=4: 806.5 ms, 6047 ms, 185 Mbit/s -> 300.5 Mbit/s
# These are the benchmark's rates since then (``--rate`` still overrides one).
BENCH_RATES = {("resnet20", 2): "36mbit", ("resnet20", 4): "27mbit",
               ("resnet20", 8): "12600kbit", ("vgg16", 4): "300mbit"}
# the dense all-reduce's communication over the compute-only step that the rates aim
# at (GPUs on 1 GbE; ``--matched-rates`` finds the rates that give it on another host)
TARGET_COMM_COMPUTE_RATIO = 4.0
# DDP's first two iterations (one bucket, then the rebuild) are set-up, never timed.
DDP_SETUP_STEPS = 2
# Steps run on the final plan before timing starts (the plan is adopted at the end of
# the warm-up step that made it; the first sparse step also sizes scratch buffers).
SETTLE_STEPS = 1
SYNTHETIC_BATCHES = 4
RESULT_PREFIX = "bench_"
# The default variant's warm-up runs until its plan has settled (its selection trial, if
# the library runs one, is over): at most this many steps beyond the fixed variants'
# warm-up, and the plan unchanged for DEFAULT_STABLE_STEPS steps on every rank. (Its
# settled model check comes 20 steps after the plan went into use, and the first trial
# can end 152 steps in: its 6 lead steps and at most 146 trial steps, 80 of them the
# side-by-side duel of its two leaders.)
DEFAULT_MAX_SETTLE_STEPS = 200
# --quick's link rate (a smoke run checks the path, not times)
QUICK_RATE = "100mbit"
DEFAULT_STABLE_STEPS = 3
# Targets of the issue (reported, never tuned for).
TARGET_SPEEDUP_VS_SPARSE = 1.3
TARGET_SPEEDUP_VS_ALLREDUCE = 2.0
TARGET_PREDICTION_ERROR = 0.15
TARGET_DEFAULT_VS_BEST_PEER = 0.98   # default at least 0.98x the better of TopK/LAGS
TARGET_DEFAULT_VS_CANDIDATE = 0.02   # never more than 2% slower than any candidate
TARGET_STRATEGY_PREDICTION_ERROR = 0.10


# =====================================================================================
# command line
# =====================================================================================


def _csv(kind, choices=None):
    def parse(text):
        items = [part.strip() for part in text.split(",") if part.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"empty {kind} list")
        if choices is not None:
            bad = [item for item in items if item not in choices]
            if bad:
                raise argparse.ArgumentTypeError(
                    f"unknown {kind} {', '.join(bad)}; valid choices: {', '.join(choices)}")
        return list(dict.fromkeys(items))  # keep order, drop repeats
    return parse


def _node_counts(text):
    counts = []
    for part in _csv("node count")(text):
        try:
            value = int(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"node count {part!r} is not an integer") from None
        if value < 2:
            raise argparse.ArgumentTypeError(f"node count must be >= 2, got {value}")
        counts.append(value)
    return counts


def _densities(text):
    values = []
    for part in _csv("density")(text):
        try:
            value = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"density {part!r} is not a number") from None
        if not 0.0 < value < 1.0:
            raise argparse.ArgumentTypeError(
                f"density must be in (0, 1) (1.0 would make every hook a dense all-reduce), "
                f"got {value}")
        values.append(value)
    return values


def _rate_override(text):
    """``MODEL:N=RATE`` -> ((model, n), rate)."""
    try:
        key, rate = text.split("=", 1)
        model, nodes = key.split(":", 1)
        nodes = int(nodes)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--rate {text!r}: expected MODEL:N=RATE, e.g. vgg16:4=485mbit") from None
    if model not in MODELS + (USER_MODEL,):
        raise argparse.ArgumentTypeError(
            f"--rate {text!r}: unknown model {model!r}; valid choices: "
            f"{', '.join(MODELS + (USER_MODEL,))}")
    return (model, nodes), link_rate(rate.strip(), f"--rate {text!r}")


def link_rate(text, name=None):
    """A tc-style link rate (``"14mbit"``), checked when the arguments are parsed: a
    rate without a unit would otherwise fail only once the cluster is built."""
    from netem_cluster import ClusterError, parse_rate
    try:
        parse_rate(text)
    except ClusterError as error:
        raise argparse.ArgumentTypeError(f"{name}: {error}" if name else str(error)) from None
    return text


_positive_int = integer_at_least(1)


def build_parser():
    parser = argparse.ArgumentParser(
        description="Iteration time of allreduce, PowerSGD, TopK-SGD, LAGS-SGD and OMGS-SGD on "
                    "an emulated slow-network cluster (see the module docstring).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = parser.add_argument
    add("--models", type=_csv("model", MODELS + (USER_MODEL,)), default=list(MODELS),
        help=f"models to benchmark; {USER_MODEL!r} is the one --user-model names")
    add("--user-model", metavar="FILE:FUNCTION", default=None,
        help="a model of your own: FUNCTION() in the Python file FILE returns an nn.Module "
             "mapping a batch of 3x32x32 images to 10 logits; benchmark it with "
             f"--models {USER_MODEL} and a --rate {USER_MODEL}:N=RATE per cluster size")
    add("--nodes", type=_node_counts, default=[2, 4], help="cluster sizes N, comma separated")
    add("--densities", type=_densities, default=[0.001],
        help="sparse densities, comma separated (each is one launch per cluster)")
    add("--hooks", type=_csv("hook", HOOKS), default=list(DEFAULT_HOOKS),
        help="hooks to compare (the compute-only reference always runs); add topk_again "
             "for an A/A control: TopK-SGD twice, whose difference is the run's noise floor")
    add("--rate", type=_rate_override, action="append", default=[],
        help="link rate of one configuration, MODEL:N=RATE (repeatable); default: "
             "default_rate() (communication/computation ratio ~4)")
    add("--steps", type=_positive_int, default=5, help="timed steps per variant and round")
    add("--rounds", type=_positive_int, default=3, help="interleaved rounds")
    add("--warmup-steps", type=_positive_int, default=5,
        help="the hooks' dense warm-up steps (omgs_hook warmup_steps, PowerSGD "
             "start_powerSGD_iter; at least 2)")
    add("--replan-every", type=_positive_int, default=100, help="omgs_hook replan_every")
    add("--batch-size", type=_positive_int, default=32, help="samples per rank and step")
    add("--vgg-fc-width", type=_positive_int, default=2048,
        help="width of vgg16's two hidden FC layers (2048: 20.0M parameters, close to the "
             "23M-parameter model the recommended rates were derived for)")
    add("--sparse-bucket-cap-mb", type=non_negative_number, default=0.0,
        help="DDP bucket size of topk/lags/omgs (0: one parameter tensor per bucket)")
    add("--allow-dense", action="store_true",
        help="let the sparse hooks send a group as a dense all-reduce where their cost model "
             "says it is cheaper (omgs_hook's allow_dense, beyond the paper); default: every "
             "group sparse, as TopK-SGD, LAGS-SGD and OMGS-SGD are published")
    add("--default-max-settle-steps", type=_positive_int, default=DEFAULT_MAX_SETTLE_STEPS,
        help="untimed steps the default variant may run beyond the others' warm-up until "
             "its plan is settled (its measured selection trial, if any, is over, and the "
             "settled model check of its plan made)")
    add("--powersgd-rank", type=_positive_int, default=2, help="PowerSGD approximation rank")
    add("--topk-backend", default="auto", help="omgs_hook topk_backend of the sparse hooks")
    add("--seed", type=int, default=0)
    add("--profile-reps", type=_positive_int, default=8,
        help="timed repetitions per point of the in-cluster profile")
    add("--results-dir", default=os.path.join(REPO_ROOT, "docs", "results"))
    add("--doc", default=os.path.join(REPO_ROOT, "docs", "benchmarks.md"))
    add("--plot", default=os.path.join(REPO_ROOT, "docs", "benchmarks.png"))
    add("--report-only", action="store_true",
        help="measure nothing: re-render --doc and --plot from --results-dir")
    add("--matched-rates", action="store_true",
        help="measure nothing: print the --rate arguments that give each configuration in "
             "--results-dir a dense comm/compute ratio of 4 on the host that measured it "
             "(from its compute-only and allreduce rows)")
    add("--quick", action="store_true",
        help="smoke run: resnet20, 2 nodes at 100 Mbit/s (unless --rate says otherwise), "
             "batch 8, 2 warm-up steps, 1 round of 2 steps, tiny profile")
    add("--wait-load", type=non_negative_number, default=None,
        help="before each configuration wait until the 1-minute load average is below this")
    add("--wait-load-max-s", type=non_negative_number, default=600.0,
        help="give up waiting for --wait-load after this long (and record the load)")
    add("--timeout", type=positive_number, default=1800.0,
        help="seconds one launch (profile or benchmark) may take before it is killed (VGG-16 "
             "N=4 at a comm/compute ratio of 4 with 12 rounds ran past 1800 s on 2 cores)")
    add("--worker", metavar="CONFIG_JSON", default=None, help=argparse.SUPPRESS)
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.worker:
        return args
    if args.quick:
        args.models, args.nodes, args.steps, args.rounds = ["resnet20"], [2], 2, 1
        args.warmup_steps, args.profile_reps = 2, 2
        args.batch_size = min(args.batch_size, 8)  # a smoke run checks the path, not times
    if args.warmup_steps < 2:
        parser.error("--warmup-steps: must be at least 2 (DDP rebuilds its buckets after the "
                     "first iteration; PowerSGD requires it)")
    if (USER_MODEL in args.models) != (args.user_model is not None):
        parser.error(f"--user-model FILE:FUNCTION and --models {USER_MODEL} go together")
    if args.user_model is not None:
        try:
            load_user_model(args.user_model)
        except (OSError, ValueError, AttributeError, ImportError, SyntaxError) as exc:
            parser.error(f"--user-model {args.user_model!r}: {exc}")
    args.rate = dict(args.rate)
    if args.quick:
        # a smoke run: a faster link than the benchmark's, so that its dense warm-up
        # all-reduces (0.6 s each at 20 Mbit/s) do not make most of its time
        args.rate.setdefault(("resnet20", 2), QUICK_RATE)
    for (model, nodes) in args.rate:
        if model not in args.models or nodes not in args.nodes:
            parser.error(f"--rate {model}:{nodes}=...: that configuration is not being run "
                         f"(--models {','.join(args.models)} --nodes "
                         f"{','.join(map(str, args.nodes))})")
    return args


# =====================================================================================
# worker: runs on every rank, inside the cluster
# =====================================================================================


class Variant:
    """One compared configuration: its model, DDP wrapper, hook state and optimiser."""

    def __init__(self, name, module, net, optimizer, hook_state=None, bucket_cap_mb=None,
                 local_only=False):
        self.name = name
        self.module = module
        self.net = net  # the DDP wrapper, or the bare module
        self.optimizer = optimizer
        # run forward/backward inside DDP's no_sync(): no communication at all
        self.local_only = local_only
        self.hook_state = hook_state
        self.bucket_cap_mb = bucket_cap_mb
        self.steps_run = 0
        self.hook_options = None  # the options register() got (omgs_hook variants)
        self.plan_at_timing_start = None
        self.round_medians = []  # per round: median slowest-rank iteration seconds
        # per timed step, slowest rank: (iteration_s, optimizer_s, topk_s, hook_s)
        self.times = []
        # per settling step of the default (settle_default), this rank's: the same tuple
        self.warmup_rows = []


def library_defaults():
    """The default option values of the installed ``OMGSState`` (recorded per result)."""
    import inspect

    from omgs_hook.hook import OMGSState

    out = {}
    for name, parameter in inspect.signature(OMGSState.__init__).parameters.items():
        if name in ("self", "process_group", "module") or parameter.default is parameter.empty:
            continue
        value = parameter.default
        out[name] = value if isinstance(value, (bool, int, float, str, type(None))) else repr(value)
    return out


def library_info():
    """Which omgs_hook was benchmarked: its source folder, git commit, default options."""
    import subprocess

    import omgs_hook

    folder = os.path.dirname(os.path.abspath(omgs_hook.__file__))
    info = {"path": folder, "commit": None, "dirty": None, "defaults": library_defaults()}
    try:
        info["commit"] = subprocess.run(
            ["git", "-C", folder, "rev-parse", "HEAD"], capture_output=True, text=True,
            check=True, timeout=30).stdout.strip()
        status = subprocess.run(
            ["git", "-C", folder, "status", "--porcelain", "--", "."], capture_output=True,
            text=True, check=True, timeout=30).stdout
        info["dirty"] = bool(status.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def _ddp_options(torch_ddp):
    import inspect

    parameters = inspect.signature(torch_ddp.__init__).parameters
    # torch >= 2.13 renames broadcast_buffers (and warns about the old name even if False)
    key = "forward_sync_buffers" if "forward_sync_buffers" in parameters else "broadcast_buffers"
    options = {key: False}
    if "init_sync" in parameters:
        options["init_sync"] = False
    return options


def load_user_model(spec):
    """The model builder ``FILE:FUNCTION`` names (``--user-model``): FUNCTION from FILE."""
    import importlib.util

    path, sep, function = spec.rpartition(":")
    if not sep or not path or not function:
        raise ValueError("expected FILE:FUNCTION, e.g. my_model.py:build")
    if not os.path.isfile(path):
        raise ValueError(f"no such file {path!r}")
    module_spec = importlib.util.spec_from_file_location("omgs_bench_user_model",
                                                         os.path.abspath(path))
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    builder = getattr(module, function, None)
    if not callable(builder):
        raise ValueError(f"{path} has no function {function!r}")
    return builder


def build_model(config):
    from omgs_hook.examples.models import build_model as build

    if config["model"] == USER_MODEL:
        module = load_user_model(config["user_model"])()
        if not hasattr(module, "parameters"):
            raise TypeError(f"--user-model {config['user_model']}: returned "
                            f"{type(module).__name__}, not an nn.Module")
        return module
    options = {"in_channels": 3, "num_classes": 10}
    if config["model"] == "vgg16":
        options["fc_width"] = config["vgg_fc_width"]
    return build(config["model"], **options)


def make_variants(config, initial_state, profile_path):
    import torch
    from torch.nn.parallel import DistributedDataParallel

    import omgs_hook

    ddp_options = _ddp_options(DistributedDataParallel)
    variants = []
    for name in config["variants"]:
        if name == REFERENCE and "allreduce" in config["variants"]:
            continue  # shares the allreduce variant's model, added below
        module = build_model(config)
        module.load_state_dict(initial_state)
        optimizer = torch.optim.SGD(module.parameters(), lr=config["lr"], momentum=0.9,
                                    weight_decay=5e-4)
        if name == REFERENCE:
            variants.append(Variant(name, module, module, optimizer))
            continue
        if name == "allreduce":
            cap = None  # DDP's defaults: 1 MiB first bucket, then 25 MiB
        elif name == "powersgd":
            model_mib = sum(p.numel() * p.element_size() for p in module.parameters()) / 2 ** 20
            cap = math.ceil(model_mib) + 1.0  # everything in one bucket (see docstring)
        else:
            cap = config["sparse_bucket_cap_mb"]
        net = DistributedDataParallel(module, bucket_cap_mb=cap, **ddp_options)
        state = None
        if name == "powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

            state = powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=config["powersgd_rank"],
                start_powerSGD_iter=config["warmup_steps"], use_error_feedback=True,
                warm_start=True, random_seed=config["seed"])
            net.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        elif name in SPARSE_STRATEGIES:
            # a fixed strategy chosen by the cost model: these variants are the plans the
            # default's measured selection chooses among
            options = {"select": "model"}
            state = omgs_hook.register(
                net, density=config["density"], strategy=SPARSE_STRATEGIES[name],
                warmup_steps=config["warmup_steps"], replan_every=config["replan_every"],
                profile=profile_path, topk_backend=config["topk_backend"],
                allow_dense=config["allow_dense"] or name == "omgs_dense", log_every=0,
                # the window then holds exactly the timed steps at the end (see
                # replayed_prediction); no re-plan happens within a benchmark
                measure_window=max(config["warmup_steps"], config["steps"] * config["rounds"]),
                **options)
        elif name == "default":
            # what a user gets: register() with only density and profile, every other
            # option at the library's default of the version being benchmarked
            state = omgs_hook.register(net, density=config["density"], profile=profile_path)
        variant = Variant(name, module, net, optimizer, state, cap)
        if name in OMGS_VARIANTS:
            variant.hook_options = {key: getattr(state, key, None) for key in (
                "density", "warmup_steps", "replan_every", "allow_dense", "topk_backend",
                "select")}
            variant.hook_options["strategy"] = repr(state.strategy)
        variants.append(variant)
    if REFERENCE in config["variants"] and "allreduce" in config["variants"]:
        # The compute reference reuses the allreduce model (its weights, optimiser and
        # DDP wrapper in no_sync mode): a whole extra copy of a 20M-parameter model,
        # with momentum, costs ~0.3 GB per rank, and timing does not depend on weights.
        dense = next(v for v in variants if v.name == "allreduce")
        variants.insert(config["variants"].index(REFERENCE),
                        Variant(REFERENCE, dense.module, dense.net, dense.optimizer,
                                local_only=True))
    return variants


def synthetic_batches(config, rank):
    """A few fixed random CIFAR-shaped batches for this rank (timing only)."""
    import torch

    generator = torch.Generator().manual_seed(config["seed"] * 1000 + 17 + rank)
    shape = (config["batch_size"], 3, 32, 32)
    return [(torch.randn(shape, generator=generator),
             torch.randint(0, 10, (config["batch_size"],), generator=generator))
            for _ in range(SYNTHETIC_BATCHES)]


def run_step(variant, batch):
    """One training step; returns (iteration_s, optimizer_s, topk_s, hook_s, forward_s)
    on this rank (forward_s: the forward pass, compute only whatever the variant: the
    host's pace, :func:`paced_medians`)."""
    import torch.nn.functional as F

    inputs, targets = batch
    started = time.perf_counter()
    with variant.net.no_sync() if variant.local_only else contextlib.nullcontext():
        outputs = variant.net(inputs)
        forwarded = time.perf_counter()
        loss = F.cross_entropy(outputs, targets)
        variant.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # returns once DDP has the averaged gradients (all futures done)
    backward_done = time.perf_counter()
    variant.optimizer.step()
    finished = time.perf_counter()
    if not math.isfinite(loss.item()):
        raise FloatingPointError(f"{variant.name}: loss became {loss.item()}")
    variant.steps_run += 1
    topk = hook = 0.0
    if variant.name in OMGS_VARIANTS:
        # the hook's own per-step timers: host seconds in top-k and in its per-bucket calls
        last = variant.hook_state.stats()["last"] or {}
        topk, hook = last.get("topk_s", 0.0), last.get("hook_s", 0.0)
    return finished - started, finished - backward_done, topk, hook, forwarded - started


def slowest_rank(rows):
    """Element-wise MAX over ranks of a list of per-step tuples, but the forward column
    (``forward_s``, the host's pace: :func:`paced_medians`) is the ranks' MEAN (two
    collectives)."""
    import torch
    import torch.distributed as dist

    table = torch.tensor(rows, dtype=torch.float64)
    mean = None
    if table.dim() == 2 and table.shape[1] > FORWARD_COLUMN:
        mean = table[:, FORWARD_COLUMN].clone()
        dist.all_reduce(mean)
        mean /= dist.get_world_size()
    dist.all_reduce(table, op=dist.ReduceOp.MAX)
    if mean is not None:
        table[:, FORWARD_COLUMN] = mean
    return [tuple(float(x) for x in row) for row in table.tolist()]


def replayed_prediction(variant):
    """The cost model's iteration time for the plan in use, fed with timed-step measurements.

    The plan's own prediction uses the times measured during the untimed warm-up. Here
    the same plan is evaluated (``planner.evaluate``) with the hook's own planning input
    (``OMGSState.measured_instance``) built from its measurement window, which holds
    the timed steps (``measure_window``). This separates stale inputs from errors of
    the model itself.
    Collective: every rank must call it. Returns None without a plan.
    """
    import torch
    import torch.distributed as dist

    from omgs_hook.planner import evaluate

    state = variant.hook_state
    plan = state.plan
    usable = plan is not None and state.meter.layout == plan.layout
    flag = torch.tensor([float(usable)], dtype=torch.float64)
    dist.all_reduce(flag)
    if flag.item() < dist.get_world_size():
        return None
    # the hook's own planning input, built from the measurement window = the timed steps
    instance = state.measured_instance(plan.layout)
    return evaluate(instance, plan.unit_groups(), dense=list(plan.dense)).predicted_iteration_s


def variant_report(variant):
    """Timings, statistics and what the hook says about itself (plan, prediction, bytes)."""
    report = {"name": variant.name, "bucket_cap_mb": variant.bucket_cap_mb,
              "steps_run": variant.steps_run, "round_medians_s": variant.round_medians}
    report.update(summarise_times(variant.times))
    state = variant.hook_state
    if variant.name in OMGS_VARIANTS and state is not None:
        stats = state.stats()
        plan = stats.get("plan") or {}
        last = stats.get("last") or {}
        backward = stats.get("backward_s_per_unit") or []
        report["hook"] = {
            "options": variant.hook_options,
            "plan_strategy": plan.get("strategy"),
            "plan_at_timing_start": variant.plan_at_timing_start,
            "plan_changed_while_timed": plan_signature(state) != variant.plan_at_timing_start,
            # whatever the library reports about its plan choice (measured selection:
            # candidates with predicted and measured times, winner), verbatim
            **{key: _json_safe(stats[key]) for key in SELECTION_STATS_KEYS if key in stats},
            "predicted_iteration_s": stats.get("predicted_iteration_s"),
            "plan_groups": plan.get("groups"),
            "plan_dense": plan.get("dense"),
            "num_groups": plan.get("num_groups"),
            "num_units": len(backward),
            "plan_made_at_step": plan.get("made_at_step"),
            "replans": stats["total"].get("replans"),
            "hook_forward_s": stats.get("forward_s"),
            "hook_backward_s": sum(backward),
            "bytes_sent_per_step": last.get("bytes_sent"),
            "dense_bytes_per_step": last.get("dense_bytes"),
            "achieved_density": last.get("density"),
            "nonfinite_steps": stats["total"].get("nonfinite_steps"),
            "replayed_prediction_s": replayed_prediction(variant),
            # the model's inputs (measured collective scaling included) and its check
            # against the plan's own steps
            "planned_with": _json_safe(stats.get("planned_with")),
            "model_check": _json_safe(stats.get("model_check")),
            "cost_correction": _json_safe(stats.get("cost_correction")),
        }
    elif variant.name == "powersgd" and state is not None:
        rate = state.compression_stats()[0]  # (rate, numel before, numel after)
        report["hook"] = {"compression_rate": rate, "rank": state.matrix_approximation_rank}
    elif variant.name == "allreduce":
        numel = sum(p.numel() for p in variant.module.parameters())
        report["hook"] = {"bytes_sent_per_step": 4 * numel}
    return report


# keys of OMGSState.stats() describing how the plan was chosen, copied into the results
SELECTION_STATS_KEYS = ("plan_history", "selection", "trial", "candidates", "select")


def _json_safe(value):
    """``value`` with anything JSON cannot hold (tensors, tuples of objects) made plain."""
    return json.loads(json.dumps(value, default=lambda o: o.tolist() if hasattr(o, "tolist")
                                 else repr(o)))


def plan_signature(state):
    """The plan in use as plain data: (groups, dense) or None."""
    plan = getattr(state, "plan", None)
    if plan is None:
        return None
    return [plan.unit_groups(), [bool(d) for d in plan.dense]]


def _selection_in_progress(stats):
    """Whether the hook says its measured plan selection (trial) is still running.

    Reads the library's stats: ``stats()["selection"]["trial"]`` (the running trial,
    None when none runs); failing that, without knowing their exact shape, a
    ``selection`` or ``trial`` entry with an ``active``/``running``/``in_progress`` flag, a
    ``done``/``finished`` flag, or a ``phase``/``state`` naming a trial. Unknown shapes
    count as not running; the plan-stability rule of :func:`settle_default` still holds.
    """
    for key in ("selection", "trial"):
        info = stats.get(key)
        if not isinstance(info, dict):
            continue
        if key == "selection" and "trial" in info:
            # omgs_hook's shape: the running trial's report, None when none is running
            return info["trial"] is not None
        for flag in ("active", "running", "in_progress", "in_trial", "trial_active"):
            if flag in info:
                return bool(info[flag])
        for flag in ("done", "finished", "complete", "decided"):
            if flag in info:
                return not info[flag]
        phase = info.get("phase", info.get("state"))
        if isinstance(phase, str):
            return phase.lower() in ("trial", "running", "measuring", "active", "remeasure")
    return False


def _prediction_settled(stats):
    """Whether the hook's prediction of the plan in use is the settled model check's
    (``stats()["model_check"]["kind"] == "settled"``, made at or after the plan's first
    step). Without a ``model_check`` entry (a library that has none) it counts as
    settled; with one that has not run yet, as not.

    Why: the table's ``predicted`` is the settled check's, made from the steps since the
    plan's first check. The first check's steps come right after the trial, and on
    VGG-16 (2026-12-05) they ran 1.92 s against 1.64 s for the timed ones, so the
    default's prediction, right for its own steps (+1%), read +18%.
    """
    if "model_check" not in stats:
        return True
    check, plan = stats.get("model_check"), stats.get("plan")
    if not isinstance(check, dict) or check.get("kind") != "settled":
        return False
    made = plan.get("made_at_step") if isinstance(plan, dict) else None
    return made is None or check.get("step", 0) >= made


def warm_up(variant, batches, config, step=None):
    """The untimed warm-up of one variant (:func:`warmup_steps_for`, then, for the library
    default, :func:`settle_default`); returns the steps run. ``step``: the worker's
    one-step function (default :func:`run_step`). Collective."""
    step = step or run_step
    hook_warmup = config["warmup_steps"]
    if variant.name == "default":
        hook_warmup = variant.hook_state.warmup_steps  # the library's default
    steps = warmup_steps_for(variant.name, hook_warmup)
    for i in range(steps):
        step(variant, batches[i % len(batches)])
    if variant.name == "default":  # until its trial is over and its plan settled
        steps += settle_default(variant, batches,
                                config.get("default_max_settle_steps", DEFAULT_MAX_SETTLE_STEPS),
                                DEFAULT_STABLE_STEPS, step)
    return steps


def settle_default(variant, batches, max_steps, stable_steps, step=None):
    """Run the default variant until its plan has settled; return the extra steps run.

    Settled: on every rank, no selection trial in progress, the same plan for the
    last ``stable_steps`` steps and its settled model check made
    (:func:`_prediction_settled`). Collective, so all ranks run the same number of
    steps. ``step``: as in :func:`warm_up`. Each step's return value is kept in
    ``variant.warmup_rows`` (this rank's; the worker reports the slowest rank's).

    Two phases. Until the trial is over and the plan stable, the ranks agree after
    every step (one small all-reduce). Then the steps the settled check still needs
    (it comes ``SETTLED_CHECK_STEPS`` after the plan's first step) run as in the timed
    rounds, with nothing of the harness between them but one agreement per batch of
    steps, because the check times them: with the all-reduce and a second ``stats()``
    after every step, ResNet-20's steps 42-57 at N = 2 ran 214 ms against 136 ms timed
    (2026-12-05), and the default's prediction, right for those steps, read +57%.
    """
    import torch
    import torch.distributed as dist

    step = step or run_step
    rows = variant.warmup_rows

    def one_step():
        row = step(variant, batches[variant.steps_run % len(batches)])
        if isinstance(row, tuple):
            rows.append(row)

    def everyone(value, op):
        tensor = torch.tensor([float(value)])
        dist.all_reduce(tensor, op=op)
        return tensor.item()

    extra = 0
    stable = 0
    previous = plan_signature(variant.hook_state)
    while extra < max_steps:
        one_step()
        extra += 1
        current = plan_signature(variant.hook_state)
        stable = stable + 1 if current == previous and current is not None else 0
        previous = current
        done = stable >= stable_steps and not _selection_in_progress(variant.hook_state.stats())
        if everyone(done, dist.ReduceOp.MIN) == 1.0:
            break
    while extra < max_steps:
        stats = variant.hook_state.stats()
        if everyone(_prediction_settled(stats), dist.ReduceOp.MIN) == 1.0:
            break
        made = (stats.get("plan") or {}).get("made_at_step")
        due = 1 if made is None else made + _settled_check_steps() + 1 - stats.get("step", 0)
        count = int(everyone(min(max(1, due), max_steps - extra), dist.ReduceOp.MAX))
        for _ in range(count):
            one_step()
        extra += count
    return extra


def _settled_check_steps():
    """The library's SETTLED_CHECK_STEPS (20 in this version)."""
    from omgs_hook import hook

    return getattr(hook, "SETTLED_CHECK_STEPS", 20)


def warmup_steps_for(name, hook_warmup_steps):
    """Untimed steps before a variant's first timed step.

    DDP needs two iterations to settle its buckets; the hooks add their dense warm-up
    (at whose end the OMGS plan is made, PowerSGD starts compressing); our sparse hooks
    re-plan once more OVERHEAD_SETTLE_STEPS later, with their own per-group work
    measured; then, if that changed the plan, the model check CHECK_SETTLE_STEPS later
    re-plans once more (PLAN_LAG steps to switch); then SETTLE_STEPS on the final
    configuration. The compute reference needs one step.
    """
    from omgs_hook.hook import CHECK_SETTLE_STEPS, OVERHEAD_SETTLE_STEPS, PLAN_LAG

    if name == REFERENCE:
        return 1
    if name == "allreduce":
        return DDP_SETUP_STEPS + SETTLE_STEPS
    if name == "powersgd":
        return max(DDP_SETUP_STEPS, hook_warmup_steps) + SETTLE_STEPS
    return (max(DDP_SETUP_STEPS, hook_warmup_steps) + OVERHEAD_SETTLE_STEPS
            + CHECK_SETTLE_STEPS + PLAN_LAG + SETTLE_STEPS)


def run_worker(config_path):
    """Entry point on each rank: build every variant, warm up, time interleaved rounds."""
    import resource

    import torch
    import torch.distributed as dist

    with open(config_path, encoding="utf-8") as handle:
        config = json.load(handle)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=config["pg_timeout_s"]))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    variants = []
    try:
        torch.manual_seed(config["seed"])  # identical initial weights on every rank
        initial_state = build_model(config).state_dict()
        variants = make_variants(config, initial_state, config["profile_path"])
        batches = synthetic_batches(config, rank)
        torch.manual_seed(config["seed"] + 1 + rank)  # dropout differs per rank, as in training

        warmup = {}
        for variant in variants:  # warm-up is per variant; it is never timed
            warmup[variant.name] = warm_up(variant, batches, config)
            if variant.warmup_rows:  # every rank ran the same settling steps
                variant.warmup_rows = slowest_rank(variant.warmup_rows)
            if variant.name in OMGS_VARIANTS:
                if variant.hook_state.stats()["plan"] is None:
                    raise RuntimeError(f"{variant.name}: no plan after {warmup[variant.name]} "
                                       f"warm-up steps")
                variant.plan_at_timing_start = plan_signature(variant.hook_state)
        dist.barrier()
        orders = [round_order(len(variants), i, config["seed"]) for i in range(config["rounds"])]
        for order in orders:
            for position in order:
                variant = variants[position]
                rows = [run_step(variant, batches[(variant.steps_run + i) % len(batches)])
                        for i in range(config["steps"])]
                timed = slowest_rank(rows)
                variant.times.extend(timed)
                variant.round_medians.append(statistics.median(r[0] for r in timed))
        reports = {}
        for variant in variants:
            reports[variant.name] = variant_report(variant)
            reports[variant.name]["warmup_steps"] = warmup[variant.name]
            if variant.warmup_rows:  # the default's settling steps (untimed), slowest rank
                reports[variant.name].update(step_columns(variant.warmup_rows, "settle_"))
        peak_rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0])
        dist.all_reduce(peak_rss, op=dist.ReduceOp.MAX)
        if rank == 0:
            output = {"variants": reports, "world_size": world_size,
                      "round_orders": [[variants[i].name for i in o] for o in orders],
                      "peak_rss_bytes_max_rank": float(peak_rss.item()),
                      "threads_per_rank": torch.get_num_threads(),
                      "torch_version": torch.__version__}
            tmp = config["out"] + ".tmp"
            with open(tmp, "w", encoding="utf-8") as handle:
                json.dump(output, handle, indent=1)
            os.replace(tmp, config["out"])
        dist.barrier()
    finally:
        # Free the DDP models (and the hook states referencing them) before tearing the
        # process group down: gloo otherwise aborts at exit in some runs.
        del variants
        gc.collect()
        dist.destroy_process_group()
    return 0


# =====================================================================================
# statistics
# =====================================================================================


def round_order(count, round_index, seed):
    """The order in which round ``round_index`` runs ``count`` variants: a permutation drawn
    from ``(seed, round_index)`` alone, so every rank draws the same one.

    Why drawn, not rotated: a rotation keeps every variant behind the same neighbour in
    every round, so whatever a variant leaves behind (the dense all-reduces' socket and
    queue state on the shaped links, caches, the allocator) lands on the same successor
    each time - a bias no number of rounds averages out. The A/A control showed one:
    in 75 of the 104 stored runs with it, TopK-SGD's copy (run after the default) read
    faster than TopK-SGD itself (run after PowerSGD); median -1.4%, -17% to +8%. A
    fresh draw per round gives every variant changing neighbours and places."""
    order = list(range(int(count)))
    # (a str seed hashes the same in every process, unlike hash() under PYTHONHASHSEED)
    random.Random(f"bench-round:{int(seed)}:{int(round_index)}").shuffle(order)
    return order


def quantile(values, q):
    """Linear-interpolated quantile ``q`` in [0, 1] of a non-empty sequence."""
    if not values:
        raise ValueError("quantile of an empty sequence")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


# the columns of a step's row, as run_step returns it
STEP_COLUMNS = ("iteration_s", "optimizer_s", "topk_s", "hook_s", "forward_s")
FORWARD_COLUMN = STEP_COLUMNS.index("forward_s")


def step_columns(rows, prefix=""):
    """``{prefix + column: [value per row]}`` for the :data:`STEP_COLUMNS` of ``rows``
    (a column the rows lack - rows of an older run - is left out)."""
    return {prefix + key: [r[at] for r in rows] for at, key in enumerate(STEP_COLUMNS)
            if all(len(r) > at for r in rows)}


# a step's pace is clamped to [1 / PACE_CLAMP, PACE_CLAMP]: the trial's spell factor
PACE_CLAMP = SPELL_FACTOR


def paced_medians(variants):
    """Per variant, the median of its timed steps each divided by its *pace*: the
    ranks' mean forward of that step over the median of those of every variant's timed
    steps in the run (clamped to ``[1 / PACE_CLAMP, PACE_CLAMP]``). The forward is
    compute only, so the pace is the host's speed at that step: on 2 cores the host runs
    in phases 20-30% apart that last about ten steps, and a variant whose rounds fell in
    slow ones read slow (docs/design.md, "Pace"). The measured selection divides its
    trial's steps the same way. Across hooks the forwards are not quite alike (PowerSGD's
    ran 5-8% above the others' at N = 4, which flatters it paced), so these figures go
    beside the raw ones, not in their place. Empty for a run without forwards (before
    this column)."""
    forwards = [x for v in variants.values() for x in v.get("forward_s") or []]
    if not forwards:
        return {}
    reference = statistics.median(forwards)
    if not reference > 0:
        return {}
    out = {}
    for name, v in variants.items():
        times, fwd = v.get("iteration_s") or [], v.get("forward_s") or []
        if not times or len(fwd) != len(times):
            continue
        out[name] = statistics.median(
            t / clamped_pace(f / reference, PACE_CLAMP) for t, f in zip(times, fwd))
    return out


def summarise_times(rows):
    """Median, quartiles and extremes of slowest-rank steps ``(iter, optimizer, topk, hook)``."""
    if not rows:
        return {"iteration_s": [], "timed_steps": 0}
    iteration = [r[0] for r in rows]
    return {
        **step_columns(rows),
        "timed_steps": len(rows),
        "median_s": statistics.median(iteration),
        "p25_s": quantile(iteration, 0.25),
        "p75_s": quantile(iteration, 0.75),
        "min_s": min(iteration),
        "max_s": max(iteration),
        "optimizer_median_s": statistics.median(r[1] for r in rows),
        "topk_median_s": statistics.median(r[2] for r in rows),
        "hook_median_s": statistics.median(r[3] for r in rows),
    }


def analyse(result):
    """Derived figures of one configuration's result: speed-ups, prediction error, targets."""
    variants = result["variants"]

    def median(name):
        v = variants.get(name)
        return v.get("median_s") if v else None

    out = {}
    omgs, allreduce, compute = median("omgs"), median("allreduce"), median(REFERENCE)
    sparse_peers = [(median(n), n) for n in ("topk", "lags") if median(n) is not None]
    if omgs is not None and sparse_peers:
        best, best_name = min(sparse_peers)
        out["best_sparse_peer"] = best_name
        out["speedup_vs_best_sparse"] = best / omgs
        if compute:
            # what OMGS could gain over that peer if merging hid ALL of the peer's
            # communication and sparsification (the compute reference's time)
            out["ceiling_vs_best_sparse"] = best / compute
    if omgs is not None and allreduce is not None:
        out["speedup_vs_allreduce"] = allreduce / omgs
    if allreduce is not None and compute:
        out["comm_compute_ratio"] = (allreduce - compute) / compute
    hook = (variants.get("omgs") or {}).get("hook") or {}
    predicted = hook.get("predicted_iteration_s")
    if omgs is not None and predicted is not None:
        out["predicted_s"] = predicted
        out["prediction_error"] = (predicted - omgs) / omgs
        replayed = hook.get("replayed_prediction_s")
        if replayed is not None:
            out["replayed_s"] = replayed
            out["replayed_prediction_error"] = (replayed - omgs) / omgs
    out.update(analyse_default(variants))
    paced = paced_medians(variants)
    if paced:
        # the same comparisons with every step divided by the host's pace at it
        figures = analyse_default({n: {**v, "median_s": paced[n]} for n, v in variants.items()
                                   if n in paced})
        out["paced"] = {"median_s": paced, **{
            k: figures[k] for k in ("default_vs_best_peer", "default_best_peer",
                                    "default_slowdown", "default_worst_candidate",
                                    "default_worst_slowdown", "fastest_candidate",
                                    "default_vs_powersgd", "aa_difference") if k in figures}}
    return out


def _prediction_error(variant, key="predicted_iteration_s"):
    """(predicted - measured) / measured of the median step, the prediction the hook's
    report holds under ``key`` (``"replayed_prediction_s"``: the model fed with the
    hook's measurements of the timed steps themselves, :func:`replayed_prediction`), or
    None."""
    if not variant or variant.get("median_s") is None:
        return None
    predicted = (variant.get("hook") or {}).get(key)
    if predicted is None:
        return None
    return (predicted - variant["median_s"]) / variant["median_s"]


def _check_error(variant):
    """The hook's own model check of the plan in use: its prediction against the steps
    it was made from (``stats()["model_check"]["error"]``), or None."""
    check = ((variant or {}).get("hook") or {}).get("model_check")
    return check.get("error") if isinstance(check, dict) else None


def analyse_default(variants):
    """The library default against its peers and candidates; prediction error per strategy.

    ``default_vs_best_peer``: the better of TopK/LAGS over the default (>= 0.98 wanted);
    ``default_slowdown``: per candidate plan, default / candidate - 1 (<= 2% wanted);
    ``default_vs_powersgd``: PowerSGD over the default (> 1: the default is ahead);
    ``strategy_prediction_error``: per strategy, (predicted - measured) / measured;
    ``strategy_check_error``: per strategy (and ``"default"``), the same error of the
    hook's own model check on the steps it was made from (:func:`_check_error`);
    ``strategy_replayed_error``: per strategy (and ``"default"``), the error of the same
    plan's prediction from the timed steps' own measurements (:func:`replayed_prediction`);
    ``aa_difference``: with the A/A control, topk_again / topk - 1 (the noise floor).
    """
    def median(name):
        v = variants.get(name)
        return v.get("median_s") if v else None

    out = {}

    def per_strategy(key, error_of, default=True):
        """``out[key]``: ``error_of(variant)`` per strategy (and the default's), those
        known; nothing when none is."""
        names = list(PREDICTION_STRATEGIES.items()) + ([("default", "default")] if default else [])
        errors = {strategy: error_of(variants.get(name)) for strategy, name in names}
        errors = {k: v for k, v in errors.items() if v is not None}
        if errors:
            out[key] = errors

    # (the default's error against the timed rounds is default_prediction_error, below)
    per_strategy("strategy_prediction_error", _prediction_error, default=False)
    per_strategy("strategy_check_error", _check_error)
    per_strategy("strategy_replayed_error",
                 lambda variant: _prediction_error(variant, "replayed_prediction_s"))
    if median("topk") is not None and median("topk_again") is not None:
        out["aa_difference"] = median("topk_again") / median("topk") - 1.0
    default = median("default")
    if default is None:
        return out
    default_error = _prediction_error(variants.get("default"))
    if default_error is not None:
        out["default_prediction_error"] = default_error
    peers = [(median(n), n) for n in ("topk", "lags") if median(n) is not None]
    if peers:
        best, best_name = min(peers)
        out["default_best_peer"] = best_name
        out["default_vs_best_peer"] = best / default
    slowdown = {name: default / median(name) - 1.0 for name in CANDIDATES
                if median(name) is not None}
    if slowdown:
        out["default_slowdown"] = slowdown
        worst = max(slowdown, key=slowdown.get)
        out["default_worst_candidate"] = worst
        out["default_worst_slowdown"] = slowdown[worst]
        fastest = min((median(n), n) for n in slowdown)
        out["fastest_candidate"] = fastest[1]
    if median("powersgd") is not None:
        out["default_vs_powersgd"] = median("powersgd") / default
    if median("allreduce") is not None:
        out["default_vs_allreduce"] = median("allreduce") / default
    return out


# =====================================================================================
# driver: clusters, profiling, launching the workers
# =====================================================================================


def config_tag(model, nodes, density, allow_dense):
    """Names one configuration's files: ``vgg16_n4_d0.001`` (``..._dense`` with dense groups)."""
    return f"{model}_n{nodes}_d{density:g}" + ("_dense" if allow_dense else "")


def result_path(results_dir, tag):
    return os.path.join(results_dir, f"{RESULT_PREFIX}{tag}.json")


def default_rate(model, nodes):
    """The link rate for (model, nodes) (see BENCH_RATES and VGG16_RATES), or None if
    none is known."""
    from netem_cluster import RECOMMENDED_RATES

    if (model, nodes) in BENCH_RATES:
        return BENCH_RATES[(model, nodes)]
    if model == "vgg16" and nodes in VGG16_RATES:
        return VGG16_RATES[nodes]
    return RECOMMENDED_RATES.get((model, nodes))


def matched_rates(results, target_ratio=TARGET_COMM_COMPUTE_RATIO):
    """The link rates that give each measured configuration a dense comm/compute ratio of
    ``target_ratio`` on the host that measured it: the rates above were chosen on one
    host, and a host 1.6x slower at compute runs them at a ratio near 2 instead of 4.

    ``results``: benchmark result dicts (:func:`load_results`). Per (model, N), each
    result's compute-only and all-reduce medians at its own rate give a rate through
    ``netem_cluster.matching_rate``; a configuration's results (its densities) are
    averaged, as :data:`BENCH_RATES` were derived. Returns ``{(model, nodes): (rate_bps,
    [measured ratios])}``; results without both rows are left out."""
    from netem_cluster import matching_rate

    found = {}
    for result in results:
        variants = result.get("variants", {})
        compute = (variants.get(REFERENCE) or {}).get("median_s")
        allreduce = (variants.get("allreduce") or {}).get("median_s")
        rate_bps = result.get("rate_bps")
        if not (compute and allreduce and rate_bps) or allreduce <= compute:
            continue
        rate = matching_rate(compute, allreduce, rate_bps, target_ratio=target_ratio)
        rates, ratios = found.setdefault((result["model"], result["nodes"]), ([], []))
        rates.append(rate)
        ratios.append((allreduce - compute) / compute)
    return {key: (sum(rates) / len(rates), ratios) for key, (rates, ratios) in found.items()}


def matched_rate_arguments(rates):
    """``--rate`` arguments for :func:`matched_rates`' result, in kbit (tc-style)."""
    return [f"--rate {model}:{nodes}={round(bps / 1000)}kbit"
            for (model, nodes), (bps, _) in sorted(rates.items())]


def print_matched_rates(results_dir):
    """``--matched-rates``: what :func:`matched_rates` finds in ``results_dir``."""
    from netem_cluster import format_rate

    rates = matched_rates(load_results(results_dir))
    if not rates:
        raise SystemExit(f"bench_cluster: --matched-rates: no result in {results_dir!r} has "
                         f"both the compute-only and the allreduce rows (run the benchmark "
                         f"once with --hooks allreduce,... first)")
    for (model, nodes), (bps, ratios) in sorted(rates.items()):
        measured = (f"{ratios[0]:.2f}" if len(ratios) == 1 else
                    f"{min(ratios):.2f}-{max(ratios):.2f} over {len(ratios)} runs")
        print(f"{model} N={nodes}: measured comm/compute {measured} -> {format_rate(bps)} "
              f"for {TARGET_COMM_COMPUTE_RATIO:g}")
    print(" ".join(matched_rate_arguments(rates)))


def load_average():
    """The 1, 5 and 15 minute load averages."""
    return list(os.getloadavg())


def wait_for_load(threshold, max_wait_s, poll_s=10.0):
    """Wait until the 1-minute load average is below ``threshold``; return the load seen."""
    deadline = time.monotonic() + max_wait_s
    while True:
        load = load_average()
        if load[0] < threshold or time.monotonic() >= deadline:
            return load
        print(f"bench_cluster: load average {load[0]:.2f} >= {threshold}, waiting ...",
              flush=True)
        time.sleep(poll_s)


def model_facts(model, config):
    """Parameter count of ``model`` as configured (builds it once, on the driver)."""
    from omgs_hook.examples.models import count_parameters

    return count_parameters(build_model({"model": model, **config}))


def profile_sweep(numel, density, quick):
    """Message sizes (bytes per rank) and top-k sizes spanning what this model sends.

    The smallest sparse message is one entry; the largest sparse one is one group of the
    whole model (TopK-SGD), and the largest dense one the whole gradient (fp32), since
    the default and ``omgs_dense`` may send any group dense. Sizes grow geometrically so
    the relative-error fit sees every scale. Without the dense end, the all-reduce's
    per-byte cost was fitted from messages of at most 2x the sparse ones (76 kB for a
    4.8M-parameter model at density 0.001): on a 220 Mbit/s link they cost no more than
    the latency, the fit gave beta = 0, and dense groups were priced as free (-42%).
    A ``quick`` sweep keeps to the sparse sizes.
    """
    largest_message = 4 * (2 * max(1, math.ceil(density * numel)) + 1)
    top = max(64 * 1024, 2 * largest_message)
    count = 3 if quick else 6
    if not quick and 4 * numel > top:
        top, count = 4 * numel, 8
    sizes = sorted({int(round(64 * (top / 64) ** (i / (count - 1)))) for i in range(count)})
    topk_top = numel
    topk_sizes = sorted({int(round(1000 * (topk_top / 1000) ** (i / (count - 1))))
                         for i in range(count)})
    return sizes, topk_sizes


def run_configuration(cluster, model, density, args, workdir):
    """Profile the cluster, launch the workers, return the merged result dict."""
    nodes = cluster.nodes
    common = {"vgg_fc_width": args.vgg_fc_width, "user_model": args.user_model}
    numel = model_facts(model, common)
    tag = config_tag(model, nodes, density, args.allow_dense)
    profile_path = os.path.join(workdir, f"profile_{tag}.json")
    sizes, topk_sizes = profile_sweep(numel, density, args.quick)
    profile_argv = [sys.executable, PROFILE_SCRIPT, "--out", profile_path, "--no-plot",
                    "--no-progress", "--density", repr(density),
                    "--sizes", ",".join(map(str, sizes)),
                    "--topk-sizes", ",".join(map(str, topk_sizes)),
                    "--reps", str(args.profile_reps), "--warmup", "1"]
    if args.topk_backend != "auto":
        profile_argv += ["--topk-backends", args.topk_backend]
    started = time.monotonic()
    cluster.run_ranks(profile_argv, timeout=args.timeout, cwd=REPO_ROOT).check()
    profile_s = time.monotonic() - started
    with open(profile_path, encoding="utf-8") as handle:
        profile = json.load(handle)
    # kept next to the results: the cost model this cluster was planned with (the
    # convergence study plans its OMGS runs with the ResNet-20 one)
    shutil.copyfile(profile_path, os.path.join(args.results_dir, f"profile_{tag}.json"))

    worker_config = {
        "model": model, "density": density, "variants": [REFERENCE] + list(args.hooks),
        "steps": args.steps, "rounds": args.rounds, "warmup_steps": args.warmup_steps,
        "replan_every": args.replan_every, "batch_size": args.batch_size, "lr": 0.01,
        "sparse_bucket_cap_mb": args.sparse_bucket_cap_mb, "powersgd_rank": args.powersgd_rank,
        "topk_backend": args.topk_backend, "allow_dense": args.allow_dense,
        "seed": args.seed, "profile_path": profile_path,
        "default_max_settle_steps": args.default_max_settle_steps,
        "out": os.path.join(workdir, f"worker_{tag}.json"),
        "pg_timeout_s": int(args.timeout), **common,
    }
    config_path = os.path.join(workdir, f"config_{tag}.json")
    with open(config_path, "w", encoding="utf-8") as handle:
        json.dump(worker_config, handle)
    load_before = load_average()
    started = time.monotonic()
    run = cluster.run_ranks([sys.executable, os.path.abspath(__file__), "--worker", config_path],
                            timeout=args.timeout, cwd=REPO_ROOT)
    run.check()
    bench_s = time.monotonic() - started
    with open(worker_config["out"], encoding="utf-8") as handle:
        measured = json.load(handle)

    from netem_cluster import format_rate

    result = {
        "kind": "omgs-bench-cluster", "version": 1,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": model, "params": numel, "nodes": nodes,
        "rate": format_rate(cluster.rate_bps), "rate_bps": cluster.rate_bps,
        "density": density, "quick": bool(args.quick),
        "settings": {k: worker_config[k] for k in (
            "steps", "rounds", "warmup_steps", "replan_every", "batch_size", "lr",
            "sparse_bucket_cap_mb", "powersgd_rank", "topk_backend", "seed", "vgg_fc_width",
            "allow_dense", "default_max_settle_steps", "user_model")},
        "library": library_info(),
        "load_before": load_before, "load_after": load_average(),
        "profile": {key: profile.get(key) for key in
                    ("comm", "dense", "topk", "world_size", "settings", "fit_errors")},
        "profile_s": profile_s, "bench_s": bench_s,
        **measured,
    }
    result["analysis"] = analyse(result)
    return result


def run_benchmarks(args):
    from netem_cluster import Cluster, unavailable_reason

    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"bench_cluster: cannot build the emulated cluster: {reason}")
    os.makedirs(args.results_dir, exist_ok=True)
    written = []
    with tempfile.TemporaryDirectory(prefix="omgs-bench-") as workdir:
        os.chmod(workdir, 0o755)
        for nodes in args.nodes:
            for model in args.models:
                rate = args.rate.get((model, nodes)) or default_rate(model, nodes)
                if rate is None:
                    raise SystemExit(f"bench_cluster: no recommended rate for {model} at "
                                     f"{nodes} nodes; pass --rate {model}:{nodes}=RATE")
                if args.wait_load is not None:
                    wait_for_load(args.wait_load, args.wait_load_max_s)
                with Cluster(nodes=nodes, rate=rate) as cluster:  # once per (N, rate)
                    for density in args.densities:
                        print(f"bench_cluster: {model}, {nodes} nodes at {rate}, density "
                              f"{density:g} ...", flush=True)
                        result = run_configuration(cluster, model, density, args, workdir)
                        path = result_path(args.results_dir, config_tag(
                            model, nodes, density, args.allow_dense))
                        with open(path, "w", encoding="utf-8") as handle:
                            json.dump(result, handle, indent=1)
                        written.append(path)
                        print(format_console_summary(result), flush=True)
    return written


# =====================================================================================
# report: Markdown + plot from the result files
# =====================================================================================


def read_result_files(results_dir, prefix, kind, analyse_one):
    """The result JSONs ``prefix*.json`` of ``kind`` in ``results_dir``, each with its
    ``"analysis"`` recomputed by ``analyse_one`` (the rules may have changed)."""
    results = []
    if not os.path.isdir(results_dir):
        return results
    for name in sorted(os.listdir(results_dir)):
        if not (name.startswith(prefix) and name.endswith(".json")):
            continue
        with open(os.path.join(results_dir, name), encoding="utf-8") as handle:
            data = json.load(handle)
        if data.get("kind") != kind:
            continue
        data["analysis"] = analyse_one(data)
        results.append(data)
    return results


def load_results(results_dir):
    """Every benchmark result JSON in ``results_dir``, sorted by (model, N, density)."""
    results = read_result_files(results_dir, RESULT_PREFIX, "omgs-bench-cluster", analyse)
    order = {m: i for i, m in enumerate(MODELS)}
    results.sort(key=lambda r: (order.get(r["model"], 99), r["nodes"], r["density"],
                                bool(r["settings"].get("allow_dense"))))
    return results


def _ms(seconds):
    return "-" if seconds is None else f"{1000 * seconds:.0f}" if seconds >= 0.1 else \
        f"{1000 * seconds:.1f}"


def _x(value):
    return "-" if value is None else f"{value:.2f}x"


def _pct(value):
    return "-" if value is None else f"{100 * value:+.0f}%"


def format_console_summary(result):
    lines = [f"{result['model']} N={result['nodes']} {result['rate']} density "
             f"{result['density']:g}:"]
    for name in VARIANTS:
        v = result["variants"].get(name)
        if v and v.get("median_s") is not None:
            hook = v.get("hook") or {}
            extra = ""
            if hook.get("predicted_iteration_s") is not None:
                extra = f" predicted {_ms(hook['predicted_iteration_s'])} ms"
            lines.append(f"  {name:<10} median {_ms(v['median_s'])} ms "
                         f"[{_ms(v['p25_s'])}, {_ms(v['p75_s'])}] top-k "
                         f"{_ms(v['topk_median_s'])} ms{extra}")
    a = result["analysis"]
    if a.get("default_vs_best_peer") is not None:
        lines.append(f"  default vs best of topk/lags {_x(a['default_vs_best_peer'])}, worst "
                     f"candidate {a.get('default_worst_candidate')} "
                     f"{_pct(a.get('default_worst_slowdown'))}, vs powersgd "
                     f"{_x(a.get('default_vs_powersgd'))}")
    lines.append(f"  omgs vs best of topk/lags {_x(a.get('speedup_vs_best_sparse'))}, "
                 f"vs allreduce {_x(a.get('speedup_vs_allreduce'))}, "
                 f"prediction {_pct(a.get('prediction_error'))}, "
                 f"replayed {_pct(a.get('replayed_prediction_error'))}")
    return "\n".join(lines)


def _dense_note(result):
    return ", dense groups allowed" if result["settings"].get("allow_dense") else ""


def _verdict(ok):
    return "met" if ok else "**missed**"


WITHIN_NOISE = "within A/A noise"


def ratio_verdict(ratio, target, noise=None, strict=False):
    """Verdict on a speed ratio whose target is ``ratio >= target`` (``ratio > target``
    with ``strict``; higher is better).

    Without an A/A control (``noise`` None) it is plain met / missed. With one, ``noise``
    is the run's A/A difference (``aa_difference``: two identical variants differed by
    that fraction by chance), and a ratio that clears or misses the target by less than
    that cannot be told apart from luck: met only at ``target * (1 + noise)`` or above,
    missed only below ``target / (1 + noise)``, and otherwise ``WITHIN_NOISE``."""
    if noise is None:
        return _verdict(ratio > target if strict else ratio >= target)
    margin = 1.0 + abs(noise)
    if ratio >= target * margin:
        return "met"
    if ratio < target / margin:
        return "**missed**"
    return WITHIN_NOISE


def render_tables(results, plot_name):
    """The generated Markdown: setup line, one table per configuration, target summary."""
    if not results:
        return "_No benchmark results yet: run `python scripts/bench_cluster.py`._\n"
    out = []
    quick = any(r.get("quick") for r in results)
    if quick:
        out.append("> **Smoke-test results (`--quick`)**: too few steps for any conclusion.\n")
    out.append(f"![iteration time per hook]({plot_name})\n")
    out.append("Times are per training step (forward, backward with gradient exchange, "
               "optimiser step) on the slowest rank, in milliseconds: median over all timed "
               "steps, [p25, p75] across them, and the min-max of the per-round medians. "
               "`top-k` is the sparse hooks' selection time per step (slowest rank), `hook` "
               "all their work on the autograd thread (top-k, assembling gradient + residual, "
               "the NaN check, packing; since 24845ad also the sparse groups' write-back, "
               "which ran in gloo threads before; never the wait for a collective), "
               "`opt` the optimiser step. `predicted` is the planner's iteration time for the "
               "plan in use as the hook holds it at the end of the run, from the times it "
               "measured (forward, per-bucket backward, its own per-group work, the step's "
               "tail - optimiser, zero_grad - and the profile's collective and top-k costs, "
               "scaled by its timed collectives), never from the step times themselves. "
               "Since 81afd07 that is the settled model check's, 20 steps after the plan "
               "went into use, on the steps since its first check: for the fixed variants "
               "these are the last untimed steps and the first timed ones, for the default "
               "(since 2026-12-05) its last untimed steps, run as the timed ones are; "
               "`replayed` evaluates the same plan with the hook's measurements of the timed "
               "steps instead.\n")
    for r in results:
        s = r["settings"]
        a = r["analysis"]
        ratio = a.get("comm_compute_ratio")
        out.append(
            f"### {r['model']} ({r['params'] / 1e6:.2f}M parameters), N = {r['nodes']}, "
            f"{r['rate']} links, density {r['density']:g}{_dense_note(r)}\n")
        out.append(
            f"{s['rounds']} rounds x {s['steps']} steps per variant, batch {s['batch_size']} "
            f"per rank, hooks' dense warm-up {s['warmup_steps']} steps (all warm-up "
            f"untimed); "
            f"load average {r['load_before'][0]:.2f} before, {r['load_after'][0]:.2f} after; "
            f"measured communication/computation ratio of allreduce "
            f"{'-' if ratio is None else f'{ratio:.1f}'}; peak memory per rank "
            f"{r.get('peak_rss_bytes_max_rank', 0) / 2 ** 30:.2f} GiB.\n")
        out.append("| variant | median ms | [p25, p75] | round medians | top-k ms | hook ms | "
                   "opt ms | predicted ms | replayed ms | groups / units | sent per step | "
                   "vs allreduce |")
        out.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
        allreduce = (r["variants"].get("allreduce") or {}).get("median_s")
        for name in VARIANTS:
            v = r["variants"].get(name)
            if not v or v.get("median_s") is None:
                continue
            hook = v.get("hook") or {}
            rounds = v.get("round_medians_s") or []
            round_text = f"{_ms(min(rounds))}-{_ms(max(rounds))}" if rounds else "-"
            groups = "-"
            if hook.get("num_groups") is not None:
                groups = f"{hook['num_groups']} / {hook.get('num_units', '?')}"
                if hook.get("plan_dense") and any(hook["plan_dense"]):
                    groups += f" ({sum(hook['plan_dense'])} dense)"
            sent = hook.get("bytes_sent_per_step")
            if name == "powersgd" and hook.get("compression_rate"):
                sent_text = f"1/{hook['compression_rate']:.0f} of dense"
            else:
                sent_text = "-" if sent is None else f"{sent / 1e3:.1f} kB"
            speed = None if allreduce is None else allreduce / v["median_s"]
            topk = v.get("topk_median_s") if name in OMGS_VARIANTS else None
            hook_s = v.get("hook_median_s") if name in OMGS_VARIANTS else None
            out.append(
                f"| {HOOK_LABELS[name]} | {_ms(v['median_s'])} | [{_ms(v['p25_s'])}, "
                f"{_ms(v['p75_s'])}] | {round_text} | {_ms(topk)} | {_ms(hook_s)} | "
                f"{_ms(v.get('optimizer_median_s'))} | "
                f"{_ms(hook.get('predicted_iteration_s'))} | "
                f"{_ms(hook.get('replayed_prediction_s'))} | {groups} | {sent_text} | "
                f"{_x(speed)} |")
        out.append("")
        plan_lines = []
        for name in ("omgs", "omgs_dense", "greedy", "default"):
            plan = (r["variants"].get(name) or {}).get("hook") or {}
            if plan.get("plan_groups"):
                sizes = [len(g) for g in plan["plan_groups"]]
                dense = plan.get("plan_dense") or []
                text = f"{HOOK_LABELS[name]}: {len(sizes)} groups of {sizes}"
                if any(dense):
                    text += " (dense: " + ", ".join(
                        str(i + 1) for i, d in enumerate(dense) if d) + ")"
                if name == "default":
                    text += default_note(r["variants"][name], r.get("settings") or {})
                plan_lines.append(text)
        if plan_lines:
            out.append("Plans (units per group, consecutive units in gradient-ready order): "
                       + "; ".join(plan_lines) + ".\n")
        trial = trial_line((r["variants"].get("default") or {}).get("hook") or {})
        if trial:
            out.append(trial + "\n")
    out.append("### Targets\n")
    out.append("`ceiling` is the best sparse peer's time over the compute-only time: the "
               "speed-up OMGS would reach over that peer if merging hid all of the peer's "
               "communication and sparsification.\n")
    out.append("| configuration | omgs vs best of topk/lags (>= 1.3x) | ceiling | omgs vs "
               "allreduce (>= 2x on the communication-bound model) | predicted vs measured "
               "(within 15%) | replayed vs measured |")
    out.append("|---|---|---|---|---|---|")
    for r in results:
        a = r["analysis"]
        name = f"{r['model']} N={r['nodes']} d={r['density']:g}{_dense_note(r)}"
        vs_sparse = a.get("speedup_vs_best_sparse")
        vs_dense = a.get("speedup_vs_allreduce")
        err = a.get("prediction_error")
        err3 = a.get("replayed_prediction_error")
        cells = [
            "-" if vs_sparse is None else
            f"{vs_sparse:.2f}x (best: {a['best_sparse_peer']}) "
            f"{ratio_verdict(vs_sparse, TARGET_SPEEDUP_VS_SPARSE, a.get('aa_difference'))}",
            _x(a.get("ceiling_vs_best_sparse")),
            "-" if vs_dense is None else
            f"{vs_dense:.2f}x {_verdict(vs_dense >= TARGET_SPEEDUP_VS_ALLREDUCE)}",
            "-" if err is None else f"{_pct(err)} {_verdict(abs(err) <= TARGET_PREDICTION_ERROR)}",
            "-" if err3 is None else
            f"{_pct(err3)} {_verdict(abs(err3) <= TARGET_PREDICTION_ERROR)}",
        ]
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    out.append("")
    out.extend(render_default_targets(results))
    return "\n".join(out) + "\n"


def default_note(variant, settings):
    """How the default variant's plan came about: options, warm-up, plan changes."""
    hook = variant.get("hook") or {}
    options = hook.get("options") or {}
    parts = []
    if options.get("select") is not None:
        parts.append(f"select={options['select']}")
    if options.get("allow_dense") is not None:
        parts.append(f"allow_dense={options['allow_dense']}")
    if variant.get("warmup_steps") is not None:
        parts.append(f"{variant['warmup_steps']} untimed warm-up steps")
    history = hook.get("plan_history")
    if isinstance(history, list):
        parts.append(f"{len(history)} plan(s) in its history")
    if hook.get("plan_changed_while_timed"):
        parts.append("**plan changed while timed**")
    return " [" + ", ".join(parts) + "]" if parts else ""


def trial_line(hook):
    """The default's last measured selection trial in one line, or None without one."""
    selection = hook.get("selection")
    trial = selection.get("last_trial") if isinstance(selection, dict) else None
    if not isinstance(trial, dict) or not trial.get("candidates"):
        return None
    parts = []
    for c in trial["candidates"]:
        predicted = c.get("predicted_s")
        measured = c.get("measured_s")
        groups = c.get("groups") or []
        dense = sum(bool(d) for d in c.get("dense") or [])
        text = (f"{c.get('name')} ({len(groups)} groups{f', {dense} dense' if dense else ''}) "
                f"{_ms(predicted)}/{_ms(measured)}")
        parts.append(f"**{text}**" if c.get("winner") else text)
    cost = ""
    if trial.get("excess_steps") is not None:  # (reported since ac11f8f)
        cost = (f" The trial ran {trial.get('steps')} steps, lead included; against running "
                f"its winner throughout they cost {trial['excess_steps']:.1f} steps of the "
                f"winner (`excess_steps`).")
    # (a later trial says why it ran: "periodic", or "regret", the winner's second look)
    why = trial.get("reason")
    kind = f"{why} " if why in ("periodic", "regret", "layout") else ""
    return (f"Default's {kind}selection trial (steps {trial.get('start_step')}-"
            f"{trial.get('decided_at')}, predicted/measured ms per step, winner in bold): "
            + ", ".join(parts) + "." + cost)


def render_default_targets(results):
    """The default's targets per configuration and the prediction error per strategy."""
    out = ["### The library default against its peers and candidates\n",
           "`default` is `omgs_hook.register(ddp, density=..., profile=...)` with every other "
           "option at the library's default. Ratios are medians over the interleaved rounds: "
           "`vs best of TopK/LAGS` is that peer's time over the default's (target >= "
           f"{TARGET_DEFAULT_VS_BEST_PEER:.2f}x), `worst candidate` the default's time over "
           "that of each fixed plan it could have chosen, shown for the worst one "
           f"(target: at most +{100 * TARGET_DEFAULT_VS_CANDIDATE:.0f}%), `vs PowerSGD` "
           "PowerSGD's time over the default's (target > 1).\n"]
    out.append("| configuration | library | default ms | vs best of TopK/LAGS (>= 0.98x) | "
               "default vs each candidate | worst candidate (<= +2%) | vs PowerSGD (> 1x) | "
               "vs allreduce |")
    out.append("|---|---|---|---|---|---|---|---|")
    any_default = False
    for r in results:
        a = r["analysis"]
        default = (r["variants"].get("default") or {}).get("median_s")
        if default is None:
            continue
        any_default = True
        name = f"{r['model']} N={r['nodes']} d={r['density']:g}{_dense_note(r)}"
        library = r.get("library") or {}
        commit = (library.get("commit") or "?")[:7] + ("+" if library.get("dirty") else "")
        peer = a.get("default_vs_best_peer")
        noise = a.get("aa_difference")
        slow = a.get("default_slowdown") or {}
        each = ", ".join(f"{n} {_pct(slow[n])}" for n in CANDIDATES if n in slow) or "-"
        worst = a.get("default_worst_slowdown")
        vs_psgd = a.get("default_vs_powersgd")
        cells = [
            commit, _ms(default),
            "-" if peer is None else
            f"{peer:.2f}x (best: {a['default_best_peer']}) "
            f"{ratio_verdict(peer, TARGET_DEFAULT_VS_BEST_PEER, noise)}",
            each,
            # "at most 2% slower": candidate / default >= 1 / 1.02
            "-" if worst is None else f"{a['default_worst_candidate']} {_pct(worst)} "
            + ratio_verdict(1.0 / (1.0 + worst), 1.0 / (1.0 + TARGET_DEFAULT_VS_CANDIDATE),
                            noise),
            # ahead of PowerSGD: strictly faster
            "-" if vs_psgd is None else
            f"{vs_psgd:.2f}x {ratio_verdict(vs_psgd, 1.0, noise, strict=True)}",
            _x(a.get("default_vs_allreduce")),
        ]
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    if not any_default:
        out = []
    controls = [(f"{r['model']} N={r['nodes']} d={r['density']:g}{_dense_note(r)}",
                 r["analysis"]["aa_difference"]) for r in results
                if r["analysis"].get("aa_difference") is not None]
    if controls:
        out.append("")
        out.append("A/A control (`topk_again`: TopK-SGD run a second time, as a model of its "
                   "own, in the same rounds): its median over TopK-SGD's, the difference two "
                   "identical variants show by chance in that run: "
                   + "; ".join(f"{n} {_pct(d)}" for n, d in controls) + ". In a configuration "
                   "with the control, a speed-ratio target is met or missed only by more than "
                   f"that difference, in either direction; closer, it reads `{WITHIN_NOISE}`: "
                   "the run cannot tell the outcome from luck.")
    paced = [(f"{r['model']} N={r['nodes']} d={r['density']:g}{_dense_note(r)}",
              r["analysis"]["paced"]) for r in results if r["analysis"].get("paced")]
    if paced:
        out.append("")
        out.append("Paced (every timed step divided by the host's pace at it: the ranks' mean "
                   "forward of that step over the median of those in the run, clamped to "
                   f"[1/{PACE_CLAMP:g}, {PACE_CLAMP:g}]; `paced_medians`, the rule the trial "
                   "uses): " + "; ".join(
                       f"{n}: default vs best TopK/LAGS {_x(p.get('default_vs_best_peer'))}, "
                       f"worst candidate {p.get('default_worst_candidate', '-')} "
                       f"{_pct(p['default_worst_slowdown']) if 'default_worst_slowdown' in p else '-'}, "
                       f"A/A {_pct(p['aa_difference']) if 'aa_difference' in p else '-'}"
                       for n, p in paced) + ". (Runs before this column have no forwards.)")
    out.append("")
    out.append("### Prediction error per strategy\n")
    out.append("(predicted - measured) / measured of the median step, `predicted` as above "
               "(the settled check's since 81afd07; before, the one made in the untimed "
               "warm-up) for the plan in use (target: within "
               f"{100 * TARGET_STRATEGY_PREDICTION_ERROR:.0f}%). `optimal+dense` is "
               "`strategy=\"optimal\", allow_dense=True`; the others are sparse-only unless "
               "the heading says dense groups are allowed.\n")

    def errors_of(r):
        a = r["analysis"]
        errors = dict(a.get("strategy_prediction_error") or {})
        if a.get("default_prediction_error") is not None:
            errors["default"] = a["default_prediction_error"]
        return errors

    out += _error_table(results, errors_of)
    out.append("The same prediction against the steps it was made from: the hook's model "
               "check (`stats()[\"model_check\"][\"error\"]`, the settled one 20 steps "
               "after the plan went into use). The table above compares it with the timed "
               "rounds instead, which run later in the run; the difference between the two "
               "is how far the host's step times moved between those windows.\n")
    out += _error_table(results, lambda r: r["analysis"].get("strategy_check_error") or {})
    out.append("The same plan's prediction made from the timed steps themselves (`replayed`: "
               "the cost model evaluated with the hook's measurements - forward, backward per "
               "bucket, its own work, the tail, the timed collectives' scaling - of its "
               "measurement window, which then holds the timed steps; the default keeps the "
               "library's `measure_window=32`, its last 32 steps), against the timed median. "
               "The host's drift between the windows is out of this one: what is left is the "
               "model's own error.\n")
    out += _error_table(results, lambda r: r["analysis"].get("strategy_replayed_error") or {})
    return out


def _error_table(results, errors_of):
    """A row per result, a column per strategy (and the default): each error against
    the target, ``errors_of(result)`` giving them by strategy."""
    strategies = list(PREDICTION_STRATEGIES) + ["default"]
    out = ["| configuration | " + " | ".join(strategies) + " |",
           "|---|" + "---|" * len(strategies)]
    for r in results:
        errors = errors_of(r)
        name = f"{r['model']} N={r['nodes']} d={r['density']:g}{_dense_note(r)}"
        cells = ["-" if errors.get(k) is None else
                 f"{_pct(errors[k])} {_verdict(abs(errors[k]) <= TARGET_STRATEGY_PREDICTION_ERROR)}"
                 for k in strategies]
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    out.append("")
    return out


def write_doc(path, generated):
    """Rewrite the generated section of ``path`` (see :mod:`omgs_hook.generated_docs`)."""
    write_generated_section(path, generated, "scripts/bench_cluster.py",
                            "Benchmark: OMGS-SGD against its peers on an emulated cluster")


def plot_results(results, path):
    """Grouped bars: one panel per (model, density), a group per N, a bar per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["model"], r["density"], bool(r["settings"].get("allow_dense")))
                     for r in results},
                    key=lambda p: (MODELS.index(p[0]) if p[0] in MODELS else 99, p[1], p[2]))
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8), squeeze=False)
    colors = {"compute": "0.75", "allreduce": "tab:gray", "powersgd": "tab:purple",
              "topk": "tab:orange", "lags": "tab:green", "greedy": "tab:olive",
              "omgs": "tab:blue", "omgs_dense": "tab:cyan", "default": "tab:red",
              "topk_again": "tab:brown"}
    for ax, (model, density, dense) in zip(axes[0], panels):
        rows = [r for r in results if r["model"] == model and r["density"] == density
                and bool(r["settings"].get("allow_dense")) == dense]
        rows.sort(key=lambda r: r["nodes"])
        names = [n for n in VARIANTS if any(n in r["variants"] for r in rows)]
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            xs, med, low, high = [], [], [], []
            for j, r in enumerate(rows):
                v = r["variants"].get(name)
                if not v or v.get("median_s") is None:
                    continue
                xs.append(j + (i - (len(names) - 1) / 2) * width)
                med.append(v["median_s"])
                low.append(v["median_s"] - v["p25_s"])
                high.append(v["p75_s"] - v["median_s"])
            ax.bar(xs, med, width, yerr=[low, high], capsize=2, color=colors[name],
                   label=HOOK_LABELS[name])
            if name == "omgs":
                predicted = [((r["variants"].get("omgs") or {}).get("hook") or {})
                             .get("predicted_iteration_s") for r in rows]
                px = [x for x, p in zip(xs, predicted) if p is not None]
                ax.plot(px, [p for p in predicted if p is not None], "k_", markersize=14,
                        markeredgewidth=2, label="OMGS planner prediction")
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels([f"N={r['nodes']}\n{r['rate']}" for r in rows])
        ax.set_ylabel("seconds per step (slowest rank, median, p25-p75)")
        ax.set_title(f"{model} ({rows[0]['params'] / 1e6:.1f}M params), density {density:g}"
                     + ("\n(sparse hooks may send dense groups)" if dense else ""))
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report(args):
    results = load_results(args.results_dir)
    generated = render_tables(results, os.path.relpath(
        os.path.abspath(args.plot), os.path.dirname(os.path.abspath(args.doc))))
    write_doc(args.doc, generated)
    if results:
        plot_results(results, args.plot)
    print(f"bench_cluster: {len(results)} result file(s) -> {args.doc}"
          + (f", {args.plot}" if results else ""), flush=True)
    return results


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return run_worker(args.worker)
    if args.matched_rates:
        print_matched_rates(args.results_dir)
        return 0
    if not args.report_only:
        run_benchmarks(args)
    report(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
