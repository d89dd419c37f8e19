"""Exact top-k selection by magnitude, behind one interface with interchangeable backends.

The hook sparsifies every merged group on every step: it needs the ``k`` entries of a
flat gradient (+ residual) ``x`` with the largest ``|x|``. This module gives that one
operation several implementations that return *identical* results:

``TopkSelector.select(x, k) -> (values, indices)``

* ``x``: 1-D floating tensor (float16, bfloat16, float32, float64), CPU or CUDA, any
  stride (the hook passes contiguous float32).
* ``k``: integer with ``1 <= k <= x.numel()``.
* ``indices``: int64, the positions of the selected entries, **in ascending order**.
* ``values``: ``x[indices]`` - the signed entries in ``x``'s dtype (a new tensor).

Selection rule (all backends, exact)
------------------------------------
The selected set is the ``k`` largest ``|x|``; among equal magnitudes the **lower index
wins** (so the set is unique and every backend returns the same tensors, bit for bit).
``-0.0`` and ``0.0`` have the same magnitude. NaN counts as larger than every number,
+-inf included (as in ``torch.topk``), so a NaN gradient is propagated, not silently
dropped. The result is deterministic: the same input gives the same output.

Backends
--------
``torch``
    ``torch.topk(|x|, k + 1, sorted=False)`` and a sort of the k positions. The extra
    (k+1)-th entry tells, at no extra pass, whether the k-th largest magnitude is tied
    with an unselected entry; only then (rare for real gradients) one more pass over
    ``|x|`` applies the lower-index-first rule, because ``torch.topk`` itself breaks ties
    in an unspecified order. Works on every device; on CUDA it syncs once per call to
    read that tie flag.
``sampled``
    Exact, and much faster than ``torch`` on a CPU (see docs/topk.md): a random sample of
    ``|x|`` gives a threshold guess ``t`` meant to lie slightly below the k-th largest
    magnitude; one pass collects the candidates ``|x| >= t`` (in index order); the exact
    rule above is then applied to the candidates only. Whenever at least ``k`` entries
    reach ``t``, every entry of the true top-k does too, so the answer is exact whatever
    the sample was - the sample only decides the speed. When fewer than ``k`` pass, a
    lower threshold from the same sample is tried, then the full ``torch`` path;
    ``stats()`` counts these fall-backs. Also runs on CUDA tensors (torch ops; the
    candidate count forces a sync).
``cupy``
    CUDA only: a radix select on the magnitude bit patterns with our own kernels
    (``omgs_hook.topk_cupy``), sharing the tensors with CuPy through DLPack (zero copy),
    no host synchronisation.

Which backend ``get_selector("auto", device)`` picks: ``cupy`` for a CUDA device when
CuPy is installed and can compile and run its kernels there, otherwise ``torch`` on CUDA
(``torch.topk`` is fast on a GPU and, unlike ``sampled``, needs only one sync); ``sampled``
on the CPU.

Selectors keep no state between calls that affects results. The ``sampled`` selector
keeps scratch buffers on the CPU (reused to avoid page faults on every call), per
thread, so one selector may be shared between threads, and, for the fused pass of a
group the caller names (``accumulate_select(..., hint_key=...)``), the threshold the
group's next call starts from instead of a sample: speed only, never the result.
"""

import importlib.util
import math
import operator
import os
import threading
import warnings

import numpy as np
import torch

BACKENDS = ("torch", "sampled", "cupy")


def _load_native():
    """The optional C pass (``omgs_hook._native``, built at install where a C compiler
    is present), or None: not built, or ``OMGS_HOOK_NATIVE=0`` in the environment."""
    if os.environ.get("OMGS_HOOK_NATIVE", "1") == "0":
        return None
    try:
        from omgs_hook import _native
    except ImportError:
        return None
    return _native


# the fused pass in C, or None (the NumPy/torch chunk loop runs instead: same results)
_native = _load_native()
# what the C pass returns when more candidates passed than its buffers hold
_OVERFLOW = object()

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# element size -> (torch signed int dtype, numpy unsigned dtype) of the same width
_BIT_VIEWS = {2: (torch.int16, np.uint16), 4: (torch.int32, np.uint32), 8: (torch.int64, np.uint64)}


class BackendUnavailableError(ValueError):
    """The named top-k backend cannot run on the requested device (e.g. cupy on a CPU)."""


