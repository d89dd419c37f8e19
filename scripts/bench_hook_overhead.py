#!/usr/bin/env python
"""The OMGS hook's own cost per step, in fp32 copy-equivalents of the gradient.

What is measured: 2 gloo ranks (spawned here, loopback), a model whose gradient is ONE
DDP bucket of D elements (a bias-free ``Linear``), the hook with one sparse group
(``strategy="single"``, ``allow_dense=False``, the model plan, density 0.001), against
a **no-op hook** that hands DDP's bucket back untouched. DDP's own bucket copies cost the
same in both, so the difference in step time is what the hook itself adds: assembling
gradient + residual, the non-finite check, top-k, packing, the all-gather of ``2k+1``
floats per rank (a few hundred kB: a small fraction of a copy), the write-back and the
residual update. It is divided by the time of one fp32 ``copy_`` of D elements measured
in the same processes, so the figure is comparable across machines.

A third variant, an **all-gather-only hook**, sends a payload of the hook's size and
hands the bucket back untouched: the collective's round trip and its hand-offs between
threads, which any sparse exchange pays and which do not grow with D. The OMGS step over
that one ("over all-gather-only") is the hook's host work alone. At 1M elements the
round trip is several copies by itself (docs/hot-path.md, "The floor of a small group").

Variants are interleaved round by round (``--rounds``; in each, every variant runs
``--steps`` steps), each block's per-step times are all-reduced with MAX (a synchronous
step is as slow as its slowest rank), and medians are reported. Run on a quiet machine
(``uptime`` load below ~1): the two ranks use the machine's two cores.

Usage::

    python scripts/bench_hook_overhead.py                       # 1M, 12M, 50M elements
    python scripts/bench_hook_overhead.py --sizes 1e6 --rounds 3 --json out.json
    python scripts/bench_hook_overhead.py --sizes 12e6 --buckets 40  # one group of 40 buckets
    python scripts/bench_hook_overhead.py --fused-pass chunks   # without the C pass

``--buckets B`` splits the gradient over B equal ``Linear`` layers, one DDP bucket each,
which ``strategy="single"`` merges into ONE group of B runs - what an OMGS group of
merged buckets looks like; the per-run parts of the hook (reading the sample, the
write-back) show up there and not with one bucket. With ``--strategy layerwise`` every
bucket is a group of its own instead: B sparse groups, whose fixed per-group costs
(issuing a collective, packing, the hand-offs of a write-back) show up; the table then
also gives the overhead per group in milliseconds. ``--density`` sets the hook's density
(default 0.001)::

    python scripts/bench_hook_overhead.py --sizes 65536 --buckets 16 --strategy layerwise --density 0.01

On a machine with CUDA, ``--device cuda`` runs both ranks on GPU 0 (gloo with CUDA
tensors) and synchronises around each step.
"""

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import omgs_hook  # noqa: E402
from omgs_hook import cli_types, communicator, cost_model, topk  # noqa: E402

DENSITY = 0.001
BATCH = 8


def noop_hook(state, bucket):
    """Hand the bucket back as it is: what DDP costs with any hook."""
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def gather_only_hook(density, bucket):
    """All-gather a payload of the size the OMGS hook sends for this bucket (``2k+1``
    floats per rank), wait for it, and hand the bucket back untouched: the collective's
    round trip and hand-offs that any sparse exchange pays, without the hook's own work
    (accumulate, select, pack, write-back, residual update). The OMGS step over this
    one is the hook's host work alone; over the no-op hook it also holds that round
    trip, which dominates small groups (docs/hot-path.md, "The floor of a small
    group")."""
    buffer = bucket.buffer()
    k = cost_model.selected_k(buffer.numel(), density)
    payload = torch.zeros(communicator.payload_numel(k), dtype=torch.float32,
                          device=buffer.device)
    future, _ = communicator.allgather_async(payload)
    return future.then(lambda _: buffer)


#: the variants, run interleaved: DDP with a no-op hook, with an all-gather-only hook
#: and with the OMGS hook
VARIANTS = ("noop", "gather", "omgs")


def _shape(numel):
    rows = 1024
    return max(1, round(numel / rows)), rows


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_seconds(numel, device, reps):
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps + 2):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


STRATEGIES = ("single", "layerwise")


