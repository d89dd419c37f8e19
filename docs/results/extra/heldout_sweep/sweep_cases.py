"""Cases of run_sweep.py: held-out models and DDP modes (see its docstring)."""
import math
import torch, torch.nn as nn, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import omgs_hook


class TiedLM(nn.Module):
    def __init__(s, V=50, d=32):
        super().__init__()
        s.emb = nn.Embedding(V, d)
        layer = nn.TransformerEncoderLayer(d, 4, 64, dropout=0.0, batch_first=True)
        s.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        s.out = nn.Linear(d, V)
        s.out.weight = s.emb.weight  # tied
    def forward(s, x):
        return s.out(s.enc(s.emb(x)))


class Branchy(nn.Module):
    def __init__(s, empty=True, frozen=True, every=3):
        super().__init__()
        s.a = nn.Linear(16, 16); s.b = nn.Linear(16, 16); s.frozen = nn.Linear(16, 16)
        s.every = every
        if frozen: s.frozen.requires_grad_(False)
        if empty: s.empty = nn.Parameter(torch.empty(0))
        s.empty_used = empty and every == 1
        s.rankdep = False
        s.head = nn.Linear(16, 4)
        s.t = 0
    def forward(s, x):
        s.t += 1
        if s.empty_used: x = x + s.empty.sum()
        h = s.frozen(torch.relu(s.a(x)))
        if s.t % s.every == 0 and not (s.rankdep and dist.get_rank() == 1):
            h = s.b(h)
        return s.head(h)


class Many(nn.Module):
    def __init__(s, n=120):
        super().__init__()
        s.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(n))
    def forward(s, x):
        for l in s.layers:
            x = torch.tanh(l(x))
        return x


class SparseEmb(nn.Module):
    def __init__(s):
        super().__init__()
        s.e = nn.Embedding(100, 8, sparse=True); s.l = nn.Linear(8, 2)
    def forward(s, x):
        return s.l(s.e(x).mean(1))


class Conv(nn.Module):
    def __init__(s):
        super().__init__()
        s.c1 = nn.Conv2d(3, 16, 3, padding=1); s.c2 = nn.Conv2d(16, 16, 3, padding=1); s.f = nn.Linear(16, 10)
    def forward(s, x):
        x = torch.relu(s.c2(torch.relu(s.c1(x))))
        return s.f(x.mean((2, 3)))


class Ckpt(nn.Module):
    def __init__(s):
        super().__init__()
        s.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4))
        s.head = nn.Linear(16, 2)
    def forward(s, x):
        from torch.utils.checkpoint import checkpoint
        for b in s.blocks:
            x = checkpoint(b, x, use_reentrant=False)
        return s.head(x)


def make(case):
    ddp_kw = {}
    if case == "tied_transformer":
        m = TiedLM(); data = lambda g: (torch.randint(0, 50, (8, 12), generator=g),)
        loss = lambda out, g: out.float().pow(2).mean()
    elif case.startswith("branchy"):
        m = Branchy(empty="noempty" not in case, frozen="nofrozen" not in case, every=1 if "always" in case else 3); data = lambda g: (torch.randn(8, 16, generator=g),)
        loss = lambda out, g: out.pow(2).mean()
        ddp_kw = {"find_unused_parameters": True} if "unused" in case else {}
        if "cap0" in case: ddp_kw["bucket_cap_mb"] = 0
    elif case == "branchy_rankdep":  # (plain DDP refuses it as well: not in results.txt)
        m = Branchy(empty=False, frozen=False, every=1); m.rankdep = True
        data = lambda g: (torch.randn(8, 16, generator=g),)
        loss = lambda out, g: out.pow(2).mean()
        ddp_kw = {"find_unused_parameters": True, "bucket_cap_mb": 0}
    elif case == "checkpointed":
        m = Ckpt(); data = lambda g: (torch.randn(8, 16, generator=g),)
        loss = lambda out, g: out.pow(2).mean(); ddp_kw = {"bucket_cap_mb": 0}
    elif case in ("fp64_all", "fp16_all"):
        dt = torch.float64 if case == "fp64_all" else torch.float16
        m = Conv().to(dt); data = lambda g: (torch.randn(4, 3, 8, 8, generator=g).to(dt),)
        loss = lambda out, g: out.float().pow(2).mean(); ddp_kw = {"bucket_cap_mb": 0}
    elif case == "many1000":
        m = Many(500); data = lambda g: (torch.randn(8, 8, generator=g),)
        loss = lambda out, g: out.pow(2).mean()
        ddp_kw = {"bucket_cap_mb": 0}
    elif case.startswith("many"):
        m = Many(); data = lambda g: (torch.randn(8, 8, generator=g),)
        loss = lambda out, g: out.pow(2).mean()
        ddp_kw = {"bucket_cap_mb": 0}
    elif case == "static_graph":
        m = Conv(); data = lambda g: (torch.randn(4, 3, 8, 8, generator=g),)
        loss = lambda out, g: out.pow(2).mean(); ddp_kw = {"static_graph": True}
    elif case == "channels_last":
        m = Conv().to(memory_format=torch.channels_last)
        data = lambda g: (torch.randn(4, 3, 8, 8, generator=g).to(memory_format=torch.channels_last),)
        loss = lambda out, g: out.pow(2).mean()
    elif case == "bucket_view":
        m = Conv(); data = lambda g: (torch.randn(4, 3, 8, 8, generator=g),)
        loss = lambda out, g: out.pow(2).mean(); ddp_kw = {"gradient_as_bucket_view": True}
    elif case == "bf16":
        m = Conv().to(torch.bfloat16); data = lambda g: (torch.randn(4, 3, 8, 8, generator=g).bfloat16(),)
        loss = lambda out, g: out.float().pow(2).mean()
    elif case == "fp64_mixed":
        m = Conv(); m.f = m.f.double()
        class W(nn.Module):
            def __init__(s, m): super().__init__(); s.m = m
            def forward(s, x):
                x = torch.relu(s.m.c2(torch.relu(s.m.c1(x))))
                return s.m.f(x.mean((2, 3)).double())
        m = W(m); data = lambda g: (torch.randn(4, 3, 8, 8, generator=g),)
        loss = lambda out, g: out.pow(2).mean()
    elif case == "sparse_embedding":
        m = SparseEmb(); data = lambda g: (torch.randint(0, 100, (8, 5), generator=g),)
        loss = lambda out, g: out.pow(2).mean()
    elif case == "no_sync_accum":
        m = Conv(); data = lambda g: (torch.randn(4, 3, 8, 8, generator=g),)
        loss = lambda out, g: out.pow(2).mean()
    else:
        raise ValueError(case)
    return m, data, loss, ddp_kw


