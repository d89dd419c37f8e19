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

Every measurement is repeated: ``--warmup`` untimed calls first (connection set-up,
allocator, CuPy kernel compilation), then ``--reps`` timed calls, each preceded by a
barrier so all ranks start together. Each rank times its own call (a CUDA synchronise
before and after on GPUs); the per-rep times are then all-reduced with MAX, because a
collective - and the training step - finishes only when the slowest rank does. The
median over reps of that slowest-rank time is the point that is fitted (robust to a
stray slow rep); all reps are kept in the file as raw samples.

Fits (``omgs_hook.fitting``): ``t = alpha + beta * bytes`` and
``t = c0 + c1*D + c2*D*log2(D)``, both minimising *relative* error with non-negative
coefficients; each point's relative fit error is written to the file and printed.

Options: ``--sizes`` (message sizes in bytes), ``--topk-sizes`` (D values), ``--reps``,
``--warmup``, ``--density``, ``--topk-backends``, ``--backend`` (default: nccl when CUDA
is available, else gloo), ``--device``, ``--quick`` (a tiny sweep for tests and smoke
checks), ``--no-plot``, ``--plot PATH``. Sizes accept ``K``/``M``/``G`` suffixes
(powers of 1024) and scientific notation (``4e6``).

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
import time

import torch
import torch.distributed as dist

from omgs_hook import cli_types, communicator
from omgs_hook.cost_model import selected_k
from omgs_hook.fitting import fit_linear_relative, fit_topk
from omgs_hook.profile_file import SCHEMA_VERSION, profile_from_dict

# Default sweep: 8 log-spaced message sizes 1 KiB .. 8 MiB (a sparse group of a
# 100M-parameter model at density 0.01 contributes 8 MB) and top-k over 1e3 .. 4e6
# elements; with 2 gloo ranks on 2 CPU cores this takes well under a minute.
DEFAULT_SIZES = tuple(int(round(1024 * 2 ** (13 * i / 7) / 8)) * 8 for i in range(8))
DEFAULT_TOPK_SIZES = tuple(int(round(1e3 * (4e3 ** (i / 7)))) for i in range(8))
DEFAULT_REPS = 20
DEFAULT_WARMUP = 5
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
                        help="message sizes in bytes, comma separated (default: 8 sizes 1K..8M); "
                             "rounded up to whole packed entries (8 bytes)")
    parser.add_argument("--topk-sizes", type=parse_size_list, default=None,
                        help="top-k input sizes D in elements (default: 8 sizes 1e3..4e6)")
    parser.add_argument("--topk-backends", default=None,
                        help="comma separated top-k backends to time (default: all available)")
    parser.add_argument("--density", type=_density, default=0.001,
                        help="top-k density: k = max(1, ceil(density * D)) (default 0.001)")
    parser.add_argument("--reps", type=_positive_int, default=None,
                        help=f"timed repetitions per point (default {DEFAULT_REPS})")
    parser.add_argument("--warmup", type=_non_negative_int, default=None,
                        help=f"untimed calls before each point (default {DEFAULT_WARMUP})")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sweep (3 sizes, 3 reps) for tests and smoke checks")
    parser.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    parser.add_argument("--plot", default=None, help="PNG path (default: --out with .png)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--timeout", type=_positive_int, default=300,
                        help="process-group timeout in seconds (default 300)")
    return parser


