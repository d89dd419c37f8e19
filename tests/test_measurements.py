"""BackwardMeter (per-bucket backward, tail) and GroupOverheadMeter, with a fake clock."""

import numpy as np
import pytest

from omgs_hook import measurements
from omgs_hook.cost_model import TopkCost
from omgs_hook.measurements import (BackwardMeter, GroupOverheadMeter, TopkTimeMeter,
                                    clipped_mean)


class FakeClock:
    """Marks are numbers the test sets; seconds() is their difference."""

    def __init__(self):
        self.now = 0.0

    def mark(self):
        return self.now

    def seconds(self, start, end):
        return end - start


def run_step(meter, clock, script, layout, step=None, start_forward=True, discard=False):
    """script: per bucket (arrival time, send start, send end); forward 0..1.

    With ``start_forward=False`` the caller already called ``meter.forward_started()``
    (at fake time 0). ``discard``: the step ends with ``end_step(discard=True)``."""
    if start_forward:
        clock.now = 0.0
        meter._fwd_start = clock.mark()
    clock.now = 1.0
    meter.forward_finished()
    for index, (arrive, send_from, send_to) in enumerate(script):
        clock.now = arrive
        meter.bucket_arrived(index)
        clock.now = send_from
        meter.sends_started()
        clock.now = send_to
        meter.sends_finished()
    meter.end_step(layout, step=step, discard=discard)


def test_backward_excludes_group_sends_but_keeps_bookkeeping():
    meter = BackwardMeter(window=4)
    clock = meter.clock = FakeClock()
    layout = (("a",), ("b",), ("c",))
    # bucket 0 arrives at 3 (2 s after forward), 0.5 s bookkeeping, sends 3.5..5.5;
    # bucket 1 arrives at 7: 4 s since bucket 0 minus 2 s of sending = 2 s of backward
    run_step(meter, clock, [(3.0, 3.5, 5.5), (7.0, 7.25, 7.25), (9.0, 9.0, 12.0)], layout)
    assert meter.backward_s() == pytest.approx([2.0, 2.0, 2.0])
    assert meter.forward_s() == pytest.approx(1.0)


def test_a_bucket_arrival_marked_earlier_is_the_one_recorded():
    """The hook marks bucket 0's arrival before it finishes a re-plan there, and starts
    its send window at that mark: the re-plan's time is the hook's, neither bucket 0's
    backward nor bucket 1's."""
    meter = BackwardMeter(window=4)
    clock = meter.clock = FakeClock()
    clock.now = 0.0
    meter._fwd_start = clock.mark()
    clock.now = 1.0
    meter.forward_finished()
    clock.now = 3.0
    arrived = clock.mark()
    clock.now = 4.5  # the re-plan: 1.5 s
    meter.bucket_arrived(0, arrived)
    meter.sends_started(arrived)
    clock.now = 5.0
    meter.sends_finished()
    clock.now = 7.0
    meter.bucket_arrived(1)
    meter.sends_started()
    meter.sends_finished()
    meter.end_step((("a",), ("b",)))
    assert meter.backward_s() == pytest.approx([2.0, 2.0])


def test_interrupted_step_is_not_recorded():
    meter = BackwardMeter(window=4)
    clock = meter.clock = FakeClock()
    run_step(meter, clock, [(3.0, 3.0, 3.0)], (("a",), ("b",)))  # one bucket of two
    assert meter.backward_s() == []


def test_a_discarded_step_keeps_the_layout_and_samples_before_it():
    """The first step after a resume runs on DDP's transient one-bucket layout and stands
    for the checkpoint's (OMGSState._layout_after_load): recorded, it cleared that
    layout's samples, and a re-plan due at that step read zeros for its backward."""
    meter = BackwardMeter(window=4)
    clock = meter.clock = FakeClock()
    layout = (("a",), ("b",))
    run_step(meter, clock, [(3.0, 3.0, 3.0), (5.0, 5.0, 5.0)], layout)
    run_step(meter, clock, [(9.0, 9.0, 9.0)], (("a", "b"),), discard=True)
    assert meter.layout == layout and meter.backward_s() == pytest.approx([2.0, 2.0])
    run_step(meter, clock, [(9.0, 9.0, 9.0)], (("a", "b"),))  # recorded: the layout moves
    assert meter.layout == (("a", "b"),)


