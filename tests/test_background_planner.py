"""Tests for omgs_hook.background_planner: the result is handed out exactly at the agreed
step, a slow worker makes poll wait instead of skipping, ranks switch together, errors
propagate, replacing and cancelling, and no thread outlives close().

Slowness is simulated with events the test controls, never with timing assertions.
"""

import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from omgs_hook.background_planner import LOW_PRIORITY_NICE, BackgroundPlanner
from omgs_hook.cost_model import Instance, LinearCost, TopkCost, Unit
from omgs_hook.planner import make_plan

SRC = str(Path(__file__).resolve().parents[1] / "src")
WAIT = 30.0  # generous: only a hung test waits this long


def _our_threads(name):
    return [t for t in threading.enumerate() if t.name.startswith(name + "-")]


@pytest.fixture
def planner(request):
    name = f"bp-test-{request.node.name}"
    p = BackgroundPlanner(name=name)
    yield p
    assert p.close(timeout=WAIT)
    assert not _our_threads(name)


def test_result_is_handed_out_exactly_at_the_agreed_step(planner):
    planner.submit(lambda x: x * 2, 21, apply_at_step=5)
    assert planner.pending and planner.apply_at_step == 5
    seen = {}
    for step in range(10):
        result = planner.poll(step)
        if result is not None:
            seen[step] = result
    assert seen == {5: 42}  # once, at step 5, even though it finished long before
    assert not planner.pending and planner.apply_at_step is None
    assert planner.poll(6) is None


def test_poll_after_the_step_still_returns_the_result(planner):
    planner.submit(str.upper, "plan", apply_at_step=3)
    assert planner.poll(7) == "PLAN"
    assert planner.poll(8) is None


def test_a_slow_function_makes_poll_wait_at_the_agreed_step():
    release = threading.Event()
    started = threading.Event()

    def slow():
        started.set()
        assert release.wait(WAIT)
        return "new plan"

    planner = BackgroundPlanner(name="bp-slow")
    planner.submit(slow, apply_at_step=2)
    assert started.wait(WAIT)
    assert planner.poll(0) is None and planner.poll(1) is None  # not due: no waiting
    assert planner.pending and not planner.ready

    outcome = {}

    def training_step_2():
        outcome["result"] = planner.poll(2)

    trainer = threading.Thread(target=training_step_2)
    trainer.start()
    trainer.join(0.2)
    # the step is held at 2 (not skipped to a later one) while the worker runs
    assert trainer.is_alive() and "result" not in outcome
    release.set()
    trainer.join(WAIT)
    assert not trainer.is_alive()
    assert outcome["result"] == "new plan"
    assert planner.last_wait_s > 0.0
    assert planner.close(timeout=WAIT)


def _wait_ready(planner):
    deadline = time.monotonic() + WAIT
    while not planner.ready and time.monotonic() < deadline:
        time.sleep(0.001)


def test_no_wait_is_recorded_when_the_worker_finished_in_time(planner):
    planner.submit(lambda: 1, apply_at_step=0)
    _wait_ready(planner)  # the worker finishes outside poll
    assert planner.ready
    assert planner.poll(0) == 1
    assert planner.last_wait_s == 0.0


def test_two_ranks_finishing_at_different_times_switch_at_the_same_step():
    """A fake two-rank run: each rank polls every step and records the step at which it
    switches. Rank 0's planning finishes at once, rank 1's only after rank 1 has reached
    the agreed step (and rank 0 is far past it). Both switch at the agreed step."""
    agreed = 4
    slow_may_finish = threading.Event()
    reached = {0: threading.Event(), 1: threading.Event()}

    def plan_fast():
        return ("plan", 7)

    def plan_slow():
        assert slow_may_finish.wait(WAIT)
        return ("plan", 7)

    switched = {}
    plans = {}

    def rank(index, fn):
        planner = BackgroundPlanner(name=f"bp-rank{index}")
        current = ("plan", 1)
        planner.submit(fn, apply_at_step=agreed)
        for step in range(10):
            if step == agreed:
                reached[index].set()
            result = planner.poll(step)
            if result is not None:
                switched[index] = step
                current = result
            plans.setdefault(index, []).append(current)
        assert planner.close(timeout=WAIT)

    ranks = [
        threading.Thread(target=rank, args=(0, plan_fast)),
        threading.Thread(target=rank, args=(1, plan_slow)),
    ]
    for r in ranks:
        r.start()
    assert reached[1].wait(WAIT)  # rank 1 is at the agreed step, its plan not yet done
    ranks[0].join(WAIT)  # rank 0 runs all its steps meanwhile
    assert not ranks[0].is_alive()
    slow_may_finish.set()
    ranks[1].join(WAIT)
    assert not ranks[1].is_alive()
    assert switched == {0: agreed, 1: agreed}
    assert plans[0] == plans[1]  # the same plan in use at every step on both ranks
    assert plans[0][agreed - 1] == ("plan", 1) and plans[0][agreed] == ("plan", 7)


