"""Fits recover known cost models, stay non-negative, and report per-point errors."""

import itertools
import math

import numpy as np
import pytest

from omgs_hook.cost_model import LinearCost, TopkCost
from omgs_hook.fitting import (
    LinearFit,
    OnlineLinearFitter,
    TopkFit,
    fit_linear_relative,
    fit_topk,
    nonnegative_least_squares,
)

SIZES = np.geomspace(1024, 8 * 2**20, 8)
TOPK_SIZES = np.geomspace(1e3, 4e6, 8)


def _noisy(values, rng, relative_sigma):
    return values * (1 + relative_sigma * rng.standard_normal(values.shape))


# ---------------------------------------------------------------------------------------
# non-negative least squares
# ---------------------------------------------------------------------------------------


def _brute_force_nnls(a, b, grid):
    """Reference: best residual over a dense grid of non-negative points."""
    best = math.inf
    for x in itertools.product(grid, repeat=a.shape[1]):
        best = min(best, float(np.linalg.norm(a @ np.array(x) - b)))
    return best


def test_nnls_equals_unconstrained_solution_when_that_is_non_negative():
    rng = np.random.default_rng(1)
    a = rng.random((20, 3))
    x_true = np.array([0.5, 2.0, 1.5])
    x = nonnegative_least_squares(a, a @ x_true)
    assert np.allclose(x, x_true, rtol=1e-9)


def test_nnls_clamps_and_is_optimal_against_a_grid_search():
    rng = np.random.default_rng(2)
    for _ in range(20):
        a = rng.standard_normal((8, 2))
        b = rng.standard_normal(8)
        x = nonnegative_least_squares(a, b)
        assert np.all(x >= 0)
        residual = float(np.linalg.norm(a @ x - b))
        grid = np.linspace(0, 3, 121)
        # the exact optimum is never worse than any grid point
        assert residual <= _brute_force_nnls(a, b, grid) + 1e-12
        unconstrained = np.linalg.lstsq(a, b, rcond=None)[0]
        if np.all(unconstrained >= 0):
            assert np.allclose(x, unconstrained)


def test_nnls_handles_columns_of_wildly_different_scale():
    d = np.geomspace(1e3, 4e6, 10)
    a = np.column_stack([np.ones_like(d), d, d * np.log2(d)])
    x_true = np.array([2e-5, 3e-9, 1e-10])
    x = nonnegative_least_squares(a / (a @ x_true)[:, None], np.ones_like(d))
    assert np.allclose(x, x_true, rtol=1e-6)


@pytest.mark.parametrize("matrix, target, problem", [
    (np.ones(3), np.ones(3), "2-D"),
    (np.ones((3, 2)), np.ones(4), "shape"),
    (np.ones((3, 0)), np.ones(3), "columns"),
    (np.array([[1.0, np.nan]]), np.ones(1), "finite"),
])
def test_nnls_rejects_bad_input(matrix, target, problem):
    with pytest.raises(ValueError, match=problem):
        nonnegative_least_squares(matrix, target)


# ---------------------------------------------------------------------------------------
# alpha + beta * bytes
# ---------------------------------------------------------------------------------------


def test_linear_fit_recovers_exact_alpha_beta():
    alpha, beta = 2.4e-4, 1.1e-9
    fit = fit_linear_relative(SIZES, alpha + beta * SIZES)
    assert isinstance(fit, LinearFit)
    assert fit.alpha_s == pytest.approx(alpha, rel=1e-9)
    assert fit.beta_s_per_byte == pytest.approx(beta, rel=1e-9)
    assert len(fit.rel_errors) == len(SIZES)
    assert fit.max_abs_rel_error < 1e-9
    assert fit.to_cost() == LinearCost(alpha_s=fit.alpha_s, beta_s_per_byte=fit.beta_s_per_byte)


