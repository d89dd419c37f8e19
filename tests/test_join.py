"""Uneven inputs: DDP's ``join()`` context manager with the hook.

A rank that runs out of data joins; DDP then calls the comm hook on it with zero
gradients, once per bucket, for every step the other ranks still run ("shadow" steps),
and at the end hands every rank the model of the last rank to join. With the hook, the
joined rank's parameters have no ``.grad`` in its shadow steps, so they are parked: it
contributes nothing and keeps its residual as it was. Checked here on 2 gloo ranks with
6 and 14 steps: error feedback is conserved over all steps of both ranks, the joined
rank's residual is untouched by its shadow steps, and both ranks count the same steps
and make the same plans (the measured selection's trial runs across the join).
"""

import pytest
import torch

from ddp_harness import run_ranks

pytestmark = pytest.mark.multiprocess

STEPS = (6, 14)  # rank 0 joins after 6 steps, rank 1 trains 14


def _flat(tensors):
    return torch.cat([t.detach().reshape(-1).double() for t in tensors])


def _residuals(state, model):
    saved = state.state_dict()["residuals"]
    return torch.cat([saved[name].reshape(-1).double() if name in saved
                      else torch.zeros(p.numel(), dtype=torch.float64)
                      for name, p in model.named_parameters()])


def join_worker(rank, world_size, options, zero_first=False):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import omgs_hook

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    ddp = DDP(model, bucket_cap_mb=0.001)  # one bucket per parameter
    state = omgs_hook.register(ddp, density=0.05, log_every=0, warmup_steps=2, **options)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1.0)  # lr 1: update = averaged gradient
    start = _flat(model.parameters())
    generator = torch.Generator().manual_seed(rank)
    gradient_sum = torch.zeros_like(start)
    residual_at_join = None
    with ddp.join():
        for _ in range(STEPS[rank]):
            if zero_first:  # the common loop: a joined rank keeps its last .grad
                optimizer.zero_grad()
            x = torch.randn(8, 16, generator=generator)
            # this rank's own gradient at the shared parameters, for the conservation check
            local = torch.autograd.grad(model(x).square().mean() * 0.01, list(model.parameters()))
            gradient_sum += _flat(local)
            (ddp(x).square().mean() * 0.01).backward()
            optimizer.step()
            if not zero_first:
                optimizer.zero_grad()
        residual_at_join = _residuals(state, model)
    stats = state.stats()
    return {
        "moved": (start - _flat(model.parameters())).numpy(),
        "gradient_sum": gradient_sum.numpy(),
        "residual_at_join": residual_at_join.numpy(),
        "residual": _residuals(state, model).numpy(),
        "steps": stats["total"]["steps"],
        "plans": [(h.get("step"), h.get("strategy"), [list(g) for g in h.get("groups", [])])
                  for h in stats["plan_history"]],
    }


@pytest.mark.parametrize("options, zero_first", [
    ({"strategy": "single", "select": "model", "allow_dense": False}, False),
    ({"allow_dense": False}, False),  # the measured selection: its trial runs while rank 0 has joined
    # zero_grad() at the top of the loop: the joined rank's last .grad is still set in its
    # shadow steps (it sent its residual's top-k there until the hook noted local use)
    ({"strategy": "single", "select": "model", "allow_dense": False}, True),
], ids=["single", "measured", "single-zero-first"])
def test_uneven_inputs_with_join_conserve_error_feedback(options, zero_first):
    early, late = run_ranks("test_join", "join_worker", world_size=2, timeout=120,
                            options=options, zero_first=zero_first)
    # both ranks count every step of the job, shadow steps included, and plan alike
    assert early["steps"] == late["steps"] == max(STEPS)
    assert early["plans"] == late["plans"]
    # the joined rank's shadow steps neither send nor drop its residual
    assert (early["residual"] == early["residual_at_join"]).all()
    assert abs(early["residual"]).sum() > 0  # there was something to keep
    # every rank ends with the last rank's model (lr 1), whose total update times the
    # world size is every gradient fed in, less what stays in the residuals
    applied = 2 * late["moved"]
    fed = early["gradient_sum"] + late["gradient_sum"] - early["residual"] - late["residual"]
    assert abs(applied - fed).max() < 1e-6
    assert abs(early["moved"] - late["moved"]).max() == 0
