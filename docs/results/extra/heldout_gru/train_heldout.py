#!/usr/bin/env python
"""Held-out DDP timing script: a GRU language model on random tokens.

Run once per rank (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set as torchrun would).
--variant: compute | allreduce | default | sparse_model | topk | lags | default_single
Prints (rank 0) one line starting with RESULT_JSON.
"""
import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn


class GRULanguageModel(nn.Module):
    """Held-out: a 2-layer GRU next-token model with a wide softmax (4.9M parameters)."""

    def __init__(self, vocab=8000, emb=160, hidden=320, layers=2):
        super().__init__()
        self.vocab = vocab
        self.emb = nn.Embedding(vocab, emb)
        self.rnn = nn.GRU(emb, hidden, layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x):
        h, _ = self.rnn(self.emb(x))
        return self.head(h).reshape(-1, self.vocab)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--variant", required=True,
                   choices=["compute", "allreduce", "default", "sparse_model", "topk", "lags",
                            "default_single"])
    p.add_argument("--pinned-buckets", type=int, default=18,
                   help="default_single: DDP's bucket count (18: the Mixer at cap 0.4)")
    p.add_argument("--density", type=float, default=0.001)
    p.add_argument("--profile", default=None)
    p.add_argument("--steps", type=int, default=160)
    p.add_argument("--window-start", type=int, default=100)
    p.add_argument("--bucket-cap-mb", type=float, default=0.6)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--tag", default="")
    args = p.parse_args()

    torch.set_num_threads(1)
    warnings.simplefilter("always")
    caught = []
    old_showwarning = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        caught.append(f"{category.__name__}: {message}")
        old_showwarning(message, category, filename, lineno, file, line)
    warnings.showwarning = showwarning

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(1234)
    model = GRULanguageModel()
    nparams = sum(p.numel() for p in model.parameters())
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb)
    state = None
    if args.variant != "allreduce" and args.variant != "compute":
        import omgs_hook
        opts = dict(density=args.density, profile=args.profile)
        if args.variant == "sparse_model":
            opts.update(allow_dense=False, select="model")
        elif args.variant == "topk":
            opts.update(strategy="single", allow_dense=False, select="model")
        elif args.variant == "lags":
            opts.update(strategy="layerwise", allow_dense=False, select="model")
        elif args.variant == "default_single":
            # the default's options with TopK-SGD's one group pinned (no trial, no
            # re-plan): what the default's steps cost beyond its plan choice
            opts.update(plan={"groups": [list(range(args.pinned_buckets))]})
        state = omgs_hook.register(ddp, **opts)

    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(100 + rank)
    batches = []
    for _ in range(4):
        tokens = torch.randint(0, 8000, (args.batch, args.seq + 1), generator=g)
        batches.append((tokens[:, :-1].contiguous(), tokens[:, 1:].reshape(-1)))

    step_s, losses = [], []
    for step in range(args.steps):
        x, y = batches[step % len(batches)]
        t0 = time.perf_counter()
        ctx = ddp.no_sync() if args.variant == "compute" else contextlib.nullcontext()
        with ctx:
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(ddp(x), y)
            loss.backward()
        opt.step()
        step_s.append(time.perf_counter() - t0)
        losses.append(loss.item())

    # slowest rank per step (a synchronous step is as slow as its slowest rank)
    t = torch.tensor(step_s, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    step_max = t.tolist()
    import resource, threading
    ru = resource.getrusage(resource.RUSAGE_SELF)
    mine = torch.tensor([statistics.median(step_s[100:]) if len(step_s) > 100 else 0.0,
                         ru.ru_utime + ru.ru_stime, float(threading.active_count())], dtype=torch.float64)
    allr = [torch.zeros(3, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(allr, mine)
    per_rank = [[round(x, 4) for x in a.tolist()] for a in allr]

    out = {"variant": args.variant, "tag": args.tag, "world": world, "params": nparams,
           "density": args.density, "steps": args.steps}
    try:
        bs = ddp._get_ddp_logging_data().get("bucket_sizes")
        out["bucket_sizes"] = bs
        out["num_buckets"] = len(str(bs).split(","))
    except Exception as exc:  # noqa: BLE001
        out["num_buckets"] = f"n/a ({exc})"
    window_start = args.window_start
    if state is not None:
        st = state.stats()
        hist = st["plan_history"]
        out["plan_history"] = [{k: e.get(k) for k in ("step", "strategy", "groups", "dense", "reason")}
                               for e in hist]
        last_change = hist[-1]["step"] if hist else 0
        sel = st["selection"]
        out["selection_trial_running"] = sel["trial"]
        lt = sel["last_trial"]
        if lt:
            out["last_trial"] = {
                "winner": lt.get("winner"),
                "excess_steps": lt.get("excess_steps"),
                "started_at_step": lt.get("started_at_step", lt.get("start_step")),
                "ended_at_step": lt.get("ended_at_step", lt.get("end_step")),
                "keys": sorted(lt.keys()),
                "decided_at": lt.get("decided_at"), "duel": lt.get("duel"),
                "candidates": [{k: c.get(k) for k in ("name", "strategy", "groups", "dense",
                                                      "predicted_s", "measured_s", "samples", "pace",
                                                      "turns")
                                if k in c} for c in lt.get("candidates") or []],
            }
        plan = st["plan"]
        out["plan"] = {k: plan.get(k) for k in ("strategy", "groups", "dense", "num_groups",
                                               "made_at_step", "predicted_iteration_s")} if plan else None
        out["model_check"] = st.get("model_check")
        out["total"] = {k: st["total"].get(k) for k in ("density", "replans", "trials",
                                                        "bytes_sent", "dense_bytes", "compression")
                        if k in st["total"]}
        out["comm_scale"] = (st.get("planned_with") or {}).get("comm_scale")
        out["summary"] = state.summary()
        # measured window must start after the last plan change (trial end)
        window_start = max(window_start, last_change + 3)
    win = step_max[window_start:]
    out["window_start"] = window_start
    out["window_steps"] = len(win)
    out["median_step_s"] = statistics.median(win) if win else None
    med = lambda v: statistics.median(v) if v else None
    out["median_step_s_after100"] = med(step_max[100:])
    out["median_step_s_80_100"] = med(step_max[80:100])
    out["per_rank_median_after100_cpu_s_threads"] = per_rank
    out["step_max"] = [round(v, 5) for v in step_max]
    out["loss_first_last"] = [losses[0], statistics.mean(losses[-10:])]
    out["warnings"] = caught
    if rank == 0:
        print("RESULT_JSON " + json.dumps(out, default=str), flush=True)
    if state is not None and hasattr(state, "close"):
        state.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
