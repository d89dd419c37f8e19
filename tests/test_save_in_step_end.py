"""A SIGTERM handler that saves (state_dict()) while the hook ends a step - after the
step's residual update is committed, before the step is counted - must save a state
that resumes as that step not taken: the residuals before it, or a record of them."""

import logging
import threading

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import omgs_hook
from ddp_harness import run_ranks

SAVE_AT = 5  # the step (counted from 1) whose end the handler interrupts


class _Terminated(Exception):
    pass


def worker(rank, world_size):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    ddp = DDP(model, bucket_cap_mb=0)
    state = omgs_hook.register(ddp, density=0.1, strategy="layerwise", select="model",
                               allow_dense=False, warmup_steps=2, log_every=1)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    saved = {}

    class SavingHandler(logging.Handler):
        # the handler's save, landing where the hook logs the step it just finished
        def emit(self, record):
            if (SAVE_AT - 1 == state.step and "saved" not in saved
                    and threading.current_thread() is threading.main_thread()):
                saved["saved"] = state.state_dict()
                raise _Terminated

    log = logging.getLogger("omgs_hook")
    handler = SavingHandler(level=logging.INFO)
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    gen = torch.Generator().manual_seed(rank)
    before = None
    try:
        for _ in range(SAVE_AT + 3):
            x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)
            before = state.state_dict()
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
    except _Terminated:
        pass
    finally:
        log.removeHandler(handler)
    state.close()
    return before, saved.get("saved")


@pytest.mark.timeout(120)
def test_a_save_while_a_step_ends_keeps_that_step_undone():
    for before, saved in run_ranks("test_save_in_step_end", "worker", world_size=1,
                                   timeout=60):
        assert saved is not None, "the step ended off the main thread"
        assert before["step"] == SAVE_AT - 1 and before["residuals"]
        # what a run resumed from it starts from: the residuals before the step travel
        # along while its gradient is not applied (the resumed run's first forward rewinds
        # to them); without them, the saved ones must be those before the step
        residuals = saved["residuals_before_last_step"]
        if residuals is None:
            assert saved["step"] == before["step"]
            residuals = saved["residuals"]
        assert residuals.keys() == before["residuals"].keys()
        for key, value in residuals.items():
            assert torch.equal(value, before["residuals"][key]), key