def test_tail_is_write_back_to_next_forward(monkeypatch):
    times = iter([10.0, 20.0, 30.0])
    monkeypatch.setattr(measurements.time, "perf_counter", lambda: next(times))
    meter = BackwardMeter(window=4)
    meter.clock = FakeClock()  # the wall clock above is for the iteration marks only
    meter.forward_started()          # t = 10
    meter.step_finished(17.5)        # last write-back of that step
    meter.forward_started()          # t = 20: tail 2.5
    assert meter.tail_s() == pytest.approx(2.5)
    assert meter.last_iteration_s == pytest.approx(10.0)
    meter.forward_started()          # t = 30, no step finished in between: no sample
    assert meter.tail_s() == pytest.approx(2.5)
    restored = BackwardMeter(window=4)
    restored.load_state_dict(meter.state_dict())
    assert restored.tail_s() == pytest.approx(2.5)


def test_group_overhead_fits_a_line_over_sizes():
    meter = GroupOverheadMeter()
    assert meter.estimate() is None
    for numel in (1000, 10_000, 100_000):
        for _ in range(20):
            total = 2e-4 + 3e-9 * numel
            meter.add(numel, total * 0.7, total * 0.3)
    meter.add(1000, 1.0, 1.0)  # one outlier in 21: clipped at the 90th percentile
    per_group, per_element = meter.estimate()
    assert per_group == pytest.approx(2e-4, rel=1e-6)
    assert per_element == pytest.approx(3e-9, rel=1e-6)


def test_group_overhead_with_one_size_uses_the_measured_split():
    meter = GroupOverheadMeter()
    for element_pass in (4e-3, 5e-3, 6e-3) * 10:
        meter.add(1_000_000, element_pass, 3e-4)
    per_group, per_element = meter.estimate()
    assert per_group == pytest.approx(3e-4)
    # the clipped mean: 6e-3 is at the 90th percentile, so nothing is clipped
    assert per_element == pytest.approx(5e-9)


def test_group_overhead_prices_the_mean_a_step_pays_not_the_median():
    """A step pays the sum of its groups' work: 59 groups whose samples are usually 1e-4 s
    but a fifth of the time 4e-4 s (preempted) cost 59 x 1.6e-4 s, not 59 x 1e-4 s."""
    meter = GroupOverheadMeter()
    for i in range(100):
        meter.add(1000, 0.0, 4e-4 if i % 5 == 0 else 1e-4)
    per_group, _ = meter.estimate()
    assert per_group == pytest.approx(1.6e-4)  # the median would read 1e-4


def test_clipped_mean_clips_at_the_ninetieth_percentile():
    rng = np.random.default_rng(3)
    for n in (1, 2, 5, 40, 257):
        values = rng.lognormal(sigma=1.5, size=n)
        expected = np.minimum(values, np.quantile(values, 0.9)).mean()
        assert clipped_mean(values) == pytest.approx(expected, rel=1e-12)
        assert clipped_mean(list(values), q=1.0) == pytest.approx(values.mean(), rel=1e-12)
    # a heavy tail: between the median and the mean (the top 5% clipped to the 90th
    # percentile, 10)
    values = [1.0] * 85 + [10.0] * 10 + [100.0] * 5
    assert clipped_mean(values) == pytest.approx((85 + 15 * 10) / 100)
    with pytest.raises(ValueError, match="no values"):
        clipped_mean([])