def test_linear_fit_recovers_alpha_beta_under_noise():
    rng = np.random.default_rng(3)
    alpha, beta = 3e-4, 8.5e-9
    sizes = np.repeat(SIZES, 10)  # every repetition as a sample
    seconds = _noisy(alpha + beta * sizes, rng, 0.05)
    fit = fit_linear_relative(sizes, seconds)
    assert fit.alpha_s == pytest.approx(alpha, rel=0.1)
    assert fit.beta_s_per_byte == pytest.approx(beta, rel=0.1)
    # each point's error is reported: about the injected 5 % noise
    assert 0.02 < float(np.std(fit.rel_errors)) < 0.08


def test_linear_fit_keeps_alpha_positive_on_a_super_linear_tail():
    # the gloo loopback shape: linear with a start-up cost, then growing faster than
    # linear at the largest sizes (ddp-hook-facts.md: 71.5 ms at 40 MB, not ~45)
    alpha, beta = 2.5e-4, 1.1e-9
    seconds = alpha + beta * SIZES * (1 + (SIZES / 2e6) ** 1.5)
    plain = np.linalg.lstsq(np.column_stack([np.ones_like(SIZES), SIZES]), seconds, rcond=None)[0]
    assert plain[0] < 0, "the synthetic tail should defeat plain least squares"
    fit = fit_linear_relative(SIZES, seconds)
    assert fit.alpha_s > 0
    # relative weighting keeps the small-message regime right: alpha within 30 %
    assert fit.alpha_s == pytest.approx(alpha, rel=0.3)
    small = SIZES < 1e5
    assert np.all(np.abs(np.array(fit.rel_errors)[small]) < 0.15)


def test_linear_fit_on_the_documented_loopback_figures():
    # ddp-hook-facts.md, W2 all_gather: 1e3..1e7 float32 per rank, median ms
    floats = np.array([1e3, 1e5, 1e6, 1e7])
    seconds = np.array([0.26, 0.54, 4.66, 71.5]) * 1e-3
    fit = fit_linear_relative(floats * 4, seconds)
    assert 1e-4 < fit.alpha_s < 4e-4
    assert 1e-9 < fit.beta_s_per_byte < 5e-9


def test_linear_fit_clamps_a_negative_slope_to_zero():
    fit = fit_linear_relative([1000, 2000, 4000], [3e-3, 2e-3, 1e-3])
    assert fit.beta_s_per_byte == 0.0
    assert fit.alpha_s > 0


@pytest.mark.parametrize("nbytes, seconds, problem", [
    ([1000, 1000], [1e-3, 2e-3], "2 distinct"),
    ([1000, 2000], [1e-3], "same length"),
    ([], [], "no samples"),
    ([1000, -5], [1e-3, 2e-3], "nbytes"),
    ([1000, 2000], [1e-3, 0.0], "seconds"),
    ([1000, 2000], [1e-3, float("nan")], "seconds"),
])
def test_linear_fit_rejects_bad_input(nbytes, seconds, problem):
    with pytest.raises(ValueError, match=problem):
        fit_linear_relative(nbytes, seconds)


# ---------------------------------------------------------------------------------------
# c0 + c1*D + c2*D*log2(D)
# ---------------------------------------------------------------------------------------


def _topk_time(d, c0, c1, c2):
    return c0 + c1 * d + c2 * d * np.log2(d)


@pytest.mark.parametrize("c0, c1, c2", [
    (2e-5, 3e-9, 1e-10),   # all three terms
    (1e-4, 2e-9, 0.0),     # linear selector (sampled threshold)
    (5e-5, 0.0, 2e-10),    # sort-like selector
])
def test_topk_fit_recovers_exact_coefficients(c0, c1, c2):
    fit = fit_topk(TOPK_SIZES, _topk_time(TOPK_SIZES, c0, c1, c2))
    assert isinstance(fit, TopkFit)
    for got, want in ((fit.c0, c0), (fit.c1, c1), (fit.c2, c2)):
        assert got == pytest.approx(want, rel=1e-6, abs=1e-15)
    assert fit.max_abs_rel_error < 1e-6
    assert fit.to_cost() == TopkCost(c0=fit.c0, c1=fit.c1, c2=fit.c2)