def test_exceptions_from_the_worker_are_raised_by_poll_at_the_agreed_step(planner):
    def broken():
        raise ValueError("no plan for you")

    planner.submit(broken, apply_at_step=3)
    assert planner.poll(2) is None  # not before the step
    with pytest.raises(ValueError, match="no plan for you"):
        planner.poll(3)
    assert not planner.pending  # handed out once
    assert planner.poll(4) is None


def test_a_new_submit_replaces_the_pending_job(planner):
    release = threading.Event()

    def old():
        assert release.wait(WAIT)
        raise RuntimeError("old job: must never be seen")

    planner.submit(old, apply_at_step=2)
    planner.submit(lambda: "new", apply_at_step=5)
    assert planner.apply_at_step == 5
    assert planner.poll(2) is None  # the old job's step means nothing now
    release.set()
    assert planner.poll(5) == "new"
    assert planner.poll(6) is None


def test_cancel_drops_the_pending_job(planner):
    planner.submit(lambda: "x", apply_at_step=1)
    assert planner.cancel() is True
    assert not planner.pending
    assert planner.poll(1) is None
    assert planner.cancel() is False


def test_arguments_and_keyword_arguments_are_passed(planner):
    planner.submit(lambda a, b, scale=1: (a + b) * scale, 1, 2, scale=10, apply_at_step=0)
    assert planner.poll(0) == 30


def test_invalid_use_is_rejected(planner):
    with pytest.raises(TypeError):
        planner.submit("not callable", apply_at_step=1)
    with pytest.raises(TypeError):
        planner.submit(lambda: 1, apply_at_step=1.5)
    with pytest.raises(TypeError):
        planner.submit(lambda: 1, apply_at_step=True)
    with pytest.raises(TypeError):
        planner.submit(lambda: 1)  # apply_at_step is required
    with pytest.raises(TypeError):
        planner.poll("3")
    assert not planner.pending


def test_no_thread_is_left_running_after_close():
    name = "bp-close"
    release = threading.Event()
    planner = BackgroundPlanner(name=name)
    planner.submit(release.wait, WAIT, apply_at_step=1)
    planner.submit(release.wait, WAIT, apply_at_step=2)  # replaced, still running
    assert len(_our_threads(name)) == 2
    # a worker that does not finish: close with a timeout says so
    assert planner.close(timeout=0.05) is False
    assert _our_threads(name)
    release.set()
    assert planner.close(timeout=WAIT) is True
    assert not _our_threads(name)
    assert planner.closed and not planner.pending
    with pytest.raises(RuntimeError, match="after close"):
        planner.submit(lambda: 1, apply_at_step=3)


def test_an_idle_worker_thread_takes_the_next_job_and_a_busy_one_does_not(planner):
    """Starting a thread holds the caller until the thread runs (5-6 ms a re-plan on
    two busy cores): a finished worker waits for the next job instead of ending. A job
    replaced while it runs keeps its thread; the new job gets another."""
    name = planner._name
    planner.submit(threading.get_ident, apply_at_step=1)
    first = planner.poll(1)
    for step in range(2, 6):
        _wait_idle(planner)
        planner.submit(threading.get_ident, apply_at_step=step)
        assert planner.poll(step) == first  # the same thread each time
    assert len(_our_threads(name)) == 1
    release = threading.Event()
    _wait_idle(planner)
    planner.submit(release.wait, WAIT, apply_at_step=6)  # busy until released
    planner.submit(threading.get_ident, apply_at_step=7)  # replaces it: another thread
    other = planner.poll(7)
    assert other != first and len(_our_threads(name)) == 2
    release.set()


