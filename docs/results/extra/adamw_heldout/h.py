"""Held-out sweep harness for omgs-hook.

usage: python h.py CASE [variant,variant,...] [--steps N]
variants: plain, d1 (density=1.0), sparse (density=0.01 defaults), single
          (density=0.01, allow_dense=False, strategy='single')
Each variant trains the same seed on 2 gloo ranks; a conservation check
sum_r (g_r + e_r) == W * g_avg + sum_r e_r' is computed every step from a twin
(non-DDP) copy of the model giving the local gradient.
"""
import copy
import json
import math
import os
import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

V = 64  # vocabulary


# ---------------------------------------------------------------- models
class LMRnn(nn.Module):
    def __init__(self, cell="lstm"):
        super().__init__()
        self.emb = nn.Embedding(V, 32)
        rnn = nn.LSTM if cell == "lstm" else nn.GRU
        self.rnn = rnn(32, 48, num_layers=2, batch_first=True)
        self.out = nn.Linear(48, V)

    def forward(self, x):
        h, _ = self.rnn(self.emb(x))
        return self.out(h)


class PadEmb(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, 32, padding_idx=0)
        self.fc = nn.Linear(32, 4)

    def forward(self, x):
        e = self.emb(x)
        mask = (x != 0).float().unsqueeze(-1)
        return self.fc((e * mask).sum(1) / mask.sum(1).clamp(min=1))


class TiedTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, 32)
        self.pos = nn.Parameter(torch.randn(16, 32) * 0.02)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, V, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, x):
        h = self.emb(x) + self.pos[: x.shape[1]]
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.head(self.enc(h, mask=mask, is_causal=True))


class FrozenMid(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(20, 64)
        self.b = nn.Linear(64, 64)
        self.c = nn.Linear(64, 64)
        self.d = nn.Linear(64, 1)
        for p in self.b.parameters():
            p.requires_grad_(False)

    def forward(self, x):
        return self.d(torch.tanh(self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))))


