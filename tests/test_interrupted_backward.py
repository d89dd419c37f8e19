"""Ctrl-C (KeyboardInterrupt) raised inside the hook during backward: the training
script's ``except KeyboardInterrupt`` must see it, and the state saved there must load
into a fresh run that trains on."""

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import omgs_hook
from ddp_harness import run_ranks

INTERRUPT_AT = 5  # the step (counted from 0) whose backward is interrupted


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 4))


OPTIONS = dict(density=0.1, strategy="layerwise", select="model", allow_dense=False,
               warmup_steps=2, log_every=0)


def worker(rank, world_size):
    model = _model()
    ddp = DDP(model, bucket_cap_mb=0)
    state = omgs_hook.register(ddp, **OPTIONS)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    arrived = state.meter.bucket_arrived
    caught, before = None, None

    def interrupt_at_bucket_1(index, *args):
        # the signal arriving while the hook runs (on CPU it runs on the main thread)
        if state.step == INTERRUPT_AT and index == 1:
            raise KeyboardInterrupt
        return arrived(index, *args)

    state.meter.bucket_arrived = interrupt_at_bucket_1
    try:
        for _ in range(INTERRUPT_AT + 1):
            x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)
            before = state.state_dict()
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
    except KeyboardInterrupt:
        caught = "KeyboardInterrupt"
    except BaseException as exc:  # noqa: BLE001 - what the script would not have caught
        caught = f"{type(exc).__name__}: {exc}"
    saved = state.state_dict()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    state.close()
    return caught, before, saved, weights


def resume_worker(rank, world_size, saved, weights):
    model = _model()
    model.load_state_dict(weights)
    ddp = DDP(model, bucket_cap_mb=0)
    state = omgs_hook.register(ddp, **OPTIONS)
    state.load_state_dict(saved)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank + 10)
    for _ in range(3):
        x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    step = state.stats()["step"]
    state.close()
    return step


@pytest.mark.timeout(120)
def test_keyboard_interrupt_in_backward_reaches_the_script_and_its_save_resumes():
    results = run_ranks("test_interrupted_backward", "worker", world_size=1, timeout=60)
    caught, before, saved, weights = results[0]
    assert caught == "KeyboardInterrupt"
    # the interrupted step committed nothing: the state is the one before that step
    assert saved["step"] == before["step"] == INTERRUPT_AT
    assert saved["residuals"].keys() == before["residuals"].keys() and saved["residuals"]
    for key, residual in saved["residuals"].items():
        assert torch.isfinite(residual).all()
        assert torch.equal(residual, before["residuals"][key]), key
    steps = run_ranks("test_interrupted_backward", "resume_worker", world_size=1, timeout=60,
                      saved=saved, weights=weights)
    assert steps == [INTERRUPT_AT + 3]
