"""float64 gradients outside float32's range: the hook keeps its residuals and selects
in float32 (docs/reliability.md), so such a gradient cannot go through it as plain
DDP's fp64 all-reduce would. The user must at least be told, not get a silently lost
gradient (below ~1e-45) or a "NaN/Inf" step for a finite gradient (above ~3.4e38)."""

import warnings

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import omgs_hook
from ddp_harness import run_ranks

pytestmark = pytest.mark.multiprocess


def train_scaled(rank, world_size, scale):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)).double()
    ddp = DDP(model, bucket_cap_mb=0)
    state = omgs_hook.register(ddp, density=0.25, warmup_steps=0, select="model",
                                 allow_dense=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    lost = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(12):  # the health check runs every 10th step
            gen = torch.Generator().manual_seed(step * 10 + rank)
            x = torch.randn(4, 8, generator=gen, dtype=torch.float64)
            opt.zero_grad()
            (ddp(x).square().mean() * scale).backward()
            lost += all(float(p.grad.abs().sum()) == 0.0 for p in model.parameters())
            opt.step()
    state.close()
    messages = [str(w.message) for w in caught]
    return {"messages": [m for m in messages if "float32's normal range" in m],
            "all_zero_grads": lost, "nonfinite": state.stats()["total"]["nonfinite_steps"]}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("scale", [1e-60, 1e40])
def test_float64_gradient_outside_float32_range_warns(scale):
    results = run_ranks("test_float64_range", "train_scaled", world_size=2, timeout=100,
                        scale=scale)
    for r in results:
        # (what happens without the warning: 1e-60 - every gradient written back is 0;
        # 1e40 - every step is non-finite)
        assert len(r["messages"]) == 1, r
        assert ("flushed to zero" in r["messages"][0]) == (scale < 1)


@pytest.mark.timeout(120)
def test_float64_gradient_in_range_does_not_warn():
    for r in run_ranks("test_float64_range", "train_scaled", world_size=2, timeout=100,
                       scale=1.0):
        assert r["messages"] == [] and r["all_zero_grads"] == 0 and r["nonfinite"] == 0, r
