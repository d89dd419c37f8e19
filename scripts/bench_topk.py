#!/usr/bin/env python
"""Time every available top-k backend against the memory-bandwidth bound.

For each size D and density (k = max(1, ceil(density * D))) the script times
``selector.select(x, k)`` for each backend available on the device (median of
``--reps`` runs after ``--warmup`` runs; ``torch.cuda.synchronize`` around every run on a
GPU), checks that all backends return the same indices, and reports:

* each backend's median time (ms), and the ratios sampled/torch and cupy/torch;
* the bandwidth bound: the time to read x once (D * element size bytes) at the device's
  memory bandwidth - no exact top-k can be faster. The bandwidth used is the *measured*
  copy bandwidth (2 * bytes / time of ``out.copy_(x)`` on the largest size: one read,
  one write), printed with the results; ``--bandwidth-gbs`` overrides it (e.g. 4800 for
  an H200's nominal 4.8 TB/s).

x is standard normal (a gradient-like, tie-free float32 input; ``--dtype`` changes it),
drawn with a fixed seed.

Examples::

    python scripts/bench_topk.py --sizes 1e5,1e6,1e7 --out-md docs/topk_bench_cpu.md
    python scripts/bench_topk.py --device cuda --out-json topk_h200.json --out-md topk_h200.md
"""

import argparse
import json
import math
import platform
import statistics
import sys
import time

import torch

from omgs_hook.topk import available_backends, get_selector

DEFAULT_SIZES = "1e5,1e6,1e7,2.5e7,1e8"
DEFAULT_DENSITIES = "0.001,0.01"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_sizes(text):
    sizes = []
    for item in text.split(","):
        value = float(item)
        if value < 1 or value != int(value):
            raise argparse.ArgumentTypeError(f"--sizes: {item!r} is not a positive integer")
        sizes.append(int(value))
    return sizes


def parse_densities(text):
    densities = [float(item) for item in text.split(",")]
    for density in densities:
        if not 0 < density <= 1:
            raise argparse.ArgumentTypeError(f"--densities: {density} is not in (0, 1]")
    return densities


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(function, device, reps, warmup):
    """Median wall time of ``function()`` over ``reps`` runs, after ``warmup`` runs."""
    for _ in range(warmup):
        function()
    synchronize(device)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        function()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_copy_bandwidth(numel, dtype, device, reps):
    """Bytes per second of a device-to-same-device copy (counts read + write)."""
    source = torch.randn(numel, device=device).to(dtype)
    target = torch.empty_like(source)
    seconds = median_seconds(lambda: target.copy_(source), device, reps, warmup=2)
    return 2 * source.numel() * source.element_size() / seconds


def run(args):
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    backends = args.backends or available_backends(device)
    selectors = {name: get_selector(name, device) for name in backends}
    element_size = torch.empty(0, dtype=dtype).element_size()

    if args.bandwidth_gbs:
        bandwidth = args.bandwidth_gbs * 1e9
        bandwidth_source = f"given (--bandwidth-gbs {args.bandwidth_gbs:g})"
    else:
        bandwidth = measure_copy_bandwidth(max(args.sizes), dtype, device, reps=max(3, args.reps))
        bandwidth_source = f"measured copy bandwidth on {max(args.sizes):.3g} elements"

    generator = torch.Generator().manual_seed(0)
    rows = []
    for numel in args.sizes:
        x = torch.randn(numel, generator=generator).to(dtype).to(device)
        for density in args.densities:
            k = max(1, math.ceil(density * numel))
            row = {"numel": numel, "density": density, "k": k,
                   "bound_ms": 1e3 * numel * element_size / bandwidth}
            reference = None
            for name, selector in selectors.items():
                _, indices = selector.select(x, k)
                if reference is None:
                    reference = indices
                elif not torch.equal(indices, reference):
                    raise SystemExit(
                        f"backend {name} disagrees with {backends[0]} at D={numel}, k={k}")
                seconds = median_seconds(lambda: selector.select(x, k), device,
                                         args.reps, args.warmup)
                row[f"{name}_ms"] = 1e3 * seconds
            for name in backends:
                if name != "torch" and "torch_ms" in row:
                    row[f"{name}_over_torch"] = row[f"{name}_ms"] / row["torch_ms"]
            rows.append(row)
            print(format_row(row, backends), flush=True)
        del x

    return {
        "device": describe_device(device),
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "bandwidth_gbs": bandwidth / 1e9,
        "bandwidth_source": bandwidth_source,
        "reps": args.reps,
        "warmup": args.warmup,
        "backends": backends,
        "sampled_stats": selectors["sampled"].stats() if "sampled" in selectors else None,
        "rows": rows,
    }


def describe_device(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


def format_row(row, backends):
    parts = [f"D={row['numel']:.3g} density={row['density']:g} k={row['k']}"]
    parts += [f"{name}={row[name + '_ms']:.3f}ms" for name in backends]
    parts += [f"{name}/torch={row[name + '_over_torch']:.2f}" for name in backends
              if name + "_over_torch" in row]
    parts.append(f"bound={row['bound_ms']:.3f}ms")
    return "  ".join(parts)


def markdown(result):
    backends = result["backends"]
    ratios = [name for name in backends if name != "torch" and "torch" in backends]
    header = (["D", "density", "k"] + [f"{name} (ms)" for name in backends]
              + [f"{name}/torch" for name in ratios] + ["read-once bound (ms)"])
    lines = [
        f"Top-k on {result['device']}, {result['dtype']}, {result['threads']} thread(s), "
        f"torch {result['torch_version']}; median of {result['reps']} runs.",
        f"Bound = D x {result['dtype']} size / {result['bandwidth_gbs']:.1f} GB/s "
        f"({result['bandwidth_source']}).",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for row in result["rows"]:
        cells = [f"{row['numel']:.3g}", f"{row['density']:g}", str(row["k"])]
        cells += [f"{row[name + '_ms']:.3f}" for name in backends]
        cells += [f"{row[name + '_over_torch']:.2f}" for name in ratios]
        cells.append(f"{row['bound_ms']:.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    parser.add_argument("--sizes", type=parse_sizes, default=parse_sizes(DEFAULT_SIZES),
                        help=f"comma-separated element counts (default {DEFAULT_SIZES})")
    parser.add_argument("--densities", type=parse_densities,
                        default=parse_densities(DEFAULT_DENSITIES),
                        help=f"comma-separated k/D (default {DEFAULT_DENSITIES})")
    parser.add_argument("--backends", type=lambda t: t.split(","), default=None,
                        help="comma-separated backends (default: all available on the device)")
    parser.add_argument("--reps", type=int, default=11, help="timed runs per case (default 11)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs first (default 2)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch CPU threads (default: torch's)")
    parser.add_argument("--bandwidth-gbs", type=float, default=0.0,
                        help="memory bandwidth for the bound in GB/s "
                             "(default: measured copy bandwidth)")
    parser.add_argument("--out-json", help="write the results as JSON here")
    parser.add_argument("--out-md", help="write a markdown table here")
    args = parser.parse_args(argv)
    if args.reps < 1 or args.warmup < 0:
        parser.error("--reps must be >= 1 and --warmup >= 0")

    result = run(args)
    arguments = sys.argv[1:] if argv is None else argv
    result["command"] = " ".join(["python", "scripts/bench_topk.py"] + list(arguments))
    table = markdown(result)
    print(table)
    if args.out_json:
        with open(args.out_json, "w") as handle:
            json.dump(result, handle, indent=2)
    if args.out_md:
        with open(args.out_md, "w") as handle:
            handle.write(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