def run_case(rank, world_size, case, steps=60, density=0.01, mode='default'):
    torch.manual_seed(0)
    m, data, lossf, ddp_kw = make(case)
    ddp = DDP(m, **ddp_kw)
    if mode == "nohook":
        class _S:
            def stats(self): return {"total": {}}
            def state_dict(self): return {}
            def close(self): pass
        state = _S()
    else:
      try:
        opts = {"default": {}, "layerwise": dict(allow_dense=False, strategy="layerwise", select="model"),
                "single": dict(allow_dense=False, strategy="single", select="model"),
                "sparse": dict(allow_dense=False),
                "twolevel": dict(topology="hierarchical", ranks_per_node=2),
                "twolevel_sparse": dict(topology="hierarchical", ranks_per_node=2, allow_dense=False),
                "resume": {}}[mode]
        state = omgs_hook.register(ddp, density=density, **opts)
      except Exception as exc:
        return {"case": case, "register_error": f"{type(exc).__name__}: {exc}"}
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(rank + 1)
    losses = []
    import time as _t
    t0 = _t.perf_counter()
    try:
        for step in range(steps):
            if mode == "resume" and step == 25:
                sd = state.state_dict()
                buf = __import__("io").BytesIO(); torch.save(sd, buf); buf.seek(0)
                sd = torch.load(buf, weights_only=True)
                state.close()
                ddp = DDP(m, **ddp_kw)
                state = omgs_hook.register(ddp, density=density)
                state.load_state_dict(sd)
            opt.zero_grad()
            if case == "no_sync_accum":
                with ddp.no_sync():
                    lossf(ddp(*data(g)), g).backward()
            out = ddp(*data(g))
            l = lossf(out, g); l.backward(); opt.step(); losses.append(float(l))
    except Exception as exc:
        import traceback
        inner = getattr(getattr(state, "_exchange", None), "error", None)
        itb = "".join(traceback.format_exception(inner))[-3000:] if inner is not None else ""
        return {"case": case, "train_error": f"step {step}: {type(exc).__name__}: {exc}", "tb": traceback.format_exc()[-1500:] + "\nINNER:\n" + itb}
    # ranks agree on parameters
    flat = torch.cat([p.detach().double().reshape(-1) for p in m.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    agree = all(torch.equal(gathered[0], x) for x in gathered)
    s = state.stats()
    sd = state.state_dict()
    state.close()
    return {"wall_s": round(_t.perf_counter() - t0, 1), "case": case + ":" + mode, "agree": agree, "finite": all(math.isfinite(x) for x in losses),
            "loss": (losses[0], losses[-1]), "plan": s["plan_history"][-1]["strategy"] if s.get("plan_history") else None,
            "groups": len(s["plan_history"][-1]["groups"]) if s.get("plan_history") else None,
            "nonfinite": s["total"].get("nonfinite_steps"), "residual_keys": len(sd.get("residuals", {}))}
