"""state_dict() from another thread (an exporter or async-checkpoint thread) while the
training loop goes on must not change training: the parameters and residuals equal
those of the same run without it, bit for bit."""

import threading

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.overrides import TorchFunctionMode

import omgs_hook
from ddp_harness import run_ranks

STEPS = 10
SAVE_AT = 6  # the other thread's state_dict() starts after this step's backward


class _PauseAtClone(TorchFunctionMode):
    """In the thread that enters it: at the ``at``-th ``Tensor.clone`` call, wait (at
    most ``timeout`` s) until ``resume`` is set - a preemption of the saving thread at
    that point, made deterministic. The clone after the residuals' own ones is the first
    of the residuals before the last step."""

    def __init__(self, at, resume, timeout):
        super().__init__()
        self.at, self.resume, self.timeout, self.calls = at, resume, timeout, 0
        self.paused = threading.Event()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.clone:
            self.calls += 1
            if self.calls == self.at:
                self.paused.set()
                self.resume.wait(self.timeout)
        return func(*args, **(kwargs or {}))


def worker(rank, world_size, concurrent):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                          nn.Linear(16, 4))
    ddp = DDP(model, bucket_cap_mb=0)
    state = omgs_hook.register(ddp, density=0.1, strategy="layerwise", select="model",
                               allow_dense=False, warmup_steps=2, log_every=0)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(rank)
    data = [(torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen))
            for _ in range(STEPS)]
    saver, saved, resume = None, {}, threading.Event()
    for step, (x, y) in enumerate(data):
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        if concurrent and step == SAVE_AT:
            pause = _PauseAtClone(len(state.memory.keys()) + 1, resume, timeout=5.0)

            def save():
                with pause:
                    saved["sd"] = state.state_dict()

            saver = threading.Thread(target=save)
            saver.start()
            assert pause.paused.wait(30)
        opt.step()
        if saver is not None and step == SAVE_AT + 1:
            resume.set()  # (after the next step's forward and backward)
            saver.join(30)
            assert not saver.is_alive()
    params = [p.detach().clone() for p in model.parameters()]
    residuals = state.state_dict()["residuals"]
    state.close()
    return params, residuals, saved.get("sd", {}).get("step")


@pytest.mark.timeout(120)
def test_state_dict_on_another_thread_leaves_training_bit_identical():
    plain = run_ranks("test_concurrent_state_dict", "worker", world_size=2, timeout=90,
                      concurrent=False)
    saving = run_ranks("test_concurrent_state_dict", "worker", world_size=2, timeout=90,
                       concurrent=True)
    for rank in range(2):
        assert saving[rank][2] == SAVE_AT + 1
        for a, b in zip(plain[rank][0], saving[rank][0]):
            assert torch.equal(a, b), (a - b).abs().max()
        assert plain[rank][1].keys() == saving[rank][1].keys()
        for key in plain[rank][1]:
            assert torch.equal(plain[rank][1][key], saving[rank][1][key]), key
