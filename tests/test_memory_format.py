"""Parameters not laid out contiguously (``channels_last`` convolutions).

DDP puts such a parameter's gradient into its bucket in the parameter's memory order,
while ``GradBucket.gradients()`` shows the slice with contiguous strides. The hook works
in that memory order; ``state_dict()`` must still give residuals in the parameter's
logical order, and a checkpoint must mean the same in a model of either memory format.
"""

import copy
import gc

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import omgs_hook
from ddp_harness import run_ranks
from omgs_hook.residual_memory import ResidualMemory, bucket_view_strides

# ----------------------------------------------------------------------------- pure


def test_bucket_view_strides_follow_ddps_reducer():
    assert bucket_view_strides(torch.empty(4, 3, 2, 2)) is None  # contiguous
    cl = torch.empty(4, 3, 2, 2).contiguous(memory_format=torch.channels_last)
    assert bucket_view_strides(cl) == (12, 1, 6, 3)
    assert bucket_view_strides(torch.empty(3, 5).t()) == (1, 5)  # dense, transposed
    # overlapping (expanded) or with gaps: DDP falls back to a contiguous view
    assert bucket_view_strides(torch.empty(3, 1).expand(3, 4)) is None
    assert bucket_view_strides(torch.empty(4, 6)[:, ::2]) is None
    # size-1 dimensions have arbitrary strides and do not count
    one = torch.empty(1, 3, 2, 2).contiguous(memory_format=torch.channels_last)
    assert bucket_view_strides(one) in (None, tuple(one.stride()))


def _memory_order(tensor):
    """``tensor``'s elements in channels_last memory order, flat."""
    cl = tensor.contiguous(memory_format=torch.channels_last)
    return cl.as_strided((cl.numel(),), (1,))


@pytest.mark.parametrize("layout_first", [True, False])
def test_residuals_are_saved_and_loaded_in_logical_order(layout_first):
    param = torch.empty(4, 3, 2, 2).contiguous(memory_format=torch.channels_last)
    saved = torch.randn(4, 3, 2, 2)
    memory = ResidualMemory()
    if layout_first:
        memory.note_layout("w", param)
    memory.load_state_dict({"w": saved})
    if not layout_first:  # loaded before the layout was known: kept as it came ...
        assert torch.equal(memory.get("w"), saved.reshape(-1))
        assert torch.equal(memory.state_dict()["w"], saved)
        memory.note_layout("w", param)  # ... and put into memory order when it is
    # inside, memory order (what the bucket holds); outside, the logical tensor
    assert torch.equal(memory.get("w"), _memory_order(saved))
    out = memory.state_dict()["w"]
    assert torch.equal(out, saved) and out.is_contiguous()
    # a later load (the rewind of a resumed run) converts at once
    again = torch.randn(4, 3, 2, 2)
    memory.load_state_dict({"w": again})
    assert torch.equal(memory.get("w"), _memory_order(again))
    assert torch.equal(memory.state_dict()["w"], again)


def test_contiguous_parameters_are_untouched_and_a_wrong_size_is_named():
    memory = ResidualMemory()
    memory.note_layout("w", torch.empty(2, 3))
    saved = torch.randn(2, 3)
    memory.load_state_dict({"w": saved})
    assert torch.equal(memory.get("w"), saved.reshape(-1))
    with pytest.raises(ValueError, match=r"'w' has shape \(7,\), the parameter has \(2, 3\)"):
        memory.load_state_dict({"w": torch.zeros(7)})
    assert torch.equal(memory.state_dict()["w"], saved)  # nothing was replaced


# ----------------------------------------------------------------------------- DDP


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16, 5)

    def forward(self, x):
        x = torch.relu(self.c1(x))
        x = torch.relu(self.c2(x))
        return self.fc(x.mean((2, 3)))


def _batch(step, rank, channels_last):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(4, 3, 8, 8, generator=gen)
    y = torch.randint(0, 5, (4,), generator=gen)
    return (x.contiguous(memory_format=torch.channels_last) if channels_last else x), y


def _gather(obj, world_size):
    out = [None] * world_size
    dist.all_gather_object(out, obj)
    return out


def _build(channels_last, strategy):
    torch.manual_seed(0)
    model = ConvNet()
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    ddp = DDP(model, bucket_cap_mb=0)
    state = omgs_hook.register(ddp, density=0.05, warmup_steps=1, allow_dense=False,
                               strategy=strategy, select="model")
    return model, ddp, state, torch.optim.SGD(model.parameters(), lr=0.05)