def test_topk_time_meter_scales_the_profile_line_by_what_training_measured():
    line = TopkCost(c0=1e-4, c1=2e-9, c2=0.0)
    meter = TopkTimeMeter()
    assert meter.scale(line) is None
    for numel in (1000, 50_000, 270_000):
        for _ in range(20):
            meter.add(numel, 2.5 * line.time(numel))
    assert meter.scale(line) == pytest.approx(2.5)
    # a rare preemption is clipped at the 90th percentile of the ratios
    meter.add(1000, 1000 * line.time(1000))
    assert meter.scale(line) == pytest.approx(2.5)
    # the factor weighs each sample by its profile time: a step's total, not the mean
    # of the ratios (small groups at 4x, one large at 1x: far below the ratios' mean)
    mixed = TopkTimeMeter()
    for _ in range(9):
        mixed.add(1000, 4 * line.time(1000))
    mixed.add(1_000_000, 1 * line.time(1_000_000))
    weights = 9 * line.time(1000), line.time(1_000_000)
    assert mixed.scale(line) == pytest.approx(
        (4 * weights[0] + 1 * weights[1]) / sum(weights), rel=1e-9)
    assert mixed.scale(TopkCost(0.0, 0.0, 0.0)) is None  # nothing to scale
    restored = TopkTimeMeter()
    restored.load_state_dict(meter.state_dict())
    assert restored.scale(line) == meter.scale(line) and len(restored) == len(meter)


def test_topk_time_meter_rejects_bad_samples_and_keeps_a_window():
    meter = TopkTimeMeter(window=3)
    for bad in ((0, 1e-3), (10, -1.0), (10, float("nan"))):
        with pytest.raises(ValueError, match="bad top-k time sample"):
            meter.add(*bad)
    for seconds in (1.0, 2.0, 3.0, 4.0):
        meter.add(10, seconds)
    assert len(meter) == 3
    with pytest.raises(ValueError, match="window"):
        TopkTimeMeter(window=0)


def test_group_overhead_rejects_bad_samples_and_round_trips():
    meter = GroupOverheadMeter(window=2)
    with pytest.raises(ValueError, match="bad group overhead sample"):
        meter.add(0, 1e-3, 1e-3)
    with pytest.raises(ValueError, match="bad group overhead sample"):
        meter.add(10, float("nan"), 1e-3)
    for numel in (10, 20, 40):  # the window keeps the last two
        meter.add(numel, 1e-6 * numel, 1e-4)
    assert len(meter) == 2
    copy = GroupOverheadMeter()
    copy.load_state_dict(meter.state_dict())
    assert copy.estimate() == pytest.approx(meter.estimate())


def test_slowest_rank_timeline_is_the_median_of_the_per_step_maximum():
    from omgs_hook.measurements import slowest_rank_timeline

    # [tail, forward, bucket 0, bucket 1]; rank 1 is slow in forward on step 2 only,
    # rank 0 slow in bucket 1 on step 3: the maximum is taken per step on cumulative time
    rank0 = [(1, [1.0, 2.0, 1.0, 1.0]), (2, [1.0, 2.0, 1.0, 1.0]), (3, [1.0, 2.0, 1.0, 9.0])]
    rank1 = [(2, [1.0, 6.0, 1.0, 1.0]), (3, [1.0, 2.0, 1.0, 1.0]), (4, [5.0, 5.0, 5.0, 5.0])]
    parts = slowest_rank_timeline([rank0, rank1])
    # common steps 2 and 3; cumulative maxima: step 2 [1, 7, 8, 9], step 3 [1, 3, 4, 13]
    # medians [1, 5, 6, 11] -> parts [1, 4, 1, 5]
    assert parts == pytest.approx([1.0, 4.0, 1.0, 5.0])
    # the mean of the ranks' medians would say [1, 3, 1, 3]: an iteration 3 s too short


