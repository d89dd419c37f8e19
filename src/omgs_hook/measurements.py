"""Measuring each bucket's share of backward while training.

DDP calls the hook once per bucket, in ready order, on the autograd thread. The time
between the end of the previous hook call and the arrival of bucket ``i`` is backward
computation that produced bucket ``i`` (the hook's own work - top-k, packing - is
excluded because it happens between arrival and exit). Bucket 0 is timed from the end
of the module's forward (a forward hook), which lumps the loss computation into it.

On CPU the marks are ``time.perf_counter()``. On CUDA they are CUDA events on the
current stream, so they measure the GPU timeline, not the launch timeline; events are
resolved one step later, when the GPU has certainly passed them.

Samples are kept per bucket *layout* (the tuple of buckets, each a tuple of parameter
keys): a different layout means different units, so the window restarts.
"""

import collections
import statistics
import time

import torch


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
        self._samples = collections.deque(maxlen=window)  # each: list of per-bucket seconds
        self._forward = collections.deque(maxlen=window)
        self._pending = None  # marks of a step not resolved yet (CUDA)
        self._fwd_start = None
        self._fwd_end = None
        self._arrive = []
        self._exit = []
        self.last_iteration_s = None
        self._last_fwd_start_wall = None

    def use_device(self, device):
        """Pick the clock for the gradients' device (called at the first bucket)."""
        if device.type == "cuda" and not isinstance(self.clock, CudaClock):
            self.clock = CudaClock(device)

    # -- marks ------------------------------------------------------------------
    def forward_started(self):
        wall = time.perf_counter()
        if self._last_fwd_start_wall is not None:
            self.last_iteration_s = wall - self._last_fwd_start_wall
        self._last_fwd_start_wall = wall
        self._fwd_start = self.clock.mark()
        self._fwd_end = None

    def forward_finished(self):
        self._fwd_end = self.clock.mark()

    def bucket_arrived(self, index):
        if index == 0:
            self._arrive, self._exit = [], []
        self._arrive.append(self.clock.mark())

    def bucket_done(self):
        self._exit.append(self.clock.mark())

    @property
    def wall_step_start(self):
        """perf_counter() at the start of the current step's forward, if seen."""
        return self._last_fwd_start_wall

    # -- bookkeeping ------------------------------------------------------------
    def end_step(self, layout):
        """Close the step whose buckets form ``layout``; resolve what can be resolved."""
        marks = (self._fwd_start, self._fwd_end, list(self._arrive), list(self._exit), layout)
        if isinstance(self.clock, CudaClock):
            previous, self._pending = self._pending, marks
            if previous is not None:
                self._record(*previous)
        else:
            self._record(*marks)
        self._fwd_start = self._fwd_end = None

    def _record(self, fwd_start, fwd_end, arrive, exits, layout):
        if len(arrive) != len(layout) or len(exits) < len(arrive) - 1:
            return  # an interrupted step (exception mid-backward): nothing reliable
        seconds = []
        for i, arrival in enumerate(arrive):
            start = fwd_end if i == 0 else exits[i - 1]
            seconds.append(max(0.0, self.clock.seconds(start, arrival)) if start is not None else 0.0)
        if layout != self.layout:
            self.layout = layout
            self._samples.clear()
        self._samples.append(seconds)
        if fwd_start is not None and fwd_end is not None:
            self._forward.append(max(0.0, self.clock.seconds(fwd_start, fwd_end)))

    def reset(self):
        self.layout = None
        self._samples.clear()
        self._forward.clear()
        self._pending = None

    # -- results ----------------------------------------------------------------
    @property
    def num_samples(self):
        return len(self._samples)

    def backward_s(self):
        """Per-bucket median backward seconds for ``self.layout`` (empty if no samples)."""
        if not self._samples:
            return []
        return [statistics.median(col) for col in zip(*self._samples)]

    def forward_s(self):
        return statistics.median(self._forward) if self._forward else 0.0

    def state_dict(self):
        return {
            "layout": [list(bucket) for bucket in self.layout] if self.layout else None,
            "samples": [list(s) for s in self._samples],
            "forward": list(self._forward),
        }

    def load_state_dict(self, sd):
        self.reset()
        if sd.get("layout"):
            self.layout = tuple(tuple(bucket) for bucket in sd["layout"])
            for s in sd.get("samples", []):
                self._samples.append([float(x) for x in s])
        for f in sd.get("forward", []):
            self._forward.append(float(f))