def _steps_conserve(rank, world_size, model, ddp, state, opt, steps, channels_last, first=0):
    """Run ``steps`` steps; per step the largest violation of
    sum_r(local_r + old_r) == W * averaged + sum_r(new_r), all in logical order, and of
    the ranks' agreement on the averaged gradient."""
    reference = ConvNet()
    if channels_last:
        reference = reference.to(memory_format=torch.channels_last)
    worst = {"conservation": 0.0, "agreement": 0.0}
    for step in range(first, first + steps):
        x, y = _batch(step, rank, channels_last)
        reference.load_state_dict(model.state_dict())
        reference.zero_grad()
        nn.functional.cross_entropy(reference(x), y).backward()
        local = {n: p.grad.reshape(-1).clone() for n, p in reference.named_parameters()}
        old = {k: v.reshape(-1).clone() for k, v in state.state_dict()["residuals"].items()}
        all_local, all_old = _gather(local, world_size), _gather(old, world_size)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        new = {k: v.reshape(-1).clone() for k, v in state.state_dict()["residuals"].items()}
        grads = {n: p.grad.reshape(-1).clone() for n, p in model.named_parameters()}
        all_new, all_grads = _gather(new, world_size), _gather(grads, world_size)
        for name, grad in grads.items():
            zero = torch.zeros_like(grad)
            lhs = sum(all_local[r][name] + all_old[r].get(name, zero) for r in range(world_size))
            rhs = world_size * grad + sum(all_new[r].get(name, zero) for r in range(world_size))
            worst["conservation"] = max(worst["conservation"], float((lhs - rhs).abs().max()))
            worst["agreement"] = max(worst["agreement"],
                                     float((all_grads[0][name] - grad).abs().max()))
        opt.step()
    return worst


def conserve_worker(rank, world_size, strategy):
    model, ddp, state, opt = _build(True, strategy)
    strides = model.c2.weight.stride()
    worst = _steps_conserve(rank, world_size, model, ddp, state, opt, 5, True)
    residual_norm = state.memory.total_norm()
    del ddp, state
    gc.collect()
    return {"worst": worst, "strides": strides, "residual_norm": residual_norm}


def cross_format_worker(rank, world_size, saved_as_channels_last):
    model, ddp, state, opt = _build(saved_as_channels_last, "single")
    before = _steps_conserve(rank, world_size, model, ddp, state, opt, 3, saved_as_channels_last)
    checkpoint = copy.deepcopy({"model": model.state_dict(), "hook": state.state_dict()})
    del ddp, state
    gc.collect()
    # resumed in the other memory format
    model, ddp, state, opt = _build(not saved_as_channels_last, "single")
    model.load_state_dict(checkpoint["model"])
    state.load_state_dict(checkpoint["hook"])
    loaded = state.state_dict()["residuals"]
    same = all(torch.equal(loaded[k], v) for k, v in checkpoint["hook"]["residuals"].items())
    # the first step after the resume runs with the checkpoint's residuals: conservation
    # holds only if they sit where the parameter's elements are in this model's buckets
    worst = _steps_conserve(rank, world_size, model, ddp, state, opt, 2,
                            not saved_as_channels_last, first=3)
    nonzero = sum(int(v.count_nonzero()) for v in checkpoint["hook"]["residuals"].values())
    del ddp, state
    gc.collect()
    return {"same": same, "before": before, "worst": worst, "nonzero": nonzero}


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
@pytest.mark.parametrize("strategy", ["single", "layerwise"])
def test_channels_last_model_conserves_error_feedback_in_logical_order(strategy):
    results = run_ranks("test_memory_format", "conserve_worker", world_size=2,
                        strategy=strategy)
    for r in results:
        assert r["strides"] == (72, 1, 24, 8)  # the test really ran channels_last
        assert r["residual_norm"] > 0
        assert r["worst"]["conservation"] < 1e-5, r["worst"]
        assert r["worst"]["agreement"] == 0.0, r["worst"]


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
@pytest.mark.parametrize("saved_as_channels_last", [True, False])
def test_a_checkpoint_resumes_in_the_other_memory_format(saved_as_channels_last):
    results = run_ranks("test_memory_format", "cross_format_worker", world_size=2,
                        saved_as_channels_last=saved_as_channels_last)
    for r in results:
        assert r["nonzero"] > 0 and r["same"]
        # (the saved residuals are in logical order only if the run before conserved)
        assert r["before"]["conservation"] < 1e-5, r["before"]
        assert r["worst"]["conservation"] < 1e-5, r["worst"]
        assert r["worst"]["agreement"] == 0.0, r["worst"]
