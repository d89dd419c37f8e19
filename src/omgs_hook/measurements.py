"""Measuring each bucket's share of backward while training.

DDP calls the hook once per bucket, in ready order, on the autograd thread. The time
between the arrival of bucket ``i-1`` and the arrival of bucket ``i``, minus the time
the hook spent *sending groups* in between (top-k, assembling, packing, issuing), is
the backward computation that produced bucket ``i``. The hook's per-bucket bookkeeping
stays in it: it is paid once per bucket whatever the plan. The sending is what the plan
changes, and the cost model charges it per group (:class:`GroupOverheadMeter`). Bucket
0 is timed from the end of the module's forward (a forward hook), which lumps the loss
computation into it.

The *tail* of a step - from the moment its last group was written back to the start of
the next forward (DDP's finalisation, the optimiser step, ``zero_grad``, the next batch)
- is timed on the host clock; the planner adds it to its prediction.

On CPU the marks are ``time.perf_counter()``. On CUDA they are CUDA events on the
current stream, so they measure the GPU timeline, not the launch timeline; events are
resolved one step later, when the GPU has certainly passed them.

Samples are kept per bucket *layout* (the tuple of buckets, each a tuple of parameter
keys): a different layout means different units, so the window restarts.
"""

import collections
import itertools
import statistics
import time

import numpy as np
import torch

from .fitting import fit_linear_relative, median, quantile


class CpuClock:
    """Wall-clock marks on the host."""

    def mark(self):
        return time.perf_counter()

    def seconds(self, start, end):
        return end - start


