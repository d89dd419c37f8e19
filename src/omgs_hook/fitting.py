"""Fitting the planner's cost models to measured timings (pure numpy, no torch, no scipy).

The planner needs two kinds of cost model (see ``omgs_hook.cost_model``):

* a collective: ``t(bytes) = alpha + beta * bytes`` (``LinearCost``), for the packed
  sparse all-gather and for the dense all-reduce;
* a top-k selection: ``t(D) = c0 + c1 * D + c2 * D * log2(D)`` (``TopkCost``).

Why plain least squares is not good enough
------------------------------------------
Measured collective times span four orders of magnitude (0.25 ms at 1 KB, 70 ms at
40 MB on gloo loopback) and the largest messages grow *faster* than linearly (caches,
memory bandwidth, TCP windows). Ordinary least squares minimises absolute errors, so it
is dominated by the two largest sizes and tilts the line steeply enough that its
intercept alpha comes out **negative** - a model that says small messages are free,
which is exactly the regime where merging groups matters. Two remedies are used here:

1. **Relative-error weighting.** We minimise ``sum(((model(x_i) - t_i) / t_i) ** 2)``,
   i.e. every point counts by its *relative* error, so 1 KB and 8 MB messages matter
   equally. This is ordinary least squares on rows divided by ``t_i``.
2. **Non-negative coefficients.** All coefficients are physical costs, so the fit is a
   non-negative least-squares problem (NNLS). With at most a handful of coefficients the
   exact NNLS optimum is found by enumerating the supports (see
   :func:`nonnegative_least_squares`); no iterative solver and no scipy.

Two options make fits stable from run to run (``omgs-profile`` uses both):

3. **Huber weighting** (``robust=True``): iteratively re-weighted NNLS in which a point
   whose relative residual exceeds 1.5 robust standard deviations (MAD-based, at least
   2 %) counts in proportion to ``1/|residual|`` instead of ``residual**2`` - one point
   disturbed by another job no longer tilts the line. (A point measured far *below* the
   others still pulls it: relative residuals are asymmetric. Timing noise is upward.)
4. **A top-k form that does not flip** (``fit_topk(log_term="auto")``, the default):
   between 1e3 and 4e6 elements ``D`` and ``D*log2(D)`` differ in slope by a factor of
   2.2 only, so a free three-term fit trades ``c1`` against ``c2`` with the noise. The
   ``D*log2(D)`` term is kept only when it at least halves the RMS relative error of
   ``c0 + c1*D`` and that error is above 3 %.

Every fit reports each point's relative error ``(model - measured) / measured`` so a
poor fit (e.g. a super-linear tail the linear model cannot follow) is visible in the
profile file rather than hidden in two numbers.

``OnlineLinearFitter`` refits alpha/beta during training from the hook's own timed
collectives (``refit_online=True``); see its docstring and docs/calibration.md for the
trade-offs.
"""

import itertools
import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from omgs_hook.cost_model import LinearCost, TopkCost


