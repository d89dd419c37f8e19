"""Cases of run_sweep2.py: held-out usage patterns (see its docstring)."""
import math
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import omgs_hook


class Conv(nn.Module):
    def __init__(s):
        super().__init__()
        s.c1 = nn.Conv2d(3, 16, 3, padding=1); s.c2 = nn.Conv2d(16, 16, 3, padding=1)
        s.f = nn.Linear(16, 10)

    def forward(s, x):
        x = torch.relu(s.c2(torch.relu(s.c1(x))))
        return s.f(x.mean((2, 3)))


class _NoHook:
    def stats(self): return {"total": {}}
    def state_dict(self): return {}
    def close(self): pass


def _register(ddp, density, mode, opts):
    return _NoHook() if mode == "nohook" else omgs_hook.register(ddp, density=density, **opts)


OPTS = {"nohook": {}, "default": {}, "keep": dict(on_unapplied="keep"),
        "twolevel": dict(topology="hierarchical", ranks_per_node=2, allow_dense=False), "sparse": dict(allow_dense=False),
        "layerwise": dict(allow_dense=False, strategy="layerwise", select="model")}


def _agree(modules, world_size):
    flat = torch.cat([p.detach().double().reshape(-1) for m in modules for p in m.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    # bit patterns, so that NaN parameters identical on every rank count as agreeing
    return all(torch.equal(gathered[0].view(torch.int64), x.view(torch.int64)) for x in gathered)


def run_case(rank, world_size, case, steps=60, density=0.01, mode="default"):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(rank + 1)
    data = lambda: torch.randn(4, 3, 8, 8, generator=g)
    opts = OPTS[mode]
    t0 = time.perf_counter()
    losses, states, modules = [], [], []
    step = -1
    cap, name = {}, f"{case}:{mode}@{world_size}"
    nosync = case.endswith("_nosync")
    if nosync:
        case = case[:-len("_nosync")]
    if case.endswith("_cap0"):  # one parameter per bucket: the planner has choices
        case, cap = case[:-len("_cap0")], {"bucket_cap_mb": 0}
    try:
        if case == "two_models":  # a GAN-like pair: two DDP models, two states, one process
            gen, disc = Conv(), nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))
            dg, dd = DDP(gen, **cap), DDP(disc, **cap)
            states = [_register(dg, density, mode, opts), _register(dd, density, mode, opts)]
            modules = [gen, disc]
            og = torch.optim.SGD(gen.parameters(), lr=0.01, momentum=0.9)
            od = torch.optim.SGD(disc.parameters(), lr=0.01, momentum=0.9)
            for step in range(steps):
                od.zero_grad()
                ld = dd(dg(data()).detach()).pow(2).mean(); ld.backward(); od.step()
                og.zero_grad()
                import contextlib
                # "_nosync": the G step's discriminator gradients (discarded by the next
                # od.zero_grad()) are never reduced, so never reach D's hook
                quiet = dd.no_sync() if nosync else contextlib.nullcontext()
                with quiet:
                    lg = (dd(dg(data())) - 1).pow(2).mean(); lg.backward()
                og.step()
                losses.append(float(lg))
        else:
            m = Conv()
            kw = dict(cap)
            if case == "frozen_midway":
                kw["find_unused_parameters"] = True
            if case == "siamese":
                kw["static_graph"] = True
            ddp = DDP(m, **kw)
            states = [_register(ddp, density, mode, opts)]
            modules = [m]
            if case == "zero_opt":
                from torch.distributed.optim import ZeroRedundancyOptimizer
                opt = ZeroRedundancyOptimizer(m.parameters(), optimizer_class=torch.optim.SGD,
                                              lr=0.01, momentum=0.9)
            else:
                opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
            n_steps = steps - 37 * rank // max(1, world_size - 1) if case == "join_uneven" else steps
            if case == "join_uneven":
                from torch.distributed.algorithms.join import Join
                ctx = Join([ddp])
            else:
                import contextlib
                ctx = contextlib.nullcontext()
            with ctx:
                for step in range(n_steps):
                    if case == "frozen_midway" and step == 20:
                        m.c1.requires_grad_(False)  # fine-tuning: freeze the first layer
                    opt.zero_grad()
                    if case == "siamese":
                        out = ddp(data()) - ddp(data())
                    else:
                        out = ddp(data())
                    loss = out.pow(2).mean()
                    loss.backward()
                    opt.step()
                    losses.append(float(loss))
                    if case.startswith("eval_rank0") and step % 10 == 9 and rank == 0:
                        ddp.eval()
                        if case == "eval_rank0":
                            with torch.no_grad():
                                ddp(data())
                        else:  # forgot no_grad: a forward with autograd, never backward
                            ddp(data())
                        ddp.train()
    except Exception as exc:  # noqa: BLE001
        import traceback
        return {"case": name, "train_error": f"step {step}: {type(exc).__name__}: {exc}"[:600],
                "tb": traceback.format_exc()[-1500:]}
    agree = _agree(modules, world_size)
    s = states[0].stats()
    out = {"wall_s": round(time.perf_counter() - t0, 1), "case": name, "agree": agree,
           "finite": all(math.isfinite(x) for x in losses), "loss": (losses[0], losses[-1]),
           "plan": s["plan_history"][-1]["strategy"] if s.get("plan_history") else None,
           "steps": s["total"].get("steps"), "nonfinite": s["total"].get("nonfinite_steps"),
           "residual_keys": len(states[0].state_dict().get("residuals", {})),
           "rewound": [st.stats()["total"].get("rewound_steps") for st in states]}
    for st in states:
        st.close()
    return out
