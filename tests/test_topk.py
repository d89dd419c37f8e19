"""Top-k backends: every backend against a sort-based reference, the tie rule, errors,
backend choice, the sampled path's retry/fall-back, and the CUDA radix select (its
algorithm emulated in numpy here; its kernels compiled with nvcc when present; run for
real only where a GPU and CuPy are usable)."""

import importlib.util
import math
import shutil
import subprocess
import warnings

import numpy as np
import pytest
import torch

from omgs_hook import topk, topk_cupy
from omgs_hook.topk import (
    BACKENDS,
    BackendUnavailableError,
    SampledTopkSelector,
    TorchTopkSelector,
    available_backends,
    get_selector,
)

CUDA_REASON = topk_cupy.cupy_unavailable_reason(torch.device("cuda", 0))
needs_cupy_gpu = pytest.mark.skipif(
    CUDA_REASON is not None, reason=f"cupy backend not runnable here: {CUDA_REASON}")

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def reference_topk(x, k):
    """Sort-based reference: k largest |x|, NaN above everything, ties to the lower
    index; returned (values, indices) in ascending index order."""
    magnitude = x.detach().abs().double().cpu().numpy()
    is_nan = np.isnan(magnitude)
    filled = np.where(is_nan, 0.0, magnitude)
    index = np.arange(magnitude.size)
    order = np.lexsort((index, -filled, -is_nan.astype(np.int8)))  # last key is primary
    chosen = torch.from_numpy(np.sort(order[:k])).to(x.device)
    return x[chosen], chosen


def forced_sampled():
    """The sampled selector with its shortcuts off, so small inputs take the sampled path."""
    return SampledTopkSelector(min_numel=1, max_density=1.0)


CPU_SELECTORS = {
    "torch": TorchTopkSelector,
    "sampled": SampledTopkSelector,
    "sampled-forced": forced_sampled,
}


def assert_matches_reference(selector, x, k):
    values, indices = selector.select(x, k)
    ref_values, ref_indices = reference_topk(x, k)
    assert indices.dtype == torch.int64 and values.dtype == x.dtype
    assert values.shape == (k,) and indices.shape == (k,)
    assert values.device == x.device and indices.device == x.device
    assert torch.equal(indices, ref_indices), \
        f"{selector.name}: indices differ (D={x.numel()}, k={k})"
    # bit-exact, NaN included
    assert torch.equal(values.view(-1).cpu().float().nan_to_num(7.0),
                       ref_values.cpu().float().nan_to_num(7.0))
    assert torch.equal(torch.signbit(values), torch.signbit(ref_values))


