"""pytest-benchmark: torch vs sampled top-k on 1e6 float32 elements.

Run with ``pytest benchmarks/test_bench_topk.py --benchmark-only``; compare the two
backends within each group (``topk D=1e6 density=...``).
"""

import math

import pytest
import torch

from omgs_hook.topk import get_selector

NUMEL = 1_000_000


@pytest.fixture(scope="module")
def gradient():
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("density", [0.001, 0.01])
@pytest.mark.parametrize("backend", ["torch", "sampled"])
def test_topk_1e6(benchmark, gradient, backend, density):
    k = math.ceil(density * NUMEL)
    selector = get_selector(backend)
    benchmark.group = f"topk D=1e6 density={density}"
    values, indices = benchmark(selector.select, gradient, k)
    # the timed call must also be the right answer
    expected = torch.topk(gradient.abs(), k).values.min()
    assert indices.numel() == k and values.abs().min() == expected