def test_slowest_rank_timeline_of_one_rank_is_its_median_and_needs_common_steps():
    from omgs_hook.measurements import slowest_rank_timeline

    rows = [(s, [0.1, 0.2 * s, 0.3]) for s in (1, 2, 3)]
    assert slowest_rank_timeline([rows]) == pytest.approx([0.1, 0.4, 0.3])
    assert slowest_rank_timeline([rows, [(9, [1.0, 1.0, 1.0])]]) is None
    assert slowest_rank_timeline([[], rows]) is None
    with pytest.raises(ValueError, match="different lengths"):
        slowest_rank_timeline([rows, [(1, [1.0, 1.0])]])


def test_timelines_carry_step_tail_forward_and_backward(monkeypatch):
    walls = iter([0.0, 10.0])
    monkeypatch.setattr(measurements.time, "perf_counter", lambda: next(walls))
    meter = BackwardMeter(window=4)
    clock = meter.clock = FakeClock()
    layout = (("a",), ("b",))
    meter.forward_started()             # wall 0: no tail before the first step
    run_step(meter, clock, [(3.0, 3.0, 4.0), (6.0, 6.0, 6.0)], layout)  # closed unnumbered
    assert meter.timelines() == []      # no tail measured before it
    meter.step_finished(8.5)
    clock.now = 0.0
    meter.forward_started()             # wall 10: tail 1.5
    run_step(meter, clock, [(3.0, 3.0, 4.0), (6.0, 6.0, 6.0)], layout, step=1,
             start_forward=False)
    [(step, row)] = meter.timelines()
    assert step == 1 and row == pytest.approx([1.5, 1.0, 2.0, 2.0])
    restored = BackwardMeter(window=4)
    restored.load_state_dict(meter.state_dict())
    assert restored.timelines() == meter.timelines()


def test_forward_in_progress_is_the_current_steps_forward_on_the_host_clock_only():
    meter = BackwardMeter(window=4)
    clock = meter.clock = FakeClock()
    assert meter.forward_in_progress_s() is None  # no forward yet
    clock.now = 2.0
    meter.forward_started()
    assert meter.forward_in_progress_s() is None  # still running
    clock.now = 2.75
    meter.forward_finished()
    meter.bucket_arrived(0)
    assert meter.forward_in_progress_s() == pytest.approx(0.75)  # read at bucket 0
    meter.end_step((("a",),), step=0)
    assert meter.forward_in_progress_s() is None  # the step is closed
    # a CUDA forward's host time is launch time: no probe there
    meter.clock = object.__new__(measurements.CudaClock)
    meter._fwd_start, meter._fwd_end = 0.0, 1.0
    assert meter.forward_in_progress_s() is None


def test_forward_load_compares_the_preferred_steps_forward_with_the_window():
    meter = BackwardMeter(window=8)
    clock = meter.clock = FakeClock()
    layout = (("a",),)

    def step(number, forward):
        clock.now = 0.0
        meter._fwd_start = clock.mark()
        clock.now = forward
        meter.forward_finished()
        meter.bucket_arrived(0)
        meter.end_step(layout, step=number)

    for n in range(5):
        step(n, 1.0)
    assert meter.forward_load() is None  # no plan preferred yet
    meter.prefer_from(5)
    step(5, 2.0)
    step(6, 2.0)
    assert meter.forward_load() is None  # fewer than MIN_FRESH_STEPS preferred steps
    step(7, 2.0)
    # preferred median 2.0 over the window's median (1, 1, 1, 1, 1, 2, 2, 2): 1.0
    assert meter.forward_load() == pytest.approx(2.0)
    meter.prefer_from(0)
    assert meter.forward_load() is None  # nothing older to compare with