class CudaClock:
    """CUDA-event marks on the current stream of ``device``."""

    def __init__(self, device):
        self.device = device

    def mark(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def seconds(self, start, end):
        end.synchronize()
        return start.elapsed_time(end) / 1000.0


def clock_for(device):
    return CudaClock(device) if device.type == "cuda" else CpuClock()


MIN_FRESH_STEPS = 3


class BackwardMeter:
    """Per-bucket backward time, forward time and iteration time, over a sliding window.

    Args:
        window: how many recent steps of the current layout are kept; the planner sees
            the per-bucket median over them (robust to the odd slow step).
    """

    def __init__(self, window=32):
        if window < 1:
            raise ValueError("window must be >= 1")
        self.window = window
        self.clock = CpuClock()
        self.layout = None
        # each: per-bucket seconds of one step, a float64 array (the planner's medians
        # stack them: no Python float per bucket on the training thread)
        self._samples = collections.deque(maxlen=window)
        self._forward = collections.deque(maxlen=window)
        self._pending = None  # marks of a step not resolved yet (CUDA)
        self._fwd_start = None
        self._fwd_end = None
        self._forward_open = False  # a forward of the coming step was seen (forward_started)
        # host clock: the forwards with autograd since the step's first one, each
        # [wall, mark, reached by a backward], and what the first one replaced (the
        # previous iteration's start, the previous step's end, whether it appended an
        # iteration and a tail): see reanchor_forward. None on CUDA
        self._forwards = None
        self._open_context = None
        self._arrive = []
        self._send_start = []
        self._send_end = []
        self.last_iteration_s = None
        self._iterations = collections.deque(maxlen=window)  # (step number or None, s)
        self._last_fwd_start_wall = None
        self._tail = collections.deque(maxlen=window)
        self._finish_wall = None
        self._step_tail = None  # the tail that preceded the current step's forward
        # per step: [tail before it, forward, backward of bucket 0, 1, ...] - one rank's
        # timeline from the end of the previous exchange, for the straggler-aware plan
        self._timelines = collections.deque(maxlen=window)
        # step numbers of the samples above (None: unknown, e.g. an old state dict), so
        # that the estimates can prefer the steps run with the plan now in use
        self._sample_steps = collections.deque(maxlen=window)
        self._forward_steps = collections.deque(maxlen=window)
        self._tail_steps = collections.deque(maxlen=window)
        self._last_step = None  # number of the last step closed (owns the next tail)
        self.prefer_from_step = None

    def iteration_s(self, since_step=None):
        """Median wall time of the window's iterations (one first forward to the next),
        or None before two forwards. With ``since_step``: of the iterations of steps from
        that one on, when there are at least 3 (a plan's own steps), else of the window.
        One iteration is a poor estimate of the next (a GC pass, a load spell, the
        evaluation after an epoch); this is what a prediction is compared with."""
        values = [s for step, s in self._iterations
                  if since_step is None or (step is not None and step >= since_step)]
        if len(values) < 3:
            values = [s for _, s in self._iterations]
        return statistics.median(values) if values else None

    def use_device(self, device):
        """Pick the clock for the gradients' device (called at the first bucket)."""
        if device.type == "cuda" and not isinstance(self.clock, CudaClock):
            self.clock = CudaClock(device)
            # the current step's forward was marked with the host clock (its first bucket
            # is where the device becomes known): host floats cannot be subtracted from
            # CUDA events when the step is resolved, so that step has no forward time
            self._fwd_start = self._fwd_end = None
            self._pending = None

    # -- marks ------------------------------------------------------------------
    def forward_started(self):
        """A forward with autograd began. Only the first one of a step counts: a step
        may run several (a siamese or contrastive loss calls the model twice, gradient
        accumulation runs its ``no_sync`` micro-batches first), and the step's forward -
        its compute before backward - and the iteration both start at the first. The
        next step's first forward is the first one after this step's backward began
        (bucket 0) or its exchange finished."""
        if self._forward_open:
            if self._forwards is not None:
                self._forwards.append([time.perf_counter(), self.clock.mark(), False])
            return
        self._forward_open = True
        wall = time.perf_counter()
        previous_start, finish = self._last_fwd_start_wall, self._finish_wall
        if self._last_fwd_start_wall is not None:
            self.last_iteration_s = wall - self._last_fwd_start_wall
            self._iterations.append((self._last_step, self.last_iteration_s))
        self._step_tail = None
        if self._finish_wall is not None and self._last_fwd_start_wall is not None \
                and self._finish_wall >= self._last_fwd_start_wall:
            self._step_tail = max(0.0, wall - self._finish_wall)
            self._tail.append(self._step_tail)
            self._tail_steps.append(self._last_step)
        self._finish_wall = None
        self._last_fwd_start_wall = wall
        self._fwd_start = self.clock.mark()
        self._fwd_end = None
        if isinstance(self.clock, CpuClock):
            self._forwards = [[wall, self._fwd_start, False]]
            self._open_context = (previous_start, finish, previous_start is not None,
                                  self._step_tail is not None)
        else:
            self._forwards = None

    def current_forward(self):
        """The entry of the forward now running (host clock; None otherwise): the hook
        sets its third item when a backward reaches the forward's output."""
        return self._forwards[-1] if self._forward_open and self._forwards else None

    def reanchor_forward(self):
        """At the step's bucket 0, before anything reads its forward: when the step's
        first forwards with autograd were never reached by a backward (an evaluation or
        a metric computed without ``torch.no_grad()``) and a later one was, the step
        starts at that later forward. The forwards before it count as the gap between
        the steps, as an evaluation under ``no_grad`` does (:meth:`tail_excess_s`):
        neither the step's time nor its forward (the load probe) holds them. A step
        whose forwards were all reached (a siamese loss, ``no_sync`` micro-batches), or
        none was, keeps its first forward as its start. Host clock only."""
        forwards, self._forwards = self._forwards, None
        if not forwards or forwards[0][2]:
            return
        first = next((f for f in forwards if f[2]), None)
        if first is None:
            return
        wall, mark, _ = first
        previous_start, finish, had_iteration, had_tail = self._open_context
        if had_iteration and self._iterations:
            self.last_iteration_s = wall - previous_start
            self._iterations[-1] = (self._iterations[-1][0], self.last_iteration_s)
        if had_tail and self._tail:
            self._step_tail = max(0.0, wall - finish)
            self._tail[-1] = self._step_tail
        self._last_fwd_start_wall = wall
        self._fwd_start = mark

    def forward_finished(self):
        self._fwd_end = self.clock.mark()

    def forward_in_progress_s(self):
        """Seconds of the current step's forward pass once it has finished (during its
        backward), on the host clock only (None otherwise: a CUDA event is not resolved
        yet, and the host time of a CUDA forward is launch time)."""
        if isinstance(self.clock, CudaClock) or self._fwd_start is None or self._fwd_end is None:
            return None
        return max(0.0, self.clock.seconds(self._fwd_start, self._fwd_end))

    def bucket_arrived(self, index, mark=None):
        """Bucket ``index`` arrived, now or at ``mark`` (taken earlier with this clock)."""
        if index == 0:
            self._forward_open = False
            self._arrive, self._send_start, self._send_end = [], [], []
        self._arrive.append(self.clock.mark() if mark is None else mark)

    def sends_started(self, mark=None):
        """The hook starts sending the groups this bucket completed, now or at ``mark``
        (taken earlier with this clock: the hook's own work since then is not backward
        either)."""
        self._send_start.append(self.clock.mark() if mark is None else mark)

    def sends_finished(self):
        self._send_end.append(self.clock.mark())

    def step_finished(self, wall):
        """The step's last group was written back at host time ``wall`` (perf_counter)."""
        self._finish_wall = wall
        self._forward_open = False

    @property
    def wall_step_start(self):
        """perf_counter() at the start of the current step's forward, if seen."""
        return self._last_fwd_start_wall

    # -- bookkeeping ------------------------------------------------------------
    def end_step(self, layout, step=None, discard=False):
        """Close the step (number ``step``) whose buckets form ``layout``; resolve what can
        be resolved. ``discard``: record nothing of this step (its layout is one no plan
        is made for; the samples of the layout before it are kept)."""
        marks = (None if discard else
                 (self._fwd_start, self._fwd_end, list(self._arrive),
                  list(zip(self._send_start, self._send_end)), layout, self._step_tail, step))
        self._last_step = step
        if isinstance(self.clock, CudaClock):
            previous, self._pending = self._pending, marks
            if previous is not None:
                self._record(*previous)
        elif marks is not None:
            self._record(*marks)
        self._fwd_start = self._fwd_end = None

    def _record(self, fwd_start, fwd_end, arrive, sends, layout, step_tail=None, step=None):
        if len(arrive) != len(layout) or len(sends) < len(arrive) - 1:
            return  # an interrupted step (exception mid-backward): nothing reliable
        if isinstance(self.clock, CpuClock):
            seconds = backward_gaps(fwd_end, arrive, sends)
        else:  # marks that only the clock can subtract (CUDA events)
            seconds = []
            for i, arrival in enumerate(arrive):
                if i == 0:
                    gap = self.clock.seconds(fwd_end, arrival) if fwd_end is not None else 0.0
                else:
                    sent_from, sent_to = sends[i - 1]
                    gap = (self.clock.seconds(arrive[i - 1], arrival)
                           - self.clock.seconds(sent_from, sent_to))
                seconds.append(max(0.0, gap))
            seconds = np.asarray(seconds, dtype=np.float64)
        if layout != self.layout:
            self.layout = layout
            self._samples.clear()
            self._sample_steps.clear()
            self._timelines.clear()
        self._samples.append(seconds)
        self._sample_steps.append(step)
        if fwd_start is not None and fwd_end is not None:
            forward = max(0.0, self.clock.seconds(fwd_start, fwd_end))
            self._forward.append(forward)
            self._forward_steps.append(step)
            if step_tail is not None and step is not None:
                self._timelines.append((int(step), np.concatenate(([step_tail, forward], seconds))))

    def reset(self):
        self.layout = None
        self._timelines.clear()
        for deque in (self._samples, self._forward, self._tail, self._sample_steps,
                      self._forward_steps, self._tail_steps, self._iterations):
            deque.clear()
        self._pending = None
        self._last_step = None
        self.prefer_from_step = None
        self._forwards = None

    def prefer_from(self, step):
        """Estimate from the steps numbered ``step`` and later once there are at least
        :data:`MIN_FRESH_STEPS` of them (older ones until then).

        The hook calls it when a plan goes into use: backward, forward and tail times
        depend on the plan (a dense all-reduce or many collectives take CPU from
        backward; the dense warm-up is the extreme case), so the next plan - and the
        check of this one - should see the steps run with it, not the warm-up's.
        """
        self.prefer_from_step = None if step is None else int(step)

    def _fresh(self, values, steps):
        floor = self.prefer_from_step
        if floor is None:
            return list(values)
        fresh = [v for v, s in zip(values, steps) if s is not None and s >= floor]
        return fresh if len(fresh) >= MIN_FRESH_STEPS else list(values)

    def forward_load(self):
        """How much slower the preferred steps' forward ran than the window's: the median
        forward since :meth:`prefer_from` over the median of every kept forward, or None
        (no preference, fewer than :data:`MIN_FRESH_STEPS` preferred steps, or no older
        step to compare with). The forward is compute only and the same for every plan,
        so a ratio well above 1 means something else took the cores (a load spell)."""
        floor = self.prefer_from_step
        if floor is None:
            return None
        fresh = [v for v, s in zip(self._forward, self._forward_steps)
                 if s is not None and s >= floor]
        if len(fresh) < MIN_FRESH_STEPS or len(fresh) == len(self._forward):
            return None
        reference = statistics.median(self._forward)
        return statistics.median(fresh) / reference if reference > 0 else None

    # -- results ----------------------------------------------------------------
    @property
    def num_samples(self):
        return len(self._samples)

    def backward_s(self):
        """Per-bucket median backward seconds for ``self.layout`` (empty if no samples)."""
        samples = self._fresh(self._samples, self._sample_steps)
        if not samples:
            return []
        # each column's median equals statistics.median's (the middle value, or the mean
        # of the two middle ones), without a Python loop over 1000 buckets
        return median(np.stack(samples), axis=0).tolist()

    def forward_s(self):
        forward = self._fresh(self._forward, self._forward_steps)
        return statistics.median(forward) if forward else 0.0

    def timelines(self):
        """Per complete step of the current layout, oldest first: ``(step, [tail, forward,
        backward of bucket 0, 1, ...])`` in seconds (steps without a measured tail are
        left out). The hook aligns them across ranks by step to plan for the slowest rank."""
        return [(step, row.tolist()) for step, row in self.timeline_rows()]

    def timeline_rows(self):
        """:meth:`timelines` with each row a float64 array (read-only: the meter's own)."""
        return self._fresh(self._timelines, [step for step, _ in self._timelines])

    def tail_excess_s(self):
        """How much longer the gap between the previous step's last write-back and this
        step's forward was than the window's median gap (0 when unknown, or with fewer
        than 3 gaps seen). The gap holds the optimiser step and the next batch, and also
        whatever a training loop runs between steps now and then - an evaluation after
        an epoch, a checkpoint, a log line: time no plan is responsible for."""
        if self._step_tail is None or len(self._tail) < 3:
            return 0.0
        return max(0.0, self._step_tail - statistics.median(self._tail))

    def tail_s(self):
        """Median seconds from a step's last write-back to the next forward (0 if unseen)."""
        tail = self._fresh(self._tail, self._tail_steps)
        return statistics.median(tail) if tail else 0.0

    def state_dict(self):
        return {
            "layout": [list(bucket) for bucket in self.layout] if self.layout else None,
            "samples": [s.tolist() for s in self._samples],
            "forward": list(self._forward),
            "tail": list(self._tail),
            "timelines": [[step] + row.tolist() for step, row in self._timelines],
            "sample_steps": list(self._sample_steps),
            "forward_steps": list(self._forward_steps),
            "tail_steps": list(self._tail_steps),
            "prefer_from_step": self.prefer_from_step,
        }

    def load_state_dict(self, sd):
        self.reset()
        if sd.get("layout"):
            self.layout = tuple(tuple(bucket) for bucket in sd["layout"])
            for s in sd.get("samples", []):
                self._samples.append(np.asarray([float(x) for x in s], dtype=np.float64))
        for f in sd.get("forward", []):
            self._forward.append(float(f))
        for f in sd.get("tail", []):
            self._tail.append(float(f))
        for row in sd.get("timelines", []):
            self._timelines.append((int(row[0]), np.asarray([float(x) for x in row[1:]],
                                                            dtype=np.float64)))
        # step tags (absent in older state dicts: unknown, i.e. never preferred)
        for values, steps, key in ((self._samples, self._sample_steps, "sample_steps"),
                                   (self._forward, self._forward_steps, "forward_steps"),
                                   (self._tail, self._tail_steps, "tail_steps")):
            saved = list(sd.get(key) or [])
            saved = [None] * (len(values) - len(saved)) + saved[-len(values):] if values else []
            steps.extend(None if x is None else int(x) for x in saved)
        floor = sd.get("prefer_from_step")
        self.prefer_from_step = None if floor is None else int(floor)


def backward_gaps(fwd_end, arrive, sends):
    """Per-bucket backward seconds of one step from host-clock marks (numbers): bucket
    0 from the forward's end (0 without one), bucket ``i`` from bucket ``i - 1``'s arrival
    minus the time spent sending what that bucket completed (``sends[i - 1]``, a
    ``(start, end)`` pair); never negative. One numpy pass: with a thousand buckets the
    loop over the clock's ``seconds`` took 0.57-0.62 ms per step on the training thread,
    this 0.19-0.23 ms, and the planner's medians stack its arrays directly. The
    same float operations in the same order as that loop: bit-identical values."""
    n = len(arrive)
    marks = np.fromiter(arrive, dtype=np.float64, count=n)
    gaps = np.empty(n, dtype=np.float64)
    if n == 0:
        return gaps
    gaps[0] = marks[0] - fwd_end if fwd_end is not None else 0.0
    if n > 1:  # (fromiter over the flattened pairs: 2-3x faster than asarray of tuples)
        spans = np.fromiter(itertools.chain.from_iterable(sends[:n - 1]), dtype=np.float64,
                            count=2 * (n - 1)).reshape(n - 1, 2)
        gaps[1:] = (marks[1:] - marks[:-1]) - (spans[:, 1] - spans[:, 0])
    return np.maximum(gaps, 0.0)


def slowest_rank_timeline(per_rank):
    """The planner's ``[tail, forward, backward of bucket 0, 1, ...]`` for synchronous ranks.

    ``per_rank``: for every rank, its :meth:`BackwardMeter.timelines` - ``(step, row)``
    pairs. Every collective waits for the last rank to get there, so a step's timeline is
    the *maximum over ranks* of each rank's cumulative time (from the end of the previous
    exchange through tail, forward and each bucket's backward), not the mean. Steps are
    aligned by number (only steps every rank measured count); the result is the median
    over steps of that maximum, differenced back into parts. With ranks on dedicated
    hardware this is close to the mean; with stragglers, or ranks sharing CPU cores, it
    is what an iteration really costs. Returns None when no step is common to all ranks.
    """
    common = None
    for rows in per_rank:
        steps = {step for step, _ in rows}
        common = steps if common is None else common & steps
    if not common:
        return None
    width = {len(row) for rows in per_rank for _, row in rows}
    if len(width) != 1:
        raise ValueError(f"timelines of different lengths {sorted(width)}")
    aligned = []
    for rows in per_rank:
        by_step = dict(rows)
        aligned.append([by_step[step] for step in sorted(common)])
    # rows may be lists or numpy arrays (the hook's gathered table): one array either way;
    # dimensions rank, step, part
    cumulative = torch.from_numpy(np.asarray(aligned, dtype=np.float64)).cumsum(dim=2)
    slowest = cumulative.max(dim=0).values
    median = torch.quantile(slowest, 0.5, dim=0)  # order statistics keep it non-decreasing
    parts = torch.diff(median, prepend=median.new_zeros(1)).clamp(min=0.0)
    return parts.tolist()  # (not a Python float per element: 1000 buckets, training thread)


def untimed_per_group_s(windows):
    """The hook's untimed seconds per sparse group sent, from one step's send windows.

    ``windows``: per send window of the step (a bucket's sends in the hook; the hook
    leaves out the last bucket's, whose flush is paid once a step), ``(sparse groups
    sent in it, seconds of it that no timer of the per-group work covered)``: the
    top-k, ``h`` and ``w`` are timed; the Python around them (choosing what is ready,
    registering and issuing the collective, the deferred write-backs' queue) is not. A
    window that sent nothing shows the part paid per bucket whatever the plan; its
    median is taken off every window that sent groups, and the rest is shared by their
    groups. 0.0 without groups sent. The hook adds it to each group's fixed part of
    ``h`` (:class:`GroupOverheadMeter`), so a plan of many groups is priced with it:
    0.036 ms a group for LAGS-SGD's 59 groups on 2 ranks (ResNet-20, docs/cost-model.md)."""
    empty = [seconds for groups, seconds in windows if groups == 0]
    base = statistics.median(empty) if empty else 0.0
    sent = [(groups, seconds) for groups, seconds in windows if groups > 0]
    count = sum(groups for groups, _ in sent)
    if not count:
        return 0.0
    return max(0.0, sum(seconds - base for _, seconds in sent) / count)


# The quantile at which the per-group samples are clipped before their mean is taken
# (clipped_mean). A step pays the SUM of its groups' samples, so their mean prices it, not
# their median: ResNet-20's 59 layer-wise groups on 2 ranks (2 cores, 36 Mbit/s) had a
# median of 0.10-0.12 ms of per-group work against a mean of 0.19-0.25 ms. The mean,
# though, follows the rare long preemptions (the 99th percentile was 3 ms), which the
# median step mostly does not see: clipped at the 90th percentile it read 0.13-0.17 ms,
# where the send windows' measured total came to 0.15 ms a group.
CLIP_QUANTILE = 0.9


def clipped_mean(values, q=None):
    """The mean of ``values`` with each clipped at their ``q`` quantile (default
    :data:`CLIP_QUANTILE`): what a step summing many such samples pays, without the
    rare outliers. Raises ValueError on no values."""
    data = np.asarray(list(values), dtype=np.float64)
    if data.size == 0:
        raise ValueError("clipped_mean of no values")
    cap = quantile(data, CLIP_QUANTILE if q is None else q)
    return float(np.minimum(data, cap).mean())


class TopkTimeMeter:
    """The top-k as training runs it, relative to the profile's top-k cost.

    The profile times a bare ``select(x, k)`` on a warm tensor. In training, a flat group's
    top-k on the host is fused with the pass that adds gradient and residual (it reads
    both, writes the accumulator and clears the gradient), runs cache-cold right after
    backward, and shares the cores with the collectives' threads: ResNet-20's 59 layer-wise
    groups on 2 ranks took 2.0-2.1x the profile's time per group in the median, 2.5-2.9x in
    the mean. The hook records every sparse group's ``(elements, seconds)``
    (``add``); :meth:`scale` is the factor the profile's top-k line is multiplied by:
    ``sum_i min(s_i, q * p_i) / sum_i p_i`` over the window, with ``p_i`` the profile's
    time for the sample's size and ``q`` the :data:`CLIP_QUANTILE` quantile of the
    ratios ``s_i / p_i`` (rare preemptions clipped, as in :func:`clipped_mean`). One
    factor for every size: a one-group plan's samples price the others too.
    """

    def __init__(self, window=256):
        if window < 1:
            raise ValueError("window must be >= 1")
        self._samples = collections.deque(maxlen=window)

    def __len__(self):
        return len(self._samples)

    def add(self, numel, seconds):
        if numel < 1 or not seconds >= 0:
            raise ValueError(f"bad top-k time sample ({numel!r}, {seconds!r})")
        self._samples.append((int(numel), float(seconds)))

    def clear(self):
        self._samples.clear()

    def scale(self, cost):
        """The factor for the profile's top-k line ``cost`` (anything with
        ``time(numel)``), or None without samples (or a line that prices them at 0)."""
        if not self._samples:
            return None
        count = len(self._samples)
        seconds = np.fromiter((t for _, t in self._samples), dtype=np.float64, count=count)
        priced = np.fromiter((cost.time(n) for n, _ in self._samples), dtype=np.float64,
                             count=count)
        usable = priced > 0
        if not usable.any():
            return None
        priced, seconds = priced[usable], seconds[usable]
        cap = quantile(seconds / priced, CLIP_QUANTILE)
        return float(np.minimum(seconds, cap * priced).sum() / priced.sum())

    def state_dict(self):
        return {"samples": [list(s) for s in self._samples]}

    def load_state_dict(self, sd):
        self._samples.clear()
        for numel, seconds in (sd or {}).get("samples", []):
            self.add(int(numel), float(seconds))


class GroupOverheadMeter:
    """The hook's own work per sparse group on the compute stream, besides top-k.

    Sending a sparse group of D elements costs, on the thread (or stream) that also runs
    backward: assembling ``gradient + residual`` into one buffer and checking it for
    NaN/Inf (a pass over D elements), the top-k, then packing the payload, zeroing the
    sent entries of the residual and issuing the all-gather (fixed work). Top-k is in the
    profile; this meter learns the rest, ``h(D) = per_group_s + per_element_s * D``, from
    samples the hook records per group: ``add(D, element_pass_s, fixed_s)``.

    Estimate: with at least two group sizes a factor ``min_size_ratio`` apart, the
    per-size clipped means (:func:`clipped_mean`: a step pays the sum of its groups'
    samples) of the total are fitted with the relative-error non-negative least squares of
    :mod:`omgs_hook.fitting`. With one size (e.g. a one-group plan) the line cannot be
    fitted, so the measured split is used: ``per_group_s`` = clipped mean of the fixed
    part, ``per_element_s`` = clipped mean of element pass / D.
    """

    def __init__(self, window=256, min_size_ratio=2.0):
        if window < 1:
            raise ValueError("window must be >= 1")
        self.min_size_ratio = float(min_size_ratio)
        self._samples = collections.deque(maxlen=window)

    def __len__(self):
        return len(self._samples)

    def add(self, numel, element_pass_s, fixed_s):
        if numel < 1 or not (element_pass_s >= 0 and fixed_s >= 0):
            raise ValueError(f"bad group overhead sample ({numel!r}, {element_pass_s!r}, {fixed_s!r})")
        self._samples.append((int(numel), float(element_pass_s), float(fixed_s)))

    def clear(self):
        self._samples.clear()

    def estimate(self):
        """``(per_group_s, per_element_s)``, or None without samples."""
        if not self._samples:
            return None
        by_size = {}
        for numel, element_pass, fixed in self._samples:
            by_size.setdefault(numel, []).append((element_pass, fixed))
        sizes = sorted(by_size)
        if len(sizes) >= 2 and sizes[-1] >= self.min_size_ratio * sizes[0]:
            totals = [clipped_mean(e + f for e, f in by_size[n]) for n in sizes]
            if min(totals) > 0:
                fit = fit_linear_relative(sizes, totals)
                return fit.alpha_s, fit.beta_s_per_byte  # here: seconds per element
        per_group = clipped_mean(f for _, _, f in self._samples)
        per_element = clipped_mean(e / n for n, e, _ in self._samples)
        return per_group, per_element

    def state_dict(self):
        return {"samples": [list(s) for s in self._samples]}

    def load_state_dict(self, sd):
        self._samples.clear()
        for numel, element_pass, fixed in (sd or {}).get("samples", []):
            self.add(int(numel), float(element_pass), float(fixed))


def comm_sums(records):
    """What one step's collectives took, by kind, as the cost model's timeline counts it.

    ``records``: the step's groups in issue order, each with ``dense``, ``bytes`` (per
    rank on the wire: the packed payload of a sparse group), ``numel``, ``issued`` and
    ``done`` (host clock: issue, and its completion: the end of its write-back where
    that runs on the completion thread - a dense group's -, the collective's own
    completion where the write-back is deferred to the autograd thread, whose time the
    model prices on the compute stream). A collective starts when it is issued or when
    the previous one is done, whichever is later (one collective at a time on the
    network), so its duration is ``done - max(issued, previous done)``: the ``t_c`` /
    ``t_d`` of the timeline.

    Returns ``(sparse_s, sparse_count, sparse_bytes, dense_s, dense_count,
    dense_elements)``, or None when a record lacks a time (a failed step).
    """
    sparse_s = dense_s = 0.0
    sparse_n = dense_n = sparse_bytes = dense_numel = 0
    previous = None
    for r in records:
        issued, done = getattr(r, "issued", None), getattr(r, "done", None)
        if issued is None or done is None:
            return None
        start = issued if previous is None else max(issued, previous)
        seconds = max(0.0, done - start)
        previous = done if previous is None else max(previous, done)
        if r.dense:
            dense_s, dense_n, dense_numel = dense_s + seconds, dense_n + 1, dense_numel + r.numel
        else:
            sparse_s, sparse_n, sparse_bytes = sparse_s + seconds, sparse_n + 1, sparse_bytes + r.bytes
    return (sparse_s, sparse_n, sparse_bytes, dense_s, dense_n, dense_numel)


def comm_scale(seconds, count, size, alpha_s, beta_s_per_byte):
    """Measured over modelled time of ``count`` collectives of ``size`` bytes in all on a
    line ``alpha + beta * bytes``: the factor that makes the line match them, or None
    without samples (or a line that prices them at zero)."""
    modelled = alpha_s * count + beta_s_per_byte * size
    if count <= 0 or not modelled > 0 or seconds <= 0:
        return None
    return seconds / modelled


def least_median_factor(table, at, line, bytes_per=1):
    """The ``measured_comm`` factor of one kind of collective from every rank's recent
    steps: ``table[rank][step]`` is a row of ``(seconds, count, size)`` triples (all
    zero where a rank has fewer steps), this kind's triple at column ``at``; ``line``
    the :class:`~omgs_hook.cost_model.LinearCost` that prices it, ``size * bytes_per``
    its bytes. Per step the measured over the modelled time (:func:`comm_scale`), per
    rank the median over its steps (one odd step does not move it), then the least over
    the ranks that have samples (the others' times include waiting for the last rank
    to issue). None without a line or without samples. Gathered numbers in, so every
    rank gets the same factor."""
    if line is None:
        return None
    found = []
    for steps in table:
        ratios = [comm_scale(r[at], int(r[at + 1]), r[at + 2] * bytes_per,
                             line.alpha_s, line.beta_s_per_byte) for r in steps]
        ratios = [f for f in ratios if f is not None]
        if ratios:
            found.append(statistics.median(ratios))
    return min(found) if found else None


def two_level_comm_sums(records):
    """What one two-level step's collectives took, per link class, as the cost model's
    two-level timeline counts them (docs/hierarchical.md, "Measured collective costs").

    ``records``: the step's groups in issue order, each with ``dense``, ``inter_issued``
    and ``inter_done`` (host clock: issue and completion of its inter-node collective -
    the sparse all-gather, or the dense group's all-reduce), ``done`` (the end of the
    write-back that follows its intra-node all-gather) and ``model_bytes`` (the bytes of
    those two collectives as the model prices them: ``(k_h * 8, N * k_h * 8)`` for a
    sparse group, ``(4 S, 4 S)`` for a dense one). The model runs a group's two network
    stages back to back on one network chain, after the previous group's: so the
    group's network time starts at ``start = max(inter_issued, previous done)``; the
    inter-node collective counts ``inter_done - start`` and the intra-node all-gather
    (with the wait until it is issued, at the next hook call, and the write-back)
    ``done - max(inter_done, start)``, each clamped at zero. The intra-node
    reduce-scatter is not counted: gloo's reduce-scatter has no future to time its
    completion by, and the wait for it at the next hook call includes that bucket's
    backward.

    Returns ``(intra_s, intra_count, intra_bytes, inter_s, inter_count, inter_bytes,
    inter_dense_s, inter_dense_count, inter_dense_bytes)`` - the intra-node all-gathers
    of sparse and dense groups together, the inter-node sparse all-gathers, the
    inter-node all-reduces -, or None when a record lacks a time (a failed step, a
    flat group)."""
    out = [0.0, 0, 0, 0.0, 0, 0, 0.0, 0, 0]
    previous = None
    for r in records:
        issued, inter_done = getattr(r, "inter_issued", None), getattr(r, "inter_done", None)
        done, sizes = getattr(r, "done", None), getattr(r, "model_bytes", None)
        if issued is None or inter_done is None or done is None or sizes is None:
            return None
        start = issued if previous is None else max(issued, previous)
        inter_s = max(0.0, inter_done - start)
        intra_s = max(0.0, done - max(inter_done, start))
        previous = done if previous is None else max(previous, done)
        at = 6 if r.dense else 3
        out[at] += inter_s
        out[at + 1] += 1
        out[at + 2] += int(sizes[0])
        out[0] += intra_s
        out[1] += 1
        out[2] += int(sizes[1])
    return tuple(out)


class CommTimeMeter:
    """The last ``window`` steps' :func:`comm_sums` (or, with ``kinds=3``, a two-level
    run's :func:`two_level_comm_sums`), summed on demand.

    The hook uses them to scale the profile's collective costs to what this run's
    collectives really take (``measured_comm``): the profile is measured alone, but in
    training an all-reduce or many small all-gathers run while backward uses the same
    cores (gloo) or the same GPU (NCCL), and the network itself may have changed.
    A step's row is ``kinds`` triples ``(seconds, count, size)``.
    """

    def __init__(self, window=16, kinds=2):
        if window < 1:
            raise ValueError("window must be >= 1")
        if kinds < 1:
            raise ValueError("kinds must be >= 1")
        self._steps = collections.deque(maxlen=window)
        self.table_width_per_step = 3 * kinds

    def add(self, sums):
        if sums is not None:
            if len(sums) != self.table_width_per_step:
                raise ValueError(f"a step of {len(sums)} numbers, expected "
                                 f"{self.table_width_per_step}")
            self._steps.append(tuple(sums))

    def clear(self):
        self._steps.clear()

    def __len__(self):
        return len(self._steps)

    @property
    def window(self):
        return self._steps.maxlen

    @property
    def table_width(self):
        return self.window * self.table_width_per_step

    def table(self):
        """The window's steps, oldest first, flattened, zero-padded to ``table_width``
        (a fixed width, so that every rank's row can be gathered)."""
        out = [float(x) for row in self._steps for x in row]
        return out + [0.0] * (self.table_width - len(out))

    def empty_table(self):
        return [0.0] * self.table_width

    def totals(self):
        """Each of the row's numbers summed over the window (zeros when empty): for
        :func:`comm_sums` ``(sparse_s, sparse_count, sparse_bytes, dense_s, dense_count,
        dense_elements)``."""
        out = [0.0 if i % 3 == 0 else 0 for i in range(self.table_width_per_step)]
        for row in self._steps:
            out = [a + b for a, b in zip(out, row)]
        return tuple(out)

    def state_dict(self):
        return {"steps": [list(row) for row in self._steps]}

    def load_state_dict(self, sd):
        self.clear()
        for row in (sd or {}).get("steps", []):
            if len(row) != self.table_width_per_step:
                raise ValueError(f"comm times: a step of {len(row)} numbers, expected "
                                 f"{self.table_width_per_step}")
            # (seconds, count, size) triples
            self._steps.append(tuple(float(x) if i % 3 == 0 else int(x)
                                     for i, x in enumerate(row)))