def check_selection_args(x, k):
    """Validate ``select``'s arguments; return ``k`` as a plain int.

    Raises TypeError for a non-tensor, a non-floating dtype or a non-integer ``k``, and
    ValueError for a tensor that is not 1-D or empty, or ``k`` outside ``[1, x.numel()]``.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"top-k: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 1:
        raise ValueError(f"top-k: x must be 1-D, got shape {tuple(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in FLOAT_DTYPES)
        raise TypeError(f"top-k: x has dtype {x.dtype}; supported dtypes: {names}")
    if isinstance(k, bool):
        raise TypeError("top-k: k must be an integer, got bool")
    try:
        k = operator.index(k)
    except TypeError:
        raise TypeError(f"top-k: k must be an integer, got {type(k).__name__}") from None
    numel = x.numel()
    if numel == 0:
        raise ValueError("top-k: x is empty")
    if not 1 <= k <= numel:
        raise ValueError(f"top-k: k={k} is out of range [1, {numel}] for x of {numel} elements")
    return k


def exact_topk_positions(magnitudes, k):
    """Positions (int64, ascending) of the k largest entries of ``magnitudes``.

    ``magnitudes`` is a 1-D tensor of non-negative values or NaN (``|x|``), with
    ``1 <= k <= len``. Ties at the k-th largest value go to the lower positions; NaN is
    larger than everything. This is the exact core that both torch-based backends share.
    """
    return _exact_topk(magnitudes, k)[0]


def _exact_topk(magnitudes, k):
    """:func:`exact_topk_positions` and the k-th largest magnitude (a Python float; NaN
    when at least k entries are NaN; None for ``k == len``, where it is not needed)."""
    numel = magnitudes.numel()
    if k == numel:
        return torch.arange(numel, device=magnitudes.device), None
    if magnitudes.device.type == "cpu" and magnitudes.dtype in (torch.float32, torch.float64):
        return _exact_topk_numpy(magnitudes.numpy(), k)
    # k + 1 entries: the smallest two of them are the k-th and (k+1)-th largest values,
    # which tells whether the cut at k falls inside a run of equal magnitudes.
    top = torch.topk(magnitudes, k + 1, sorted=False)
    lowest = torch.topk(top.values, 2, largest=False, sorted=True)
    next_value, kth_value = lowest.values.tolist()  # the one host read (a sync on CUDA)
    tied = next_value == kth_value or (math.isnan(next_value) and math.isnan(kth_value))
    if not tied:
        # No tie across the cut: the selection is the k+1 entries minus the smallest one.
        positions = top.indices
        positions[lowest.indices[0]] = positions[k]
        return _ascending(positions[:k], numel), kth_value
    return _positions_with_ties(magnitudes, k, lowest.values[1]), kth_value


def _exact_topk_numpy(magnitudes, k):
    """:func:`_exact_topk` in NumPy, for CPU float32/float64 (``k < len``): the same
    positions, bit for bit. A NumPy call costs a few microseconds here against 10-20 for
    a torch op, and the two torch top-k's plus the sort are most of a small group's
    selection (measured in docs/topk.md)."""
    count = magnitudes.size
    # np.partition sorts NaN last, i.e. above every number, as the selection rule does
    kth = magnitudes.dtype.type(np.partition(magnitudes, count - k)[count - k])
    if np.isnan(kth):  # at least k NaNs: the k lowest-index ones
        return torch.from_numpy(np.flatnonzero(np.isnan(magnitudes))[:k]), math.nan
    chosen = np.logical_not(magnitudes <= kth)  # above the k-th value, NaN included
    needed = k - int(np.count_nonzero(chosen))
    if needed:  # the ties at the k-th value: the lowest-index ones
        chosen[np.flatnonzero(magnitudes == kth)[:needed]] = True
    return torch.from_numpy(np.flatnonzero(chosen)), float(kth)


def _ascending(positions, numel):
    """``positions`` (distinct, in [0, numel)) sorted ascending.

    On the CPU NumPy does it (torch's CPU sort of int64 is ~8x slower): by marking a
    boolean map and reading it back when the positions are dense, else by sorting.
    """
    if positions.device.type != "cpu":
        return positions.sort().values
    if 4 * positions.numel() >= numel:
        marked = np.zeros(numel, dtype=np.bool_)
        marked[positions.numpy()] = True
        return torch.from_numpy(np.flatnonzero(marked))
    return torch.from_numpy(np.sort(positions.numpy()))


def _positions_with_ties(magnitudes, k, kth_value):
    """Exact selection when the k-th largest value ``kth_value`` also occurs unselected.

    Everything strictly larger is taken, then the lowest-index entries equal to it.
    """
    if torch.isnan(kth_value):
        # At least k NaNs: the k lowest-index NaNs.
        return torch.isnan(magnitudes).nonzero().squeeze(1)[:k]
    # ~(m <= v) is m > v or m is NaN: NaN counts as larger than any number.
    above = torch.logical_not(magnitudes <= kth_value).nonzero().squeeze(1)
    needed = k - above.numel()
    equal = (magnitudes == kth_value).nonzero().squeeze(1)[:needed]
    return _ascending(torch.cat((above, equal)), magnitudes.numel())


class TopkSelector:
    """Base class: validates arguments and handles ``k == numel``; subclasses select.

    Attributes:
        name: the backend name, one of ``BACKENDS``.
    """

    name = "base"

    def select(self, x, k):
        """Return ``(values, indices)`` of the k largest ``|x|`` (see the module docstring)."""
        k = check_selection_args(x, k)
        x = x.detach()  # selection is not differentiable; DLPack refuses grad tensors
        with torch.no_grad():
            if k == x.numel():
                return x.clone(), torch.arange(k, device=x.device)
            return self._select(x, k)

    def _select(self, x, k):
        raise NotImplementedError(f"{type(self).__name__} must implement _select")

    def accumulate_select(self, runs, residual, out, k, clear_runs=False, hint_key=None):
        """``out = gradient + residual``, then ``select(out, k)``.

        ``runs``: ``[(offset, length, gradient slice)]`` covering ``out`` (a 1-D float32
        tensor); ``residual``: a tensor like ``out`` or None (zero). The result is exactly
        ``select(out, k)`` after the sums; a backend may fuse the two passes (the
        ``sampled`` CPU selector does), which only changes the speed. With
        ``clear_runs`` every gradient run is zero on return (the hook's write-back then
        need not zero it; the fused pass zeroes each chunk while it is in cache).
        ``hint_key``: any hashable naming the group, the same every step; a backend may
        remember something of this call under it to go faster next time (the ``sampled``
        CPU selector: the k-th largest magnitude, as the next threshold). Never changes
        the result.
        """
        _accumulate_into(runs, residual, out)
        if clear_runs:
            for _, _, grad in runs:
                grad.zero_()
        return self.select(out, k)

    def stats(self):
        """Counters for logging (empty for backends that keep none)."""
        return {}

    def __repr__(self):
        return f"{type(self).__name__}(name={self.name!r})"


class TorchTopkSelector(TopkSelector):
    """``torch.topk`` on ``|x|`` with the lower-index tie rule enforced (any device)."""

    name = "torch"

    def _select(self, x, k):
        indices = exact_topk_positions(x.abs(), k)
        return x[indices], indices


class SampledTopkSelector(TopkSelector):
    """Exact top-k via a sampled threshold and an exact top-k over the candidates.

    Algorithm, per call (D = x.numel()):

    1. ``|x|`` into a reused scratch buffer (one pass).
    2. Read ``s`` entries of it at random positions (cached per D, rotated every call by
       a deterministic offset so that no fixed part of the gradient is persistently
       under-sampled). About ``s * k / D`` of them are expected among the top k; the
       threshold ``t`` is the sample's r-th largest magnitude with
       ``r = s*k/D + margin_sigmas * sqrt(s*k/D) + 1``, i.e. ``margin_sigmas`` binomial
       standard deviations of head room so that ``|x| > t`` holds for at least k entries
       with high probability while keeping the candidates few (about
       ``k + margin_sigmas * sqrt(k * D / s)``).
    3. One comparison pass and ``nonzero`` give the candidate indices ``|x| >= t`` (NaN
       included) in index order (on the CPU in NumPy, see ``_candidates``).
    4. If there are at least k candidates, the exact rule of ``exact_topk_positions`` on
       the candidates' magnitudes is the exact answer for x (proof: k entries are >= t,
       so the k-th largest magnitude T is >= t too, and every entry >= T - the whole
       top k, ties included - is a candidate; the candidates keep index order, so the
       tie rule carries over). Otherwise a threshold ``retry_factor`` times further
       down the sample is tried, then the full ``torch`` path. ``>=`` rather than ``>``
       matters for coarse values: with runs of equal magnitudes at the top (quantised
       or integer data), ``> t`` would often pass fewer than k entries.
    5. If the threshold is 0 (mostly-zero input), the candidates are ``|x| > 0`` instead;
       when fewer than k entries are non-zero, the answer is all of them plus the
       lowest-index zeros - still exact, without the full path.

    Below ``min_numel`` elements, or above ``max_density`` (k/D), the plain exact path is
    used: there the extra passes cost more than they save (measured one-thread
    break-even: about 3e4 elements; density 0.2-0.4 at 1e5-1e6 elements).

    Memory: on the CPU each thread that calls ``select`` keeps a magnitude buffer and a
    boolean mask as large as the largest input seen (5 bytes per float32 element).

    Args:
        margin_sigmas: head room of the threshold in binomial standard deviations
            (larger: fewer fall-backs, more candidates).
        min_numel: smallest D that uses the sampled path.
        max_density: largest k/D that uses the sampled path.
        retry_factor: how many times deeper in the sample the second threshold is taken.
        seed: seed of the (private) generator that draws the sample positions; it never
            touches torch's global random state.
    """

    name = "sampled"

    def __init__(self, margin_sigmas=4.0, min_numel=32768, max_density=0.25, retry_factor=4,
                 seed=0x5EED):
        if not margin_sigmas >= 0:
            raise ValueError(f"sampled top-k: margin_sigmas must be >= 0, got {margin_sigmas}")
        if not 0 < max_density <= 1:
            raise ValueError(f"sampled top-k: max_density must be in (0, 1], got {max_density}")
        if retry_factor < 1:
            raise ValueError(f"sampled top-k: retry_factor must be >= 1, got {retry_factor}")
        self.margin_sigmas = float(margin_sigmas)
        self.min_numel = int(min_numel)
        self.max_density = float(max_density)
        self.retry_factor = int(retry_factor)
        self.seed = int(seed)
        self._positions = {}  # (D, s, device) -> int64 sample positions
        self._scratch_local = threading.local()
        self._lock = threading.Lock()
        self._counts = {"calls": 0, "sampled_calls": 0, "retries": 0, "fallbacks": 0,
                        "candidates": 0, "hinted_calls": 0, "hint_misses": 0,
                        "raises": 0, "overflows": 0}
        self._hints = {}  # (hint_key, k) -> the group's last k-th largest magnitude

    def stats(self):
        """Counters: calls, sampled_calls (took the sampled path), retries (second
        threshold needed), fallbacks (full top-k needed), candidates (summed count),
        hinted_calls (fused passes whose threshold was the group's previous k-th
        magnitude, no sample), hint_misses (of those, passes with fewer than k
        candidates, which then took the sampled path on the finished sums), raises
        (fused passes in C that raised their threshold when the candidates filled its
        buffers: the threshold was far too low), overflows (of those, passes where ties
        kept the buffers full, which then took the sampled path on the sums too)."""
        with self._lock:
            return dict(self._counts)

    def _count(self, **increments):
        with self._lock:
            for key, value in increments.items():
                self._counts[key] += value

    @staticmethod
    def sample_size(numel, k):
        """Sample size s for D = numel and k.

        The sample costs a gather and a top-k of s elements; a smaller sample costs more
        candidates, about k + margin * sqrt(k*D/s) + D/s. The sum is smallest around
        s ~ 4 * (k*D)^(1/3) (at least 1024, at most D); the expected number of sample
        hits may then be small - the margin in ``_thresholds`` keeps the chance of too
        few candidates below ~1e-3 even so, and too few candidates only cost time.
        """
        return int(min(numel, max(1024.0, 4.0 * (k * numel) ** (1.0 / 3.0))))

    def _scratch(self, numel, dtype):
        """A reused per-thread CPU buffer of ``numel`` elements of ``dtype``.

        Fresh large CPU allocations cost page faults on every call. (Not used on CUDA:
        the caching allocator makes fresh tensors cheap there, and a buffer shared
        across streams would race.)"""
        buffers = getattr(self._scratch_local, "buffers", None)
        if buffers is None:
            buffers = self._scratch_local.buffers = {}
        buffer = buffers.get(dtype)
        if buffer is None or buffer.numel() < numel:
            buffer = buffers[dtype] = torch.empty(numel, dtype=dtype)
        return buffer[:numel]

    def _magnitudes(self, x):
        """|x|, on the CPU written into a reused buffer."""
        if x.device.type != "cpu":
            return x.abs()
        magnitudes = self._scratch(x.numel(), x.dtype)
        torch.abs(x, out=magnitudes)
        return magnitudes

    def _candidates(self, magnitudes, threshold, strict):
        """Indices (ascending) where magnitude >= threshold (> threshold if ``strict``),
        NaN always included.

        On the CPU this runs in NumPy on the magnitudes' bit patterns read as unsigned
        integers: for non-negative floats that order equals the value order, a NaN's
        pattern lies above inf's (so NaN is a candidate, as the tie rule wants), and
        NumPy's vectorised compare and ``flatnonzero`` are 3-5x faster here than
        ``torch.le``/``torch.nonzero`` (0.2 + 0.13 ms vs 0.5 + 0.7 ms at 1e6, one thread).
        """
        if magnitudes.device.type != "cpu":
            # ~(m < t) is m >= t or m is NaN
            below = magnitudes <= threshold if strict else magnitudes < threshold
            return torch.logical_not(below).nonzero().squeeze(1)
        signed, unsigned = _BIT_VIEWS[magnitudes.element_size()]
        bits = magnitudes.view(signed).numpy().view(unsigned)
        threshold_bits = threshold.reshape(1).view(signed).numpy().view(unsigned)[0]
        mask = self._scratch(magnitudes.numel(), torch.bool).numpy()
        (np.greater if strict else np.greater_equal)(bits, threshold_bits, out=mask)
        return torch.from_numpy(np.flatnonzero(mask))

    @staticmethod
    def _first_zeros(magnitudes, count):
        """The ``count`` lowest indices where the magnitude is 0."""
        return (magnitudes == 0).nonzero().squeeze(1)[:count]

    def _sample_positions(self, numel, size, device):
        """The cached sample positions for (D, s), ascending (so a rotation of them is two
        ascending pieces, see :meth:`_sorted_sample_at`; only the set matters for the
        thresholds, never the order)."""
        key = (numel, size, device)
        positions = self._positions.get(key)
        if positions is None:
            generator = torch.Generator().manual_seed(self.seed)
            positions = torch.randint(numel, (size,), generator=generator).sort().values.to(device)
            with self._lock:
                self._positions[key] = positions
        return positions

    def _select(self, x, k):
        numel = x.numel()
        self._count(calls=1)
        if numel < self.min_numel or k > self.max_density * numel:
            indices = exact_topk_positions(x.abs(), k)
            return x[indices], indices
        self._count(sampled_calls=1)
        magnitudes = self._magnitudes(x)
        indices = self._select_sampled(magnitudes, k)
        return x[indices], indices

    def _sample_at(self, numel, k, device):
        """This call's sample positions: cached per D, rotated by a golden-ratio step per
        call - deterministic, but each call sees a different subset, so a persistently
        unlucky sample cannot recur every step."""
        positions, offset = self._sample_base(numel, k, device)
        return (positions + offset) % numel

    def _sample_base(self, numel, k, device):
        """The cached positions and this call's rotation offset."""
        size = self.sample_size(numel, k)
        positions = self._sample_positions(numel, size, device)
        with self._lock:
            calls = self._counts["calls"]
        return positions, (calls * 0x9E3779B97F4A7C15) % numel

    def _sorted_sample_at(self, numel, k):
        """The positions of :meth:`_sample_at` (the same set), ascending, on the CPU: the
        rotation of the ascending cached positions wraps once, so it is the wrapped tail
        followed by the rest - no sort. Ascending positions let :func:`_sum_at` read each
        run of a multi-bucket group as one slice instead of masking every position."""
        positions, offset = self._sample_base(numel, k, torch.device("cpu"))
        wrap = int(torch.searchsorted(positions, numel - offset))
        return torch.cat((positions[wrap:] + (offset - numel), positions[:wrap] + offset))

    def _thresholds(self, magnitudes, k):
        """Two threshold guesses (first, then lower for the retry) from a sample."""
        numel = magnitudes.numel()
        sample = magnitudes[self._sample_at(numel, k, magnitudes.device)]
        return self._ranked_thresholds(sample, numel, k)

    def _ranked_thresholds(self, sample, numel, k):
        """The sample's magnitudes at the two threshold ranks (see the class docstring)."""
        size = sample.numel()
        expected_hits = size * k / numel
        rank = int(math.ceil(expected_hits + self.margin_sigmas * math.sqrt(expected_hits))) + 1
        rank = min(rank, size)
        retry_rank = min(self.retry_factor * rank, size)
        ranked = torch.topk(sample, retry_rank, sorted=True).values
        return ranked[rank - 1], ranked[retry_rank - 1]

    def accumulate_select(self, runs, residual, out, k, clear_runs=False, hint_key=None):
        """``out = gradient + residual`` and the exact top-k of ``out``, in one pass.

        On the CPU for float32, where the sampled path applies: the threshold is this
        group's k-th largest magnitude of its previous call times :data:`HINT_MARGIN`
        when ``hint_key`` names a group seen before with the same k, else it comes from
        the sample positions' values of ``gradient + residual`` (read before the pass).
        Then one pass writes ``out``, compares the magnitudes with the threshold and
        collects the candidate positions and values (and, with ``clear_runs``, zeroes
        the gradient it just read): in C (``omgs_hook._native``) where it is built and
        every run is a contiguous float32 tensor, 64 elements at a time in registers;
        else in cache-sized chunks in NumPy/torch (:meth:`_chunk_pass`). Either way
        neither ``|out|`` nor a group-sized mask goes through memory, and the
        candidates are never read back from it. The rest is the sampled path: at least k
        candidates make the exact rule on the candidates exact; fewer (or a threshold of
        0, or NaN/inf in the sample) fall back to the plain path on the finished ``out``.
        """
        numel = out.numel()
        k = check_selection_args(out, k)
        if (out.device.type != "cpu" or out.dtype != torch.float32 or k == numel
                or numel < self.min_numel or k > self.max_density * numel):
            return super().accumulate_select(runs, residual, out, k, clear_runs)
        hint = None if hint_key is None else self._hints.get((hint_key, k))
        if hint is not None:
            # the previous k-th magnitude, a little lower: the sample's gather reads s
            # random positions of two group-sized arrays, cache misses all (about 2 ms
            # at 12M elements); this costs nothing
            threshold_bits = np.float32(hint).view(np.uint32)
        else:
            positions = self._sorted_sample_at(numel, k)
            first, _ = self._ranked_thresholds(_sum_at(runs, residual, positions).abs_(),
                                               numel, k)
            if not bool(first > 0) or not bool(torch.isfinite(first)):
                return super().accumulate_select(runs, residual, out, k, clear_runs)
            threshold_bits = first.reshape(1).view(torch.int32).numpy().view(np.uint32)[0]
        self._count(calls=1, sampled_calls=1, hinted_calls=int(hint is not None))
        with torch.no_grad():
            found = self._native_pass(runs, residual, out, k, threshold_bits, clear_runs)
            if found is None:
                found = self._chunk_pass(runs, residual, out, threshold_bits, clear_runs)
            overflow = found is _OVERFLOW
            candidates, values, threshold_bits = (
                (None, None, threshold_bits) if overflow else found)
            if candidates is not None and candidates.size >= k:
                candidates = torch.from_numpy(candidates)
                self._count(candidates=candidates.numel())
                magnitudes = np.abs(values)
                chosen, kth = _exact_topk(torch.from_numpy(magnitudes), k)
                if hint_key is not None:
                    self._remember(hint_key, k, _next_threshold(
                        magnitudes, k, kth, threshold_bits.view(np.float32)))
                return torch.from_numpy(values)[chosen], candidates[chosen]
            # fewer than k candidates (the top fell), or more than the C pass's buffers
            # hold (it rose): the sampled path on the finished sums
            self._count(retries=1, hint_misses=int(hint is not None and not overflow),
                        overflows=int(overflow))
            indices = self._select_sampled(self._magnitudes(out), k)
            values = out[indices]
            if hint_key is not None:  # start lower than the new k-th value
                self._remember(hint_key, k, HINT_AFTER_MISS * float(values.abs().min()))
            return values, indices

    def _chunk_pass(self, runs, residual, out, threshold_bits, clear_runs):
        """The fused pass in NumPy/torch, chunk by chunk: ``(candidate positions, their
        values, threshold_bits)``, NumPy arrays in ascending position (None with none)."""
        chunk = self._chunk_scratch(out.dtype)
        chunk_mask = self._chunk_scratch(torch.bool).numpy()
        found, found_values = [], []  # ascending candidate positions and their values
        for offset, length, grad in runs:
            for start in range(0, length, FUSED_CHUNK):
                stop = min(length, start + FUSED_CHUNK)
                target = out[offset + start:offset + stop]
                source = grad[start:stop]
                if residual is None:
                    target.copy_(source)
                else:
                    torch.add(source, residual[offset + start:offset + stop], out=target)
                if clear_runs:
                    source.zero_()  # still in cache: the write-back need not zero it
                magnitudes = chunk[:stop - start]
                torch.abs(target, out=magnitudes)
                hits = chunk_mask[:stop - start]
                np.greater_equal(magnitudes.view(torch.int32).numpy().view(np.uint32),
                                 threshold_bits, out=hits)
                where = np.flatnonzero(hits)
                if where.size:
                    found.append(where + (offset + start))
                    found_values.append(target.numpy()[where])  # from cache
        if not found:
            return None, None, threshold_bits
        return np.concatenate(found), np.concatenate(found_values), threshold_bits

    def _native_pass(self, runs, residual, out, k, threshold_bits, clear_runs):
        """The fused pass in C (``omgs_hook._native``): ``(candidate positions, their
        values, the threshold's bits at the end)``, the positions ascending. Its
        candidate buffers hold ``cap`` entries; when they fill up it raises the
        threshold to the magnitude that keeps ``cap // 2`` (>= k) of them, which keeps
        the top k whole (a threshold far too low costs a few selections among the
        buffers, not a second pass). Without that the candidates are those of
        :meth:`_chunk_pass`, bit for bit. :data:`_OVERFLOW` when ties at the raised
        threshold left nothing to drop (the sums and the zeros are complete: the caller
        selects on ``out``). None where it cannot run: not built, a threshold of 0, or a
        run or residual that is not a contiguous float32 CPU tensor (the chunk loop
        handles those), or one that overlaps ``out`` (the C pass reads and writes through
        ``restrict`` pointers)."""
        native = _native
        if native is None or int(threshold_bits) == 0 or not out.is_contiguous():
            return None
        span = _byte_span(out)
        if residual is not None and (residual.dtype != torch.float32
                                     or residual.device.type != "cpu"
                                     or not residual.is_contiguous()
                                     or residual.numel() != out.numel()
                                     or _overlap(_byte_span(residual), span)):
            return None
        table = []
        for offset, length, grad in runs:
            if (grad.dtype != torch.float32 or grad.device.type != "cpu"
                    or not grad.is_contiguous() or grad.numel() != length
                    or (length and _overlap(_byte_span(grad), span))):
                return None
            table += (grad.data_ptr() if length else 0, offset, length)
        table = np.array(table, dtype=np.int64)
        # room for the hint's 3k (HINT_HEADROOM) and the sample's margin before a raise
        cap = int(4 * HINT_HEADROOM * k) + 65536
        positions, values = self._candidate_scratch(cap)
        count, final_bits = native.accumulate_select_f32(
            table.ctypes.data, len(runs),
            residual.data_ptr() if residual is not None else 0, out.data_ptr(),
            int(threshold_bits), bool(clear_runs),
            positions.ctypes.data, values.ctypes.data, cap, cap // 2)
        if count > cap:  # (a compaction found nothing to drop)
            self._count(raises=1)
            return _OVERFLOW
        if final_bits != int(threshold_bits):
            self._count(raises=1)
        if count == 0:
            return None, None, threshold_bits
        # copies: the scratch is reused by this thread's next pass
        return (positions[:count].copy(), values[:count].copy(),
                np.uint32(final_bits))

    def _candidate_scratch(self, cap):
        """Per-thread position (int64) and value (float32) buffers of at least ``cap``."""
        buffers = getattr(self._scratch_local, "candidates", None)
        if buffers is None or buffers[0].size < cap:
            buffers = self._scratch_local.candidates = (np.empty(cap, dtype=np.int64),
                                                        np.empty(cap, dtype=np.float32))
        return buffers

    def _remember(self, hint_key, k, threshold):
        """Keep ``threshold`` as the group's next threshold (a positive finite value
        only; else forget the group's hint, so that the next call samples)."""
        if 0.0 < threshold < math.inf:
            if len(self._hints) >= MAX_HINTS:  # groups of plans long gone
                self._hints.clear()
            self._hints[(hint_key, k)] = threshold
        else:
            self._hints.pop((hint_key, k), None)

    def _chunk_scratch(self, dtype):
        """A per-thread buffer of FUSED_CHUNK elements (stays in cache between uses)."""
        buffers = getattr(self._scratch_local, "chunks", None)
        if buffers is None:
            buffers = self._scratch_local.chunks = {}
        if dtype not in buffers:
            buffers[dtype] = torch.empty(FUSED_CHUNK, dtype=dtype)
        return buffers[dtype]

    def _select_sampled(self, magnitudes, k):
        first, retry = self._thresholds(magnitudes, k)
        for attempt, threshold in enumerate((first, retry)):
            if attempt == 1:
                self._count(retries=1)
            # |x| >= t keeps exactness (and copes with runs of equal values at the top);
            # at t = 0 that would be everything, so take |x| > 0 there instead.
            strict = threshold.item() == 0
            candidates = self._candidates(magnitudes, threshold, strict)
            if candidates.numel() >= k:
                self._count(candidates=candidates.numel())
                return candidates[exact_topk_positions(magnitudes[candidates], k)]
            if strict:
                # Fewer than k non-zeros: all of them are in, then the lowest-index zeros.
                self._count(candidates=candidates.numel())
                zeros = self._first_zeros(magnitudes, k - candidates.numel())
                return _ascending(torch.cat((candidates, zeros)), magnitudes.numel())
        self._count(fallbacks=1)
        return exact_topk_positions(magnitudes, k)


# elements per chunk of the fused accumulate-and-select pass: 1 MiB of float32, so a
# chunk's magnitudes are read back from cache, not from memory
FUSED_CHUNK = 1 << 18

# The fused pass's threshold from a group's previous call: the magnitude that would
# have let HINT_HEADROOM * k candidates through then. Error feedback keeps the top of
# |gradient + residual| steady from step to step; the head room between the k-th and the
# (3k)-th magnitude absorbs its drift (a miss costs a second pass). Measured on the LSTM
# (2 ranks, density 0.001, 137 hinted passes per rank): 2k missed 7% of the time, 3k
# 2-4%, for 17% more candidates.
HINT_HEADROOM = 3.0
# After a miss (fewer than k candidates): the new k-th magnitude times this.
HINT_AFTER_MISS = 0.8
# Hints kept per selector at most (a group is a key; a plan change makes new groups).
MAX_HINTS = 4096


# Bucket runs above which a GPU accumulates with two launches - one multi-tensor copy of
# every run, then one add over the whole group - instead of one add per run: a launch
# costs microseconds of host time each, the extra pass over the group a few microseconds
# per million elements at GPU bandwidth.
FOREACH_RUNS = 8


def _next_threshold(magnitudes, k, kth, threshold):
    """The threshold that would have passed ``HINT_HEADROOM * k`` of this call's
    candidate ``magnitudes`` (float32 numpy; ``kth`` the k-th largest, ``threshold`` the
    one used). With fewer candidates than that, a little below the one used; with NaN at
    the k-th place, none (nan: the next call samples)."""
    if kth is None or math.isnan(kth):
        return math.nan
    rank = int(math.ceil(HINT_HEADROOM * k))
    count = magnitudes.size
    if count <= rank:
        return float(threshold) * 0.95
    # NaN sorts last in np.partition, i.e. among the largest: the rank stays right
    return float(np.partition(magnitudes, count - rank)[count - rank])


def _byte_span(tensor):
    """``[first byte, end)`` of a contiguous tensor's storage in memory."""
    start = tensor.data_ptr()
    return start, start + tensor.numel() * tensor.element_size()


def _overlap(a, b):
    return a[0] < b[1] and b[0] < a[1]


def _accumulate_into(runs, residual, out, foreach=None):
    """``out[run] = gradient run + residual[run]`` (a copy where residual is None).

    ``foreach`` (default: off the CPU with more than :data:`FOREACH_RUNS` runs): a fixed
    number of launches whatever the runs (``_foreach_copy_``, then ``out += residual``),
    the same sums bit for bit (one fp32 rounding either way)."""
    if foreach is None:
        foreach = out.device.type != "cpu" and len(runs) > FOREACH_RUNS
    if (foreach and all(grad.dtype == out.dtype for _, _, grad in runs)
            and sum(length for _, length, _ in runs) == out.numel()):
        torch._foreach_copy_([out[offset:offset + length] for offset, length, _ in runs],
                             [grad for _, _, grad in runs])
        if residual is not None:
            out.add_(residual)
        return
    for offset, length, grad in runs:
        target = out[offset:offset + length]
        if residual is None:
            target.copy_(grad)
        else:
            torch.add(grad, residual[offset:offset + length], out=target)


def _sum_at(runs, residual, positions):
    """``gradient + residual`` at ``positions`` (ascending) of the group (float32), from
    the runs (which cover the group). Each run's positions are one slice of the ascending
    positions (one ``searchsorted`` for all runs), so the work is O(s + runs), not
    O(s * runs) as with a mask per run."""
    if len(runs) == 1 and runs[0][0] == 0:
        values = runs[0][2][positions].to(torch.float32)
    else:
        values = torch.empty(positions.numel(), dtype=torch.float32)
        edges = torch.tensor([edge for offset, length, _ in runs
                              for edge in (offset, offset + length)], dtype=positions.dtype)
        bounds = torch.searchsorted(positions, edges).tolist()
        for i, (offset, _, grad) in enumerate(runs):
            lo, hi = bounds[2 * i], bounds[2 * i + 1]
            if hi > lo:
                values[lo:hi] = grad[positions[lo:hi] - offset]
    if residual is not None:
        values += residual[positions]
    return values


def _normalise_device(device):
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def available_backends(device=torch.device("cpu")):
    """Backends that can run on ``device``, in ``BACKENDS`` order.

    ``torch`` and ``sampled`` run everywhere; ``cupy`` only on a CUDA device with CuPy
    installed and usable there (checked without compiling the kernels).
    """
    device = _normalise_device(device)
    names = ["torch", "sampled"]
    if device.type == "cuda":
        from omgs_hook import topk_cupy

        if topk_cupy.cupy_unavailable_reason(device) is None:
            names.append("cupy")
    return names


def get_selector(name="auto", device=torch.device("cpu")):
    """Return a ``TopkSelector`` for backend ``name`` on ``device``.

    Args:
        name: ``"auto"`` or one of ``BACKENDS``. ``auto`` picks ``cupy`` on a CUDA device
            when CuPy can run there (kernels compiled), else ``torch`` on CUDA, and
            ``sampled`` on the CPU.
        device: where the tensors passed to ``select`` will live.

    Raises:
        ValueError: unknown ``name`` (the message lists the valid choices).
        BackendUnavailableError (a ValueError): the backend cannot run on ``device``,
            e.g. ``cupy`` on a CPU, without CuPy, or without a usable GPU.
    """
    if not isinstance(name, str) or name not in ("auto",) + BACKENDS:
        raise ValueError(f"unknown top-k backend {name!r}; valid choices: "
                         + ", ".join(("auto",) + BACKENDS))
    device = _normalise_device(device)
    if device.type not in ("cpu", "cuda"):
        raise BackendUnavailableError(f"top-k backends support cpu and cuda devices, not {device}")
    if name == "auto":
        if device.type == "cpu":
            return SampledTopkSelector()
        try:
            return get_selector("cupy", device)
        except BackendUnavailableError as error:
            if importlib.util.find_spec("cupy") is not None:
                # Installed but unusable (no NVRTC, driver mismatch...): say so once,
                # rather than silently running the slower path.
                warnings.warn(f"top-k backend 'auto' on {device}: cupy unusable, using torch "
                              f"({error})", RuntimeWarning, stacklevel=2)
            return TorchTopkSelector()
    if name == "torch":
        return TorchTopkSelector()
    if name == "sampled":
        return SampledTopkSelector()
    from omgs_hook import topk_cupy

    return topk_cupy.CupyTopkSelector(device)