def test_only_a_steps_first_forward_starts_it(monkeypatch):
    """A step that calls the model twice (a siamese loss) or runs no_sync micro-batches
    first: its forward and the iteration start at its first forward, not its last."""
    walls = iter([0.0, 10.0, 99.0])
    monkeypatch.setattr(measurements.time, "perf_counter", lambda: next(walls))
    meter = BackwardMeter(window=4)
    clock = meter.clock = FakeClock()
    layout = (("a",),)
    for first_wall in (0.0, 10.0):  # two steps, each with two forwards
        clock.now = 0.0
        meter.forward_started()      # the step's first forward: fake time 0
        clock.now = 0.5
        meter.forward_finished()
        meter.forward_started()      # the second forward: ignored (no perf_counter read)
        run_step(meter, clock, [(3.0, 3.0, 3.5)], layout, start_forward=False)
        meter.step_finished(first_wall + 3.5)
    # forward 0 -> 1 (both forwards), iteration 0 -> 10 (first forward to first forward)
    assert meter.forward_s() == pytest.approx(1.0)
    assert meter.last_iteration_s == pytest.approx(10.0)
    assert meter.tail_s() == pytest.approx(6.5)  # 3.5 -> 10
    assert next(walls) == 99.0  # the second forwards never read the clock


def test_iteration_median_of_the_window_and_of_the_plan_in_use(monkeypatch):
    """``iteration_s``: the median of the window's iterations (one slow one - a GC pass,
    an evaluation - does not move it), of the steps from ``since_step`` on once there are
    3 of them; ``last_iteration_s`` stays the last one alone."""
    starts = [0.0, 1.0, 2.0, 3.0, 13.0, 14.0, 14.5, 15.0, 15.5]  # forward starts
    times = iter(starts)
    monkeypatch.setattr(measurements.time, "perf_counter", lambda: next(times))
    meter = BackwardMeter(window=8)
    clock = meter.clock = FakeClock()
    assert meter.iteration_s() is None
    for step in range(1, len(starts) + 1):
        meter.forward_started()
        run_step(meter, clock, [(3.0, 3.0, 3.0)], (("a",),), step=step, start_forward=False)
    # iterations of steps 1..8: 1, 1, 1, 10, 1, 0.5, 0.5, 0.5
    assert meter.last_iteration_s == pytest.approx(0.5)
    assert meter.iteration_s() == pytest.approx(1.0)
    assert meter.iteration_s(since_step=6) == pytest.approx(0.5)
    assert meter.iteration_s(since_step=7) == pytest.approx(1.0)  # 2 steps: the window's
    meter.reset()
    assert meter.iteration_s() is None


def test_tail_excess_is_the_gap_beyond_the_usual_one(monkeypatch):
    """An evaluation between two steps makes one gap (last write-back to the next
    forward) long: ``tail_excess_s`` is its excess over the window's median gap, which the
    hook takes off that step's time; 0 for an ordinary gap or before 3 gaps."""
    # forward starts at 0, 10, 20, 30, 40; each step's last write-back 8 s after its start,
    # except the fourth, after which an evaluation ran: gaps 2, 2, 2, then 12 (at t=40+10)
    starts = iter([0.0, 10.0, 20.0, 30.0, 50.0])
    monkeypatch.setattr(measurements.time, "perf_counter", lambda: next(starts))
    meter = BackwardMeter(window=8)
    meter.clock = FakeClock()
    excess = []
    for finish in (8.0, 18.0, 28.0, 38.0, None):
        meter.forward_started()
        excess.append(meter.tail_excess_s())
        if finish is not None:
            meter.step_finished(finish)
    assert excess[:4] == [0.0, 0.0, 0.0, 0.0]
    assert excess[4] == pytest.approx(10.0)  # gap 12 against the median 2


def _loop_gaps(fwd_end, arrive, sends):
    """The per-bucket backward rule written out one bucket at a time (the reference)."""
    out = []
    for i, arrival in enumerate(arrive):
        if i == 0:
            gap = arrival - fwd_end if fwd_end is not None else 0.0
        else:
            gap = (arrival - arrive[i - 1]) - (sends[i - 1][1] - sends[i - 1][0])
        out.append(max(0.0, gap))
    return out


