"""``omgs-profile``: measure the cost models the OMGS hook plans with, on the real cluster.

Run it with the launcher and the process-group settings the training job will use::

    torchrun --nproc_per_node=2 scripts/profile.py --out profile.json
    torchrun --no-python --nnodes=4 --nproc_per_node=8 ... omgs-profile --out profile.json

and pass the file to the hook: ``omgs_hook.register(model, profile="profile.json")``.

What is measured (every rank takes part; rank 0 writes the results):

1. **Packed sparse all-gather** (``comm``): for each message size, exactly what the hook
   does for one sparse group - ``communicator.pack_sparse`` of k float32 values and k
   indices into one float32 payload of 2k elements, ``communicator.allgather_async``, and
   the wait. Size = bytes one rank contributes (``8 * k``), the planner's convention.
2. **Dense all-reduce** (``dense``): ``communicator.allreduce_async`` of a float32 tensor
   and the wait. Size = the tensor's bytes.
3. **Top-k** (``topk``/``topk_all``): ``get_selector(backend, device).select(x, k)`` on a
   random float32 tensor of D elements with ``k = selected_k(D, density)``, for every
   backend that can run on the device.

4. **Two link classes** (``intra``/``inter``, only on a multi-GPU-node world: more than
   one node and more than one rank per node, resolved like the hook's ``topology``/
   ``ranks_per_node`` options - ``--topology``, ``--ranks-per-node``, default torchrun's
   ``LOCAL_WORLD_SIZE``; consecutive ranks form a node). The subgroups are those of
   ``topology.build_subgroups``. ``intra`` times, inside every node at once, the two
   intra-node collectives of the two-level exchange: the reduce-scatter of a dense
   float32 buffer of ``L * S`` elements (size = the rank's shard, ``4 * S`` bytes) and
   the all-gather of a float32 payload (size = the bytes one rank puts in); both sets of
   points are fitted by one line, since the cost model prices both by ``intra`` per byte
   each rank contributes. ``inter`` times the packed sparse all-gather (as in 1.) among
   the N ranks with the same local rank, with all L inter-node groups exchanging at
   the same time (they share the node's network link). ``inter_dense`` times the
   two-level dense path's inter-node all-reduce of a float32 shard (size = the shard's
   bytes) among those same N ranks, again all L groups at once. Written as
   ``ranks_per_node``, ``intra``, ``inter`` and ``inter_dense``; flat worlds write none
   of them.

Every measurement is repeated: ``--warmup`` untimed calls first (connection set-up,
allocator, CuPy kernel compilation), then ``--reps`` timed calls, each preceded by a
barrier so all ranks start together. Each rank times its own call (a CUDA synchronise
before and after on GPUs); the per-rep times are then all-reduced with MAX, because a
collective - and the training step - finishes only when the slowest rank does. The
median over reps of that slowest-rank time is the point that is fitted (robust to a
stray slow rep); all reps are kept in the file as raw samples.

The default sweep is **adaptive** under ``--time-budget`` seconds of measuring (default
30): sizes double from 1 KiB (1e3 elements for top-k) towards ``--max-size`` 8 MiB
(``--max-topk-size`` 4e6); the budget is shared between the all-gather, the all-reduce
and each top-k backend, and each part stops growing once the next size - predicted from
the last one - would not fit in what is left of its share. Expensive points get fewer
reps (down to :data:`MIN_REPS`) and warm-up calls; the last warm-up calls are a timed
probe that abandons a point far more expensive than predicted. Every decision is a pure
function (:func:`plan_point`, :func:`reps_after_probe`) of MAX-all-reduced times, so all
ranks take the same decisions and run the same collectives. Where the budget cut a part
short, the profile's ``sweep`` record and the printed summary say which sizes were
measured, where and why it stopped, and that the fit extrapolates beyond the largest
measured size. Explicit ``--sizes``/``--topk-sizes`` and ``--quick`` measure exactly
their sizes with fixed reps (no budget unless ``--time-budget`` is given). The timing
source is injectable (:func:`run_section` takes any ``measure(size, warmup, reps_for)``),
which the tests use to run the sweep on simulated noisy timings.

Fits (``omgs_hook.fitting``): ``t = alpha + beta * bytes`` and
``t = c0 + c1*D (+ c2*D*log2(D))``, both minimising Huber-weighted *relative* error with
non-negative coefficients; the top-k fit keeps ``c2 = 0`` unless the data clearly need
the ``D log D`` term. Each point's relative fit error is written to the file and printed.

Options: ``--sizes`` (message sizes in bytes), ``--topk-sizes`` (D values), ``--max-size``,
``--max-topk-size``, ``--time-budget``, ``--reps``, ``--warmup``, ``--density``,
``--topk-backends``, ``--topology``, ``--ranks-per-node``, ``--backend`` (default: nccl
when CUDA is available, else gloo),
``--device``, ``--quick`` (a tiny fixed sweep for tests and smoke checks), ``--no-plot``,
``--plot PATH``. Sizes accept ``K``/``M``/``G`` suffixes (powers of 1024) and scientific
notation (``4e6``).

Without a launcher (no ``WORLD_SIZE`` in the environment) it runs as a single rank,
which still measures top-k but says nothing useful about the network.
"""

import argparse
import datetime
import json
import math
import os
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from omgs_hook import cli_types, communicator, topology
from omgs_hook.cost_model import selected_k
from omgs_hook.fitting import fit_linear_relative, fit_topk
from omgs_hook.profile_file import SCHEMA_VERSION, profile_bandwidth_gaps, profile_from_dict

# Default sweep: adaptive. Message sizes grow geometrically (x2) from 1 KiB towards
# 8 MiB (a sparse group of a 100M-parameter model at density 0.01 contributes 8 MB) and
# top-k sizes from 1e3 towards 4e6 elements; each part of the sweep stops growing once
# its next point would not fit in its share of --time-budget (see plan_point).
DEFAULT_MIN_SIZE = 1024
DEFAULT_MAX_SIZE = 8 * 2 ** 20
DEFAULT_MIN_TOPK_SIZE = 1000
DEFAULT_MAX_TOPK_SIZE = 4_000_000
GROWTH = 2.0
DEFAULT_TIME_BUDGET_S = 30.0
DEFAULT_REPS = 20
DEFAULT_WARMUP = 5
# adaptive repetitions never go below MIN_REPS (a median of 5 still ignores 2 stray reps)
MIN_REPS = 5
# the smallest MIN_POINTS sizes of each part are always measured, whatever the budget
MIN_POINTS = 4
# a point's timed reps may use at most POINT_SHARE of its part's budget, and at most
# half of what is left of it, so that there is room to grow further; beyond that its reps
# drop (down to MIN_REPS)
POINT_SHARE = 1 / 12
# the last PROBE_CALLS warm-up calls of a point are timed; the fastest of them predicts
# its reps (one stray slow call must not abandon a point), so expensive points keep this
# many warm-up calls
PROBE_CALLS = 2
# how the budget is split; what a part leaves unused goes to the parts after it
SECTION_WEIGHTS = {"all_gather": 0.4, "all_reduce": 0.3, "topk": 0.3}
# ... and on a multi-GPU-node world, with the two link classes (intra: two sections)
HIERARCHICAL_SECTION_WEIGHTS = {"all_gather": 0.22, "all_reduce": 0.18,
                                "intra_reduce_scatter": 0.08, "intra_all_gather": 0.08,
                                "inter_all_gather": 0.14, "inter_all_reduce": 0.1,
                                "topk": 0.2}
