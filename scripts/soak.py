#!/usr/bin/env python3
"""Soak test: many steps of the OMGS hook on gloo ranks, re-planning often.

Checks the two things a days-long job needs: resident memory stays flat, and the
error-feedback residual norm stays bounded (it must not grow step after step).

    python scripts/soak.py --steps 1000 --replan-every 50 --world-size 2 --out soak.json

Each rank samples its RSS and the residual L2 norm every ``--sample-every`` steps; rank 0
writes a JSON report and prints a summary. Exit status 1 when a check fails:
* memory: RSS growth from the end of the first quarter of steps to the end > --max-growth-mb
  (the first quarter lets the allocator and the plan settle);
* residual: the maximum norm in the last quarter > --max-norm-ratio x the maximum in the
  second quarter (a growing residual means gradient is being lost or never sent).
"""

import argparse
import datetime
import gc
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def rss_mb():
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def make_model():
    return nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
        nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10),
    )


def worker(rank, args, port, out_path):
    import omgs_hook

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.world_size,
                            timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=0)
    state = omgs_hook.register(ddp, density=args.density, warmup_steps=5,
                               replan_every=args.replan_every, log_every=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(1 + rank)
    teacher = torch.randn(64, 10, generator=torch.Generator().manual_seed(7))
    samples = []
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        x = torch.randn(32, 64, generator=gen)
        y = (x @ teacher).argmax(dim=1)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        if step % args.sample_every == 0 or step == args.steps:
            gc.collect()
            samples.append({"step": step, "rss_mb": rss_mb(), "residual_norm": state.memory.total_norm(),
                            "loss": loss.item(), "replans": state.stats()["total"]["replans"]})
    elapsed = time.perf_counter() - start
    stats = state.stats()
    del ddp, state
    gc.collect()
    gathered = [None] * args.world_size
    dist.all_gather_object(gathered, samples)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"per_rank": gathered, "elapsed_s": elapsed, "total": stats["total"]}, f)
    dist.destroy_process_group()
    os._exit(0)


def evaluate(report, args):
    failures = []
    lines = []
    for rank, samples in enumerate(report["per_rank"]):
        n = len(samples)
        base = samples[max(0, n // 4 - 1)]
        growth = samples[-1]["rss_mb"] - base["rss_mb"]
        q2 = [s["residual_norm"] for s in samples[n // 4: n // 2]] or [samples[0]["residual_norm"]]
        q4 = [s["residual_norm"] for s in samples[3 * n // 4:]]
        ratio = max(q4) / max(max(q2), 1e-12)
        lines.append(
            f"rank {rank}: RSS {base['rss_mb']:.1f} -> {samples[-1]['rss_mb']:.1f} MB "
            f"(growth {growth:+.1f} MB after step {base['step']}); residual norm max q2 "
            f"{max(q2):.4g}, q4 {max(q4):.4g} (ratio {ratio:.2f}); loss {samples[0]['loss']:.3f}"
            f" -> {samples[-1]['loss']:.3f}; replans {samples[-1]['replans']}"
        )
        if growth > args.max_growth_mb:
            failures.append(f"rank {rank}: RSS grew {growth:.1f} MB > {args.max_growth_mb} MB")
        if ratio > args.max_norm_ratio:
            failures.append(f"rank {rank}: residual norm ratio {ratio:.2f} > {args.max_norm_ratio}")
    return lines, failures


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--replan-every", type=int, default=50)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--sample-every", type=int, default=20)
    parser.add_argument("--max-growth-mb", type=float, default=20.0)
    parser.add_argument("--max-norm-ratio", type=float, default=2.0)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", default="soak.json")
    args = parser.parse_args(argv)
    if args.steps < 40:
        parser.error("--steps must be >= 40 (quarters of the run are compared)")

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(r, args, port, args.out)) for r in range(args.world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + args.timeout
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    if any(p.is_alive() for p in procs):
        for p in procs:
            p.kill()
        print(f"soak: timed out after {args.timeout} s", file=sys.stderr)
        return 1
    if any(p.exitcode != 0 for p in procs) or not os.path.exists(args.out):
        print(f"soak: a rank failed (exit codes {[p.exitcode for p in procs]})", file=sys.stderr)
        return 1
    with open(args.out) as f:
        report = json.load(f)
    lines, failures = evaluate(report, args)
    print(f"soak: {args.steps} steps, {args.world_size} ranks, replan every {args.replan_every}, "
          f"{report['elapsed_s']:.1f} s")
    for line in lines:
        print("  " + line)
    for failure in failures:
        print("FAIL: " + failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