def _wait_idle(planner):
    deadline = time.monotonic() + WAIT
    while not planner._idle and time.monotonic() < deadline:
        time.sleep(0.001)


def test_context_manager_closes():
    name = "bp-context"
    with BackgroundPlanner(name=name) as planner:
        planner.submit(lambda: 5, apply_at_step=0)
        assert planner.poll(0) == 5
        planner.submit(lambda: 6, apply_at_step=9)
    assert planner.closed
    assert not _our_threads(name)


def test_concurrent_submit_and_poll_never_hand_out_a_result_twice():
    """Thread safety: one thread submits jobs, another polls; every result is handed
    out at most once and only at or after its own step."""
    planner = BackgroundPlanner(name="bp-concurrent")
    handed = []
    stop = threading.Event()
    lock = threading.Lock()
    submitted = {}

    def submitter():
        for i in range(200):
            planner.submit(lambda i=i: i, apply_at_step=i)
            with lock:
                submitted[i] = i

    def poller():
        step = 0
        while not stop.is_set() or planner.pending:
            result = planner.poll(step)
            if result is not None:
                handed.append((step, result))
            step = min(step + 1, 200)

    threads = [threading.Thread(target=submitter), threading.Thread(target=poller)]
    for t in threads:
        t.start()
    threads[0].join(WAIT)
    stop.set()
    threads[1].join(WAIT)
    assert not any(t.is_alive() for t in threads)
    results = [r for _, r in handed]
    assert len(results) == len(set(results))
    assert all(step >= result for step, result in handed)
    assert planner.close(timeout=WAIT)


def test_plans_a_real_instance_in_the_background(planner):
    rng = np.random.default_rng(0)
    inst = Instance(
        layers=tuple(Unit(int(rng.integers(1, 10**6)), float(rng.uniform(0, 1e-3)))
                     for _ in range(50)),
        world_size=4,
        density=0.01,
        forward_s=0.01,
        comm=LinearCost(1e-3, 1e-9),
        topk=TopkCost(1e-5, 1e-10, 0.0),
    )
    planner.submit(make_plan, inst, "optimal", apply_at_step=1)
    assert planner.poll(0) is None
    assert planner.poll(1) == make_plan(inst, "optimal")