class SkipSome(nn.Module):
    """branch2 used only on even steps (a counter in the module)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(20, 64)
        self.b1 = nn.Linear(64, 64)
        self.b2 = nn.Linear(64, 64)
        self.d = nn.Linear(64, 1)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long), persistent=False)
        self.use_b2 = True

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.b1(h))
        if self.use_b2:
            h = h + torch.tanh(self.b2(h))
        return self.d(h)


class Sizes(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))
        self.big = nn.Linear(2000, 1000)  # 2M
        self.out = nn.Linear(1000, 1)

    def forward(self, x):
        return self.out(torch.tanh(self.big(x))) * self.scale


class BNNet(nn.Module):
    def __init__(self, sync=False):
        super().__init__()
        self.c1 = nn.Conv2d(3, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.c2 = nn.Conv2d(16, 32, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(32)
        self.fc = nn.Linear(32, 4)

    def forward(self, x):
        h = F.relu(self.bn1(self.c1(x)))
        h = F.relu(self.bn2(self.c2(h)))
        return self.fc(h.mean((2, 3)))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(20, 128)
        self.l2 = nn.Linear(128, 128)
        self.l3 = nn.Linear(128, 64)
        self.l4 = nn.Linear(64, 1)

    def forward(self, x):
        x = x.to(self.l1.weight.dtype)
        h = torch.tanh(self.l1(x))
        h = torch.tanh(self.l2(h))
        h = torch.tanh(self.l3(h))
        return self.l4(h)


class MixedMLP(MLP):
    """l2 in bf16, the rest fp32."""

    def __init__(self):
        super().__init__()
        self.l2.to(torch.bfloat16)

    def forward(self, x):
        h = torch.tanh(self.l1(x))
        h = torch.tanh(self.l2(h.to(torch.bfloat16))).float()
        h = torch.tanh(self.l3(h))
        return self.l4(h)


class ComplexNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(20, 16, dtype=torch.cfloat) * 0.1)
        self.fc = nn.Linear(16, 1)

    def forward(self, x):
        return self.fc((x.to(torch.cfloat) @ self.w).abs())


# ---------------------------------------------------------------- tasks
TEACHER = None


def teacher():
    global TEACHER
    if TEACHER is None:
        g = torch.Generator().manual_seed(1234)
        TEACHER = (torch.randn(20, 8, generator=g), torch.randn(8, 1, generator=g))
    return TEACHER


def reg_batch(rank, step, n=32, d=20, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, d, generator=g)
    if d == 20:
        w1, w2 = teacher()
        y = torch.tanh(x @ w1) @ w2 / 3
    else:
        y = x[:, :1] * 0.5 + x[:, 1:2].sin()
    return x.to(dtype), y.to(dtype)


def lm_batch(rank, step, n=16, t=16):
    g = torch.Generator().manual_seed(1000 * step + rank)
    start = torch.randint(1, V, (n, 1), generator=g)
    seq = (start + 3 * torch.arange(t + 1)) % (V - 1) + 1  # deterministic next token
    return seq[:, :-1], seq[:, 1:]


def pad_batch(rank, step, n=32, t=10):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(1, V, (n, t), generator=g)
    lens = torch.randint(2, t + 1, (n,), generator=g)
    x[torch.arange(t)[None, :] >= lens[:, None]] = 0
    y = (x.sum(1) % 4)
    y = ((x[:, 0] % 4))  # label from first token
    return x, y


def img_batch(rank, step, n=16):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, 3, 8, 8, generator=g)
    y = (x[:, 0].mean((1, 2)) > 0).long() + 2 * (x[:, 1].mean((1, 2)) > 0).long()
    return x, y


def mse(out, y):
    return F.mse_loss(out.float(), y.float())


def ce_seq(out, y):
    return F.cross_entropy(out.float().reshape(-1, out.shape[-1]), y.reshape(-1))


def ce(out, y):
    return F.cross_entropy(out.float(), y)


# name -> (builder, batch, loss, ddp kwargs, extra)
CASES = {
    "lstm": (lambda: LMRnn("lstm"), lm_batch, ce_seq, {}, {"lr": 0.5}),
    "gru": (lambda: LMRnn("gru"), lm_batch, ce_seq, {}, {"lr": 0.5}),
    "pademb": (PadEmb, pad_batch, ce, {}, {"lr": 0.5}),
    "tied": (TiedTransformer, lm_batch, ce_seq, {}, {"lr": 0.1}),
    "frozen": (FrozenMid, reg_batch, mse, {}, {}),
    "skip": (SkipSome, reg_batch, mse, {"find_unused_parameters": True}, {"skip": True}),
    "sizes": (Sizes, lambda r, s: reg_batch(r, s, n=8, d=2000), mse, {}, {"lr": 0.02}),
    "bn": (BNNet, img_batch, ce, {}, {"lr": 0.1}),
    "syncbn": (BNNet, img_batch, ce, {}, {"lr": 0.1, "syncbn": True}),
    "bf16": (lambda: MLP().to(torch.bfloat16), lambda r, s: reg_batch(r, s, dtype=torch.bfloat16), mse, {}, {}),
    "fp16": (lambda: MLP().to(torch.float16), lambda r, s: reg_batch(r, s, dtype=torch.float16), mse, {}, {}),
    "mixed": (MixedMLP, reg_batch, mse, {}, {}),
    "complex": (ComplexNet, reg_batch, mse, {}, {}),
    "mlp": (MLP, reg_batch, mse, {}, {}),
    # DDP modes on the MLP
    "bucketview": (MLP, reg_batch, mse, {"gradient_as_bucket_view": True}, {}),
    "static": (MLP, reg_batch, mse, {"static_graph": True}, {}),
    "tinybucket": (MLP, reg_batch, mse, {"bucket_cap_mb": 0.01}, {}),
    "hugebucket": (MLP, reg_batch, mse, {"bucket_cap_mb": 500}, {}),
    "nosync": (MLP, reg_batch, mse, {}, {"accum": 3}),
    "clip": (MLP, reg_batch, mse, {}, {"clip": 0.5}),
    "adamw": (MLP, reg_batch, mse, {}, {"opt": "adamw", "lr": 3e-3}),
    "autocast": (MLP, reg_batch, mse, {}, {"autocast": True}),
    "autocast_tied": (TiedTransformer, lm_batch, ce_seq, {}, {"lr": 0.1, "autocast": True}),
    "static_skip": (SkipSome, reg_batch, mse, {"static_graph": True}, {"skip": True}),
    "skip_zeros": (SkipSome, reg_batch, mse, {"find_unused_parameters": True}, {"skip": True, "zeros": True}),
    "skip_zeros_bv": (SkipSome, reg_batch, mse, {"find_unused_parameters": True, "gradient_as_bucket_view": True}, {"skip": True, "zeros": True}),
    "skip_bv": (SkipSome, reg_batch, mse, {"find_unused_parameters": True, "gradient_as_bucket_view": True}, {"skip": True}),
    "tied_adamw": (TiedTransformer, lm_batch, ce_seq, {"bucket_cap_mb": 0.01}, {"opt": "adamw", "lr": 3e-3, "clip": 1.0}),
    "lstm_adamw": (lambda: LMRnn("lstm"), lm_batch, ce_seq, {"bucket_cap_mb": 0.01}, {"opt": "adamw", "lr": 3e-3, "clip": 1.0}),
    "mlp_sgd_clip": (MLP, reg_batch, mse, {"bucket_cap_mb": 0.01}, {"clip": 1.0}),
    "bucketview_bn": (BNNet, img_batch, ce, {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.01}, {"lr": 0.1}),
}

VARIANTS = {
    "plain": None,
    "d1": {"density": 1.0},
    "sparse": {"density": 0.01},
    "single": {"density": 0.01, "allow_dense": False, "strategy": "single"},
    "d1_tiny": {"density": 1.0},
}


def run_variant(rank, ws, case, vname, steps, extra_opts):
    build, batch, lossf, ddpkw, extra = CASES[case]
    torch.manual_seed(0)
    model = build()
    if extra.get("syncbn"):
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    ddpkw = dict(ddpkw)
    ddpkw.setdefault("bucket_cap_mb", 0.05)
    ddp = DDP(model, **ddpkw)
    opts = VARIANTS[vname]
    state = None
    if opts is not None:
        from omgs_hook import register
        o = dict(opts)
        o.update(extra_opts)
        o.setdefault("log_every", 0)
        state = register(ddp, **o)
    twin = copy.deepcopy(model)
    lr = float(os.environ.get("LR", extra.get("lr", 0.05)))
    params = [p for p in model.parameters() if p.requires_grad]
    if extra.get("opt") == "adamw":
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.05)
    else:
        opt = torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, 30, 0.5) if extra.get("opt") == "adamw" else None
    accum = extra.get("accum", 1)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    losses, cons = [], []
    ac = extra.get("autocast", False)
    for step in range(steps):
        use_b2 = (step % 2 == 0) if extra.get("skip") else True
        if hasattr(model, "use_b2"):
            model.use_b2 = use_b2
            twin.use_b2 = use_b2
        micro = [batch(rank, step * accum + m) for m in range(accum)]
        # local gradient from the twin
        twin.load_state_dict(model.state_dict())
        twin.train()
        for p in twin.parameters():
            p.grad = None
        for x, y in micro:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=ac):
                tl = lossf(twin(x), y)
            tl.backward()
        tg = {n: ((p.grad.detach().to(torch.cdouble) if p.grad.is_complex() else p.grad.detach().double()).clone() if p.grad is not None else torch.zeros(p.shape, dtype=torch.float64))
              for n, p in twin.named_parameters() if p.requires_grad}
        rb = {k: (v.to(torch.cdouble) if v.is_complex() else v.double()) for k, v in state.memory.state_dict().items()} if state else {}
        opt.zero_grad(set_to_none=not extra.get("zeros", False))
        tot = 0.0
        for m, (x, y) in enumerate(micro):
            if m < accum - 1:
                with ddp.no_sync():
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=ac):
                        loss = lossf(ddp(x), y)
                    loss.backward()
            else:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=ac):
                    loss = lossf(ddp(x), y)
                loss.backward()
            tot += loss.item()
        ra = {k: (v.to(torch.cdouble) if v.is_complex() else v.double()) for k, v in state.memory.state_dict().items()} if state else {}
        # conservation: all-reduce (g + rb - ra) and compare with W * G
        errs = []
        gnorm = 0.0
        for n, p in model.named_parameters():
            if not p.requires_grad:
                continue
            z = torch.zeros(p.shape, dtype=torch.float64)
            lhs = tg[n] + rb.get(n, z).reshape(p.shape) - ra.get(n, z).reshape(p.shape)
            if lhs.is_complex() or tg[n].is_complex():
                lhs = torch.view_as_real(lhs.to(torch.cdouble))
            dist.all_reduce(lhs)
            G = p.grad.detach() if p.grad is not None else torch.zeros_like(p)
            G = torch.view_as_real(G.to(torch.cdouble)) if G.is_complex() else G.double()
            d = (lhs - ws * G).abs().max().item() if lhs.numel() else 0.0
            errs.append(d)
            if os.environ.get("DEBUGCONS") and rank == 0 and d > 1e-4 * (1 + (ws * G).abs().max().item()):
                print(f"CONS step {step} {n}: err {d:.4g} |WG| {(ws*G).abs().max().item():.4g} |g+rb-ra| {lhs.abs().max().item():.4g} rb {rb.get(n, z).abs().max().item():.4g} ra {ra.get(n, z).abs().max().item():.4g} grad_is_none {p.grad is None}", flush=True)
            gnorm = max(gnorm, (ws * G).abs().max().item() if G.numel() else 0.0)
        cons.append(max(errs) / (gnorm + 1e-12))
        if extra.get("clip"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), extra["clip"])
        opt.step()
        if sched is not None:
            sched.step()
        t = torch.tensor([tot / accum], dtype=torch.float64)
        dist.all_reduce(t)
        losses.append(t.item() / ws)
    # rank agreement
    flat = torch.cat([p.detach().double().reshape(-1) if not p.is_complex() else torch.view_as_real(p.detach()).double().reshape(-1)
                      for p in model.parameters()])
    other = flat.clone()
    dist.broadcast(other, 0)
    agree = (flat - other).abs().max().item()
    agree_t = torch.tensor([agree], dtype=torch.float64)
    dist.all_reduce(agree_t, op=dist.ReduceOp.MAX)
    res = {"losses": losses, "cons_max": max(cons), "cons_warm": max(cons[:5]),
           "cons_after": max(cons[5:]) if len(cons) > 5 else None,
           "rank_param_diff": agree_t.item(), "final_params": flat}
    if state is not None:
        st = state.stats()
        res["plan"] = str(st.get("plan"))[:300]
        tot = st.get("total", {})
        res["total"] = {k: tot.get(k) for k in ("steps", "nonfinite_steps", "replans", "trials", "rewound_steps", "achieved_density") if k in tot}
        if rank == 0 and extra.get("pademb_check", True) and case == "pademb":
            res["pad_row_absmax"] = model.emb.weight[0].abs().max().item()
        state.close()
    elif case == "pademb":
        res["pad_row_absmax"] = model.emb.weight[0].abs().max().item()
    return res


def worker(rank, ws, port, case, variants, steps, extra_opts, out):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=ws)
    results = {}
    for v in variants:
        t0 = time.time()
        try:
            r = run_variant(rank, ws, case, v, steps, extra_opts)
            r["wall_s"] = round(time.time() - t0, 1)
            if rank == 0 and os.environ.get("VERBOSE"):
                print(v, [round(x, 4) for x in r["losses"]], r.get("total"), r.get("plan"), flush=True)
            results[v] = r
        except Exception as exc:
            results[v] = {"error": "".join(traceback.format_exception(exc))[-3000:],
                          "wall_s": round(time.time() - t0, 1)}
            print(f"[rank {rank}] {case}/{v} ERROR\n{results[v]['error']}", flush=True)
            break  # collectives may be out of step
        dist.barrier()
    if rank == 0:
        summary = {}
        ref = results.get("plain")
        for v, r in results.items():
            if "error" in r:
                summary[v] = {"error": r["error"].strip().splitlines()[-1], "wall_s": r["wall_s"]}
                continue
            L = r["losses"]
            s = {"loss0": round(L[0], 4), "loss_last": round(sum(L[-5:]) / 5, 5),
                 "finite": all(math.isfinite(x) for x in L),
                 "cons_max_rel": float(f"{r['cons_max']:.3g}"),
                 "rank_param_diff": r["rank_param_diff"], "wall_s": r["wall_s"]}
            if ref is not None and v != "plain" and "error" not in ref:
                s["max_param_diff_vs_plain"] = float(f"{(r['final_params'] - ref['final_params']).abs().max().item():.3g}")
                s["max_loss_diff_vs_plain"] = float(f"{max(abs(a - b) for a, b in zip(L, ref['losses'])):.3g}")
            for k in ("plan", "total", "pad_row_absmax"):
                if k in r:
                    s[k] = r[k]
            summary[v] = s
        line = json.dumps({"case": case, "steps": steps, "opts": extra_opts, "results": summary}, default=str)
        print(line, flush=True)
        with open(out, "a") as f:
            f.write(line + "\n")
    dist.destroy_process_group()


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


if __name__ == "__main__":
    case = sys.argv[1]
    variants = sys.argv[2].split(",") if len(sys.argv) > 2 else ["plain", "d1", "sparse", "single"]
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 40
    extra_opts = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    out = os.environ.get("RESULTS", "results.jsonl")
    t0 = time.time()
    mp.spawn(worker, args=(2, free_port(), case, variants, steps, extra_opts, out), nprocs=2, join=True)
    print(f"wall {time.time() - t0:.1f}s")