def test_topk_fit_under_noise_predicts_well_and_stays_non_negative():
    rng = np.random.default_rng(4)
    c0, c1, c2 = 2e-5, 1e-9, 5e-11
    sizes = np.repeat(TOPK_SIZES, 8)
    truth = _topk_time(sizes, c0, c1, c2)
    fit = fit_topk(sizes, _noisy(truth, rng, 0.05), log_term=True)
    assert min(fit.c0, fit.c1, fit.c2) >= 0
    assert fit.c0 == pytest.approx(c0, rel=0.2)
    # c1 and c2 trade off against each other under noise; the prediction must not
    predicted = _topk_time(TOPK_SIZES, fit.c0, fit.c1, fit.c2)
    assert np.all(np.abs(predicted / _topk_time(TOPK_SIZES, c0, c1, c2) - 1) < 0.05)


def test_topk_fit_never_goes_negative_on_a_concave_curve():
    # sub-linear growth (caches warming up) would need a negative c2 without the constraint
    seconds = 1e-4 * np.sqrt(TOPK_SIZES)
    fit = fit_topk(TOPK_SIZES, seconds)
    assert min(fit.c0, fit.c1, fit.c2) >= 0
    d = TOPK_SIZES
    design = np.column_stack([np.ones_like(d), d, d * np.log2(d)])
    unconstrained = np.linalg.lstsq(design / seconds[:, None], np.ones_like(seconds), rcond=None)[0]
    assert np.any(unconstrained < 0), "the curve should push an unconstrained fit negative"


def test_topk_fit_prefers_the_linear_form_on_noisy_linear_data():
    rng = np.random.default_rng(6)
    d = np.geomspace(1e3, 4e6, 13)
    for _ in range(10):
        fit = fit_topk(d, _noisy(_topk_time(d, 1e-4, 3e-9, 0.0), rng, 0.08))
        assert fit.form == "linear" and fit.c2 == 0.0
        assert fit.c1 == pytest.approx(3e-9, rel=0.2)


def test_topk_fit_keeps_the_log_term_when_the_data_clearly_need_it():
    fit = fit_topk(TOPK_SIZES, _topk_time(TOPK_SIZES, 5e-5, 0.0, 2e-10))
    assert fit.form == "n log n"
    assert fit.c2 == pytest.approx(2e-10, rel=1e-6) and fit.c1 == pytest.approx(0, abs=1e-15)
    # the same data forced into the linear form: c2 = 0 and a visibly worse fit
    linear = fit_topk(TOPK_SIZES, _topk_time(TOPK_SIZES, 5e-5, 0.0, 2e-10), log_term=False)
    assert linear.form == "linear" and linear.c2 == 0.0 and linear.max_abs_rel_error > 0.1


def test_topk_fit_log_term_option_is_checked():
    with pytest.raises(ValueError, match="log_term"):
        fit_topk(TOPK_SIZES, _topk_time(TOPK_SIZES, 1e-4, 1e-9, 0.0), log_term="maybe")


def test_robust_fits_are_pulled_far_less_by_one_disturbed_point():
    truth = 3e-4 + 2e-9 * SIZES
    for index, factor in ((3, 4.0), (0, 3.0), (7, 3.0)):
        disturbed = truth.copy()
        disturbed[index] *= factor  # one point measured while another job ran
        plain = fit_linear_relative(SIZES, disturbed)
        robust = fit_linear_relative(SIZES, disturbed, robust=True)
        others = np.arange(len(SIZES)) != index

        def worst(fit, others=others):
            line = fit.alpha_s + fit.beta_s_per_byte * SIZES
            return float(np.max(np.abs(line / truth - 1)[others]))

        assert worst(robust) < 0.01 and worst(plain) > 0.04, (index, factor)
    # on clean data both are the same exact fit
    clean = fit_linear_relative(SIZES, truth, robust=True)
    assert clean.alpha_s == pytest.approx(3e-4, rel=1e-9)
    d = np.geomspace(1e3, 4e6, 13)
    topk_truth = _topk_time(d, 1e-4, 3e-9, 0.0)
    bumped = topk_truth.copy()
    bumped[5] *= 3
    assert fit_topk(d, bumped, robust=True).c1 == pytest.approx(3e-9, rel=0.05)