def test_backward_gaps_equal_the_one_bucket_at_a_time_rule_bit_for_bit():
    import random

    rng = random.Random(3)
    for n in (1, 2, 7, 1000):
        t = 1e4 * rng.random()  # perf_counter-like magnitudes: rounding matters
        arrive, sends = [], []
        for _ in range(n):
            t += rng.random() * 1e-3
            arrive.append(t)
            start = t + rng.random() * 1e-4
            sends.append((start, start + rng.random() * 2e-3))  # may exceed the gap: clamped
        sends.append((0.0, 0.0))  # a flush send after the last bucket is ignored
        for fwd_end in (None, arrive[0] - 0.25):
            got = measurements.backward_gaps(fwd_end, arrive, sends)
            assert got.tolist() == _loop_gaps(fwd_end, arrive, sends)
            assert (got >= 0).all()
    assert measurements.backward_gaps(None, [], []).tolist() == []


def test_the_host_clock_meter_stores_arrays_and_restores_plain_floats():
    class HostFake(measurements.CpuClock):  # the meter's host path, with marks set by hand
        now = 0.0

        def mark(self):
            return self.now

    meter = BackwardMeter(window=4)
    clock = meter.clock = HostFake()
    layout = (("a",), ("b",), ("c",))
    run_step(meter, clock, [(3.0, 3.5, 5.5), (7.0, 7.25, 7.25), (9.0, 9.0, 12.0)], layout, step=0)
    assert meter.backward_s() == [2.0, 2.0, 2.0]
    state = meter.state_dict()
    assert all(type(x) is float for row in state["samples"] for x in row)
    restored = BackwardMeter(window=4)
    restored.load_state_dict(state)
    assert restored.backward_s() == meter.backward_s()


class _FakeEvent:
    """A CUDA event's interface on a fake timeline (seconds in ``at``)."""

    def __init__(self, at):
        self.at = at

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return (end.at - self.at) * 1000.0


def test_the_first_cuda_step_forward_marked_on_the_host_is_not_resolved_as_events(monkeypatch):
    """On CUDA the device is known at the first bucket, after the first step's forward
    was marked with the host clock (floats): resolving that step one step later with
    the CUDA clock subtracted a float from an event (AttributeError in backward())."""
    times = iter(float(t) for t in range(1000))
    monkeypatch.setattr(measurements.CudaClock, "mark", lambda self: _FakeEvent(next(times)))
    meter = BackwardMeter(window=4)
    layout = (("a",), ("b",))
    for step in range(3):
        meter.forward_started()
        meter.forward_finished()
        if step == 0:
            meter.use_device(measurements.torch.device("cuda", 0))  # as _first_bucket_setup
        for index in range(2):
            meter.bucket_arrived(index)
            meter.sends_started()
            meter.sends_finished()
        meter.end_step(layout, step=step)
        meter.step_finished(0.0)
    # steps 0 and 1 resolved (step 2 waits for the next one); step 0 without a forward
    assert meter.num_samples == 2
    assert all(s >= 0.0 for s in meter.backward_s())
    assert meter.forward_s() > 0.0


def test_untimed_per_group_s_shares_what_windows_with_groups_took_beyond_an_empty_one():
    from omgs_hook.measurements import untimed_per_group_s

    # empty windows show the per-bucket part (median 1e-4); two windows sent 1 and 2 groups
    windows = [(0, 1e-4), (0, 3e-4), (0, 1e-4), (1, 5e-4), (2, 9e-4)]
    assert untimed_per_group_s(windows) == pytest.approx((4e-4 + 8e-4) / 3)
    # no empty window (every bucket sent a group, as LAGS-SGD's plan): nothing taken off
    assert untimed_per_group_s([(1, 2e-4), (1, 4e-4)]) == pytest.approx(3e-4)
    # no group sent, or windows quicker than the empty ones: nothing
    assert untimed_per_group_s([(0, 1e-4)]) == 0.0
    assert untimed_per_group_s([]) == 0.0
    assert untimed_per_group_s([(0, 5e-4), (1, 1e-4)]) == 0.0