def test_the_module_does_not_import_torch():
    code = (
        "import sys, omgs_hook.background_planner; "
        "assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    )
    env = {"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


# ------------------------------------------------------------------ the worker process


@pytest.fixture
def jobs_importable(monkeypatch):
    """The worker process finds tests/planner_jobs.py (it inherits the environment)."""
    tests = str(Path(__file__).resolve().parent)
    monkeypatch.setenv("PYTHONPATH", tests)
    import planner_jobs
    return planner_jobs


def test_an_isolated_job_runs_in_another_process_with_the_same_result(planner, jobs_importable):
    import os

    planner.submit(jobs_importable.pid_and, "x", apply_at_step=1, isolate=True)
    pid, value = planner.poll(1)
    assert value == "x" and pid != os.getpid()
    # the same worker serves the next job; a real plan comes back equal to a local one
    rng = np.random.default_rng(1)
    inst = Instance(
        layers=tuple(Unit(int(rng.integers(1, 10**6)), float(rng.uniform(0, 1e-3)))
                     for _ in range(120)),
        world_size=8, density=0.001, forward_s=0.01, comm=LinearCost(1e-3, 1e-9),
        topk=TopkCost(1e-5, 1e-10, 0.0), dense=LinearCost(2e-3, 2e-10))
    planner.submit(make_plan, inst, "optimal", apply_at_step=2, isolate=True)
    assert planner.poll(2) == make_plan(inst, "optimal")
    planner.submit(jobs_importable.pid_and, "y", apply_at_step=3, isolate=True)
    assert planner.poll(3)[0] == pid
    assert planner.last_compute_s >= 0.0


@pytest.mark.skipif(not hasattr(__import__("os"), "nice"), reason="no OS niceness here")
def test_a_low_priority_job_runs_in_a_process_of_the_lowest_priority(planner, jobs_importable):
    import os

    own = os.nice(0)
    planner.submit(jobs_importable.pid_and_nice, "normal", apply_at_step=1, isolate=True)
    normal_pid, normal_nice, value = planner.poll(1)
    assert value == "normal" and normal_pid != os.getpid() and normal_nice == own
    planner.submit(jobs_importable.pid_and_nice, "low", apply_at_step=2, isolate=True,
                   low_priority=True)
    low_pid, low_nice, value = planner.poll(2)
    assert value == "low" and low_pid not in (os.getpid(), normal_pid)
    assert low_nice == min(19, own + LOW_PRIORITY_NICE)  # (Linux caps niceness at 19)
    # each kind keeps its own process for the next jobs
    planner.submit(jobs_importable.pid_and_nice, 1, apply_at_step=3, isolate=True)
    assert planner.poll(3)[0] == normal_pid
    planner.submit(jobs_importable.pid_and_nice, 2, apply_at_step=4, isolate=True,
                   low_priority=True)
    assert planner.poll(4)[0] == low_pid
    # low_priority without isolate: a thread, as before
    planner.submit(jobs_importable.pid_and_nice, 3, apply_at_step=5, low_priority=True)
    assert planner.poll(5)[:2] == (os.getpid(), own)


def test_the_worker_reads_its_niceness_from_its_command_line(monkeypatch):
    from omgs_hook import plan_worker

    calls = []
    monkeypatch.setattr(plan_worker.os, "nice", lambda n: calls.append(n) or n, raising=False)
    assert plan_worker.lower_priority([]) == 0 and calls == []
    assert plan_worker.lower_priority(["--nice", "19"]) == 19 and calls == [19]

    def refused(n):
        raise OSError("not permitted")

    monkeypatch.setattr(plan_worker.os, "nice", refused, raising=False)
    assert plan_worker.lower_priority(["--nice", "5"]) == 5  # the job still runs


def test_an_isolated_jobs_error_and_warnings_reach_the_caller(planner, jobs_importable):
    planner.submit(jobs_importable.fail, "boom", apply_at_step=1, isolate=True)
    with pytest.raises(ValueError, match="boom"):
        planner.poll(1)
    with pytest.warns(UserWarning, match="careful"):
        planner.submit(jobs_importable.warn_and_return, "careful", 7, apply_at_step=2,
                       isolate=True)
        assert planner.poll(2) == 7
    planner.submit(jobs_importable.unpicklable_result, apply_at_step=3, isolate=True)
    with pytest.raises(RuntimeError, match="cannot return the result"):
        planner.poll(3)


def test_a_dead_worker_process_hands_its_job_to_a_thread(planner, jobs_importable):
    import os

    with pytest.warns(RuntimeWarning, match="worker process ended"):
        planner.submit(jobs_importable.die_unless_in, os.getpid(), "saved", apply_at_step=1,
                       isolate=True)
        assert planner.poll(1) == "saved"  # computed again, here, on a thread
    # the next isolated job starts a new process
    planner.submit(jobs_importable.pid_and, "again", apply_at_step=2, isolate=True)
    pid, value = planner.poll(2)
    assert value == "again" and pid != os.getpid()


def test_a_worker_process_that_cannot_start_leaves_the_job_on_a_thread(planner, monkeypatch):
    import os

    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    with pytest.warns(RuntimeWarning, match="could not start"):
        planner.submit(os.getpid, apply_at_step=1, isolate=True)
    assert planner.poll(1) == os.getpid()


def test_close_ends_the_worker_process(jobs_importable):
    planner = BackgroundPlanner(name="bp-close-process")
    planner.submit(jobs_importable.pid_and, 1, apply_at_step=1, isolate=True)
    pid, _ = planner.poll(1)
    planner.submit(jobs_importable.pid_and, 2, apply_at_step=2, isolate=True,
                   low_priority=True)
    planner.poll(2)
    processes = [p._process for p in planner._processes.values()]
    assert len(processes) == 2
    assert all(process.poll() is None for process in processes)  # waiting for jobs
    assert planner.close(timeout=WAIT)
    assert all(process.poll() is not None for process in processes)
    assert not _our_threads("bp-close-process")


def test_the_worker_process_does_not_import_torch():
    from omgs_hook import plan_worker

    code = ("import sys, omgs_hook.plan_worker, omgs_hook.plan_job; "
            "assert 'torch' not in sys.modules, 'torch imported'; print('ok')")
    env = {"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
    # and the framing: what goes in comes out
    import io

    stream = io.BytesIO()
    plan_worker.write_message(stream, ("job", 1, [2.5]))
    stream.seek(0)
    assert plan_worker.read_message(stream) == ("job", 1, [2.5])
    assert plan_worker.read_message(stream) is None


def test_the_hooks_planning_job_gives_the_same_result_in_the_process(planner):
    """omgs_hook.plan_job.compute_plan (the hook's re-plan) in the worker process and
    here: equal results, for the model's plan and for a full trial's candidates."""
    from omgs_hook.plan_job import compute_plan

    rng = np.random.default_rng(2)
    inst = Instance(
        layers=tuple(Unit(int(rng.integers(1, 10**6)), float(rng.uniform(0, 1e-3)))
                     for _ in range(60)),
        world_size=4, density=0.01, forward_s=0.01, comm=LinearCost(1e-3, 1e-9),
        topk=TopkCost(1e-5, 1e-10, 0.0), dense=LinearCost(2e-3, 1e-10), tail_s=0.001)
    job = {"instance": inst.to_dict(), "kept": None, "model_key": None, "retrial_ok": True}
    for step, select in enumerate(("model", "measured"), start=1):
        planner.submit(compute_plan, job, "optimal", select, apply_at_step=step, isolate=True)
        assert planner.poll(step) == compute_plan(job, "optimal", select)


def test_start_process_warms_the_worker_for_the_first_isolated_job(jobs_importable):
    planner = BackgroundPlanner(name="bp-start-process")
    assert planner.start_process()
    process = planner._processes[0]
    planner.submit(jobs_importable.pid_and, 3, apply_at_step=1, isolate=True)
    assert planner.poll(1)[1] == 3 and planner._processes[0] is process  # the same process
    assert planner.start_process(low_priority=True)
    low = planner._processes[LOW_PRIORITY_NICE]
    planner.submit(jobs_importable.pid_and, 4, apply_at_step=2, isolate=True,
                   low_priority=True)
    assert planner.poll(2)[1] == 4 and planner._processes[LOW_PRIORITY_NICE] is low
    assert planner.close(timeout=WAIT)
    with pytest.raises(RuntimeError, match="after close"):
        planner.start_process()


def test_a_planner_dropped_without_close_ends_its_process(jobs_importable):
    import gc

    planner = BackgroundPlanner(name="bp-dropped")
    planner.submit(jobs_importable.pid_and, 1, apply_at_step=1, isolate=True)
    planner.poll(1)
    process = planner._processes[0]._process
    del planner
    gc.collect()
    assert process.wait(timeout=WAIT) is not None
    deadline = __import__("time").monotonic() + WAIT
    while _our_threads("bp-dropped") and __import__("time").monotonic() < deadline:
        __import__("time").sleep(0.01)
    assert not _our_threads("bp-dropped")


@pytest.mark.parametrize("polled", [True, False], ids=["polled", "result-unpolled"])
def test_a_dropped_planner_is_freed_by_reference_counting_and_ends_its_thread(polled):
    # a finished job waits in the planner until poll() hands it out; it must not hold
    # its planner back, or the pair is a cycle that only the cycle collector frees
    import gc
    import weakref

    planner = BackgroundPlanner(name="bp-refcount")
    planner.submit(int, 7, apply_at_step=5)
    (thread,) = _our_threads("bp-refcount")
    if polled:
        assert planner.poll(5) == 7
    else:
        deadline = time.monotonic() + WAIT
        while planner._job is not None and not planner._job.done.is_set() \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        assert planner.pending and planner.ready
    gone = weakref.ref(planner)
    gc.disable()
    try:
        del planner
        assert gone() is None
    finally:
        gc.enable()
    thread.join(timeout=WAIT)
    assert not thread.is_alive()
