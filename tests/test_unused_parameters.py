"""Parameters a rank leaves unused (DDP's ``find_unused_parameters=True``), under real DDP
with 2 gloo ranks: error feedback is conserved however ``zero_grad`` left the unused
gradient, and a one-bucket dense group whose ranks hold different residuals is one
collective of one size whatever the model's dtype."""

import gc

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import omgs_hook
from ddp_harness import run_ranks
from test_hook_ddp import flat_residuals, gather, max_abs

pytestmark = pytest.mark.multiprocess


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 32)
        self.b = nn.Linear(32, 32)
        self.d = nn.Linear(32, 1)

    def forward(self, x, use_b=True):
        h = torch.tanh(self.a(x))
        if use_b:
            h = h + 5 * torch.tanh(self.b(h))
        return self.d(h)


def _batch(step, rank, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 8, generator=g).to(dtype)


def _uses_b(step, rank):
    """Both ranks use ``b``; rank 0 alone leaves it unused; no rank uses it."""
    return {0: True, 1: rank != 0, 2: False}[step % 3]


def conservation_worker(rank, world_size, set_to_none, bucket_view):
    torch.manual_seed(0)
    model, reference = Branchy(), Branchy()
    ddp = DDP(model, bucket_cap_mb=0, find_unused_parameters=True,
              gradient_as_bucket_view=bucket_view)
    state = omgs_hook.register(ddp, density=0.05, strategy="single", allow_dense=False,
                               select="model", warmup_steps=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    worst, parked_steps = 0.0, 0
    for step in range(10):
        use_b = _uses_b(step, rank)
        x = _batch(step, rank)
        reference.load_state_dict(model.state_dict())
        reference.zero_grad()
        reference(x, use_b).pow(2).mean().backward()
        local = {n: (p.grad.reshape(-1).clone() if p.grad is not None
                     else torch.zeros(p.numel())) for n, p in reference.named_parameters()}
        old = flat_residuals(state)
        all_local, all_old = gather(local, world_size), gather(old, world_size)
        opt.zero_grad(set_to_none=set_to_none)
        ddp(x, use_b).pow(2).mean().backward()
        all_new = gather(flat_residuals(state), world_size)
        used_anywhere = any(gather(use_b, world_size))
        for name, p in model.named_parameters():
            zeros = torch.zeros(p.numel())
            if name.startswith("b.") and not used_anywhere:
                # no rank used it: DDP leaves the gradient as it was, so every rank's
                # residual must be exactly what it was
                for r in range(world_size):
                    assert torch.equal(all_new[r].get(name, zeros), all_old[r].get(name, zeros)), \
                        (step, name, r)
                parked_steps += 1
                continue
            # sum over ranks of (gradient + old residual) = W x average + new residuals
            lhs = sum(all_local[r][name] + all_old[r].get(name, zeros)
                      for r in range(world_size))
            rhs = world_size * p.grad.reshape(-1) + sum(all_new[r].get(name, zeros)
                                                        for r in range(world_size))
            worst = max(worst, max_abs(lhs - rhs) / max(max_abs(lhs), 1e-12))
        opt.step()
    del ddp, state
    gc.collect()
    return worst, parked_steps


@pytest.mark.timeout(150)
@pytest.mark.parametrize("set_to_none, bucket_view", [(True, False), (False, False),
                                                       (False, True)],
                         ids=["set_to_none", "zeroed", "zeroed-bucket-view"])
def test_error_feedback_is_conserved_for_parameters_a_rank_left_unused(set_to_none,
                                                                        bucket_view):
    # zero_grad(set_to_none=False) leaves an unused parameter a zero .grad, not None:
    # its residual was sent, DDP discarded the result, and that part of it was lost
    for worst, parked_steps in run_ranks("test_unused_parameters", "conservation_worker",
                                         world_size=2, timeout=120, set_to_none=set_to_none,
                                         bucket_view=bucket_view):
        assert parked_steps == 2 * 3  # b's two parameters at steps 2, 5 and 8
        assert worst < 1e-5, worst


def frozen_stale_grad_worker(rank, world_size):
    """``b`` frozen mid-run (requires_grad_(False), DDP not rebuilt) with a new optimizer
    without it, whose zero_grad() leaves b's last .grad in place."""
    torch.manual_seed(0)
    model = Branchy()
    ddp = DDP(model, bucket_cap_mb=0, find_unused_parameters=True)
    state = omgs_hook.register(ddp, density=0.05, strategy="single", allow_dense=False,
                               select="model", warmup_steps=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    frozen_at = None
    for step in range(9):
        if step == 4:
            model.b.requires_grad_(False)
            opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.02)
            frozen_at = {k: v.clone() for k, v in flat_residuals(state).items()
                         if k.startswith("b.")}
            stale = model.b.weight.grad.clone()
        opt.zero_grad()
        ddp(_batch(step, rank)).pow(2).mean().backward()
        opt.step()
    after = flat_residuals(state)
    kept = all(torch.equal(after[k], v) for k, v in frozen_at.items())
    grad_kept = torch.equal(model.b.weight.grad, stale)
    del ddp, state
    gc.collect()
    return kept, grad_kept, bool(frozen_at) and all(bool(v.any()) for v in frozen_at.values())


@pytest.mark.timeout(120)
def test_a_parameter_frozen_mid_run_keeps_its_residual():
    # its stale .grad was added to the residual and its top-k sent (and dropped by DDP:
    # no rank used it) every step: the residual moved by 0.14 (norm 0.62) in 20 steps
    for kept, grad_kept, had_residual in run_ranks(
            "test_unused_parameters", "frozen_stale_grad_worker", world_size=2, timeout=100):
        assert had_residual  # there was error feedback to keep
        assert kept and grad_kept


def mixed_residuals_worker(rank, world_size, dtype_name):
    """Sparse steps leave residuals on both ranks; then, at density 1, rank 0 leaves
    ``b`` unused (parked: its residual stays) while rank 1 sends its own with the dense
    sum, so at the next step ``b``'s one-bucket dense group has a residual on rank 0
    only."""
    dtype = getattr(torch, dtype_name)

    def build(options):
        torch.manual_seed(0)
        model = Branchy().to(dtype)
        ddp = DDP(model, bucket_cap_mb=0, find_unused_parameters=True)
        return model, ddp, omgs_hook.register(ddp, **options)

    model, ddp, state = build(dict(density=0.05, strategy="single", allow_dense=False,
                                   select="model", warmup_steps=1))
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    for step in range(3):
        opt.zero_grad()
        ddp(_batch(step, rank, dtype)).float().pow(2).mean().backward()
        opt.step()
    saved_state, saved_model = state.state_dict(), model.state_dict()
    state.close()
    model, ddp, state = build(dict(density=1.0))
    model.load_state_dict(saved_model)
    state.load_state_dict(saved_state)
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    opt.zero_grad()
    ddp(_batch(3, rank, dtype), use_b=rank != 0).float().pow(2).mean().backward()
    opt.step()
    held = {k for k, v in flat_residuals(state).items() if k.startswith("b.") and v.any()}
    # the step with b's residual on one rank only
    reference = Branchy().to(dtype)
    reference.load_state_dict(model.state_dict())
    x = _batch(4, rank, dtype)
    reference(x).float().pow(2).mean().backward()
    mine = {n: p.grad.float().reshape(-1) + flat_residuals(state).get(n, 0.0)
            for n, p in reference.named_parameters() if n.startswith("b.")}
    expected = gather(mine, world_size)
    opt.zero_grad()
    ddp(x).float().pow(2).mean().backward()
    errors = {}
    for name, p in model.named_parameters():
        if name.startswith("b."):
            average = sum(e[name] for e in expected) / world_size
            errors[name] = max_abs(p.grad.float().reshape(-1) - average) / max_abs(average)
    left = {k for k, v in flat_residuals(state).items() if v.any()}
    grads = gather({n: p.grad.float() for n, p in model.named_parameters()}, world_size)
    same = all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
    del ddp, state
    gc.collect()
    return sorted(held), errors, sorted(left), same


@pytest.mark.timeout(150)
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float64", "float32"])
def test_a_dense_bucket_with_a_residual_on_one_rank_only_is_one_collective(dtype_name):
    # one rank folded its residual into an fp32 copy and all-reduced that, the other
    # all-reduced the bf16 (or fp64) bucket in place: two sizes, and gloo aborted
    results = run_ranks("test_unused_parameters", "mixed_residuals_worker", world_size=2,
                        timeout=120, dtype_name=dtype_name)
    (held0, errors0, left0, same0), (held1, _, left1, same1) = results
    assert held0 == ["b.bias", "b.weight"] and held1 == []  # the case is the intended one
    assert left0 == left1 == []  # density 1: everything was sent
    assert same0 and same1
    # the average of both ranks' gradient + residual, up to the bucket dtype's rounding
    tolerance = {"bfloat16": 1e-2, "float64": 1e-6, "float32": 1e-6}[dtype_name]
    assert max(errors0.values()) < tolerance, errors0


def test_track_local_use_needs_the_module_and_leaves_saving_the_model_quiet(tmp_path):
    import warnings

    with pytest.raises(ValueError, match="module"):
        omgs_hook.OMGSState().track_local_use()
    model = Branchy()
    state = omgs_hook.OMGSState(module=model)
    state.track_local_use()
    state.track_local_use()  # once is enough: no second set of hooks
    assert len(model.b.weight._backward_hooks) == 1
    model(torch.randn(2, 8), use_b=False).sum().backward()
    assert state._used_keys == {"a.weight", "a.bias", "d.weight", "d.bias"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "backward hook ... will not be serialized"
        torch.save(model, tmp_path / "model.pt")
    state.close()
    assert not model.b.weight._backward_hooks