def _hook_options(strategy="single", density=DENSITY):
    return {"density": density, "strategy": strategy, "allow_dense": False, "select": "model",
            "warmup_steps": 2, "log_every": 0}


class _Parallel(torch.nn.Module):
    """B bias-free ``Linear`` layers of the same shape on the same input, outputs summed:
    B gradients of equal size, one DDP bucket each (``bucket_cap_mb`` = one layer)."""

    def __init__(self, in_features, out_features, count):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Linear(in_features, out_features, bias=False) for _ in range(count))

    def forward(self, x):
        return sum(layer(x) for layer in self.layers)


def _build(numel, device, hook, buckets=1, strategy="single", density=DENSITY):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    out_features, in_features = _shape(numel / buckets)
    if buckets == 1:
        model = torch.nn.Linear(in_features, out_features, bias=False).to(device)
        cap_mb = 10_000
    else:
        model = _Parallel(in_features, out_features, buckets).to(device)
        cap_mb = in_features * out_features * 4 / 2**20
    # (no broadcast_buffers option: the model has no buffers, and torch 2.13 warns about
    # the old name even when it is False)
    ddp = DDP(model, bucket_cap_mb=cap_mb,
              device_ids=[device.index] if device.type == "cuda" else None)
    state = None
    if hook == "noop":
        ddp.register_comm_hook(None, noop_hook)
    elif hook == "gather":
        ddp.register_comm_hook(density, gather_only_hook)
    else:
        state = omgs_hook.register(ddp, **_hook_options(strategy, density))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    return ddp, optimizer, state, in_features


def _bucket_count(ddp):
    """How many buckets DDP made (its logging data), or None where it does not say."""
    try:
        data = ddp._get_ddp_logging_data()
        key = "rebuilt_bucket_sizes" if data.get("has_rebuilt_buckets") else "bucket_sizes"
        return len(str(data[key]).split(","))
    except Exception:  # noqa: BLE001 - private API; the count is only reported
        return None