def resolve_settings(args):
    """Fill sweep defaults (``--quick`` or full) and check the sweep can be fitted."""
    sizes = args.sizes or list(QUICK_SIZES if args.quick else DEFAULT_SIZES)
    # whole packed entries: one entry = one float32 value + one int32 index = 8 bytes
    sizes = sorted({max(8, -(-s // 8) * 8) for s in sizes})
    topk_sizes = args.topk_sizes or list(QUICK_TOPK_SIZES if args.quick else DEFAULT_TOPK_SIZES)
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
    return sizes, topk_sizes, reps, warmup


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

    def slowest_rank_seconds(self, call, reps, warmup):
        """Per-rep seconds of ``call`` on the slowest rank (list of ``reps`` floats)."""
        for _ in range(warmup):
            call()
        self._sync()
        mine = []
        for _ in range(reps):
            self.barrier()
            self._sync()
            start = time.perf_counter()
            call()
            self._sync()
            mine.append(time.perf_counter() - start)
        times = torch.tensor(mine, dtype=torch.float64, device=self.device)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        return [float(t) for t in times.cpu()]


# ---------------------------------------------------------------------------------------
# the three measurements
# ---------------------------------------------------------------------------------------


def packed_allgather_call(nbytes, device, generator):
    """The hook's sparse-group collective for a per-rank contribution of ``nbytes``."""
    k = nbytes // (communicator.VALUE_BYTES + communicator.INDEX_BYTES)
    values = torch.randn(k, generator=generator).to(device)
    indices = torch.randint(0, communicator.MAX_INDEX, (k,), generator=generator).to(device)

    def call():
        payload = communicator.pack_sparse(values, indices)
        future, _gathered = communicator.allgather_async(payload)
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


def topk_call(selector, numel, density, device, generator):
    x = torch.randn(numel, generator=generator).to(device)
    k = selected_k(numel, density)

    def call():
        selector.select(x, k)

    return call, k


def _median(values):
    return float(statistics.median(values))


def measure(sizes, topk_sizes, topk_backends, density, reps, warmup, device, progress):
    """Run every measurement; returns the raw samples (identical on every rank)."""
    from omgs_hook.topk import get_selector

    timer = Timer(device)
    generator = torch.Generator().manual_seed(1234 + dist.get_rank())
    samples = {"all_gather": [], "all_reduce": [], "topk": {}}
    for nbytes in sizes:
        for name, make in (("all_gather", packed_allgather_call),
                           ("all_reduce", dense_allreduce_call)):
            progress.set_postfix_str(f"{name} {nbytes} B")
            seconds = timer.slowest_rank_seconds(make(nbytes, device, generator), reps, warmup)
            samples[name].append({"bytes": nbytes, "seconds": seconds})
            progress.update(1)
    for backend in topk_backends:
        selector = get_selector(backend, device)
        rows = samples["topk"][backend] = []
        for numel in topk_sizes:
            progress.set_postfix_str(f"top-k {backend} D={numel}")
            call, k = topk_call(selector, numel, density, device, generator)
            seconds = timer.slowest_rank_seconds(call, reps, warmup)
            rows.append({"numel": numel, "k": k, "seconds": seconds})
            progress.update(1)
    return samples


# ---------------------------------------------------------------------------------------
# fitting and the file
# ---------------------------------------------------------------------------------------


def fit_samples(samples):
    """Fit the models to the per-point medians; returns (fits dict, fit_errors dict)."""
    fits, errors = {}, {}
    for key, name in (("comm", "all_gather"), ("dense", "all_reduce")):
        rows = samples[name]
        medians = [_median(r["seconds"]) for r in rows]
        fit = fit_linear_relative([r["bytes"] for r in rows], medians)
        fits[key] = fit
        errors[key] = [{"bytes": r["bytes"], "median_s": m, "rel_error": e}
                       for r, m, e in zip(rows, medians, fit.rel_errors)]
    fits["topk_all"], errors["topk"] = {}, {}
    for backend, rows in samples["topk"].items():
        medians = [_median(r["seconds"]) for r in rows]
        fit = fit_topk([r["numel"] for r in rows], medians)
        fits["topk_all"][backend] = fit
        errors["topk"][backend] = [{"numel": r["numel"], "k": r["k"], "median_s": m, "rel_error": e}
                                   for r, m, e in zip(rows, medians, fit.rel_errors)]
    return fits, errors


def _cupy_version():
    try:
        import cupy
    except Exception:  # ImportError, or a broken CUDA install raising at import
        return None
    return getattr(cupy, "__version__", None)


def build_document(*, samples, fits, errors, default_backend, world_size, backend, device,
                   settings):
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    topk = fits["topk_all"][default_backend]
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
        "topk": {"backend": default_backend, "c0": topk.c0, "c1": topk.c1, "c2": topk.c2},
        "topk_all": {name: {"c0": f.c0, "c1": f.c1, "c2": f.c2}
                     for name, f in fits["topk_all"].items()},
        "settings": settings,
        "fit_errors": errors,
        "samples": samples,
    }


def write_json_atomically(path, document):
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    temporary = f"{path}.tmp{os.getpid()}"
    with open(temporary, "w", encoding="utf-8") as handle:
        json.dump(document, handle, indent=1)
        handle.write("\n")
    os.replace(temporary, path)


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
    right.set(xscale="log", yscale="log", xlabel="elements D", ylabel="seconds (slowest rank)",
              title=f"top-k on {document['device_name']}, "
                    f"density {document['settings']['topk_density']:g}")
    right.grid(True, which="both", alpha=0.3)
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _summary(document, out, plot_path, elapsed):
    lines = [f"omgs-profile: {document['world_size']} ranks, {document['backend']}, "
             f"{document['device_name']}, {elapsed:.1f} s"]
    for key, label in (("comm", "all_gather"), ("dense", "all_reduce")):
        fit = document[key]
        worst = max(abs(p["rel_error"]) for p in document["fit_errors"][key])
        lines.append(f"  {label:<10} alpha = {fit['alpha_s'] * 1e3:.4g} ms, beta = "
                     f"{fit['beta_s_per_byte'] * 1e9:.4g} ns/B (worst point {worst:.0%} off)")
    for backend, c in document["topk_all"].items():
        worst = max(abs(p["rel_error"]) for p in document["fit_errors"]["topk"][backend])
        mark = " (default)" if backend == document["topk"]["backend"] else ""
        lines.append(f"  top-k {backend:<8} c0 = {c['c0']:.3g} s, c1 = {c['c1']:.3g} s, "
                     f"c2 = {c['c2']:.3g} s (worst point {worst:.0%} off){mark}")
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
    sizes, topk_sizes, reps, warmup = resolve_settings(args)
    backend, device = choose_backend_and_device(args.backend, args.device)

    from omgs_hook.topk import available_backends, get_selector

    usable = available_backends(device)
    if args.topk_backends:
        topk_backends = [b.strip() for b in args.topk_backends.split(",") if b.strip()]
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

    init = {"backend": backend, "timeout": datetime.timedelta(seconds=args.timeout)}
    if device.type == "cuda":
        init["device_id"] = device
    dist.init_process_group(**init)
    try:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        if rank == 0 and single:
            print("omgs-profile: no launcher environment, running as a single rank "
                  "(collective figures say nothing about a network)", file=sys.stderr)
        steps = 2 * len(sizes) + len(topk_backends) * len(topk_sizes)
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
            samples = measure(sizes, topk_sizes, topk_backends, args.density, reps, warmup,
                              device, progress)
        finally:
            progress.close()
        elapsed = time.perf_counter() - started
        if rank == 0:
            fits, errors = fit_samples(samples)
            settings = {"sizes_bytes": sizes, "topk_numel": topk_sizes,
                        "topk_density": args.density,
                        "reps": reps, "warmup": warmup, "quick": args.quick,
                        "torch_threads": torch.get_num_threads(),
                        "statistic": "median over reps of the slowest rank's time",
                        "elapsed_s": elapsed}
            document = build_document(samples=samples, fits=fits, errors=errors,
                                      default_backend=default_backend, world_size=world_size,
                                      backend=backend, device=device, settings=settings)
            profile_from_dict(document, args.out)  # never write a file load_profile rejects
            write_json_atomically(args.out, document)
            plot_path = None
            if not args.no_plot:
                try:
                    import matplotlib  # noqa: F401  (optional: omgs-hook[scripts])
                except ImportError:
                    print("omgs-profile: matplotlib is not installed, no plot written "
                          "(install omgs-hook[scripts] or pass --no-plot)", file=sys.stderr)
                else:
                    plot_path = args.plot or os.path.splitext(args.out)[0] + ".png"
                    plot_profile(document, plot_path)
            print(_summary(document, args.out, plot_path, elapsed))
        # rank 0 writes while the others wait, so the launcher sees every rank finish together
        Timer(device).barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