@pytest.mark.parametrize("shape", [(1e-4, 3e-9, 0.0), (7e-5, 0.0, 2e-10), (2e-5, 1e-9, 1e-10)])
def test_topk_fits_of_three_noisy_runs_agree_within_20_percent(shape):
    # per-point medians with 10 % noise and, in every run, one point disturbed 2-3x: the
    # fitted curves of three runs stay within 20 % of their median at every size
    rng = np.random.default_rng(7)
    d = np.geomspace(1e3, 4e6, 13)
    truth = _topk_time(d, *shape)
    for _trial in range(20):
        curves = []
        for _run in range(3):
            t = truth * np.exp(0.1 * rng.standard_normal(d.size))
            t[rng.integers(d.size)] *= rng.uniform(2, 3)
            fit = fit_topk(d, t, robust=True)
            curves.append(_topk_time(d, fit.c0, fit.c1, fit.c2))
        curves = np.array(curves)
        assert np.max(np.abs(curves / np.median(curves, axis=0) - 1)) <= 0.2


@pytest.mark.parametrize("numel, seconds, problem", [
    ([1000, 2000, 2000], [1e-3, 2e-3, 2e-3], "3 distinct"),
    ([0, 1000, 2000], [1e-3, 2e-3, 3e-3], ">= 1"),
    ([1000, 2000, 3000], [1e-3, -2e-3, 3e-3], "seconds"),
])
def test_topk_fit_rejects_bad_input(numel, seconds, problem):
    with pytest.raises(ValueError, match=problem):
        fit_topk(numel, seconds)


# ---------------------------------------------------------------------------------------
# OnlineLinearFitter
# ---------------------------------------------------------------------------------------


def test_online_fitter_returns_none_until_it_has_two_distinct_sizes():
    fitter = OnlineLinearFitter(window=16)
    assert fitter.fit() is None
    for _ in range(5):
        fitter.add(8000, 1e-3)
    assert fitter.fit() is None  # one group size cannot separate alpha from beta
    fitter.add(9000, 1.1e-3)
    assert fitter.fit() is None  # sizes too close: beta would be noise
    fitter.add(80000, 2e-3)
    cost = fitter.fit()
    assert isinstance(cost, LinearCost)


def test_online_fitter_recovers_alpha_beta_and_ignores_outliers():
    rng = np.random.default_rng(5)
    alpha, beta = 1e-3, 1e-8
    fitter = OnlineLinearFitter(window=300)
    sizes = [8_000, 80_000, 800_000]
    for step in range(100):
        for nbytes in sizes:
            seconds = (alpha + beta * nbytes) * (1 + 0.03 * rng.standard_normal())
            if step % 25 == 0:
                seconds *= 20  # a GC pause / straggler now and then
            fitter.add(nbytes, seconds)
    cost = fitter.fit()
    assert cost.alpha_s == pytest.approx(alpha, rel=0.1)
    assert cost.beta_s_per_byte == pytest.approx(beta, rel=0.1)


def test_online_fitter_window_forgets_old_network_conditions():
    fitter = OnlineLinearFitter(window=20)
    for _ in range(10):
        for nbytes in (1000, 100_000):
            fitter.add(nbytes, 1e-3 + 1e-8 * nbytes)  # fast network
    for _ in range(10):
        for nbytes in (1000, 100_000):
            fitter.add(nbytes, 1e-3 + 1e-7 * nbytes)  # network became 10x slower
    assert len(fitter) == 20
    assert fitter.fit().beta_s_per_byte == pytest.approx(1e-7, rel=1e-6)