def _step(ddp, optimizer, x, device):
    _sync(device)
    t0 = time.perf_counter()
    ddp(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    _sync(device)
    return time.perf_counter() - t0


def worker(rank, world_size, port, sizes, rounds, steps, device_name, out_path, buckets=1,
           strategy="single", density=DENSITY):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    device = torch.device(device_name)
    if device.type == "cuda":
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=600))
    results = []
    try:
        for numel in sizes:
            variants = {name: _build(numel, device, name, buckets, strategy, density)
                        for name in VARIANTS}
            x = torch.randn(BATCH, variants["noop"][3], device=device)
            for name, (ddp, opt, _, _) in variants.items():  # DDP rebuild, dense warm-up, plan
                for _ in range(12):
                    _step(ddp, opt, x, device)
            times = {name: [] for name in variants}
            for r in range(rounds):
                order = list(variants) if r % 2 == 0 else list(reversed(list(variants)))
                for name in order:
                    ddp, opt, _, _ = variants[name]
                    block = torch.tensor([_step(ddp, opt, x, device) for _ in range(steps)],
                                         dtype=torch.float64)
                    dist.all_reduce(block, op=dist.ReduceOp.MAX)
                    times[name] += block.tolist()
            copy_s = torch.tensor([copy_seconds(numel, device, 10)], dtype=torch.float64)
            dist.all_reduce(copy_s, op=dist.ReduceOp.MAX)
            state = variants["omgs"][2]
            last = state.stats()["last"] or {}
            noop = statistics.median(times["noop"])
            gather = statistics.median(times["gather"])
            omgs = statistics.median(times["omgs"])
            copy = float(copy_s[0])
            results.append({
                "numel": numel, "copy_s": copy, "noop_step_s": noop, "omgs_step_s": omgs,
                "overhead_copies": (omgs - noop) / copy,
                "gather_step_s": gather, "over_gather_copies": (omgs - gather) / copy,
                "hook_s": last.get("hook_s"), "topk_s": last.get("topk_s"),
                "groups": last.get("groups"), "dense_groups": last.get("dense_groups"),
                "buckets": _bucket_count(variants["omgs"][0]),
                "noop_steps_s": times["noop"], "omgs_steps_s": times["omgs"],
                "gather_steps_s": times["gather"],
            })
            for ddp, _, st, _ in variants.values():
                if st is not None:
                    st.close()
            del variants, ddp
            import gc

            gc.collect()
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(results, f)
    finally:
        import gc

        gc.collect()
        dist.destroy_process_group()


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(sizes, rounds=5, steps=4, device="cpu", world_size=2, buckets=1, strategy="single",
            density=DENSITY):
    """Run the 2-rank measurement; return one result dict per size."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.json")
        mp.start_processes(worker, args=(world_size, _free_port(), sizes, rounds, steps, device, out,
                                         buckets, strategy, density),
                           nprocs=world_size, join=True, start_method="spawn")
        with open(out) as f:
            return json.load(f)


def format_table(results):
    """The results as a Markdown table; with more than one sparse group (``layerwise``)
    a last column gives the overhead per group. Rows measured beside the all-gather-only
    hook (:func:`gather_only_hook`) add its step and the OMGS step over it, in copies:
    the hook's host work without the collective's round trip."""
    per_group = any((r.get("groups") or 1) > 1 for r in results)
    gather = all("gather_step_s" in r for r in results)
    lines = ["| elements | buckets | one copy_ (ms) | no-op hook step (ms) | OMGS step (ms) | "
             "hook overhead (copies) |"
             + (" all-gather-only hook step (ms) | over all-gather-only (copies) |"
                if gather else "")
             + (" groups | overhead per group (ms) |" if per_group else ""),
             "|---|---|---|---|---|---|" + ("---|---|" if gather else "")
             + ("---|---|" if per_group else "")]
    for r in results:
        line = (f"| {r['numel'] / 1e6:.1f}M | {r.get('buckets') or '?'} | "
                f"{r['copy_s'] * 1e3:.2f} | "
                f"{r['noop_step_s'] * 1e3:.1f} | {r['omgs_step_s'] * 1e3:.1f} | "
                f"{r['overhead_copies']:.2f} |")
        if gather:
            line += f" {r['gather_step_s'] * 1e3:.1f} | {r['over_gather_copies']:.2f} |"
        if per_group:
            groups = r.get("groups") or 1
            line += (f" {groups} | "
                     f"{(r['omgs_step_s'] - r['noop_step_s']) * 1e3 / groups:.2f} |")
        lines.append(line)
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=cli_types.size_list if hasattr(cli_types, "size_list")
                        else str, default="1e6,12e6,50e6",
                        help="gradient sizes in elements, comma-separated")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4, help="steps per variant per round")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--buckets", type=int, default=1,
                        help="split the gradient over this many DDP buckets, merged into one "
                             "group (default 1)")
    parser.add_argument("--strategy", choices=STRATEGIES, default="single",
                        help="single: the buckets form one sparse group; layerwise: one group "
                             "per bucket (default single)")
    parser.add_argument("--density", type=cli_types.density, default=DENSITY,
                        help=f"the hook's density (default {DENSITY})")
    parser.add_argument("--fused-pass", choices=("c", "chunks"), default=None,
                        help="the CPU's fused accumulate-and-select pass: c (omgs_hook._native, "
                             "the default where it is built) or chunks (the NumPy/torch loop; "
                             "sets OMGS_HOOK_NATIVE=0 for the ranks), for a before/after")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if args.fused_pass is not None:  # read by omgs_hook.topk when the ranks import it
        os.environ["OMGS_HOOK_NATIVE"] = "1" if args.fused_pass == "c" else "0"
        if args.fused_pass == "c" and topk._load_native() is None:
            parser.error("--fused-pass c: omgs_hook._native is not built here")
    fused_pass = "c" if topk._load_native() is not None else "chunks"
    print(f"fused pass: {fused_pass}")
    if args.buckets < 1:
        parser.error(f"--buckets: must be >= 1, got {args.buckets}")
    sizes = args.sizes if isinstance(args.sizes, list) else [
        int(float(s)) for s in args.sizes.split(",") if s.strip()]
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available here")
    results = measure(sizes, args.rounds, args.steps, args.device, buckets=args.buckets,
                      strategy=args.strategy, density=args.density)
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "buckets": args.buckets,
                       "strategy": args.strategy, "density": args.density,
                       "fused_pass": fused_pass,
                       "load": os.getloadavg(),
                       "results": results}, f,
                      indent=1)
    return results


if __name__ == "__main__":
    main()