def median(values, axis=None):
    """The median (of each column with ``axis=0``) exactly as ``statistics.median`` and
    ``np.median`` compute it: the middle value, or ``(a + b) / 2`` of the two middle ones.

    ``np.median`` imports ``numpy.ma`` at its first call (about 8 ms of CPU, and its
    allocations can set off one of Python's full GC passes), which in the hook lands on
    the training thread at the first re-plan; a sort does not."""
    if axis not in (None, 0):
        raise ValueError(f"median: axis must be None or 0, got {axis!r}")
    ordered = np.sort(np.asarray(values, dtype=np.float64), axis=axis)
    n = ordered.shape[0]
    if n == 0:
        raise ValueError("median of no values")
    middle = n // 2
    return ordered[middle] if n % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def quantile(values, q):
    """The ``q`` quantile of ``values`` (1-D) as ``np.quantile`` computes it by default
    (linear interpolation between the two nearest ranks), from a sort: ``np.quantile``
    imports ``numpy.ma`` at its first call (see :func:`median`)."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile: q must be in [0, 1], got {q!r}")
    ordered = np.sort(np.asarray(values, dtype=np.float64).ravel())
    n = ordered.size
    if n == 0:
        raise ValueError("quantile of no values")
    position = q * (n - 1)
    low = int(position)
    high = min(low + 1, n - 1)
    return float(ordered[low] + (ordered[high] - ordered[low]) * (position - low))


def _distinct(values):
    """How many distinct values ``values`` (1-D) holds: ``np.unique(values).size``
    without ``np.unique``, which imports ``numpy.ma`` at its first call (see
    :func:`median`)."""
    ordered = np.sort(np.asarray(values).ravel())
    return int(ordered.size and 1 + np.count_nonzero(ordered[1:] != ordered[:-1]))


# Enumerating supports costs 2**n least-squares solves: fine for the 2-3 coefficients
# used here, pointless beyond this.
_MAX_NNLS_COLUMNS = 12


@dataclass(frozen=True)
class LinearFit:
    """Result of :func:`fit_linear_relative`.

    alpha_s: fitted start-up time in seconds (>= 0).
    beta_s_per_byte: fitted time per byte in seconds (>= 0).
    rel_errors: one ``(predicted - measured) / measured`` per input point, in input order.
    """

    alpha_s: float
    beta_s_per_byte: float
    rel_errors: tuple

    @property
    def max_abs_rel_error(self):
        """Largest absolute relative error over the fitted points."""
        return max(abs(e) for e in self.rel_errors)

    def to_cost(self):
        """The fit as the planner's ``LinearCost``."""
        return LinearCost(alpha_s=self.alpha_s, beta_s_per_byte=self.beta_s_per_byte)


@dataclass(frozen=True)
class TopkFit:
    """Result of :func:`fit_topk`: ``t(D) = c0 + c1*D + c2*D*log2(D)``, all coefficients >= 0.

    rel_errors: one ``(predicted - measured) / measured`` per input point, in input order.
    form: ``"linear"`` when the ``D*log2(D)`` column was left out (``c2 == 0`` by choice,
        see :func:`fit_topk`), ``"n log n"`` when it was offered to the fit.
    """

    c0: float
    c1: float
    c2: float
    rel_errors: tuple
    form: str = "n log n"

    @property
    def max_abs_rel_error(self):
        """Largest absolute relative error over the fitted points."""
        return max(abs(e) for e in self.rel_errors)

    def to_cost(self):
        """The fit as the planner's ``TopkCost``."""
        return TopkCost(c0=self.c0, c1=self.c1, c2=self.c2)


def nonnegative_least_squares(matrix, target):
    """Solve ``min ||matrix @ x - target||_2`` subject to ``x >= 0`` exactly.

    The NNLS optimum ``x*`` with support ``S`` (its non-zero entries) is the unconstrained
    least-squares solution restricted to the columns in ``S`` (a KKT condition), and it is
    feasible. Conversely every support whose unconstrained solution is non-negative gives a
    feasible point, whose residual cannot beat the optimum. So the optimum is the best
    feasible solution over all ``2**n`` supports - exact, with no tolerances to tune, and
    cheap for the two or three columns of the cost models.

    Columns are scaled to unit norm before solving (top-k columns ``1``, ``D`` and
    ``D*log2(D)`` differ by ten orders of magnitude) and the solution is scaled back.

    Returns the solution as a 1-D float array of length ``matrix.shape[1]``.
    """
    a = np.asarray(matrix, dtype=float)
    b = np.asarray(target, dtype=float)
    if a.ndim != 2:
        raise ValueError(f"matrix: must be 2-D, got shape {a.shape}")
    rows, cols = a.shape
    if b.shape != (rows,):
        raise ValueError(f"target: must have shape ({rows},), got {b.shape}")
    if cols == 0 or cols > _MAX_NNLS_COLUMNS:
        raise ValueError(f"matrix: must have 1..{_MAX_NNLS_COLUMNS} columns, got {cols}")
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        raise ValueError("matrix and target: must be finite")

    norms = np.linalg.norm(a, axis=0)
    # an all-zero column can only ever get coefficient 0
    usable = norms > 0
    scale = np.where(usable, norms, 1.0)
    scaled = a / scale

    best = np.zeros(cols)
    best_residual = float(np.linalg.norm(b))  # the empty support: x = 0
    candidates = [c for c in range(cols) if usable[c]]
    for size in range(1, len(candidates) + 1):
        for support in itertools.combinations(candidates, size):
            sub = scaled[:, support]
            solution, _, rank, _ = np.linalg.lstsq(sub, b, rcond=None)
            # a rank-deficient support is covered by one of its smaller subsets
            if rank < size or np.any(solution < 0):
                continue
            residual = float(np.linalg.norm(sub @ solution - b))
            if residual < best_residual:
                best_residual = residual
                best = np.zeros(cols)
                best[list(support)] = solution
    return best / scale


