"""A forward with autograd on that no backward follows (an evaluation or a metric
computed without ``torch.no_grad()``) between two training steps is no part of the next
step's time: the trial and the model check compare plans by step times, and a slow
evaluation counted in one candidate's step got that candidate dropped. Forwards that a
backward does reach (a siamese loss) stay in the step."""

import time

import pytest
import torch
import torch.nn as nn

from ddp_harness import run_ranks

pytestmark = pytest.mark.multiprocess

SLEEP_S = 0.3


class SlowableNet(nn.Module):
    def __init__(self, dict_output=False):
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 8)
        self.slow = False
        self.dict_output = dict_output

    def forward(self, x):
        if self.slow:
            time.sleep(SLEEP_S)
        out = self.b(torch.relu(self.a(x)))
        # (a model output as a dict, the loss's tensor not the first one found)
        return {"extra": [out.detach()], "out": out} if self.dict_output else out


def _out(value):
    return value["out"] if isinstance(value, dict) else value


def step_times_worker(rank, world_size, mode, steps=9, extra_at=5, dict_output=False,
                      backward_hook=False):
    import omgs_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = SlowableNet(dict_output)
    if backward_hook:  # wraps the module's output in a hook node of its own
        model.register_full_backward_hook(lambda module, grad_in, grad_out: None)
    ddp = DDP(model, bucket_cap_mb=0)
    state = omgs_hook.register(ddp, density=0.1, warmup_steps=100, log_every=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(steps):
        gen = torch.Generator().manual_seed(step * 10 + rank)
        x = torch.randn(8, 16, generator=gen)
        opt.zero_grad()
        if mode == "siamese" and step == extra_at + 1:
            model.slow = True
            first = _out(ddp(x))
            model.slow = False
            loss = first.square().mean() + _out(ddp(x.flip(0))).square().mean()
        else:
            loss = _out(ddp(x)).square().mean()
        loss.backward()
        opt.step()
        if step == extra_at and mode in ("grad", "no_grad"):
            model.slow = True
            with torch.set_grad_enabled(mode == "grad"):
                metric = _out(ddp(x)).abs().mean().item()  # no backward
            model.slow = False
            assert metric >= 0
    times = dict(state.stats() and state._step_times)
    state.close()
    return times


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode,options", [
    ("grad", {}), ("no_grad", {}), ("grad", {"dict_output": True}),
    ("grad", {"backward_hook": True})], ids=["grad", "no_grad", "grad-dict", "grad-bwhook"])
def test_a_forward_without_backward_is_not_counted_in_the_next_step(mode, options):
    for times in run_ranks("test_eval_forward_timing", "step_times_worker", world_size=2,
                           timeout=100, mode=mode, **options):
        # the evaluation ran after step 5: step 6 holds it unless it is left out
        assert 6 in times, times
        assert times[6] < SLEEP_S / 2, times


@pytest.mark.timeout(120)
def test_a_slow_forward_the_backward_reaches_stays_in_the_step():
    for times in run_ranks("test_eval_forward_timing", "step_times_worker", world_size=2,
                           timeout=100, mode="siamese"):
        assert times[6] >= SLEEP_S * 0.9, times