LINK_SECTIONS = ("intra_reduce_scatter", "intra_all_gather", "inter_all_gather",
                 "inter_all_reduce")
QUICK_SIZES = (1024, 8192, 65536)
QUICK_TOPK_SIZES = (1000, 10000, 100000)
QUICK_REPS = 3
QUICK_WARMUP = 1
_SUFFIXES = {"K": 1024, "M": 1024 ** 2, "G": 1024 ** 3}


def parse_size(text):
    """``"64K"`` -> 65536, ``"4e6"`` -> 4000000; K/M/G are powers of 1024."""
    raw = text.strip()
    multiplier = 1
    if raw and raw[-1].upper() in _SUFFIXES:
        multiplier = _SUFFIXES[raw[-1].upper()]
        raw = raw[:-1]
    try:
        value = float(raw) * multiplier
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"bad size {text!r}: expected a number with an optional K/M/G suffix") from None
    if not math.isfinite(value) or value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"bad size {text!r}: must be a positive whole number")
    return int(value)


def parse_size_list(text):
    sizes = [parse_size(part) for part in text.split(",") if part.strip()]
    if not sizes:
        raise argparse.ArgumentTypeError(f"bad size list {text!r}: no sizes")
    return sorted(set(sizes))


def geometric_sizes(start, stop, growth=GROWTH, multiple=1):
    """Sizes from ``start`` to ``stop`` (both included), spaced by a factor of about ``growth``.

    Rounded up to multiples of ``multiple`` and deduplicated; the ratio is adjusted so the last
    size is exactly ``stop`` (rounded up to a multiple).
    """
    if not (start >= 1 and stop >= start and growth > 1):
        raise ValueError(f"geometric_sizes: need 1 <= start <= stop and growth > 1, "
                         f"got {start}, {stop}, {growth}")
    count = max(1, math.ceil(math.log(stop / start) / math.log(growth) - 1e-9)) + 1
    ratio = (stop / start) ** (1 / (count - 1))
    sizes = {max(multiple, -(-int(round(start * ratio ** i)) // multiple) * multiple)
             for i in range(count)}
    return sorted(sizes)


def _time_budget(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad time budget {text!r}: expected seconds") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(
            f"bad time budget {text!r}: must be a finite number of seconds >= 0")
    return value


_positive_int = cli_types.integer_at_least(1)
_non_negative_int = cli_types.integer_at_least(0)
_density = cli_types.density


def build_parser():
    parser = argparse.ArgumentParser(
        prog="omgs-profile",
        description="Measure all-gather, all-reduce and top-k costs on this process group "
                    "and write an OMGS hook profile (run under torchrun).",
    )
    parser.add_argument("--out", default="profile.json", help="profile file to write (rank 0)")
    parser.add_argument("--backend", default=None,
                        help="torch.distributed backend "
                             "(default: nccl when CUDA is available, else gloo)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="device the tensors live on (auto: cuda for nccl, else cpu)")
    parser.add_argument("--sizes", type=parse_size_list, default=None,
                        help="message sizes in bytes, comma separated, all measured (default: "
                             "adaptive, x2 from 1K up to --max-size within --time-budget); "
                             "rounded up to whole packed entries (8 bytes)")
    parser.add_argument("--topk-sizes", type=parse_size_list, default=None,
                        help="top-k input sizes D in elements, all measured (default: adaptive, "
                             "x2 from 1e3 up to --max-topk-size within --time-budget)")
    parser.add_argument("--max-size", type=parse_size, default=DEFAULT_MAX_SIZE,
                        help="largest message size of the adaptive sweep (default 8M)")
    parser.add_argument("--max-topk-size", type=parse_size, default=DEFAULT_MAX_TOPK_SIZE,
                        help="largest top-k size of the adaptive sweep (default 4e6)")
    parser.add_argument("--time-budget", type=_time_budget, default=None, metavar="SECONDS",
                        help=f"seconds of measuring the sweep may take; each part stops growing "
                             f"its sizes (and lowers its reps, down to {MIN_REPS}) to stay "
                             f"within its share (default {DEFAULT_TIME_BUDGET_S:g} for the "
                             f"adaptive sweep, none for --sizes/--topk-sizes/--quick; "
                             f"0 = no budget)")
    parser.add_argument("--topk-backends", default=None,
                        help="comma separated top-k backends to time (default: all available)")
    parser.add_argument("--density", type=_density, default=0.001,
                        help="top-k density: k = max(1, ceil(density * D)) (default 0.001)")
    parser.add_argument("--reps", type=_positive_int, default=None,
                        help=f"timed repetitions per point; with a budget, the most per point "
                             f"(default {DEFAULT_REPS})")
    parser.add_argument("--warmup", type=_non_negative_int, default=None,
                        help=f"untimed calls before each point (default {DEFAULT_WARMUP})")
    parser.add_argument("--topology", choices=topology.TOPOLOGIES, default="auto",
                        help="auto (default): also measure the intra- and inter-node link "
                             "classes when there is more than one node and more than one "
                             "rank per node; hierarchical: measure them whenever there are "
                             "at least 2 ranks per node; flat: never (as the hook's option)")
    parser.add_argument("--ranks-per-node", type=_positive_int, default=None,
                        help="ranks per node, consecutive ranks forming a node "
                             "(default: torchrun's LOCAL_WORLD_SIZE)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sweep (3 sizes, 3 reps) for tests and smoke checks")
    parser.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    parser.add_argument("--plot", default=None,
                        help="plot path, .png, .svg or .pdf (default: --out with .png)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--timeout", type=_positive_int, default=300,
                        help="process-group timeout in seconds (default 300)")
    return parser


@dataclass(frozen=True)
class SweepSettings:
    """What the sweep measures and how (``resolve_settings``); identical on every rank."""

    sizes: tuple            # candidate message sizes, ascending
    topk_sizes: tuple       # candidate top-k sizes, ascending
    reps: int               # timed reps per point (the most, with a budget)
    warmup: int             # untimed calls per point (the most, with a budget)
    time_budget_s: object   # seconds of measuring, or None for no budget
    adaptive: bool          # sizes are the default geometric grids
    min_reps: int = MIN_REPS
    min_points: int = MIN_POINTS


def _sweep_sizes(explicit, quick, quick_sizes, option, maximum, minimum, span, multiple=1):
    """The sizes of one sweep: the explicit ones, the quick ones, or the geometric sweep
    from ``minimum`` to ``maximum`` (``option``), which must reach ``span`` times the
    minimum."""
    if explicit:
        return explicit
    if quick:
        return list(quick_sizes)
    if maximum < span * minimum:
        raise SystemExit(f"omgs-profile: {option}: must be at least {span * minimum} "
                         f"(the sweep starts at {minimum})")
    return geometric_sizes(minimum, maximum, multiple=multiple)


def resolve_settings(args):
    """Fill sweep defaults (adaptive, ``--quick`` or explicit) and check it can be fitted."""
    adaptive = args.sizes is None and args.topk_sizes is None and not args.quick
    sizes = _sweep_sizes(args.sizes, args.quick, QUICK_SIZES, "--max-size", args.max_size,
                         DEFAULT_MIN_SIZE, 2, multiple=8)
    # whole packed entries: one entry = one float32 value + one int32 index = 8 bytes
    sizes = sorted({max(8, -(-s // 8) * 8) for s in sizes})
    topk_sizes = _sweep_sizes(args.topk_sizes, args.quick, QUICK_TOPK_SIZES, "--max-topk-size",
                              args.max_topk_size, DEFAULT_MIN_TOPK_SIZE, 4)
    if len(sizes) < 2:
        raise SystemExit(
            "omgs-profile: --sizes: need at least 2 distinct sizes to fit alpha and beta")
    if len(topk_sizes) < 3:
        raise SystemExit(
            "omgs-profile: --topk-sizes: need at least 3 distinct sizes to fit c0, c1, c2")
    reps = args.reps or (QUICK_REPS if args.quick else DEFAULT_REPS)
    if args.warmup is not None:
        warmup = args.warmup
    else:
        warmup = QUICK_WARMUP if args.quick else DEFAULT_WARMUP
    budget = args.time_budget
    if budget is None:
        budget = DEFAULT_TIME_BUDGET_S if adaptive else None
    elif budget == 0:
        budget = None
    return SweepSettings(sizes=tuple(sizes), topk_sizes=tuple(topk_sizes), reps=reps,
                         warmup=warmup, time_budget_s=budget, adaptive=adaptive,
                         min_reps=min(MIN_REPS, reps))


# ---------------------------------------------------------------------------------------
# the adaptive sweep: pure decisions, an injectable timing source
# ---------------------------------------------------------------------------------------
#
# Every decision below is a pure function of the settings (the same on every rank) and of
# *agreed* numbers: the times a timing source returns are MAX-all-reduced over ranks, so
# every rank sees the same values and takes the same decision, and all ranks run the
# same collectives. A rank deciding from its own clock alone would deadlock the others.


@dataclass(frozen=True)
class PointPlan:
    """Measure the next size with this many untimed calls; ``predicted_s`` per call or None."""

    warmup: int
    predicted_s: object = None


@dataclass(frozen=True)
class Stop:
    """Stop growing before ``size``: ``reason`` is a code, ``message`` says why in words."""

    size: int
    reason: str
    message: str


@dataclass(frozen=True)
class Measurement:
    """What a timing source returns for one point (all values agreed across ranks).

    seconds: the timed reps (slowest rank each); empty when the point was abandoned after
        its probe. wall_s: the whole point, set-up and warm-up included (slowest rank).
    probe_s: the probe - the fastest of the last :data:`PROBE_CALLS` warm-up calls, each
        timed on the slowest rank - or None without warm-up.
    """

    seconds: tuple
    wall_s: float
    probe_s: object = None


def plan_point(*, index, size, previous, spent_s, budget_s, settings):
    """Decide whether to measure ``size`` (the ``index``-th candidate of a part) at all.

    previous: ``(size, seconds per call)`` of the last measured point of this part - the
        point's agreed wall time over its calls, so barriers and set-up count - or None.
    spent_s / budget_s: this part's agreed seconds so far and its budget (None: no budget).

    Returns a :class:`PointPlan` or a :class:`Stop`. The cost of ``size`` is predicted
    linearly from the previous point (``per_call * size / previous_size``); the part stops
    growing when even the cheapest measurement of it (:data:`PROBE_CALLS` warm-up calls
    and ``min_reps`` reps) would exceed what is left of the budget. The first
    ``min_points`` sizes are always measured. Warm-up shrinks (down to ``PROBE_CALLS``)
    for points whose warm-up would use more than a quarter of what the point may use
    (:func:`point_allowance`).
    """
    if budget_s is None:
        return PointPlan(warmup=settings.warmup)
    predicted = None
    if previous is not None:
        previous_size, per_call = previous
        predicted = per_call * size / previous_size
    remaining = budget_s - spent_s
    warm_floor = min(PROBE_CALLS, settings.warmup)
    if predicted is not None and index >= settings.min_points:
        cheapest = predicted * (warm_floor + settings.min_reps)
        if cheapest > remaining:
            return Stop(size=size, reason="budget",
                        message=f"the next size would take about {cheapest:.3g} s even with "
                                f"{warm_floor} warm-up calls and {settings.min_reps} reps, and "
                                f"{max(remaining, 0.0):.3g} s of this part's {budget_s:.3g} s "
                                f"budget were left")
    warmup = settings.warmup
    if predicted is not None and predicted > 0 and warmup > warm_floor:
        allowance = point_allowance(remaining, budget_s)
        warmup = max(warm_floor, min(warmup, int(0.25 * allowance / predicted)))
    return PointPlan(warmup=warmup, predicted_s=predicted)


def point_allowance(remaining_s, budget_s):
    """Seconds one point's timed reps may use: POINT_SHARE of the budget, half of what is left."""
    return min(budget_s * POINT_SHARE, max(remaining_s, 0.0) / 2)


def choose_reps(per_call_s, allowance_s, reps, min_reps):
    """Timed reps that fit ``allowance_s`` at ``per_call_s`` each, within [min_reps, reps]."""
    if per_call_s is None or per_call_s <= 0:
        return reps
    return max(min_reps, min(reps, int(allowance_s / per_call_s)))


def reps_after_probe(*, index, plan, probe_s, spent_s, budget_s, settings):
    """Timed reps for a point whose warm-up probe took ``probe_s`` (agreed); 0 = abandon.

    The probe catches a size that is far more expensive than predicted (a super-linear
    jump): if ``min_reps`` reps of it no longer fit in what is left, the point is
    abandoned (unless it is one of the first ``min_points``) and the part stops. The
    warm-up calls count as ``probe_s`` each.
    """
    if budget_s is None:
        return settings.reps
    per_call = probe_s if probe_s is not None else plan.predicted_s
    warm_cost = (probe_s or 0.0) * plan.warmup
    remaining = budget_s - spent_s - warm_cost
    if (per_call is not None and index >= settings.min_points
            and per_call * settings.min_reps > remaining):
        return 0
    return choose_reps(per_call, point_allowance(remaining, budget_s), settings.reps,
                       settings.min_reps)


def section_budgets(weights, spent_before, total_budget):
    """Budget of the next part: its weight's share of what the earlier parts left."""
    if total_budget is None:
        return None
    left = max(0.0, total_budget - spent_before)
    return left * weights[0] / sum(weights)


def run_section(name, sizes, measure, budget_s, settings, progress=None):
    """Measure one part (``name``) of the sweep over ascending ``sizes``.

    measure(size, warmup, reps_for) -> :class:`Measurement`: the injectable timing source;
    ``reps_for(probe_s)`` gives the number of timed reps once the probe is known.
    Returns ``(rows, record)``: ``rows`` = ``[(size, seconds tuple)]`` of the measured
    points, ``record`` = what was measured, where it stopped and why (for the file).
    """
    rows, reps_used, warmups, spent = [], [], [], 0.0
    previous, stop = None, None
    for index, size in enumerate(sizes):
        plan = plan_point(index=index, size=size, previous=previous, spent_s=spent,
                          budget_s=budget_s, settings=settings)
        if isinstance(plan, Stop):
            stop = plan
            break

        def reps_for(probe_s, index=index, plan=plan, spent=spent):
            return reps_after_probe(index=index, plan=plan, probe_s=probe_s, spent_s=spent,
                                    budget_s=budget_s, settings=settings)

        result = measure(size, plan.warmup, reps_for)
        spent += result.wall_s
        if progress is not None:
            progress.update(1)
        if not result.seconds:
            stop = Stop(size=size, reason="probe",
                        message=f"its warm-up calls took {result.probe_s:.3g} s each, so "
                                f"{settings.min_reps} reps would not fit in the "
                                f"{max(budget_s - spent, 0.0):.3g} s left of this part's "
                                f"{budget_s:.3g} s budget")
            break
        rows.append((size, tuple(result.seconds)))
        reps_used.append(len(result.seconds))
        warmups.append(plan.warmup)
        previous = (size, result.wall_s / (plan.warmup + len(result.seconds)))
    if progress is not None:
        progress.update(len(sizes) - len(rows) - (1 if stop and stop.reason == "probe" else 0))
    measured = [size for size, _ in rows]
    over = budget_s is not None and spent > budget_s
    record = {
        "planned": list(sizes),
        "measured": measured,
        "reps": reps_used,
        "warmup": warmups,
        "budget_s": budget_s,
        "spent_s": spent,
        "complete": stop is None,
        "stopped_before": None if stop is None else stop.size,
        "reason": None if stop is None else stop.reason,
        "message": None if stop is None else stop.message,
        "over_budget": over,
    }
    return rows, record


def run_sweep(parts, budget_s, settings, progress=None):
    """Run every part in order, sharing ``budget_s`` by :data:`SECTION_WEIGHTS`.

    parts: ``[(name, weight, sizes, measure)]``. Unused budget of a part goes to the parts
    after it. Returns ``(rows by name, records by name, seconds spent)``.
    """
    rows, records, spent = {}, {}, 0.0
    for position, (name, _weight, sizes, measure) in enumerate(parts):
        weights = [w for _, w, _, _ in parts[position:]]
        budget = section_budgets(weights, spent, budget_s)
        rows[name], records[name] = run_section(name, sizes, measure, budget, settings,
                                                progress)
        spent += records[name]["spent_s"]
    return rows, records, spent


def truncation_notes(records):
    """One line per part the budget cut short: what was measured, where and why it stopped."""
    notes = []
    for name, record in records.items():
        if record["complete"]:
            continue
        measured = record["measured"]
        notes.append(
            f"{name}: the time budget cut the sweep short: measured {len(measured)} of "
            f"{len(record['planned'])} sizes ({_size_range(name, measured)}), stopped before "
            f"{_size_text(name, record['stopped_before'])} because {record['message']}; the fit "
            f"extrapolates beyond the largest measured size, "
            f"{_size_text(name, measured[-1]) if measured else 'none'}")
    for name, record in records.items():
        if record["over_budget"]:
            budget = record["budget_s"]
            over = (f"{record['spent_s'] / budget - 1:.0%} over its {budget:.3g} s budget"
                    if budget > 0 else "with none of the budget left for it")
            notes.append(f"{name}: took {record['spent_s']:.3g} s, {over} (a point's cost is "
                         f"known only once it is measured, and the first {MIN_POINTS} sizes "
                         f"are measured whatever the budget)")
    return notes


def _size_text(name, size):
    if size is None:
        return "none"
    if name.startswith("topk"):
        return f"D={size:g}"
    for unit, factor in (("MiB", 2 ** 20), ("KiB", 1024)):
        if size >= factor:
            return f"{size / factor:.4g} {unit}"
    return f"{size} B"


def _size_range(name, sizes):
    if not sizes:
        return "none"
    return f"{_size_text(name, sizes[0])} .. {_size_text(name, sizes[-1])}"


# ---------------------------------------------------------------------------------------
# process group
# ---------------------------------------------------------------------------------------


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ensure_launch_environment():
    """Make a plain ``python scripts/profile.py`` a valid single-rank launch."""
    if "WORLD_SIZE" in os.environ:
        return False
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())})
    return True


def resolve_link_topology(topology_option, ranks_per_node, env=None):
    """The :class:`~omgs_hook.topology.Topology` whose two link classes are measured, or
    None for a flat profile (the hook's resolution: ``topology.resolve_topology`` with the
    launcher's ``WORLD_SIZE``/``RANK``; ``ranks_per_node`` defaults to ``LOCAL_WORLD_SIZE``).

    Raises SystemExit naming the option for a bad combination, before any process group
    exists. ``hierarchical`` asked for explicitly needs at least 2 ranks per node (one rank
    per node is the flat model: the profile file's ``ranks_per_node`` must be >= 2)."""
    env = os.environ if env is None else env
    world_size, rank = int(env.get("WORLD_SIZE", "1")), int(env.get("RANK", "0"))
    try:
        topo = topology.resolve_topology(topology_option, ranks_per_node, world_size, rank,
                                         env=env)
    except ValueError as error:
        text = str(error)
        for name, flag in (("ranks_per_node", "--ranks-per-node"), ("topology", "--topology")):
            if text.startswith(name):
                text = flag + text[len(name):]
                break
        raise SystemExit(f"omgs-profile: {text}") from None
    if not topo.hierarchical:
        return None
    if topo.ranks_per_node < 2:
        raise SystemExit(f"omgs-profile: --topology hierarchical: needs at least 2 ranks per "
                         f"node to measure the intra-node link class, got "
                         f"{topo.ranks_per_node} (use --ranks-per-node)")
    return topo


def agree_on_topology(topo, device):
    """Every rank must measure the same link classes (else the subgroups' ``new_group``
    calls and the sweep's collectives wait for each other until the timeout): check the
    resolved ranks per node (0 for a flat profile) with one MAX all-reduce of ``(L, -L)``,
    on every rank alike, so every rank takes the same decision."""
    mine = 0 if topo is None else topo.ranks_per_node
    values = torch.tensor([mine, -mine], dtype=torch.float64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    high, low = int(values[0]), -int(values[1])
    if high != low:
        def say(n):
            return "flat" if n == 0 else f"{n} ranks per node"
        raise SystemExit(f"omgs-profile: --ranks-per-node/--topology: the ranks disagree "
                         f"({say(low)} .. {say(high)}); every rank must resolve the same "
                         f"topology (every node the same LOCAL_WORLD_SIZE)")


def choose_backend_and_device(backend, device_choice):
    """Backend: nccl when CUDA is available, else gloo; device: cuda:LOCAL_RANK for GPU runs."""
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if device_choice == "auto":
        device_choice = "cuda" if backend == "nccl" else "cpu"
    if device_choice == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(
                "omgs-profile: --device cuda (or --backend nccl) but CUDA is not available")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_backend_available(backend):  # (nccl without CUDA is named above)
        raise SystemExit(f"omgs-profile: --backend {backend}: not available in this torch "
                         "build (gloo everywhere, nccl with CUDA)")
    return backend, device


class Timer:
    """Times one callable the way described in the module docstring (barrier, MAX over ranks)."""

    def __init__(self, device):
        self.device = device

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def barrier(self):
        """A barrier that also works on NCCL (which needs the device)."""
        if self.device.type == "cuda" and dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()

    def _agreed(self, values):
        """``values`` MAX-all-reduced over ranks: the same list on every rank."""
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return [float(t) for t in tensor.cpu()]

    def _timed(self, call):
        self.barrier()
        self._sync()
        start = time.perf_counter()
        call()
        self._sync()
        return time.perf_counter() - start

    def timing_source(self, make_call):
        """A ``measure(size, warmup, reps_for)`` timing source for :func:`run_section`.

        ``make_call(size)`` builds the timed callable (its set-up counts in the wall time).
        The last warm-up calls are timed as the probe; the probe, every rep and the point's
        wall time are MAX-all-reduced, so every rank returns the same numbers and
        ``reps_for`` - a pure function of them - picks the same number of reps everywhere.
        """

        def measure(size, warmup, reps_for):
            start = time.perf_counter()
            call = make_call(size)
            probes = min(PROBE_CALLS, warmup)
            for _ in range(warmup - probes):
                call()
            self._sync()
            probe = None
            if probes:
                probe = min(self._agreed([self._timed(call) for _ in range(probes)]))
            reps = reps_for(probe)
            mine = [self._timed(call) for _ in range(reps)]
            agreed = self._agreed(mine + [time.perf_counter() - start])
            return Measurement(seconds=tuple(agreed[:-1]), wall_s=agreed[-1], probe_s=probe)

        return measure


# ---------------------------------------------------------------------------------------
# the three measurements
# ---------------------------------------------------------------------------------------


def packed_allgather_call(nbytes, device, generator, group=None):
    """The hook's sparse-group collective for a per-rank contribution of ``nbytes``
    (over ``group``, default the whole world)."""
    k = nbytes // (communicator.VALUE_BYTES + communicator.INDEX_BYTES)
    values = torch.randn(k, generator=generator).to(device)
    indices = torch.randint(0, communicator.MAX_INDEX, (k,), generator=generator).to(device)

    def call():
        payload = communicator.pack_sparse(values, indices)
        future, _gathered = communicator.allgather_async(payload, process_group=group)
        future.wait()

    return call


def dense_allreduce_call(nbytes, device, _generator):
    """The hook's dense-group collective for a float32 tensor of ``nbytes``."""
    # zeros: repeated in-place SUMs of random data would overflow to inf after a few
    # dozen reps on many ranks; the bytes on the wire are the same either way
    tensor = torch.zeros(max(1, nbytes // 4), device=device)

    def call():
        communicator.allreduce_async(tensor).wait()

    return call


def intra_reduce_scatter_call(nbytes, device, generator, group):
    """The two-level exchange's first stage: the reduce-scatter, over the node's L ranks
    (``group``), of a dense float32 buffer of ``L * S`` elements; ``nbytes = 4 * S`` is
    the rank's shard, the bytes the cost model prices ``intra`` by."""
    shard = max(1, nbytes // 4)
    ranks = dist.get_world_size(group)
    source = torch.randn(ranks * shard, generator=generator).to(device)
    out = torch.empty(shard, device=device)
    receive = torch.empty(ranks * shard, device=device)

    def call():  # the hook's own stage 1 (an all-to-all and a sum on the CPU)
        work, complete = communicator.start_shard_sum(out, source, group, receive)
        work.wait()
        if complete is not None:
            complete()

    return call


def intra_all_gather_call(nbytes, device, generator, group):
    """The two-level exchange's last stage: the all-gather, over the node's L ranks, of a
    float32 payload of ``nbytes`` per rank (the bytes the cost model prices ``intra`` by)."""
    payload = torch.randn(max(1, nbytes // 4), generator=generator).to(device)

    def call():
        communicator.allgather_async(payload, process_group=group)[0].wait()

    return call


def inter_all_gather_call(nbytes, device, generator, group):
    """The two-level exchange's sparse stage: the packed all-gather of
    :func:`packed_allgather_call` among the N ranks with this rank's local rank (``group``).
    Every rank runs it at once, so the node's L inter-node groups share its link."""
    return packed_allgather_call(nbytes, device, generator, group)


def inter_all_reduce_call(nbytes, device, _generator, group):
    """The two-level dense path's middle stage: the all-reduce of a float32 shard of
    ``nbytes`` among the N ranks with this rank's local rank (``group``), every rank at
    once, as the L inter-node groups of a node do in training."""
    tensor = torch.zeros(max(1, nbytes // 4), device=device)  # zeros: see dense_allreduce_call

    def call():
        communicator.allreduce_async(tensor, process_group=group).wait()

    return call


def topk_call(selector, numel, density, device, generator):
    x = torch.randn(numel, generator=generator).to(device)
    k = selected_k(numel, density)

    def call():
        selector.select(x, k)

    return call, k


def _median(values):
    return float(statistics.median(values))


def measure(settings, topk_backends, density, device, progress, subgroups=None):
    """Run the sweep on the process group; returns (samples, sweep records, seconds spent).

    subgroups: this rank's :class:`~omgs_hook.topology.Subgroups` on a multi-GPU-node
    world (the two link classes are measured too, :data:`LINK_SECTIONS`), else None.
    The samples and records are identical on every rank (all times are agreed).
    """
    from omgs_hook.topk import get_selector

    timer = Timer(device)
    generator = torch.Generator().manual_seed(1234 + dist.get_rank())
    weights = SECTION_WEIGHTS if subgroups is None else HIERARCHICAL_SECTION_WEIGHTS

    def collective(make, *group):
        return timer.timing_source(lambda nbytes: make(nbytes, device, generator, *group))

    def selection(selector):
        return timer.timing_source(
            lambda numel: topk_call(selector, numel, density, device, generator)[0])

    parts = [("all_gather", weights["all_gather"], settings.sizes,
              collective(packed_allgather_call)),
             ("all_reduce", weights["all_reduce"], settings.sizes,
              collective(dense_allreduce_call))]
    if subgroups is not None:
        # every rank runs the same sections in the same order: its own node's intra group,
        # its own local rank's inter group - all groups of a kind at the same time
        parts += [("intra_reduce_scatter", weights["intra_reduce_scatter"], settings.sizes,
                   collective(intra_reduce_scatter_call, subgroups.intra)),
                  ("intra_all_gather", weights["intra_all_gather"], settings.sizes,
                   collective(intra_all_gather_call, subgroups.intra)),
                  ("inter_all_gather", weights["inter_all_gather"], settings.sizes,
                   collective(inter_all_gather_call, subgroups.inter)),
                  ("inter_all_reduce", weights["inter_all_reduce"], settings.sizes,
                   collective(inter_all_reduce_call, subgroups.inter))]
    for backend in topk_backends:
        parts.append((f"topk:{backend}", weights["topk"] / len(topk_backends),
                      settings.topk_sizes, selection(get_selector(backend, device))))
    rows, records, spent = run_sweep(parts, settings.time_budget_s, settings, progress)
    collectives = ("all_gather", "all_reduce") + (() if subgroups is None else LINK_SECTIONS)
    samples = {name: [{"bytes": size, "seconds": list(seconds)} for size, seconds in rows[name]]
               for name in collectives}
    samples["topk"] = {}
    for backend in topk_backends:
        samples["topk"][backend] = [
            {"numel": numel, "k": selected_k(numel, density), "seconds": list(seconds)}
            for numel, seconds in rows[f"topk:{backend}"]]
    return samples, records, spent


# ---------------------------------------------------------------------------------------
# fitting and the file
# ---------------------------------------------------------------------------------------


# fit choices shared with the simulated-stability test (tests/test_fitting.py)
ROBUST_FIT = True
TOPK_LOG_TERM = "auto"


def fit_samples(samples):
    """Fit the models to the per-point medians; returns (fits dict, fit_errors dict)."""
    fits, errors = {}, {}
    for key, name in (("comm", "all_gather"), ("dense", "all_reduce")):
        rows = samples[name]
        medians = [_median(r["seconds"]) for r in rows]
        fit = fit_linear_relative([r["bytes"] for r in rows], medians, robust=ROBUST_FIT)
        fits[key] = fit
        errors[key] = [{"bytes": r["bytes"], "median_s": m, "rel_error": e}
                       for r, m, e in zip(rows, medians, fit.rel_errors)]
    # inter_all_reduce is fitted when present (samples from before it was measured lack it)
    if all(name in samples for name in LINK_SECTIONS if name != "inter_all_reduce"):
        fits.update(_fit_link_classes(samples, errors))
    fits["topk_all"], errors["topk"] = {}, {}
    for backend, rows in samples["topk"].items():
        medians = [_median(r["seconds"]) for r in rows]
        fit = fit_topk([r["numel"] for r in rows], medians, log_term=TOPK_LOG_TERM,
                       robust=ROBUST_FIT)
        fits["topk_all"][backend] = fit
        errors["topk"][backend] = [{"numel": r["numel"], "k": r["k"], "median_s": m, "rel_error": e}
                                   for r, m, e in zip(rows, medians, fit.rel_errors)]
    return fits, errors


def _fit_link_classes(samples, errors):
    """``intra``, ``inter`` and ``intra_parts`` of a multi-GPU-node sweep (see the module
    docstring); adds their per-point errors to ``errors``.

    ``intra`` is one line through the reduce-scatter's and the all-gather's points
    together: the cost model charges both intra-node collectives ``intra`` per byte each
    rank contributes (the shard for the reduce-scatter, the payload for the all-gather),
    and the points are placed at exactly those sizes. ``intra_parts`` keeps each
    collective's own line for people (not read by ``load_profile``)."""
    fits, parts = {}, {}
    x, t, tags = [], [], []
    for part, name in (("reduce_scatter", "intra_reduce_scatter"),
                       ("all_gather", "intra_all_gather")):
        rows = samples[name]
        medians = [_median(r["seconds"]) for r in rows]
        parts[part] = fit_linear_relative([r["bytes"] for r in rows], medians,
                                          robust=ROBUST_FIT)
        x += [r["bytes"] for r in rows]
        t += medians
        tags += [part] * len(rows)
    intra = fit_linear_relative(x, t, robust=ROBUST_FIT)
    fits["intra"], fits["intra_parts"] = intra, parts
    errors["intra"] = [{"collective": tag, "bytes": b, "median_s": m, "rel_error": e}
                       for tag, b, m, e in zip(tags, x, t, intra.rel_errors)]
    rows = samples["inter_all_gather"]
    medians = [_median(r["seconds"]) for r in rows]
    fits["inter"] = fit_linear_relative([r["bytes"] for r in rows], medians, robust=ROBUST_FIT)
    errors["inter"] = [{"bytes": r["bytes"], "median_s": m, "rel_error": e}
                       for r, m, e in zip(rows, medians, fits["inter"].rel_errors)]
    rows = samples.get("inter_all_reduce")
    if rows:
        medians = [_median(r["seconds"]) for r in rows]
        fit = fit_linear_relative([r["bytes"] for r in rows], medians, robust=ROBUST_FIT)
        fits["inter_dense"] = fit
        errors["inter_dense"] = [{"bytes": r["bytes"], "median_s": m, "rel_error": e}
                                 for r, m, e in zip(rows, medians, fit.rel_errors)]
    return fits


def _cupy_version():
    try:
        import cupy
    except Exception:  # ImportError, or a broken CUDA install raising at import
        return None
    return getattr(cupy, "__version__", None)


def build_document(*, samples, fits, errors, default_backend, world_size, backend, device,
                   settings, sweep=None, topo=None):
    """The profile document; ``topo`` (a hierarchical :class:`~omgs_hook.topology.Topology`,
    with ``fits`` holding ``intra``/``inter`` and maybe ``inter_dense``) adds the two link
    classes - ``ranks_per_node``, ``intra``, ``inter``, ``inter_dense`` (read by
    ``load_profile``), ``topology`` and ``intra_parts`` (records) - after ``dense``;
    without it the document has none of these keys."""
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    topk = fits["topk_all"][default_backend]
    links = {}
    if topo is not None:
        links = {
            "ranks_per_node": topo.ranks_per_node,
            "intra": fits["intra"].to_cost().to_dict(),
            "inter": fits["inter"].to_cost().to_dict(),
            **({"inter_dense": fits["inter_dense"].to_cost().to_dict()}
               if "inter_dense" in fits else {}),
            "topology": {"kind": topo.kind, "nodes": topo.nodes,
                         "ranks_per_node": topo.ranks_per_node, "requested": topo.requested},
            "intra_parts": {name: fit.to_cost().to_dict()
                            for name, fit in fits["intra_parts"].items()},
        }
    return {
        "schema_version": SCHEMA_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "world_size": world_size,
        "backend": backend,
        "device": device.type,
        "device_name": device_name,
        "torch_version": torch.__version__,
        "cupy_version": _cupy_version(),
        "comm": fits["comm"].to_cost().to_dict(),
        "dense": fits["dense"].to_cost().to_dict(),
        **links,
        "topk": {"backend": default_backend, "c0": topk.c0, "c1": topk.c1, "c2": topk.c2},
        "topk_all": {name: {"c0": f.c0, "c1": f.c1, "c2": f.c2, "form": f.form}
                     for name, f in fits["topk_all"].items()},
        "settings": settings,
        "sweep": sweep,
        "fit_errors": errors,
        "samples": samples,
    }


def write_json_atomically(path, document):
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    temporary = f"{path}.tmp{os.getpid()}"
    try:
        with open(temporary, "w", encoding="utf-8") as handle:
            json.dump(document, handle, indent=1)
            handle.write("\n")
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)  # no stray half-written file beside the target
        raise


#: the suffixes --plot may have: matplotlib picks the format by the suffix, and these are
#: the formats the plot is documented in (another one failed only after the sweep)
PLOT_SUFFIXES = (".png", ".svg", ".pdf")
#: an --out with one of these is a plot's name given to the profile's option
IMAGE_SUFFIXES = PLOT_SUFFIXES + (".jpg", ".jpeg", ".gif", ".bmp", ".tif", ".tiff", ".webp",
                                  ".eps", ".ps", ".svgz")


def _check_file_name(path, option):
    """Refuse a path that names no file: empty, or a folder ('dir/', '.', '..')."""
    if not path:
        raise SystemExit(f"omgs-profile: {option}: empty path; give a file path")
    if path.endswith(("/", os.sep)) or os.path.basename(path) in (".", ".."):
        raise SystemExit(f"omgs-profile: {option}: {path} names a directory; give a file path")


def _same_file(a, b):
    return os.path.normcase(os.path.realpath(a)) == os.path.normcase(os.path.realpath(b))


def resolve_output_paths(out, plot, no_plot):
    """``(profile path, plot path or None)`` of ``--out``, ``--plot`` and ``--no-plot``,
    checked without touching the disk (every rank runs it, before anything is measured;
    :func:`check_output_path` then checks the file system on rank 0). The rule: ``--out``
    is the profile, JSON, so an image suffix there is refused; the plot (``--plot``, by
    default ``--out`` with ``.png``) must end in one of :data:`PLOT_SUFFIXES` - no suffix
    either, as matplotlib would add one - and be another file than ``--out``. Raises
    SystemExit naming the option."""
    _check_file_name(out, "--out")
    stem, suffix = os.path.splitext(out)
    if suffix.lower() in IMAGE_SUFFIXES:
        plot_text = "" if plot is not None or no_plot else f", which plots to {stem}.png"
        raise SystemExit(f"omgs-profile: --out: {out} is an image name, but --out is the "
                         f"profile (JSON); give e.g. --out {stem}.json{plot_text}")
    if no_plot:
        return out, None
    if plot is None:
        plot = stem + ".png"
    else:
        _check_file_name(plot, "--plot")
    if _same_file(plot, out):
        raise SystemExit(f"omgs-profile: --plot: {plot} is the --out file; the plot would "
                         f"overwrite the profile")
    if os.path.splitext(plot)[1].lower() not in PLOT_SUFFIXES:
        raise SystemExit(f"omgs-profile: --plot: {plot} must end in "
                         f"{', '.join(PLOT_SUFFIXES[:-1])} or {PLOT_SUFFIXES[-1]} "
                         f"(the suffix picks the format)")
    return out, plot


def check_output_path(path, option, hint=""):
    """Fail now, before any measuring, where ``path`` cannot be written later: a
    directory, or a folder that cannot be created or written to. Creates the folder
    (as the write would) and a probe file in it, removed at once. Raises SystemExit
    naming ``option``; ``hint`` ends the message where the path was not given as such."""
    if os.path.isdir(path):
        raise SystemExit(f"omgs-profile: {option}: {path} is a directory; give a file "
                         f"path{hint}")
    directory = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".omgs-profile-probe"):
            pass
    except OSError as exc:
        raise SystemExit(f"omgs-profile: {option}: cannot write {path} ({exc.strerror or exc}); "
                         f"nothing was measured{hint}") from exc


def plot_profile(document, path):
    """Two log-log panels: collectives (time vs bytes) and top-k (time vs D), points + fits."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    samples = document["samples"]
    for name, key, color in (("all_gather (packed sparse)", "comm", "tab:blue"),
                             ("all_reduce (dense)", "dense", "tab:orange")):
        rows = samples["all_gather" if key == "comm" else "all_reduce"]
        x = np.array([r["bytes"] for r in rows], dtype=float)
        med = np.array([_median(r["seconds"]) for r in rows])
        low = med - np.array([min(r["seconds"]) for r in rows])
        high = np.array([max(r["seconds"]) for r in rows]) - med
        left.errorbar(x, med, yerr=[low, high], fmt="o", color=color, capsize=3,
                      label=f"{name}: median, min-max")
        alpha, beta = document[key]["alpha_s"], document[key]["beta_s_per_byte"]
        line_x = np.geomspace(x.min(), x.max(), 100)
        left.plot(line_x, alpha + beta * line_x, "-", color=color,
                  label=f"fit {alpha * 1e3:.3g} ms + {beta * 1e9:.3g} ns/B")
        top = _planned_top(document, "all_gather" if key == "comm" else "all_reduce")
        if top and top > x.max():
            far = np.geomspace(x.max(), top, 20)
            left.plot(far, alpha + beta * far, "--", color=color,
                      label="extrapolated (not measured: time budget)")
    if "intra" in document:  # the two link classes of a multi-GPU-node profile
        for name, key, color, marker in (
                ("intra reduce-scatter", "intra_reduce_scatter", "tab:green", "s"),
                ("intra all-gather", "intra_all_gather", "tab:green", "^"),
                ("inter all-gather (packed)", "inter_all_gather", "tab:red", "o"),
                ("inter all-reduce (dense shard)", "inter_all_reduce", "tab:purple", "D")):
            rows = samples.get(key)
            if not rows:
                continue
            x = np.array([r["bytes"] for r in rows], dtype=float)
            med = np.array([_median(r["seconds"]) for r in rows])
            left.plot(x, med, marker, color=color, fillstyle="none", label=f"{name}: median")
        for key, color, section in (("intra", "tab:green", "intra_all_gather"),
                                    ("inter", "tab:red", "inter_all_gather"),
                                    ("inter_dense", "tab:purple", "inter_all_reduce")):
            if key not in document:
                continue
            rows = samples[section]
            x = np.array([r["bytes"] for r in rows], dtype=float)
            alpha, beta = document[key]["alpha_s"], document[key]["beta_s_per_byte"]
            line_x = np.geomspace(x.min(), x.max(), 100)
            left.plot(line_x, alpha + beta * line_x, "-", color=color,
                      label=f"{key} fit {alpha * 1e3:.3g} ms + {beta * 1e9:.3g} ns/B")
    left.set(xscale="log", yscale="log", xlabel="bytes per rank", ylabel="seconds (slowest rank)",
             title=f"collectives: {document['backend']}, {document['world_size']} ranks")
    left.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=8)

    colors = iter(("tab:green", "tab:red", "tab:purple", "tab:brown", "tab:gray"))
    for backend, rows in samples["topk"].items():
        color = next(colors, "black")
        d = np.array([r["numel"] for r in rows], dtype=float)
        med = np.array([_median(r["seconds"]) for r in rows])
        right.plot(d, med, "o", color=color, label=f"{backend}: median")
        c = document["topk_all"][backend]
        line_d = np.geomspace(d.min(), d.max(), 100)
        right.plot(line_d, c["c0"] + c["c1"] * line_d + c["c2"] * line_d * np.log2(line_d), "-",
                   color=color,
                   label=f"{backend} fit: c0={c['c0']:.2g} c1={c['c1']:.2g} c2={c['c2']:.2g}")
        top = _planned_top(document, f"topk:{backend}")
        if top and top > d.max():
            far = np.geomspace(d.max(), top, 20)
            right.plot(far, c["c0"] + c["c1"] * far + c["c2"] * far * np.log2(far), "--",
                       color=color, label=f"{backend} extrapolated (time budget)")
    right.set(xscale="log", yscale="log", xlabel="elements D", ylabel="seconds (slowest rank)",
              title=f"top-k on {document['device_name']}, "
                    f"density {document['settings']['topk_density']:g}")
    right.grid(True, which="both", alpha=0.3)
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _planned_top(document, name):
    record = ((document.get("sweep") or {}).get("sections") or {}).get(name)
    return record["planned"][-1] if record and not record["complete"] else None


def _summary(document, out, plot_path, elapsed, gaps=()):
    """The console summary; ``gaps``: :func:`profile_bandwidth_gaps` of the profile."""
    lines = [f"omgs-profile: {document['world_size']} ranks, {document['backend']}, "
             f"{document['device_name']}, {elapsed:.1f} s"]
    for key, label in (("comm", "all_gather"), ("dense", "all_reduce")):
        fit = document[key]
        worst = max(abs(p["rel_error"]) for p in document["fit_errors"][key])
        lines.append(f"  {label:<10} alpha = {fit['alpha_s'] * 1e3:.4g} ms, beta = "
                     f"{fit['beta_s_per_byte'] * 1e9:.4g} ns/B (worst point {worst:.0%} off)")
    if "intra" in document:
        t = document["topology"]
        lines.append(f"  two link classes: {t['nodes']} nodes x {t['ranks_per_node']} ranks")
        for key, label in (("intra", "intra"), ("inter", "inter"),
                           ("inter_dense", "inter_dense")):
            if key not in document:
                continue
            fit = document[key]
            worst = max(abs(p["rel_error"]) for p in document["fit_errors"][key])
            lines.append(f"  {label:<10} alpha = {fit['alpha_s'] * 1e3:.4g} ms, beta = "
                         f"{fit['beta_s_per_byte'] * 1e9:.4g} ns/B (worst point {worst:.0%} off)")
    for backend, c in document["topk_all"].items():
        worst = max(abs(p["rel_error"]) for p in document["fit_errors"]["topk"][backend])
        mark = " (default)" if backend == document["topk"]["backend"] else ""
        lines.append(f"  top-k {backend:<8} c0 = {c['c0']:.3g} s, c1 = {c['c1']:.3g} s, "
                     f"c2 = {c['c2']:.3g} s (worst point {worst:.0%} off){mark}")
    sweep = document.get("sweep") or {}
    if sweep.get("time_budget_s") is not None:
        lines.append(f"  time budget {sweep['time_budget_s']:g} s, {sweep['spent_s']:.1f} s "
                     f"spent measuring")
    for note in sweep.get("notes", []):
        lines.append(f"  WARNING {note}")
    for note in gaps:
        lines.append(f"  WARNING {note}")
    lines.append(f"  wrote {out}" + (f" and {plot_path}" if plot_path else ""))
    return "\n".join(lines)


class _NoProgress:
    def update(self, n=1):
        pass

    def set_postfix_str(self, text):
        pass

    def close(self):
        pass


def main(argv=None):
    args = build_parser().parse_args(argv)
    settings = resolve_settings(args)
    out, plot_path = resolve_output_paths(args.out, args.plot, args.no_plot)
    if os.environ.get("RANK", "0") == "0":  # the rank that writes them, before measuring
        check_output_path(out, "--out")
        if plot_path is not None:
            # (a default path is checked too: a folder of that name failed after the sweep)
            check_output_path(plot_path, "--plot", "" if args.plot is not None else
                              f" ({plot_path} is the default, --out with .png: pass --plot "
                              f"PATH or --no-plot)")
    backend, device = choose_backend_and_device(args.backend, args.device)

    from omgs_hook.topk import BACKENDS, available_backends, get_selector

    usable = available_backends(device)
    if args.topk_backends:
        topk_backends = [b.strip() for b in args.topk_backends.split(",") if b.strip()]
        unknown = [b for b in topk_backends if b not in BACKENDS]
        if unknown:
            raise SystemExit(f"omgs-profile: --topk-backends: unknown backend "
                             f"{', '.join(unknown)} (known: {', '.join(BACKENDS)})")
        missing = [b for b in topk_backends if b not in usable]
        if missing:
            raise SystemExit(f"omgs-profile: --topk-backends: {', '.join(missing)} cannot run on "
                             f"{device.type} here (available: {', '.join(usable)})")
    else:
        topk_backends = list(usable)
    if not topk_backends:
        raise SystemExit(f"omgs-profile: no top-k backend can run on {device.type}")
    auto_backend = get_selector("auto", device).name
    default_backend = auto_backend if auto_backend in topk_backends else topk_backends[0]
    # only now, once every option is known to be usable
    single = _ensure_launch_environment()
    topo = resolve_link_topology(args.topology, args.ranks_per_node)

    init = {"backend": backend, "timeout": datetime.timedelta(seconds=args.timeout)}
    if device.type == "cuda":
        init["device_id"] = device
    dist.init_process_group(**init)
    try:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        if rank == 0 and single:
            print("omgs-profile: no launcher environment, running as a single rank "
                  "(collective figures say nothing about a network)", file=sys.stderr)
        subgroups = None
        agree_on_topology(topo, device)
        if topo is not None:
            subgroups = topology.build_subgroups(topo)
            if rank == 0 and topo.nodes == 1:
                print("omgs-profile: --topology hierarchical on one node: the inter-node "
                      "groups have one rank each, so inter says nothing about a network",
                      file=sys.stderr)
        sections = 2 + (len(LINK_SECTIONS) if topo is not None else 0)
        steps = sections * len(settings.sizes) + len(topk_backends) * len(settings.topk_sizes)
        progress = _NoProgress()
        if rank == 0 and not args.no_progress:
            try:
                from tqdm import tqdm
            except ImportError:  # an optional dependency (omgs-hook[scripts])
                print("omgs-profile: tqdm is not installed, no progress bar", file=sys.stderr)
            else:
                progress = tqdm(total=steps, desc="omgs-profile", unit="point", file=sys.stderr)
        started = time.perf_counter()
        try:
            samples, records, spent = measure(settings, topk_backends, args.density, device,
                                              progress, subgroups)
        finally:
            progress.close()
        elapsed = time.perf_counter() - started
        if rank == 0:
            notes = truncation_notes(records)  # printed with the summary, kept in the file
            fits, errors = fit_samples(samples)
            sweep = {
                "adaptive": settings.adaptive,
                "time_budget_s": settings.time_budget_s,
                "spent_s": spent,
                "growth": GROWTH if settings.adaptive else None,
                "min_reps": settings.min_reps, "min_points": settings.min_points,
                "sections": records,
                "truncated": [name for name, r in records.items() if not r["complete"]],
                "notes": notes,
            }
            run_settings = {"sizes_bytes": list(settings.sizes),
                            "topk_numel": list(settings.topk_sizes),
                            "topk_density": args.density,
                            "reps": settings.reps, "warmup": settings.warmup,
                            "quick": args.quick, "time_budget_s": settings.time_budget_s,
                            "torch_threads": torch.get_num_threads(),
                            "statistic": "median over reps of the slowest rank's time",
                            "fit": ("relative-error NNLS, Huber-weighted" if ROBUST_FIT
                                    else "relative-error NNLS") + f", top-k log term "
                                                                   f"{TOPK_LOG_TERM}",
                            "elapsed_s": elapsed}
            document = build_document(samples=samples, fits=fits, errors=errors,
                                      default_backend=default_backend, world_size=world_size,
                                      backend=backend, device=device, settings=run_settings,
                                      sweep=sweep, topo=topo)
            # never write a file load_profile rejects
            profile = profile_from_dict(document, out)
            write_json_atomically(out, document)
            if plot_path is not None:
                try:
                    import matplotlib  # noqa: F401  (optional: omgs-hook[scripts])
                except ImportError:
                    print("omgs-profile: matplotlib is not installed, no plot written "
                          "(install omgs-hook[scripts] or pass --no-plot)", file=sys.stderr)
                    plot_path = None
                else:
                    plot_profile(document, plot_path)
            print(_summary(document, out, plot_path, elapsed,
                           gaps=profile_bandwidth_gaps(profile)))
        # rank 0 writes while the others wait, so the launcher sees every rank finish together
        Timer(device).barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