def _as_samples(name_x, xs, name_t, ts):
    x = np.asarray(xs, dtype=float).ravel()
    t = np.asarray(ts, dtype=float).ravel()
    if x.shape != t.shape:
        raise ValueError(
            f"{name_x} and {name_t}: must have the same length, got {x.size} and {t.size}")
    if x.size == 0:
        raise ValueError(f"{name_x}: no samples given")
    if not np.all(np.isfinite(x)) or np.any(x < 0):
        raise ValueError(f"{name_x}: must be finite and non-negative")
    if not np.all(np.isfinite(t)) or np.any(t <= 0):
        # relative weighting divides by t: a zero or negative time cannot be weighted
        raise ValueError(f"{name_t}: must be finite and positive")
    return x, t


# Huber weighting of relative residuals (``robust=True``): residuals within
# HUBER_K robust standard deviations keep full weight, larger ones are down-weighted in
# proportion; the scale never drops below HUBER_MIN_SCALE so that near-perfect data do
# not make every small deviation an "outlier".
HUBER_K = 1.5
HUBER_MIN_SCALE = 0.02
_HUBER_ITERATIONS = 30


def _relative_fit(design, t, robust=False):
    """NNLS of ``design @ c ~ t`` weighted by 1/t; returns (coefficients, relative errors).

    ``robust=True`` iterates re-weighted NNLS with Huber weights on the relative
    residuals, so one bad point (a run disturbed by another job) pulls the fit far less
    than in plain least squares; every step is still the exact NNLS of
    :func:`nonnegative_least_squares`.
    """
    weighted = design / t[:, None]
    ones = np.ones_like(t)
    coefficients = nonnegative_least_squares(weighted, ones)
    if robust and t.size > design.shape[1]:
        for _ in range(_HUBER_ITERATIONS):
            residuals = weighted @ coefficients - ones
            scale = max(HUBER_MIN_SCALE,
                        1.4826 * float(median(np.abs(residuals - median(residuals)))))
            limit = HUBER_K * scale
            magnitude = np.abs(residuals)
            weights = np.where(magnitude <= limit, 1.0, limit / np.maximum(magnitude, 1e-300))
            root = np.sqrt(weights)[:, None]
            updated = nonnegative_least_squares(weighted * root, ones * root[:, 0])
            if np.allclose(updated, coefficients, rtol=1e-10, atol=0):
                coefficients = updated
                break
            coefficients = updated
    predicted = design @ coefficients
    rel_errors = tuple(float(e) for e in (predicted - t) / t)
    return coefficients, rel_errors


def fit_linear_relative(nbytes, seconds, robust=False):
    """Fit ``t = alpha + beta * bytes`` minimising relative errors, with alpha, beta >= 0.

    nbytes: message sizes in bytes (any non-negative numbers; repeats allowed, e.g. every
        repetition of a size, or one median per size).
    seconds: the measured time of each message, same length, all > 0.
    robust: Huber-weighted relative errors instead of squared ones (see
        :func:`_relative_fit`): a single disturbed point moves the line much less.

    Needs at least two distinct sizes (one size cannot separate start-up from per-byte
    cost). Returns a :class:`LinearFit` with each point's relative error.
    """
    x, t = _as_samples("nbytes", nbytes, "seconds", seconds)
    if _distinct(x) < 2:
        raise ValueError("nbytes: need at least 2 distinct message sizes to fit alpha and beta")
    design = np.column_stack([np.ones_like(x), x])
    (alpha, beta), rel_errors = _relative_fit(design, t, robust)
    return LinearFit(alpha_s=float(alpha), beta_s_per_byte=float(beta), rel_errors=rel_errors)


