"""Which finished steps' measurements a re-plan reads.

A step finishes on whichever thread completes its last collective (gloo's, often), while
the re-plan runs on the autograd thread at the end of the next step's backward. The
meters the planner reads (the collectives' times, the per-group work) are therefore fed
on the autograd thread, from the steps before the current one only: a re-plan at step N
sees exactly steps < N, whether step N's collectives happen to be done yet or not. The
first step a state runs is never a sample of the network: it times the process group's
first use (2-6x a later step with 2 gloo ranks).
"""

from types import SimpleNamespace

import pytest
import torch

from omgs_hook import OMGSState
from omgs_hook.group_exchange import GroupRecord


def finished_step(step, collective_s, density=0.01, overhead=(1000, 2e-4, 1e-4), windows=(),
                  topk=(1000, 5e-4)):
    """A fake finished exchange: one sparse group whose collective took ``collective_s``;
    ``windows``: its send windows (groups sent, untimed seconds)."""
    record = GroupRecord(keys=("w",), dense=False, numel=1000, selected=10, nbytes=80)
    record.issued, record.done = 10.0, 10.0 + collective_s
    return SimpleNamespace(
        nonfinite=False, error=None, finish_wall=20.0, records=[record], subgroups=None,
        density=density, overhead_samples=[overhead], writeback_samples=[(1000, 3e-4)],
        window_samples=list(windows), topk_samples=[topk],
        step_number=step, health=None, staleness=None, warmup=False, topk_s=1e-3, hook_s=2e-3)


def sparse_seconds(state):
    return [row[0] for row in state._comm_times._steps]


def test_a_re_plan_at_step_n_reads_the_steps_before_n_and_never_the_first():
    state = OMGSState(density=0.01)
    for step, seconds in ((1, 0.5), (2, 0.01), (3, 0.02)):
        state._on_step_finished(finished_step(step, seconds))
    # nothing is fed on the thread that finished the steps
    assert sparse_seconds(state) == [] and len(state.overhead) == 0
    # the end of step 3's backward (step 3 already done here; it may as well not be)
    state._ingest_finished(before_step=3)
    # step 1 (the first use, 0.5 s) is no sample; step 2 is; step 3 waits for step 4
    assert sparse_seconds(state) == [pytest.approx(0.01)]
    assert len(state.overhead) == 2 and len(state.writeback) == 2
    state._ingest_finished(before_step=3)  # nothing new below 3
    assert sparse_seconds(state) == [pytest.approx(0.01)]
    state._ingest_finished(before_step=4)
    assert sparse_seconds(state) == [pytest.approx(0.01), pytest.approx(0.02)]
    assert len(state.overhead) == 3


def test_a_checkpoint_holds_every_finished_step_and_a_loaded_state_starts_clean():
    state = OMGSState(density=0.01)
    for step, seconds in ((1, 0.5), (2, 0.01), (3, 0.02)):
        state._on_step_finished(finished_step(step, seconds))
    saved = state.state_dict()
    # what the uninterrupted run's next re-plan (at step 4) would read
    assert [row[0] for row in saved["comm_times"]["steps"]] == [
        pytest.approx(0.01), pytest.approx(0.02)]
    resumed = OMGSState(density=0.01)
    resumed._on_step_finished(finished_step(1, 0.7))  # before the load: not this run's
    resumed.load_state_dict(saved)
    resumed._ingest_finished()
    assert sparse_seconds(resumed) == sparse_seconds(state)


def test_density_warm_up_steps_time_the_network_but_not_the_planned_density_s_work():
    state = OMGSState(density=0.01)
    state._on_step_finished(finished_step(1, 0.5))
    state._on_step_finished(finished_step(2, 0.01, density=0.25))  # still warming up
    state._on_step_finished(finished_step(3, 0.02))
    state._ingest_finished()
    assert sparse_seconds(state) == [pytest.approx(0.01), pytest.approx(0.02)]
    assert len(state.overhead) == 2  # steps 1 and 3: at the planned density


def test_without_measured_comm_nothing_is_timed_but_the_group_work_still_is():
    state = OMGSState(density=0.01, measured_comm=False)
    for step in (1, 2, 3):
        state._on_step_finished(finished_step(step, 0.01))
    state._ingest_finished()
    assert sparse_seconds(state) == [] and len(state.overhead) == 3


def test_the_send_windows_untimed_seconds_join_each_groups_fixed_part():
    """What a step's send windows took beyond the timed per-group work, less an empty
    window's (the per-bucket part), is shared by the groups and priced with ``h``."""
    state = OMGSState(density=0.01)
    # a window that sent nothing (1e-4 s), one that sent the group (4e-4 s untimed)
    windows = [(0, 1e-4), (1, 4e-4)]
    for step in (1, 2, 3):
        state._on_step_finished(finished_step(step, 0.01, windows=windows))
    state._ingest_finished(before_step=3)
    fixed = [f for _, _, f in state.overhead._samples]
    assert fixed == [pytest.approx(1e-4 + 3e-4)] * 2
    # without windows (a two-level step, the last bucket alone) the timed part stands
    state._on_step_finished(finished_step(4, 0.01))
    state._ingest_finished(before_step=5)
    assert [f for _, _, f in state.overhead._samples][-1] == pytest.approx(1e-4)


def set_up_as_on_cpu(state):
    """What the first bucket sets up (the selector and profile), without a process group."""
    from omgs_hook import topk as topk_mod
    from omgs_hook.profile_file import default_profile

    state._selector = topk_mod.get_selector("auto", torch.device("cpu"))
    state.profile = default_profile("cpu", world_size=2)
    return state


def test_the_top_k_as_training_ran_it_is_fed_at_the_planned_density_and_checkpointed():
    state = set_up_as_on_cpu(OMGSState(density=0.01))
    line = state.profile.topk_for(state._selector.name)
    state._on_step_finished(finished_step(1, 0.5, topk=(1000, 3 * line.time(1000))))
    # the density warm-up's groups select another k: not the planned density's top-k
    state._on_step_finished(finished_step(2, 0.01, density=0.25, topk=(1000, 1.0)))
    state._on_step_finished(finished_step(3, 0.01, topk=(1000, 3 * line.time(1000))))
    assert len(state.topk_times) == 0  # fed on the autograd thread, at the ingest
    state._ingest_finished()
    assert len(state.topk_times) == 2
    assert state._topk_scale_pair() == (pytest.approx(3.0), 0.0)
    resumed = set_up_as_on_cpu(OMGSState(density=0.01))
    resumed.load_state_dict(state.state_dict())
    assert resumed._topk_scale_pair() == state._topk_scale_pair()
    # an older checkpoint has none: the profile's line stands until training measures
    saved = state.state_dict()
    del saved["topk_times"]
    older = set_up_as_on_cpu(OMGSState(density=0.01))
    older.load_state_dict(saved)
    assert older._topk_scale_pair() is None
