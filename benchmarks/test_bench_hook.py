"""The hook's own host work for one sparse group, in fp32 copy-equivalents.

Run with ``pytest benchmarks/test_bench_hook.py --benchmark-only``. One process, a
one-rank gloo group (the collective is then nearly free, so what is timed is the hook's
own work: assembling gradient + residual, top-k, the non-finite check, packing, the
write-back into the bucket buffer and the residual commit), on a fake DDP bucket of D
fp32 elements, density 0.001, the exact sampled CPU selector. Each benchmark also
times one ``copy_`` of D elements interleaved with the group's rounds and stores
``copies = group time / copy time`` in ``extra_info``.

Target (issue 11): at most 5 copy-equivalents per sparse group. The 2-rank DDP figure
against a no-op hook is ``scripts/bench_hook_overhead.py``.
"""

import datetime
import os
import statistics
import time
import types

import pytest
import torch
import torch.distributed as dist

from omgs_hook import topk
from omgs_hook.group_exchange import StepExchange
from omgs_hook.residual_memory import ResidualMemory
from omgs_hook.topk import get_selector

NATIVE = topk._native

DENSITY = 0.001


class FakeBucket:
    """What StepExchange reads of a DDP GradBucket: one buffer, per-parameter views."""

    def __init__(self, sizes):
        self._buffer = torch.randn(sum(sizes))
        self._grads, offset = [], 0
        for n in sizes:
            self._grads.append(self._buffer[offset:offset + n])
            offset += n
        # StepExchange only asks whether a parameter has a .grad (was used in forward)
        self.params = [types.SimpleNamespace(grad=g) for g in self._grads]

    def buffer(self):
        return self._buffer

    def gradients(self):
        return self._grads


@pytest.fixture(scope="module")
def one_rank_group():
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        store = dist.HashStore()
        dist.init_process_group("gloo", store=store, rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=60))
    yield
    dist.destroy_process_group()


def _one_step(memory, selector, buckets, bucket_keys):
    """One step of one sparse group made of ``buckets`` (in ready order)."""
    exchange = StepExchange(memory, selector, None, 1, DENSITY)
    futures = [exchange.add_bucket(bucket, keys, bucket.params)
               for bucket, keys in zip(buckets, bucket_keys)]
    exchange.send_group([key for keys in bucket_keys for key in keys], dense=False)
    exchange.finish_issuing()
    for future in futures:
        future.wait()
    if exchange.error is not None:
        raise exchange.error


@pytest.mark.parametrize("fused_pass", ["c", "chunks"])
@pytest.mark.parametrize("numel, num_buckets", [(1_000_000, 1), (12_000_000, 1),
                                                (12_000_000, 40)])
def test_sparse_group_host_work(benchmark, one_rank_group, monkeypatch, numel, num_buckets,
                                fused_pass):
    """One bucket of four parameters, or - what an OMGS group of merged buckets looks
    like - ``num_buckets`` buckets of one parameter each in one group (per-run work).
    ``fused_pass``: the CPU's fused pass in C (``omgs_hook._native``) or the NumPy/torch
    chunk loop, side by side in one run."""
    if fused_pass == "c" and NATIVE is None:
        pytest.skip("omgs_hook._native is off: not built, or OMGS_HOOK_NATIVE=0")
    monkeypatch.setattr(topk, "_native", NATIVE if fused_pass == "c" else None)
    benchmark.group = f"sparse group host work, {numel / 1e6:g}M in {num_buckets} bucket(s)"
    torch.set_num_threads(1)
    if num_buckets == 1:
        sizes = [[numel // 4] * 3 + [numel - 3 * (numel // 4)]]  # four parameters, one bucket
    else:
        sizes = [[numel // num_buckets] for _ in range(num_buckets)]
    buckets = [FakeBucket(bucket_sizes) for bucket_sizes in sizes]
    keys, i = [], 0
    for bucket_sizes in sizes:
        keys.append([f"p{i + j}" for j in range(len(bucket_sizes))])
        i += len(bucket_sizes)
    numel = sum(map(sum, sizes))
    memory, selector = ResidualMemory(), get_selector("sampled", torch.device("cpu"))
    src, dst = torch.randn(numel), torch.empty(numel)
    for _ in range(3):
        _one_step(memory, selector, buckets, keys)
        dst.copy_(src)
    copies = []

    def setup():
        t0 = time.perf_counter()
        dst.copy_(src)
        copies.append(time.perf_counter() - t0)

    benchmark.pedantic(_one_step, args=(memory, selector, buckets, keys), setup=setup,
                       rounds=15, iterations=1)
    copy_s = statistics.median(copies)
    benchmark.extra_info["copy_s"] = copy_s
    benchmark.extra_info["copies"] = benchmark.stats.stats.median / copy_s
    assert memory.get("p0") is not None  # the residual was kept