# The D*log2(D) column is kept only when it clearly helps: it must at least halve the
# RMS relative error of the linear fit c0 + c1*D, and the linear fit must be worse than
# this RMS (below it, the difference is measurement noise). Between 1e3 and 4e6
# elements D and D*log2(D) differ in slope by a factor of 2.2 only, so on noisy data
# the three-term fit trades c1 against c2 from run to run (a fit that "changes shape");
# the linear form is the stable default.
LOG_TERM_GAIN = 0.5
LOG_TERM_NOISE_RMS = 0.03


def _rms(errors):
    return math.sqrt(sum(e * e for e in errors) / len(errors))


def fit_topk(numel, seconds, log_term="auto", robust=False):
    """Fit ``t = c0 + c1*D + c2*D*log2(D)`` minimising relative errors, with c0, c1, c2 >= 0.

    numel: tensor sizes D (>= 1) the selector was timed on.
    seconds: the measured time of each selection, same length, all > 0.
    log_term: ``"auto"`` (default) fits ``c0 + c1*D`` and adds the ``D*log2(D)`` term only
        when the data clearly need it (it halves the RMS relative error, and the linear
        fit's RMS error exceeds :data:`LOG_TERM_NOISE_RMS`); ``True`` always offers all
        three terms to the fit, ``False`` never (``c2 = 0``).
    robust: Huber-weighted relative errors (see :func:`fit_linear_relative`).

    ``c0`` is the fixed cost (kernel launches, Python), ``c1`` a streaming pass over the
    data (abs, threshold), ``c2`` a sort-like term. Needs at least three distinct sizes.
    Returns a :class:`TopkFit` with each point's relative error and the chosen form.
    """
    if log_term not in ("auto", True, False):
        raise ValueError(f"log_term: must be 'auto', True or False, got {log_term!r}")
    d, t = _as_samples("numel", numel, "seconds", seconds)
    if np.any(d < 1):
        raise ValueError("numel: every size must be >= 1")
    if _distinct(d) < 3:
        raise ValueError("numel: need at least 3 distinct sizes to fit c0, c1 and c2")
    full_design = np.column_stack([np.ones_like(d), d, d * np.log2(d)])
    if log_term is True:
        (c0, c1, c2), rel_errors = _relative_fit(full_design, t, robust)
        return TopkFit(c0=float(c0), c1=float(c1), c2=float(c2), rel_errors=rel_errors)
    (c0, c1), rel_errors = _relative_fit(full_design[:, :2], t, robust)
    linear = TopkFit(c0=float(c0), c1=float(c1), c2=0.0, rel_errors=rel_errors, form="linear")
    if log_term is False:
        return linear
    (c0, c1, c2), rel_errors = _relative_fit(full_design, t, robust)
    full = TopkFit(c0=float(c0), c1=float(c1), c2=float(c2), rel_errors=rel_errors)
    linear_rms = _rms(linear.rel_errors)
    if linear_rms > LOG_TERM_NOISE_RMS and _rms(full.rel_errors) <= LOG_TERM_GAIN * linear_rms:
        return full
    return linear