def test_online_fitter_state_round_trip_and_validation():
    fitter = OnlineLinearFitter(window=8)
    fitter.add(1000, 1e-3)
    fitter.add(10_000, 2e-3)
    state = fitter.state_dict()
    other = OnlineLinearFitter(window=8)
    other.load_state_dict(state)
    assert other.samples == fitter.samples
    assert other.fit() == fitter.fit()
    with pytest.raises(ValueError, match=r"samples\[1\]\.seconds"):
        other.load_state_dict({"samples": [[1000, 1e-3], [2000, -1.0]]})
    assert other.samples == fitter.samples  # a rejected state leaves the window alone
    with pytest.raises(ValueError, match="samples"):
        other.load_state_dict([])
    other.clear()
    assert len(other) == 0


@pytest.mark.parametrize("kwargs, problem", [
    ({"window": 1}, "window"),
    ({"window": 2.5}, "window"),
    ({"min_sizes": 1}, "min_sizes"),
    ({"min_size_ratio": 0.5}, "min_size_ratio"),
])
def test_online_fitter_rejects_bad_options(kwargs, problem):
    with pytest.raises(ValueError, match=problem):
        OnlineLinearFitter(**kwargs)


@pytest.mark.parametrize("nbytes, seconds, problem", [
    (0, 1e-3, "nbytes"),
    (1.5, 1e-3, "nbytes"),
    (True, 1e-3, "nbytes"),
    (1000, 0.0, "seconds"),
    (1000, float("inf"), "seconds"),
    (1000, "fast", "seconds"),
])
def test_online_fitter_rejects_bad_samples(nbytes, seconds, problem):
    with pytest.raises(ValueError, match=problem):
        OnlineLinearFitter().add(nbytes, seconds)


def test_median_equals_statistics_median_for_values_and_columns():
    import statistics

    from omgs_hook.fitting import median

    rng = np.random.default_rng(3)
    for n in range(1, 33):
        values = rng.exponential(size=n).tolist()
        assert float(median(values)) == statistics.median(values)  # bit for bit
        table = rng.exponential(size=(n, 5))
        expected = [statistics.median(table[:, j].tolist()) for j in range(5)]
        assert median(table, axis=0).tolist() == expected
    with pytest.raises(ValueError, match="no values"):
        median([])
    with pytest.raises(ValueError, match="axis"):
        median(np.ones((2, 2)), axis=1)


def test_the_hooks_medians_do_not_import_numpy_ma():
    # np.median imports numpy.ma at its first call (about 8 ms, more where it sets off a
    # full GC pass): in the hook that landed on the training thread at the first re-plan
    import subprocess
    import sys

    probe = ("import sys, torch, omgs_hook\n"
             "from omgs_hook.measurements import BackwardMeter, GroupOverheadMeter\n"
             "from omgs_hook.fitting import median\n"
             "median([[1.0, 2.0], [3.0, 4.0]], axis=0)\n"
             "meter = GroupOverheadMeter()\n"
             "for n in (1000, 2000, 4000, 8000, 16000, 32000):\n"
             "    meter.add(n, 1e-8 * n, 1e-4)\n"
             "meter.estimate()\n"
             "from omgs_hook.measurements import TopkTimeMeter\n"
             "from omgs_hook.cost_model import TopkCost\n"
             "topk = TopkTimeMeter()\n"
             "for n in (1000, 2000, 4000):\n"
             "    topk.add(n, 1e-4)\n"
             "topk.scale(TopkCost(1e-5, 1e-9, 0.0))\n"
             "print('numpy.ma' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_quantile_is_numpys_default_quantile():
    from omgs_hook.fitting import quantile

    rng = np.random.default_rng(5)
    for n in (1, 2, 3, 10, 101):
        values = rng.standard_normal(n)
        for q in (0.0, 0.1, 0.5, 0.9, 1.0):
            assert quantile(values, q) == pytest.approx(np.quantile(values, q), abs=1e-12)
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="q must be in"):
            quantile([1.0], bad)
    with pytest.raises(ValueError, match="no values"):
        quantile([], 0.5)
