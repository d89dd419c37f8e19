"""DDP's first iterations: static_graph's delayed all-reduce (every bucket numbered 0), its
first-guess bucket layout held for two steps, and a resume or rollback while DDP's rebuilt
layout settles; 2 gloo ranks."""

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import omgs_hook
from ddp_harness import run_ranks
from test_hook_ddp import DENSITY, Net, _train_planner_settled, gather, train_steps

pytestmark = pytest.mark.multiprocess


@pytest.mark.timeout(240)
@pytest.mark.parametrize("first", [3, 4])
def test_static_graph_resume_while_the_rebuilt_layout_settles_is_bit_identical(tmp_path, first):
    # DDP(static_graph=True) runs its first guess of the buckets for two iterations (it
    # rebuilds one iteration later), in the uninterrupted run and again in the resumed one
    results = run_ranks("test_hook_ddp", "resume_worker", world_size=2, timeout=200,
                        ddp_options={"static_graph": True},
                        hook_options={"strategy": "layerwise", "warmup_steps": 1,
                                      "replan_every": 1000, "allow_dense": False,
                                      "select": "model"},
                        ckpt_dir=str(tmp_path), first=first, second=8)
    for r in results:
        assert r["identical"], (r["max_diff"], r["plan"])


def hand_registered_ignore_worker(rank, world_size, warmup_steps):
    """OMGSState(module=...) + register_comm_hook by hand, static_graph=True, parameters
    of two dtypes (two buckets numbered 0 in DDP's first iteration) and a trainable
    parameter DDP is told to ignore: that parameter never reaches the hook."""
    torch.manual_seed(0)
    model = Net()
    model.a.double()
    model.forward = lambda x: model.c(torch.relu(model.b(torch.relu(model.a(x.double())).float())))
    DDP._set_params_and_buffers_to_ignore_for_model(model, ["c.bias"])
    ddp = DDP(model, bucket_cap_mb=0, static_graph=True)
    state = omgs_hook.OMGSState(module=model, density=DENSITY, strategy="optimal",
                                select="model", allow_dense=False, warmup_steps=warmup_steps)
    ddp.register_comm_hook(state, omgs_hook.omgs_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    train_steps(ddp, opt, 0, 4, rank)
    steps = state.stats()["total"]["steps"]
    flat = torch.cat([p.detach().float().reshape(-1) for n, p in model.named_parameters()
                      if n != "c.bias"])
    state.close()
    return {"steps": steps, "flats": gather(flat, world_size)}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("warmup_steps", [0, 2])
def test_hand_registered_static_graph_with_an_ignored_parameter_ends_the_first_step(
        warmup_steps):
    # without the fix: warmup_steps=0 hangs in the first backward (no bucket future is
    # ever set: the step waits for c.bias); warmup_steps=2 trains but counts 3 steps
    results = run_ranks("test_first_iterations", "hand_registered_ignore_worker",
                        world_size=2, timeout=90, pg_timeout_s=60, warmup_steps=warmup_steps)
    for r in results:
        assert r["steps"] == 4, r["steps"]
        assert torch.equal(r["flats"][0], r["flats"][1])


def rollback_resave_worker(rank, world_size):
    """A rollback in the same process (load an earlier checkpoint, no new DDP) and a
    state_dict() right after it, before any step (a checkpoint at the start of an epoch)."""
    torch.manual_seed(0)
    model = Net()
    ddp = DDP(model, bucket_cap_mb=0)
    state = omgs_hook.register(ddp, density=DENSITY, strategy="layerwise", warmup_steps=1,
                               replan_every=1000, allow_dense=False, select="model")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    _train_planner_settled(ddp, opt, state, 0, 3, rank)
    saved = state.state_dict()
    _train_planner_settled(ddp, opt, state, 3, 10, rank)
    state.load_state_dict(saved)
    again = state.state_dict()
    state.close()
    return {"saved": (saved["layout"], saved["layout_streak"]),
            "again": (again["layout"], again["layout_streak"])}


@pytest.mark.timeout(120)
def test_a_state_saved_right_after_a_rollback_is_the_checkpoints():
    for r in run_ranks("test_first_iterations", "rollback_resave_worker", world_size=2):
        assert r["again"] == r["saved"], (r["saved"][1], r["again"][1])