class OnlineLinearFitter:
    """Refit ``alpha``/``beta`` from the hook's own timed collectives (``refit_online=True``).

    The hook times each collective it issues (bytes on the wire per rank, seconds from
    issue to completion) and calls :meth:`add`. The fitter keeps only the most recent
    ``window`` samples, so the model follows a network whose load changes, and refits with
    the same relative-error NNLS as the offline profile.

    Robustness: samples are grouped by size and each size contributes the *median* of its
    recent times, so one slow step (a GC pause, a straggler) does not move the fit.

    Returns ``None`` from :meth:`fit` until the window holds at least ``min_sizes``
    distinct sizes whose largest is at least ``min_size_ratio`` times the smallest - a
    hook whose plan has one group (or groups of nearly equal size) sends one size and can
    never separate alpha from beta; it then keeps its profile.

    Options:
        window: number of most recent (bytes, seconds) samples kept (>= 2).
        min_sizes: distinct sizes needed before fitting (>= 2).
        min_size_ratio: required largest/smallest size ratio (>= 1); sizes closer than
            this make beta ill-determined and the fit pure noise.

    The hook must average the fitted numbers across ranks before planning: every rank
    times its own collectives, and ranks that plan with different costs would form
    different groups and deadlock.
    """

    def __init__(self, window=256, min_sizes=2, min_size_ratio=2.0):
        if isinstance(window, bool) or not isinstance(window, int) or window < 2:
            raise ValueError(f"window: must be an integer >= 2, got {window!r}")
        if isinstance(min_sizes, bool) or not isinstance(min_sizes, int) or min_sizes < 2:
            raise ValueError(f"min_sizes: must be an integer >= 2, got {min_sizes!r}")
        if not (isinstance(min_size_ratio, (int, float)) and math.isfinite(min_size_ratio)
                and min_size_ratio >= 1):
            raise ValueError(
                f"min_size_ratio: must be a finite number >= 1, got {min_size_ratio!r}")
        self.window = window
        self.min_sizes = min_sizes
        self.min_size_ratio = float(min_size_ratio)
        self._samples = deque(maxlen=window)

    def __len__(self):
        return len(self._samples)

    @property
    def samples(self):
        """The kept (bytes, seconds) samples, oldest first."""
        return list(self._samples)

    @staticmethod
    def _checked_sample(nbytes, seconds):
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or nbytes <= 0:
            raise ValueError(f"nbytes: must be a positive integer, got {nbytes!r}")
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float, np.floating)):
            raise ValueError(f"seconds: must be a number, got {seconds!r}")
        seconds = float(seconds)
        if not math.isfinite(seconds) or seconds <= 0:
            raise ValueError(f"seconds: must be finite and positive, got {seconds!r}")
        return int(nbytes), seconds

    def add(self, nbytes, seconds):
        """Record one timed collective of ``nbytes`` bytes that took ``seconds``."""
        self._samples.append(self._checked_sample(nbytes, seconds))

    def clear(self):
        """Forget every sample (e.g. after the hook changed its process group)."""
        self._samples.clear()

    def medians(self):
        """``{bytes: median seconds}`` over the window."""
        by_size = {}
        for nbytes, seconds in self._samples:
            by_size.setdefault(nbytes, []).append(seconds)
        return {size: float(median(times)) for size, times in sorted(by_size.items())}

    def fit(self):
        """Return the refitted ``LinearCost``, or ``None`` while the window cannot support a fit."""
        medians = self.medians()
        if len(medians) < self.min_sizes:
            return None
        sizes = list(medians)
        if sizes[-1] < self.min_size_ratio * sizes[0]:
            return None
        return fit_linear_relative(sizes, list(medians.values())).to_cost()

    def state_dict(self):
        """Plain-Python state (for the hook's checkpoint; safe with ``weights_only`` loads)."""
        return {
            "window": self.window,
            "min_sizes": self.min_sizes,
            "min_size_ratio": self.min_size_ratio,
            "samples": [list(s) for s in self._samples],
        }

    def load_state_dict(self, state):
        """Restore samples saved by :meth:`state_dict` (options stay as constructed)."""
        try:
            samples = state["samples"]
        except (KeyError, TypeError):
            raise ValueError("state: expected a dict with a 'samples' list") from None
        restored = []
        for i, sample in enumerate(samples):
            if not isinstance(sample, (list, tuple)) or len(sample) != 2:
                raise ValueError(f"state.samples[{i}]: expected [bytes, seconds], got {sample!r}")
            try:
                restored.append(self._checked_sample(*sample))
            except ValueError as error:
                raise ValueError(f"state.samples[{i}].{error}") from None
        # validated first, so a bad state leaves the current window untouched
        self._samples.clear()
        self._samples.extend(restored)
