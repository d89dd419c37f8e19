"""StepExchange's opt-in extras on their own (no DDP): DGC-style local gradient clipping
against a reference, the error-feedback health numbers, and the staleness counters on a
hand-made case."""

import math
import types

import pytest
import torch

from ddp_harness import run_ranks
from reference_omgs import reference_step

pytestmark = pytest.mark.multiprocess


class FakeBucket:
    def __init__(self, grads):
        self._buffer = torch.cat([g.reshape(-1) for g in grads]).float()
        self._grads, offset = [], 0
        for g in grads:
            self._grads.append(self._buffer[offset:offset + g.numel()])
            offset += g.numel()
        # (stand-ins for the parameters: a gradient, and trainable as DDP's are)
        self.params = [types.SimpleNamespace(grad=g, requires_grad=True) for g in self._grads]

    def buffer(self):
        return self._buffer

    def gradients(self):
        return self._grads


def _run_step(memory, selector, world, density, keys, grads, **options):
    from omgs_hook.group_exchange import StepExchange

    exchange = StepExchange(memory, selector, None, world, density, **options)
    bucket = FakeBucket(grads)
    future = exchange.add_bucket(bucket, keys, bucket.params)
    exchange.send_group(keys, dense=False)
    exchange.finish_issuing()
    future.wait()
    assert exchange.error is None, exchange.error
    return exchange, bucket


def clipping_worker(rank, world_size, steps=4):
    import torch.distributed as dist

    from omgs_hook.residual_memory import ResidualMemory
    from omgs_hook.topk import get_selector

    memory, selector = ResidualMemory(), get_selector("torch")
    keys, sizes, density, c = ("w", "b"), (300, 20), 0.05, 0.02
    worst = {"grad": 0.0, "health_grad": 0.0, "health_res": 0.0}
    clipped_steps = 0
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 * step + rank)
        grads = [torch.randn(n, generator=gen) * (1 + rank) for n in sizes]
        old = {k: v.reshape(-1).clone() for k, v in memory.state_dict().items()}
        local = dict(zip(keys, [g.clone() for g in grads]))
        # reference: each rank's group gradient scaled to norm <= c * sqrt(D) first
        norm = float(torch.cat(grads).double().norm())
        factor = min(1.0, c * math.sqrt(sum(sizes)) / norm)
        clipped_steps += factor < 1.0
        clipped = {k: (v.double() * factor).float() for k, v in local.items()}
        all_local = [None] * world_size
        all_old = [None] * world_size
        dist.all_gather_object(all_local, clipped)
        dist.all_gather_object(all_old, old)
        avg, new_res = reference_step(all_local, all_old, [(list(keys), False)], density)
        exchange, bucket = _run_step(memory, selector, world_size, density, keys, grads,
                                     clip_per_sqrt_element=c, measure_health=True)
        got = dict(zip(keys, bucket.gradients()))
        for k in keys:
            worst["grad"] = max(worst["grad"], float((got[k].double() - avg[k]).abs().max()))
        (grad_sq, res_sq), = exchange.health
        ref_grad_sq = sum(float(clipped[k].double().square().sum()) for k in keys)
        ref_res_sq = sum(float(new_res[rank][k].square().sum()) for k in keys)
        worst["health_grad"] = max(worst["health_grad"], abs(float(grad_sq) / ref_grad_sq - 1))
        worst["health_res"] = max(worst["health_res"], abs(float(res_sq) / ref_res_sq - 1))
    return worst, clipped_steps


@pytest.mark.timeout(120)
def test_local_clipping_and_health_match_the_reference():
    for worst, clipped_steps in run_ranks("test_exchange_options", "clipping_worker",
                                          world_size=2, timeout=100):
        assert clipped_steps >= 2  # the threshold is below the gradients' norms
        assert worst["grad"] < 1e-6
        assert worst["health_grad"] < 1e-5 and worst["health_res"] < 1e-5


def staleness_worker(rank, world_size):
    from omgs_hook.residual_memory import ResidualMemory
    from omgs_hook.topk import get_selector

    memory, selector = ResidualMemory(), get_selector("torch")
    keys = ("a", "b")
    grads = [torch.tensor([6.0, 5.0, 4.0]), torch.tensor([3.0, 2.0, 1.0])]
    seen = []
    for _ in range(4):  # k = 1 of 6: the largest remaining entry goes each step
        exchange, _ = _run_step(memory, selector, 1, 1 / 6, keys, grads, track_staleness=True)
        (group_keys, ages), = exchange.staleness
        seen.append(ages.tolist())
        grads = [torch.zeros(3), torch.zeros(3)]
    return seen, {k: v.tolist() for k, v in memory.ages().items()}


@pytest.mark.timeout(60)
def test_staleness_counts_steps_since_each_element_was_sent():
    (seen, per_key), = run_ranks("test_exchange_options", "staleness_worker", world_size=1,
                                 timeout=50)
    assert seen == [[0, 1, 1, 1, 1, 1], [1, 0, 2, 2, 2, 2], [2, 1, 0, 3, 3, 3],
                    [3, 2, 1, 0, 4, 4]]
    assert per_key == {"a": [3, 2, 1], "b": [0, 4, 4]}


def hint_worker(rank, world_size, steps=5):
    from omgs_hook.residual_memory import ResidualMemory
    from omgs_hook.topk import SampledTopkSelector, TorchTopkSelector

    keys, sizes, density = ("w", "b"), (60_000, 4_000), 0.002
    runs = {"sampled": (ResidualMemory(), SampledTopkSelector()),
            "torch": (ResidualMemory(), TorchTopkSelector())}
    written = {name: [] for name in runs}
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        grads = [torch.randn(n, generator=gen) for n in sizes]
        for name, (memory, selector) in runs.items():
            _, bucket = _run_step(memory, selector, 1, density, keys, [g.clone() for g in grads])
            written[name].append(bucket.buffer().clone())
    residuals = [{k: v.clone() for k, v in memory.state_dict().items()}
                 for memory, _ in runs.values()]
    return written, residuals, runs["sampled"][1].stats()


@pytest.mark.timeout(60)
def test_the_exchange_names_its_group_so_the_selector_reuses_its_threshold():
    """Step after step the same group is the same ``hint_key``: every sparse pass after
    the first starts from the previous threshold, and the exchange's write-back and
    residuals equal those of the torch selector, bit for bit."""
    (written, residuals, stats), = run_ranks("test_exchange_options", "hint_worker",
                                             world_size=1, timeout=50)
    for mine, theirs in zip(written["sampled"], written["torch"]):
        assert torch.equal(mine.view(torch.int32), theirs.view(torch.int32))
    assert residuals[0].keys() == residuals[1].keys()
    for key in residuals[0]:
        assert torch.equal(residuals[0][key].view(torch.int32),
                           residuals[1][key].view(torch.int32))
    assert stats["sampled_calls"] == 5 and stats["hinted_calls"] == 4