def ks_for(numel):
    candidates = (1, 2, numel // 100, numel // 3, numel - 1, numel)
    return sorted({k for k in candidates if 1 <= k <= numel})


@pytest.mark.parametrize("name", sorted(CPU_SELECTORS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("numel", [1, 2, 7, 1000, 4097, 40_009])
def test_backends_match_reference_random(name, dtype, numel):
    generator = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=generator).to(dtype)
    selector = CPU_SELECTORS[name]()
    for k in ks_for(numel):
        assert_matches_reference(selector, x, k)


def tie_heavy_inputs():
    generator = torch.Generator().manual_seed(3)
    return {
        # few distinct magnitudes, both signs: the cut almost always falls inside a run
        "quantised": torch.randint(-3, 4, (5001,), generator=generator).float(),
        "all-zero": torch.zeros(3000),
        "signed-zeros": torch.tensor([0.0, -0.0] * 1500),
        "all-equal-magnitude": torch.tensor([1.0, -1.0, -1.0, 1.0] * 800),
        "mostly-zero": torch.where(torch.rand(50_000, generator=generator) < 0.995,
                                   torch.zeros(50_000), torch.randn(50_000, generator=generator)),
        "negative-only": -torch.rand(40_000, generator=generator) - 1.0,
        "specials": torch.tensor([1.0, float("inf"), float("nan"), -float("inf"), 0.0,
                                  -float("nan"),
                                  float("nan"), -2.0, 1e-45, -1e-45, 3.0] * 40),
    }


@pytest.mark.parametrize("name", sorted(CPU_SELECTORS))
@pytest.mark.parametrize("case", sorted(tie_heavy_inputs()))
def test_backends_follow_tie_rule(name, case):
    x = tie_heavy_inputs()[case]
    selector = CPU_SELECTORS[name]()
    for k in ks_for(x.numel()) + [x.numel() // 2 + 1]:
        assert_matches_reference(selector, x, k)


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
def test_low_precision_ties_large(dtype):
    """fp16/bf16 gradients have many exactly equal magnitudes; the large-D sampled path
    must still apply the lower-index rule."""
    generator = torch.Generator().manual_seed(11)
    x = (torch.randn(200_000, generator=generator) * 1e-3).to(dtype)
    for selector in (SampledTopkSelector(), TorchTopkSelector()):
        for k in (200, 2000):
            assert_matches_reference(selector, x, k)


def test_tie_rule_small_example():
    x = torch.tensor([1.0, -3.0, 3.0, 2.0, -3.0])
    for name in ("torch", "sampled"):
        values, indices = get_selector(name).select(x, 2)
        assert indices.tolist() == [1, 2] and values.tolist() == [-3.0, 3.0]
    values, indices = forced_sampled().select(x, 4)
    assert indices.tolist() == [1, 2, 3, 4]


def test_nan_counts_as_largest():
    x = torch.tensor([5.0, float("nan"), -float("inf"), 1.0])
    for selector in (TorchTopkSelector(), forced_sampled()):
        values, indices = selector.select(x, 2)
        assert indices.tolist() == [1, 2]
        assert torch.isnan(values[0]) and values[1] == -float("inf")


@pytest.mark.parametrize("name", sorted(CPU_SELECTORS))
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=str)
@pytest.mark.parametrize("k", [1, 3, 40])
def test_a_non_finite_entry_is_always_selected(name, bad, k):
    # the hook's non-finite check looks only at the k selected values: it relies on this
    gen = torch.Generator().manual_seed(k)
    for position in (0, 777, 40_008):
        x = torch.randn(40_009, generator=gen) * 1e30  # large finite values around it
        x[position] = bad
        values, indices = CPU_SELECTORS[name]().select(x, k)
        assert position in indices.tolist()
        assert not bool(torch.isfinite(values).all())


@pytest.mark.parametrize("name", sorted(CPU_SELECTORS))
def test_non_contiguous_and_grad_inputs(name):
    generator = torch.Generator().manual_seed(5)
    base = torch.randn(2 * 50_001, generator=generator)
    strided = base[::2]
    assert not strided.is_contiguous()
    selector = CPU_SELECTORS[name]()
    assert_matches_reference(selector, strided, 50)
    leaf = torch.randn(1000, generator=generator, requires_grad=True)
    values, indices = selector.select(leaf, 10)
    assert not values.requires_grad
    assert torch.equal(indices, reference_topk(leaf.detach(), 10)[1])


@pytest.mark.parametrize("name", sorted(CPU_SELECTORS))
def test_deterministic_and_does_not_alias_or_touch_rng(name):
    generator = torch.Generator().manual_seed(9)
    x = torch.randn(100_000, generator=generator)
    before = x.clone()
    selector = CPU_SELECTORS[name]()
    rng_state = torch.get_rng_state()
    first = selector.select(x, 100)
    second = selector.select(x, 100)
    assert torch.equal(torch.get_rng_state(), rng_state), "selection must not draw from torch's RNG"
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert torch.equal(x, before), "input modified"
    first[0].zero_()
    assert torch.equal(x, before), "returned values alias the input"


def test_sampled_scratch_buffers_do_not_leak_between_calls():
    """A second, smaller call must not see the first call's magnitudes."""
    generator = torch.Generator().manual_seed(4)
    selector = SampledTopkSelector()
    large = torch.randn(200_000, generator=generator) * 100
    small = torch.randn(60_000, generator=generator)
    assert_matches_reference(selector, large, 150)
    assert_matches_reference(selector, small, 60)
    assert_matches_reference(selector, small.double(), 60)


class _ThresholdOverride(SampledTopkSelector):
    """A sampled selector whose thresholds are forced, to exercise retry and fall-back."""

    def __init__(self, thresholds):
        super().__init__(min_numel=1, max_density=1.0)
        self.forced = thresholds

    def _thresholds(self, magnitudes, k):
        return tuple(torch.tensor(t, dtype=magnitudes.dtype) for t in self.forced)


@pytest.mark.parametrize("thresholds, retries, fallbacks", [
    ((0.5, 0.5), 0, 0),  # low enough at once
    ((10.0, 0.5), 1, 0),  # first guess too high: the retry threshold works
    ((10.0, 9.0), 1, 1),  # both too high: full top-k
    ((float("nan"), 0.5), 1, 0),  # a NaN threshold lets only NaNs through: retry
    ((float("nan"), float("nan")), 1, 1),
])
def test_sampled_retry_and_fallback_stay_exact(thresholds, retries, fallbacks):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(20_000, generator=generator)
    selector = _ThresholdOverride(thresholds)
    assert_matches_reference(selector, x, 300)
    stats = selector.stats()
    assert (stats["retries"], stats["fallbacks"]) == (retries, fallbacks)
    assert stats["calls"] == stats["sampled_calls"] == 1


def test_sampled_zero_threshold_completes_with_lowest_index_zeros():
    """Fewer non-zeros than k: all non-zeros, then the lowest-index zeros - exactly,
    without the full top-k."""
    generator = torch.Generator().manual_seed(6)
    x = torch.zeros(50_000)
    x[torch.randperm(50_000, generator=generator)[:100]] = torch.randn(100, generator=generator)
    forced = _ThresholdOverride((0.0, 0.0))
    assert_matches_reference(forced, x, 1000)
    assert (forced.stats()["retries"], forced.stats()["fallbacks"]) == (0, 0)
    default = SampledTopkSelector()
    assert_matches_reference(default, x, 5000)
    assert default.stats()["sampled_calls"] == 1 and default.stats()["fallbacks"] == 0


def test_sampled_copes_with_runs_of_equal_top_values():
    """Integer-valued data: the threshold often equals the largest magnitude, so the
    candidates must be |x| >= t (with > t the sampled path would keep falling back)."""
    generator = torch.Generator().manual_seed(7)
    x = torch.randint(-50, 51, (400_000,), generator=generator).float()
    selector = SampledTopkSelector()
    for k in (200, 400, 4000):
        for _ in range(3):
            assert_matches_reference(selector, x, k)
    stats = selector.stats()
    assert stats["sampled_calls"] == 9 and stats["fallbacks"] == 0


def test_sampled_statistics_and_candidate_count():
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(1_000_000, generator=generator)
    selector = SampledTopkSelector()
    for _ in range(3):
        selector.select(x, 1000)
    selector.select(x[:1000], 10)  # below min_numel: plain path
    stats = selector.stats()
    assert stats["calls"] == 4 and stats["sampled_calls"] == 3
    assert stats["fallbacks"] == 0
    # candidates: at least k, and only a small surplus (the point of the threshold)
    assert 3 * 1000 <= stats["candidates"] <= 3 * 3000


def test_sample_size_bounds():
    assert SampledTopkSelector.sample_size(10_000_000, 10_000) == 18_566  # 4 * (k*D)^(1/3)
    assert SampledTopkSelector.sample_size(100_000, 1) == 1024
    assert SampledTopkSelector.sample_size(500, 1) == 500


@pytest.mark.parametrize("kwargs, field", [
    ({"margin_sigmas": -1}, "margin_sigmas"),
    ({"max_density": 0}, "max_density"),
    ({"retry_factor": 0}, "retry_factor"),
])
def test_sampled_options_validated(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SampledTopkSelector(**kwargs)


@pytest.mark.parametrize("name", sorted(CPU_SELECTORS))
def test_error_cases(name):
    selector = CPU_SELECTORS[name]()
    x = torch.randn(10)
    with pytest.raises(ValueError, match=r"k=0 is out of range \[1, 10\]"):
        selector.select(x, 0)
    with pytest.raises(ValueError, match=r"k=11 is out of range"):
        selector.select(x, 11)
    with pytest.raises(ValueError, match="must be 1-D, got shape"):
        selector.select(torch.randn(2, 5), 3)
    with pytest.raises(ValueError, match="must be 1-D"):
        selector.select(torch.tensor(1.0), 1)
    with pytest.raises(ValueError, match="x is empty"):
        selector.select(torch.empty(0), 1)
    with pytest.raises(TypeError, match="dtype torch.int64"):
        selector.select(torch.arange(10), 3)
    with pytest.raises(TypeError, match="k must be an integer, got float"):
        selector.select(x, 2.0)
    with pytest.raises(TypeError, match="k must be an integer, got bool"):
        selector.select(x, True)
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        selector.select(np.ones(10, dtype=np.float32), 3)
    # numpy integers are fine
    assert selector.select(x, np.int64(3))[1].numel() == 3


def test_get_selector_choices():
    assert BACKENDS == ("torch", "sampled", "cupy")
    assert get_selector().name == "sampled"
    assert get_selector("auto", "cpu").name == "sampled"
    assert isinstance(get_selector("auto", torch.device("cpu")), SampledTopkSelector)
    assert get_selector("torch").name == "torch"
    assert get_selector("sampled", "cpu").name == "sampled"
    assert available_backends(torch.device("cpu")) == ["torch", "sampled"]
    with pytest.raises(ValueError, match="unknown top-k backend 'radix'; "
                                         "valid choices: auto, torch, sampled, cupy"):
        get_selector("radix")
    with pytest.raises(ValueError, match="unknown top-k backend"):
        get_selector(None)


def test_cupy_on_cpu_is_a_clear_error():
    with pytest.raises(BackendUnavailableError, match="needs a CUDA device, got cpu"):
        get_selector("cupy", torch.device("cpu"))
    with pytest.raises(ValueError):  # BackendUnavailableError is a ValueError
        get_selector("cupy")
    with pytest.raises(BackendUnavailableError, match="cpu and cuda"):
        get_selector("torch", "meta")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cupy_without_cuda_names_the_problem():
    reason = topk_cupy.cupy_unavailable_reason(torch.device("cuda", 0))
    assert "CUDA" in reason
    with pytest.raises(BackendUnavailableError, match="CUDA"):
        get_selector("cupy", "cuda:0")
    assert available_backends("cuda:0") == ["torch", "sampled"]
    # auto on a CUDA device without a usable cupy: torch, with a warning naming why when
    # cupy is installed (the `gpu` extra), silently when it is not
    if importlib.util.find_spec("cupy") is not None:
        with pytest.warns(RuntimeWarning, match="cupy unusable, using torch"):
            assert get_selector("auto", "cuda:0").name == "torch"
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert get_selector("auto", "cuda:0").name == "torch"


# ---------------------------------------------------------------- CUDA radix select

def test_radix_digit_plan():
    assert topk_cupy.radix_digit_plan(31) == ((20, 11), (10, 10), (0, 10))
    assert topk_cupy.radix_digit_plan(15) == ((7, 8), (0, 7))
    assert topk_cupy.radix_digit_plan(63) == (
        (52, 11), (41, 11), (30, 11), (20, 10), (10, 10), (0, 10))
    for bits in range(1, 64):
        plan = topk_cupy.radix_digit_plan(bits)
        assert sum(width for _, width in plan) == bits
        assert all(width <= topk_cupy.MAX_DIGIT_BITS for _, width in plan)
        assert plan[-1][0] == 0
    with pytest.raises(ValueError):
        topk_cupy.radix_digit_plan(0)


def magnitude_keys(x):
    """What the kernels compute: the bits of x with the sign cleared, as int64."""
    key_format = topk_cupy.KEY_FORMATS[x.dtype]
    bits = x.contiguous().view(key_format.int_dtype).numpy().astype(np.int64)
    return bits & ((1 << key_format.key_bits) - 1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_magnitude_keys_order_like_magnitudes(dtype):
    """The kernels' premise: sign-cleared bit patterns sort like |x|, NaN on top."""
    finfo = torch.finfo(dtype)
    specials = [0.0, -0.0, finfo.tiny, -finfo.tiny, finfo.tiny / 4, finfo.max, -finfo.max,
                float("inf"), -float("inf"), float("nan"), 1.0, -1.0]
    generator = torch.Generator().manual_seed(0)
    x = torch.cat([torch.tensor(specials, dtype=dtype),
                   (torch.randn(2000, generator=generator, dtype=torch.float64)
                    * torch.logspace(-30, 30, 2000, dtype=torch.float64)).to(dtype)])
    keys = magnitude_keys(x)
    magnitude = x.abs().double().numpy()
    nan = np.isnan(magnitude)
    assert keys[nan].min() > keys[~nan].max()
    finite_keys, finite_mag = keys[~nan], magnitude[~nan]
    order = np.argsort(finite_mag, kind="stable")
    assert np.all(np.diff(finite_keys[order]) >= 0)
    # equal keys exactly when equal magnitudes
    assert np.array_equal(finite_keys[order][1:] == finite_keys[order][:-1],
                          finite_mag[order][1:] == finite_mag[order][:-1])


def emulate_cuda_select(x, k):
    """numpy transliteration of topk_cupy's kernels (same digits, pick rule, tile
    counts and output-slot formula), to check the algorithm itself on any machine."""
    key_format = topk_cupy.KEY_FORMATS[x.dtype]
    keys = magnitude_keys(x)
    prefix, rank = 0, k
    for shift, digit_bits in topk_cupy.radix_digit_plan(key_format.key_bits):
        nbins = 1 << digit_bits
        matching = (keys >> (shift + digit_bits)) == prefix
        hist = np.bincount((keys[matching] >> shift) & (nbins - 1), minlength=nbins)
        suffix = np.cumsum(hist[::-1])[::-1]
        above = np.append(suffix[1:], 0)
        (chosen,) = np.nonzero((above < rank) & (rank <= suffix))
        assert chosen.size == 1, "pick rule must find exactly one bin"
        prefix = (prefix << digit_bits) | int(chosen[0])
        rank -= int(above[chosen[0]])
    threshold, need = prefix, rank
    tile = topk_cupy.TILE
    tiles = -(-keys.size // tile)
    padded = np.full(tiles * tile, -1, dtype=np.int64)  # padding is never > or == T
    padded[: keys.size] = keys
    is_gt = (padded > threshold).reshape(tiles, tile)
    is_eq = (padded == threshold).reshape(tiles, tile)
    gt_before = np.cumsum(is_gt.sum(1)) - is_gt.sum(1)
    eq_before = np.cumsum(is_eq.sum(1)) - is_eq.sum(1)
    # in-tile exclusive ranks (what the ballot scan computes)
    gt_rank = (gt_before[:, None] + np.cumsum(is_gt, 1) - is_gt).ravel()
    eq_rank = (eq_before[:, None] + np.cumsum(is_eq, 1) - is_eq).ravel()
    selected = is_gt.ravel() | (is_eq.ravel() & (eq_rank < need))
    slots = gt_rank[selected] + np.minimum(eq_rank[selected], need)
    indices = np.full(k, -1, dtype=np.int64)
    indices[slots] = np.nonzero(selected)[0]
    assert selected.sum() == k and np.all(indices >= 0)
    indices = torch.from_numpy(indices)
    return x[indices], indices


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_emulated_cuda_algorithm_matches_reference(dtype):
    generator = torch.Generator().manual_seed(21)
    inputs = [torch.randn(3 * topk_cupy.TILE + 5, generator=generator).to(dtype)]
    inputs += [v.to(dtype) for v in tie_heavy_inputs().values()]
    for x in inputs:
        for k in ks_for(x.numel())[:-1]:  # k == D never reaches the kernels
            values, indices = emulate_cuda_select(x, k)
            ref_values, ref_indices = reference_topk(x, k)
            assert torch.equal(indices, ref_indices)


def nvcc_without_sm90():
    """None when nvcc can build for sm_90 (Hopper), else why the compile check skips."""
    if shutil.which("nvcc") is None:
        return "nvcc not installed: cannot compile-check the kernels"
    listing = subprocess.run(["nvcc", "--list-gpu-arch"], capture_output=True, text=True)
    if "compute_90" not in listing.stdout:
        return "this nvcc cannot target sm_90"
    return None


NVCC_REASON = nvcc_without_sm90()


@pytest.mark.skipif(NVCC_REASON is not None, reason=str(NVCC_REASON))
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.float64), ids=str)
def test_cuda_kernels_compile_with_nvcc(dtype, tmp_path):
    source = tmp_path / "topk_kernels.cu"
    source.write_text(topk_cupy.kernel_source(dtype))
    result = subprocess.run(
        ["nvcc", "-arch=sm_90", "-cubin", "-Werror", "all-warnings",
         "-o", str(tmp_path / "k.cubin"), str(source)],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


@needs_cupy_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("numel", [1, 2, 31, 4097, 3 * topk_cupy.TILE + 1, 1_000_003])
def test_cupy_matches_reference(dtype, numel):
    device = torch.device("cuda", 0)
    selector = get_selector("cupy", device)
    generator = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=generator).to(dtype)
    for k in ks_for(numel):
        values, indices = selector.select(x.to(device), k)
        ref_values, ref_indices = reference_topk(x, k)
        assert torch.equal(indices.cpu(), ref_indices)
        assert torch.equal(values.cpu(), ref_values)


@needs_cupy_gpu
@pytest.mark.parametrize("case", sorted(tie_heavy_inputs()))
def test_cupy_tie_rule(case):
    device = torch.device("cuda", 0)
    selector = get_selector("cupy", device)
    x = tie_heavy_inputs()[case]
    for k in ks_for(x.numel()):
        values, indices = selector.select(x.to(device), k)
        assert torch.equal(indices.cpu(), reference_topk(x, k)[1])


@needs_cupy_gpu
def test_cupy_on_gpu_choice_and_streams():
    device = torch.device("cuda", 0)
    assert get_selector("auto", device).name == "cupy"
    assert "cupy" in available_backends(device)
    selector = get_selector("cupy", device)
    x = torch.randn(2_000_000, device=device)
    expected = TorchTopkSelector().select(x, 2000)
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):  # runs on a side stream too
        y = x * 1.0
        values, indices = selector.select(y, 2000)
    torch.cuda.synchronize(device)
    assert torch.equal(indices, expected[1]) and torch.equal(values, expected[0])
    with pytest.raises(BackendUnavailableError, match="needs a CUDA tensor"):
        selector.select(torch.randn(10), 3)


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA device: torch/sampled on GPU untested here")
@pytest.mark.parametrize("name", ["torch", "sampled-forced"])
def test_torch_backends_on_cuda(name):
    device = torch.device("cuda", 0)
    selector = CPU_SELECTORS[name]()
    x = torch.randn(100_003, generator=torch.Generator().manual_seed(8))
    for k in (1, 100, 1000):
        values, indices = selector.select(x.to(device), k)
        assert torch.equal(indices.cpu(), reference_topk(x, k)[1])


def test_bench_script_smoke(tmp_path):
    """scripts/bench_topk.py runs end to end on tiny sizes and writes both outputs."""
    import json

    from script_loader import load_script

    bench = load_script("bench_topk")
    out_json, out_md = tmp_path / "r.json", tmp_path / "r.md"
    assert bench.main(["--sizes", "4e4,5e4", "--densities", "0.01", "--reps", "1",
                       "--warmup", "0", "--out-json", str(out_json), "--out-md", str(out_md)]) == 0
    result = json.loads(out_json.read_text())
    assert [row["numel"] for row in result["rows"]] == [40_000, 50_000]
    for row in result["rows"]:
        assert row["k"] == math.ceil(0.01 * row["numel"])
        assert row["torch_ms"] > 0 and row["sampled_ms"] > 0 and row["bound_ms"] > 0
        assert row["sampled_over_torch"] == pytest.approx(row["sampled_ms"] / row["torch_ms"])
    assert result["bandwidth_gbs"] > 0
    assert "| 4e+04 | 0.01 | 400 |" in out_md.read_text()
    with pytest.raises(SystemExit):
        bench.main(["--sizes", "0"])


NATIVE = topk._native  # the C pass as imported (None: not built, or OMGS_HOOK_NATIVE=0)
NATIVE_OFF = "omgs_hook._native is off: not built, or OMGS_HOOK_NATIVE=0"


@pytest.fixture(params=["native", "chunks"])
def fused_pass(request, monkeypatch):
    """Run a test with the fused pass in C, then with the NumPy/torch chunk loop."""
    if request.param == "native":
        if NATIVE is None:
            pytest.skip(NATIVE_OFF)
        monkeypatch.setattr(topk, "_native", NATIVE)
    else:
        monkeypatch.setattr(topk, "_native", None)
    return request.param


def _runs_of(values, cuts, dtype):
    """Split ``values`` at ``cuts`` into separate gradient tensors (like bucket runs)."""
    runs, start = [], 0
    for stop in list(cuts) + [values.numel()]:
        runs.append((start, stop - start, values[start:stop].to(dtype).clone()))
        start = stop
    return runs


@pytest.mark.parametrize("name", sorted(CPU_SELECTORS))
@pytest.mark.parametrize("case", ["random", "ties", "nonfinite", "zeros", "bf16", "no-residual"])
@pytest.mark.parametrize("numel, cuts", [(100_003, []), (600_000, [1, 250_000, 333_333])])
def test_accumulate_select_equals_sum_then_select(name, case, numel, cuts, fused_pass):
    gen = torch.Generator().manual_seed(numel + len(case))
    if case == "ties":
        grad = torch.randint(-4, 5, (numel,), generator=gen).float()
    elif case == "zeros":
        grad = torch.zeros(numel)
        grad[::997] = 1.0
    else:
        grad = torch.randn(numel, generator=gen)
    if case == "nonfinite":
        grad[numel // 2] = float("nan")
        grad[numel - 1] = -float("inf")
    residual = None if case == "no-residual" else torch.randn(numel, generator=gen) * 0.1
    if case == "zeros":
        residual = torch.zeros(numel)
    dtype = torch.bfloat16 if case == "bf16" else torch.float32
    runs = _runs_of(grad, cuts, dtype)
    expected_out = torch.empty(numel)
    for offset, length, g in runs:
        target = expected_out[offset:offset + length]
        if residual is None:
            target.copy_(g)
        else:
            torch.add(g, residual[offset:offset + length], out=target)
    for k, clear_runs in ((1, False), (37, True), (numel // 100, False), (numel // 100, True)):
        ev, ei = TorchTopkSelector().select(expected_out, k)
        out = torch.full((numel,), 7.0)
        gradients = [g.clone() for _, _, g in runs]
        values, indices = CPU_SELECTORS[name]().accumulate_select(runs, residual, out, k,
                                                                  clear_runs=clear_runs)
        assert torch.equal(out.view(torch.int32), expected_out.view(torch.int32))
        assert torch.equal(indices, ei)
        assert torch.equal(values.view(torch.int32), ev.view(torch.int32))
        # clear_runs: every gradient run is zero on return (the write-back only adds);
        # otherwise the runs are untouched
        for (offset, length, g), before in zip(runs, gradients):
            want = torch.zeros_like(g) if clear_runs else before  # (bits: NaN stays NaN)
            assert torch.equal(g.view(torch.uint8), want.view(torch.uint8))
            g.copy_(before)
        if case == "nonfinite":  # NaN first, then -inf: both when k >= 2
            assert {numel // 2, numel - 1}.intersection(indices.tolist()) == (
                {numel // 2} if k == 1 else {numel // 2, numel - 1})


def test_accumulate_select_takes_the_fused_pass_on_the_cpu():
    selector = SampledTopkSelector()
    numel = 400_000
    out = torch.empty(numel)
    runs = [(0, numel, torch.randn(numel))]
    selector.accumulate_select(runs, torch.randn(numel), out, 400)
    stats = selector.stats()
    assert stats["calls"] == stats["sampled_calls"] == 1 and stats["fallbacks"] == 0


@pytest.mark.parametrize("numel, k", [(100_003, 50), (1_000_000, 1000), (40_000, 4000)])
def test_sorted_sample_is_the_same_set_as_the_rotated_sample(numel, k):
    """The fused pass reads its sample in ascending order; the set (and so the thresholds)
    must be the one the unfused path reads, call after call (the rotation moves)."""
    selector = SampledTopkSelector()
    for calls in range(4):
        selector._count(calls=calls)
        ascending = selector._sorted_sample_at(numel, k)
        rotated = selector._sample_at(numel, k, torch.device("cpu"))
        assert torch.equal(ascending, rotated.sort().values)
        assert bool((ascending[1:] >= ascending[:-1]).all())
        assert 0 <= int(ascending.min()) and int(ascending.max()) < numel


@pytest.mark.parametrize("cuts", [[], [1], [7, 8, 9], list(range(1000, 60_000, 1500)), [59_999]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sum_at_reads_every_run_of_a_multi_bucket_group(cuts, dtype):
    """``_sum_at`` over runs (one per bucket) gives exactly (gradient + residual) at the
    positions, for any split, including empty stretches of the sample."""
    from omgs_hook.topk import _sum_at

    numel = 60_000
    gen = torch.Generator().manual_seed(len(cuts))
    grad = torch.randn(numel, generator=gen)
    residual = torch.randn(numel, generator=gen)
    runs = _runs_of(grad, cuts, dtype)
    gradient = torch.cat([g.float() for _, _, g in runs])
    whole = gradient + residual
    selector = SampledTopkSelector()
    for k in (10, 600):
        positions = selector._sorted_sample_at(numel, k)
        assert torch.equal(_sum_at(runs, residual, positions), whole[positions])
        assert torch.equal(_sum_at(runs, None, positions), gradient[positions])


@pytest.mark.parametrize("with_residual", [True, False])
def test_accumulate_with_fused_launches_equals_one_add_per_run(with_residual):
    """The GPU's fixed-launch accumulate (one multi-tensor copy, one add over the group),
    run here on the CPU: the same sums, bit for bit, as one add per run; runs that do
    not cover the group, or of another dtype, take the per-run loop."""
    from omgs_hook.topk import _accumulate_into

    gen = torch.Generator().manual_seed(5)
    numel = 10_007
    grad = torch.randn(numel, generator=gen) * 1e3
    residual = torch.randn(numel, generator=gen) * 1e-3 if with_residual else None
    runs = _runs_of(grad, [1, 17, 4000, 4001, 9000], torch.float32)
    results = []
    for foreach in (False, True):
        out = torch.full((numel,), 7.0)
        _accumulate_into(runs, residual, out, foreach=foreach)
        results.append(out)
    assert torch.equal(results[0].view(torch.int32), results[1].view(torch.int32))
    expected = grad + residual if with_residual else grad
    assert torch.equal(results[1], expected)
    # runs covering part of the group only: the untouched rest stays as it was
    out = torch.full((numel,), 7.0)
    _accumulate_into(runs[:2], residual, out, foreach=True)
    assert torch.equal(out[17:], torch.full((numel - 17,), 7.0))


@pytest.mark.parametrize("case", ["random", "ties", "nonfinite", "multi-run"])
def test_a_group_hint_changes_the_speed_never_the_result(case, fused_pass):
    """The fused pass's threshold from the group's previous call (``hint_key``): call
    after call on changing sums - steady, a top that falls by 15% or 10x (the hint passes fewer
    than k: a miss, then the sampled path), one that rises 10x (many candidates), NaN
    and ties - the values, indices, sums and cleared runs equal the unhinted selector's
    bit for bit."""
    numel, k = 200_000, 200
    cuts = [70_001, 150_000] if case == "multi-run" else []
    gen = torch.Generator().manual_seed(len(case))
    hinted, plain = SampledTopkSelector(), SampledTopkSelector()
    residual = torch.randn(numel, generator=gen) * 0.1
    for scale in (1.0, 1.0, 1.05, 0.85, 1.0, 0.1, 0.1, 10.0, 1.0):
        grad = torch.randn(numel, generator=gen) * scale
        if case == "ties":
            grad = torch.randint(-3, 4, (numel,), generator=gen).float() * scale
        if case == "nonfinite" and scale == 0.1:
            grad[12_345] = float("nan")
        results = []
        for selector, key in ((hinted, ("group", numel)), (plain, None)):
            runs = _runs_of(grad, cuts, torch.float32)
            out = torch.empty(numel)
            values, indices = selector.accumulate_select(runs, residual, out, k,
                                                         clear_runs=True, hint_key=key)
            assert all(not bool(g.any()) for _, _, g in runs)
            results.append((values.view(torch.int32), indices, out.view(torch.int32)))
        for mine, theirs in zip(*results):
            assert torch.equal(mine, theirs)
    stats = hinted.stats()
    assert stats["hinted_calls"] >= 4 and stats["hint_misses"] >= 1
    assert plain.stats()["hinted_calls"] == 0
    # the 10x rise passes more candidates than the C pass's buffers hold: it raises
    assert stats["raises"] >= (1 if fused_pass == "native" else 0)
    assert stats["overflows"] == 0
    if fused_pass == "chunks":
        assert stats["raises"] == 0


def test_a_hint_is_kept_per_group_and_k(fused_pass):
    """A hint is used only by the same key with the same k; a hint from a NaN-topped
    call is not kept."""
    numel = 100_000
    gen = torch.Generator().manual_seed(3)
    selector = SampledTopkSelector()

    def call(key, k, grad=None):
        grad = torch.randn(numel, generator=gen) if grad is None else grad
        selector.accumulate_select([(0, numel, grad)], None, torch.empty(numel), k,
                                   hint_key=key)
        return selector.stats()["hinted_calls"]

    assert call("a", 100) == 0
    assert call("a", 100) == 1
    assert call("b", 100) == 1  # another group
    assert call("a", 101) == 1  # another k (a density warm-up step)
    assert call("a", 100) == 2
    nans = torch.randn(numel, generator=gen)
    nans[:200] = float("nan")  # the k-th largest is NaN: nothing to keep
    call("c", 100, nans)
    before = selector.stats()["hinted_calls"]
    assert call("c", 100) == before
    assert call(None, 100) == before  # no key, no hint


def _pass_inputs(seed, lengths, with_residual):
    """Runs of the given lengths (some empty, odd offsets) over one group, with values
    on the threshold, -0.0, NaN and +-inf among them."""
    gen = torch.Generator().manual_seed(seed)
    numel = sum(lengths)
    grad = torch.randn(numel, generator=gen)
    if numel > 10:
        grad[3] = -0.0
        grad[numel // 3] = float("nan")
        grad[numel // 2] = float("inf")
        grad[numel - 1] = -float("inf")
        grad[5:9] = 1.5  # exactly the threshold: |x| >= t keeps them
    residual = torch.randn(numel, generator=gen) * 0.01 if with_residual else None
    if residual is not None and numel > 10:
        residual[5:9] = 0.0
    runs, offset = [], 0
    for length in lengths:
        runs.append((offset, length, grad[offset:offset + length].clone()))
        offset += length
    return runs, residual, numel


@pytest.mark.skipif(NATIVE is None, reason=NATIVE_OFF)
@pytest.mark.parametrize("lengths", [[1], [63], [64], [65], [1000, 0, 3, 129, 7, 70_001],
                                     [0, 5, 0], [200_003]])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("clear", [True, False])
def test_the_c_pass_equals_the_chunk_loop_bit_for_bit(lengths, with_residual, clear):
    """``_native_pass`` against ``_chunk_pass`` on the same inputs: the same sums, the
    same candidates (positions and values) in the same order, the same gradient runs
    after (zeroed or untouched) - for runs at odd offsets, of any length (a partial last
    block, empty runs), with NaN, inf, -0.0 and values right on the threshold."""
    threshold_bits = np.float32(1.5).view(np.uint32)
    results = []
    for use_native in (True, False):
        runs, residual, numel = _pass_inputs(len(lengths) + sum(lengths), lengths, with_residual)
        out = torch.full((numel,), 7.0)
        selector = SampledTopkSelector()
        if use_native:
            found = selector._native_pass(runs, residual, out, 4, threshold_bits, clear)
        else:
            found = selector._chunk_pass(runs, residual, out, threshold_bits, clear)
        positions, values, final_bits = found
        assert final_bits == threshold_bits  # few candidates: no raise
        results.append((out.view(torch.int32).clone(),
                        None if positions is None else positions.tolist(),
                        None if values is None else values.view(np.int32).tolist(),
                        [g.view(torch.int32).clone() for _, _, g in runs]))
    (out_a, pos_a, val_a, runs_a), (out_b, pos_b, val_b, runs_b) = results
    assert torch.equal(out_a, out_b)
    assert pos_a == pos_b and val_a == val_b
    assert all(torch.equal(a, b) for a, b in zip(runs_a, runs_b))
    if sum(lengths) > 10:
        assert {5, 6, 7, 8}.issubset(pos_a)  # on the threshold
        assert 3 not in pos_a  # -0.0


def test_the_c_pass_declines_what_it_cannot_run(monkeypatch):
    """A non-contiguous or non-float32 run, a non-contiguous or non-float32 residual, a
    residual or run that overlaps ``out``, a threshold of 0 or no extension:
    ``_native_pass`` returns None (the chunk loop runs) and writes nothing."""
    selector = SampledTopkSelector()
    bits = np.float32(1.0).view(np.uint32)
    out = torch.full((100,), 7.0)
    strided = torch.randn(200)[::2]
    cases = [
        ([(0, 100, strided)], None, bits),
        ([(0, 100, torch.randn(100, dtype=torch.float64))], None, bits),
        ([(0, 100, torch.randn(100))], torch.randn(200)[::2], bits),
        ([(0, 100, torch.randn(100))], None, np.uint32(0)),
        ([(0, 100, torch.randn(100))], torch.randn(100, dtype=torch.float64), bits),
        ([(0, 100, torch.randn(100))], out, bits),  # the residual is out itself
        ([(0, 50, out[50:])], None, bits),  # a run inside out
    ]
    if NATIVE is not None:
        for runs, residual, threshold in cases:
            assert selector._native_pass(runs, residual, out, 3, threshold, True) is None
        assert torch.equal(out, torch.full((100,), 7.0))
    monkeypatch.setattr(topk, "_native", None)
    assert selector._native_pass([(0, 100, torch.randn(100))], None, out, 3, bits, True) is None


@pytest.mark.skipif(NATIVE is None, reason=NATIVE_OFF)
def test_the_c_pass_rejects_bad_arguments():
    """The extension checks what it can: a threshold that is not a positive float32's
    pattern, negative counts, ``keep`` outside ``[1, cap)`` and null addresses raise
    ValueError, not a crash."""
    out = torch.zeros(4)
    runs = np.array([out.data_ptr(), 0, 0], dtype=np.int64)
    positions, values = np.empty(4, dtype=np.int64), np.empty(4, dtype=np.float32)
    good = (runs.ctypes.data, 1, 0, out.data_ptr(), 1, True, positions.ctypes.data,
            values.ctypes.data, 4, 2)
    assert NATIVE.accumulate_select_f32(*good) == (0, 1)
    for index, bad in ((4, 0), (4, 0x80000000), (4, -5), (1, -1), (8, 0), (9, 0), (9, 4),
                       (0, 0), (3, 0), (6, 0), (7, 0)):
        args = list(good)
        args[index] = bad
        with pytest.raises((ValueError, OverflowError)):
            NATIVE.accumulate_select_f32(*args)


def test_the_c_pass_is_built_where_a_compiler_is(monkeypatch):
    """The install builds ``omgs_hook._native`` wherever a C compiler is on the PATH (CI
    has gcc): a silent fall back to the chunk loop would cost about 1.5 copies of the
    gradient per sparse group and step (docs/hot-path.md). OMGS_HOOK_NATIVE=0 turns it off."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here: the chunk loop is the expected path")
    if topk.os.environ.get("OMGS_HOOK_NATIVE", "1") == "0":
        pytest.skip("OMGS_HOOK_NATIVE=0 in this environment")
    assert NATIVE is not None, "omgs_hook._native was not built: reinstall with pip install -e ."
    monkeypatch.setenv("OMGS_HOOK_NATIVE", "0")
    assert topk._load_native() is None
    monkeypatch.setenv("OMGS_HOOK_NATIVE", "1")
    assert topk._load_native() is NATIVE


@pytest.mark.skipif(NATIVE is None, reason=NATIVE_OFF)
@pytest.mark.parametrize("case", ["rising", "ascending", "ties", "few-distinct", "nan"])
def test_the_c_pass_raises_a_threshold_far_too_low_and_stays_exact(case):
    """A threshold that lets nearly everything through (a hint from a step whose sums were
    much smaller) fills the C pass's buffers: it raises the threshold as it goes and the
    top k is still exact - on sums that rise along the group (every entry passes the
    threshold in force: the worst case for the raises), on ties at the raised threshold
    (the buffers cannot shrink: the sampled path on the finished sums), and with NaN."""
    numel, k = 300_000, 300
    gen = torch.Generator().manual_seed(11)
    if case == "rising":
        grad = torch.randn(numel, generator=gen) * torch.linspace(1, 3, numel)
    elif case == "ascending":
        grad = torch.linspace(0.5, 2.0, numel)
    elif case == "ties":
        grad = torch.ones(numel)
    elif case == "few-distinct":
        grad = torch.randint(1, 4, (numel,), generator=gen).float()
    else:
        grad = torch.randn(numel, generator=gen)
        grad[::1000] = float("nan")
    residual = torch.randn(numel, generator=gen) * 0.01
    if case == "ties":
        residual.zero_()
    expected_out = grad + residual
    ev, ei = TorchTopkSelector().select(expected_out, k)
    selector = SampledTopkSelector()
    selector._remember("group", k, 1e-6)  # far too low: every entry is a candidate
    run = grad.clone()
    out = torch.empty(numel)
    values, indices = selector.accumulate_select([(0, numel, run)], residual, out, k,
                                                 clear_runs=True, hint_key="group")
    assert torch.equal(out.view(torch.int32), expected_out.view(torch.int32))
    assert torch.equal(indices, ei)
    assert torch.equal(values.view(torch.int32), ev.view(torch.int32))
    assert not bool(run.any())
    stats = selector.stats()
    assert stats["hinted_calls"] == 1 and stats["raises"] == 1
    assert stats["overflows"] == int(case == "ties")
