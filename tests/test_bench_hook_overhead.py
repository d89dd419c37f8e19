"""scripts/bench_hook_overhead.py: the multi-bucket model and the option checks (the
timing itself is a benchmark, not a test)."""

import pytest
import torch

from script_loader import load_script

bench = load_script("bench_hook_overhead")


def test_multi_bucket_model_has_equal_layers_of_the_requested_total():
    model = bench._Parallel(1024, 30, 40)
    sizes = [p.numel() for p in model.parameters()]
    assert len(sizes) == 40 and set(sizes) == {30 * 1024}
    out = model(torch.randn(2, 1024))
    assert out.shape == (2, 30)
    # the sum of the layers: each layer's gradient is non-zero
    out.square().sum().backward()
    assert all(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in model.parameters())


def test_bad_bucket_count_is_refused_before_anything_runs():
    with pytest.raises(SystemExit):
        bench.main(["--buckets", "0", "--sizes", "1e5"])


@pytest.mark.parametrize("argv", [["--density", "0"], ["--density", "1.5"],
                                  ["--strategy", "optimal"]])
def test_bad_density_or_strategy_is_refused_before_anything_runs(argv):
    with pytest.raises(SystemExit):
        bench.main(argv + ["--sizes", "1e5"])


def test_hook_options_carry_strategy_and_density():
    options = bench._hook_options("layerwise", 0.01)
    assert options["strategy"] == "layerwise" and options["density"] == 0.01
    assert options["allow_dense"] is False and options["select"] == "model"


def test_table_names_the_bucket_count():
    row = {"numel": 12e6, "buckets": 40, "copy_s": 0.01, "noop_step_s": 0.07,
           "omgs_step_s": 0.14, "overhead_copies": 7.0}
    table = bench.format_table([row])
    assert "| 12.0M | 40 | 10.00 | 70.0 | 140.0 | 7.00 |" in table


def test_table_gives_the_overhead_per_group_when_there_are_several():
    row = {"numel": 65536, "buckets": 16, "copy_s": 0.0001, "noop_step_s": 0.002,
           "omgs_step_s": 0.026, "overhead_copies": 240.0, "groups": 16}
    table = bench.format_table([row])
    assert "overhead per group (ms)" in table
    assert table.splitlines()[-1].endswith("| 16 | 1.50 |")
    assert "per group" not in bench.format_table([dict(row, groups=1)])


def test_table_adds_the_all_gather_only_columns_when_measured():
    row = {"numel": 1e6, "buckets": 1, "copy_s": 0.0002, "noop_step_s": 0.010,
           "omgs_step_s": 0.014, "overhead_copies": 20.0, "gather_step_s": 0.0132,
           "over_gather_copies": 4.0}
    table = bench.format_table([row])
    assert "over all-gather-only (copies)" in table.splitlines()[0]
    assert table.splitlines()[-1].endswith("| 20.00 | 13.2 | 4.00 |")
    header, rule = table.splitlines()[:2]
    assert header.count("|") == rule.count("|")


class _Bucket:
    def __init__(self, tensor):
        self._tensor = tensor

    def buffer(self):
        return self._tensor


@pytest.mark.parametrize("numel,density", [(1_000_000, 0.001), (3, 0.001), (4096, 0.01)])
def test_all_gather_only_hook_sends_the_hooks_payload_and_returns_the_bucket(
        monkeypatch, numel, density):
    from omgs_hook import communicator, cost_model

    sent = []

    def fake_allgather(payload, process_group=None):
        sent.append(payload)
        future = torch.futures.Future()
        future.set_result([payload])
        return future, payload

    monkeypatch.setattr(bench.communicator, "allgather_async", fake_allgather)
    gradient = torch.randn(numel)
    before = gradient.clone()
    result = bench.gather_only_hook(density, _Bucket(gradient)).wait()
    k = cost_model.selected_k(numel, density)
    assert [p.numel() for p in sent] == [communicator.payload_numel(k)]
    assert result is gradient and torch.equal(result, before)
