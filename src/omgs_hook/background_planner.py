"""Planning off the training thread, switching at an agreed step.

Re-planning (``planner.make_plan(instance, strategy)``) takes milliseconds to a fraction of
a second. Done inline it stalls the step that triggers it. :class:`BackgroundPlanner`
runs the planning function on a daemon worker thread instead. The new plan takes effect
at a step number given when the job is submitted, the same on every rank (for example
``current_step + 2``):

* before that step, :meth:`BackgroundPlanner.poll` returns ``None`` and training goes
  on with the old plan;
* at that step (or the first poll after it), ``poll`` returns the result. If the worker
  has not finished yet, ``poll`` **waits for it** rather than skipping to a later step.
  A slow rank therefore delays its own step but never switches later than the others.
  Every rank that submits the same job with the same ``apply_at_step`` and polls every
  step switches at exactly that step, however fast it plans.

An exception raised by the function is re-raised by the ``poll`` that would have
returned its result, at the agreed step, so every rank fails at the same step too.

The module is pure Python: it imports neither torch nor ``torch.distributed`` and has no
collective of its own. Agreeing on ``apply_at_step`` is the caller's business: the hook
derives it from the step counter that every rank shares.

API (all methods are thread-safe)::

    planner = BackgroundPlanner()
    planner.submit(make_plan, instance, "optimal", apply_at_step=step + 2)
    ...
    result = planner.poll(step)      # None, or the result exactly at the agreed step
    if result is not None:
        use(result)
    ...
    planner.close()                  # joins every worker thread it started

``submit`` while a job is pending *replaces* it. The old job's result is discarded, and
so is its exception. Its thread cannot be interrupted, so it runs to the end in the
background (the new job gets another thread); :meth:`close` waits for it. A worker
thread that has finished its job waits for the next one instead of ending: starting a
thread holds the caller until the new thread has been scheduled and has taken the
interpreter lock, 5-6 ms per re-plan on two busy cores (measured at 1000 buckets),
which a reused thread does not cost. A result is handed out once: after ``poll``
returned it, nothing is pending. Because ``None`` means "nothing due", a function used
with ``poll`` should not return ``None`` (``make_plan`` returns a ``Plan``).

Threads or a process (``submit(..., isolate=True)``): a worker *thread* shares the
interpreter lock (GIL) with the training thread. Numpy holds it in most of its calls, so
while a plan is computed the training thread's Python - DDP's and the comm hook's code at
every bucket - waits for the lock again and again: measured here, a loop of small torch
calls ran 6-10x slower beside a 0.8 s plan (``docs/design.md``). An *isolated* job runs
in the planner's worker process instead (``python -m omgs_hook.plan_worker``: a fresh
interpreter without torch, started at the first isolated job and kept for the next
ones), which shares no lock with training; the job's function and arguments travel as
pickles, so the function must be a module-level function of a torch-free module. Jobs
in the process run one at a time, in order; a replaced job is finished and discarded.
Warnings the job emits are re-emitted here. If the process cannot be started, or dies,
the job runs on a thread instead (with one ``RuntimeWarning``): the result is the same,
only the lock is shared again. ``last_compute_s`` is the CPU time the last finished job
took, wherever it ran: a caller can isolate the next job when that is longer than the
stall it can afford.

Low priority (``submit(..., isolate=True, low_priority=True)``): the job runs in a second
worker process whose OS priority is the lowest (niceness ``LOW_PRIORITY_NICE``). Where
the training processes fill every core, a planner at their priority takes its CPU from
them; at the lowest one it runs in the cores' idle time (a rank waiting for the network)
and otherwise gets a few percent, so the plan arrives later rather than the steps
slowing. A low-priority *thread* would not do: while the OS leaves it waiting it may
hold the interpreter lock that the training thread needs (measured: single steps of
0.7-0.8 s, docs/design.md). A process shares no lock.
"""

from __future__ import annotations

import itertools
import os
import queue
import subprocess
import sys
import threading
import time
import warnings
import weakref
from typing import Any, Callable, Dict, List, Optional

__all__ = ["BackgroundPlanner"]

_thread_numbers = itertools.count(1)

#: niceness of the low-priority worker process (``submit(..., low_priority=True)``): the
#: lowest priority on Linux, where CFS gives it about 1.5% of a core that a nice-0 task
#: also wants and all of an idle one
LOW_PRIORITY_NICE = 19


class _Job:
    """One submitted call and its outcome (written by the worker before ``done`` is set)."""

    __slots__ = ("fn", "args", "kwargs", "apply_at_step", "done", "result", "error", "thread",
                 "compute_s", "owner")

    def __init__(self, fn, args, kwargs, apply_at_step):
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.apply_at_step = apply_at_step
        self.done = threading.Event()
        self.result: Any = None
        self.error: Optional[BaseException] = None
        self.thread: Optional[threading.Thread] = None
        self.compute_s: Optional[float] = None
        self.owner: Optional["BackgroundPlanner"] = None

    def run(self) -> None:
        started = time.thread_time()
        try:
            result = self.fn(*self.args, **self.kwargs)
        except BaseException as exc:  # noqa: BLE001 - re-raised by poll, on the caller
            self.finish(False, exc, time.thread_time() - started)
        else:
            self.finish(True, result, time.thread_time() - started)

    def finish(self, ok, value, compute_s) -> None:
        if ok:
            self.result = value
        else:
            self.error = value
        self.compute_s = compute_s
        # drop the references to the inputs (an instance can be large)
        self.fn = self.args = self.kwargs = None
        # the planner holds its pending job until poll() hands the result out: a job
        # that kept its planner would make the pair a reference cycle, and a planner
        # dropped with a result unpolled would keep its thread until Python's cycle
        # collector ran
        owner, self.owner = self.owner, None
        if owner is not None:
            owner._finished(self)
        self.done.set()


class _WorkerThread:
    """A daemon thread that runs the jobs put in its queue, one at a time, and after
    each puts itself back on its planner's idle list (``None`` in the queue ends it).
    The loop holds no reference to the planner, so a planner dropped without ``close``
    can still be collected (its finalizer ends the threads)."""

    def __init__(self, name, idle, lock):
        self.jobs = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, args=(idle, lock), name=name,
                                       daemon=True)

    def _loop(self, idle, lock):
        while True:
            job = self.jobs.get()
            if job is None:
                return
            job.run()
            job = None  # nothing of it stays alive while this thread waits
            with lock:
                idle.append(self)


def _stop_threads(workers, lock):
    """Tell every worker thread to end once its current job is done."""
    with lock:
        pending = list(workers)
    for worker in pending:
        worker.jobs.put(None)


class _WorkerProcess:
    """The planner's worker process (``python -m omgs_hook.plan_worker``) and the thread
    that reads its answers. ``send`` hands it a job; the answer finishes the job. When
    the process dies, the jobs it still had run on threads (``fallback``)."""

    def __init__(self, name, fallback, nice=0):
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ)
        # the worker imports this very omgs_hook, whatever the parent's sys.path was
        env["PYTHONPATH"] = os.pathsep.join(
            [package_root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        from omgs_hook import plan_worker  # torch-free; its framing on this side

        self._framing = plan_worker
        self._process = subprocess.Popen(
            [sys.executable, "-m", "omgs_hook.plan_worker"]
            + (["--nice", str(int(nice))] if nice else []), stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, env=env, close_fds=True)
        # weakly: the reader thread must not keep its planner alive (a planner dropped
        # without close() ends its process through a finalizer)
        self._fallback = weakref.WeakMethod(fallback)
        self._lock = threading.Lock()
        self._jobs: Dict[int, _Job] = {}
        self._ids = itertools.count(1)
        self.alive = True
        self._reader = threading.Thread(target=self._read_answers, name=f"{name}-process-reader",
                                        daemon=True)
        self._reader.start()

    def send(self, job: _Job) -> bool:
        """Hand ``job`` to the process; False (nothing sent) when it is gone."""
        fn = job.fn
        with self._lock:
            if not self.alive:
                return False
            job_id = next(self._ids)
            self._jobs[job_id] = job
            try:
                self._framing.write_message(
                    self._process.stdin,
                    (job_id, fn.__module__, fn.__qualname__, job.args, job.kwargs))
            except (OSError, ValueError):
                del self._jobs[job_id]
                self.alive = False
                return False
        return True

    def _read_answers(self):
        stream = self._process.stdout
        while True:
            try:
                message = self._framing.read_message(stream)
            except Exception:  # noqa: BLE001 - a broken stream ends the process's use
                message = None
            if message is None:
                break
            job_id, ok, value, caught, seconds = message
            with self._lock:
                job = self._jobs.pop(job_id, None)
            for category, text in caught:
                warnings.warn(text, category, stacklevel=1)
            if job is not None:
                job.finish(ok, value, seconds)
            # nothing of it stays in this frame while the next read blocks (the job
            # refers to its planner, which must stay collectable)
            job = value = message = None
        with self._lock:
            self.alive = False
            orphans, self._jobs = list(self._jobs.values()), {}
        fallback = self._fallback()
        for job in orphans:  # the process died with work outstanding: finish it here
            if fallback is not None:
                fallback(job)

    def close(self, timeout):
        """End the process (closing its input ends it; killed if it does not)."""
        with self._lock:
            self.alive = False
        try:
            self._process.stdin.close()
        except OSError:
            pass
        try:
            self._process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._reader.join(timeout)


def _check_step(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return value


class BackgroundPlanner:
    """Run a planning function on a worker thread; hand its result out at an agreed step.

    Args:
        name: prefix of the worker threads' names (``"<name>-<n>"``), to find them in a
            thread dump.

    Methods and properties:

    ``submit(fn, *args, apply_at_step, isolate=False, low_priority=False, **kwargs)``
        Start ``fn(*args, **kwargs)`` on an idle worker thread (a new daemon thread when
        none is idle) or, with ``isolate``, in the worker process (with
        ``low_priority``, the low-priority one). The result is due at
        step ``apply_at_step`` (keyword only, an int). It replaces a pending job, whose
        result is then discarded. Raises ``RuntimeError`` after :meth:`close`.
    ``poll(step) -> result or None``
        ``None`` while nothing is pending or ``step < apply_at_step``. Otherwise: wait
        for the worker if it is still running, clear the pending job, and return its
        result (or re-raise its exception).
    ``pending`` (bool)
        A job is submitted and not yet handed out by ``poll`` (nor cancelled).
    ``apply_at_step`` (int or None)
        The pending job's step.
    ``ready`` (bool)
        The pending job has finished computing (``poll`` at its step will not wait).
    ``cancel() -> bool``
        Drop the pending job (``True`` if there was one). Its thread finishes in the
        background; its result and exception are discarded.
    ``close(timeout=None) -> bool``
        Cancel, then join every worker thread this planner started. ``True`` when none
        is left running; with a ``timeout`` (seconds, for all threads together) a thread
        still running makes it ``False``. Idempotent; also the context manager's exit.
    ``start_process(low_priority=False) -> bool``
        Start the worker process for isolated jobs (of that priority) now (it starts at
        the first such job otherwise). ``True`` when it runs.
    ``last_compute_s`` (float)
        CPU seconds the last finished job took (0.0 before any).
    ``last_wait_s`` (float)
        How long the last ``poll`` that handed out a result waited for the worker (0.0
        when it had finished in time). The stall that planning cost that step.
    """

    def __init__(self, name: str = "omgs-planner"):
        self._name = str(name)
        self._lock = threading.Lock()
        self._threads_lock = threading.Lock()
        self._job: Optional[_Job] = None
        self._workers: List[_WorkerThread] = []  # every worker thread started
        self._idle: List[_WorkerThread] = []  # those waiting for a job
        # a planner dropped without close() still ends its threads
        weakref.finalize(self, _stop_threads, self._workers, self._threads_lock)
        self._closed = False
        self.last_wait_s = 0.0
        self.last_compute_s = 0.0
        # worker processes by niceness (0: the caller's priority; LOW_PRIORITY_NICE)
        self._processes: Dict[int, _WorkerProcess] = {}
        self._process_starts: Dict[int, int] = {}
        self._warned = False

    # -- submitting -----------------------------------------------------------------

    def submit(self, fn: Callable[..., Any], *args, apply_at_step: int, isolate: bool = False,
               low_priority: bool = False, **kwargs) -> None:
        """Start ``fn(*args, **kwargs)`` in the background; its result is due at
        ``apply_at_step``. Replaces (cancels) a pending job. ``isolate``: run it in the
        worker process (module docstring), not on a thread; with ``low_priority`` in a
        worker process of the lowest OS priority (module docstring)."""
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        apply_at_step = _check_step(apply_at_step, "apply_at_step")
        job = _Job(fn, args, kwargs, apply_at_step)
        job.owner = self
        with self._lock:
            if self._closed:
                raise RuntimeError("BackgroundPlanner.submit after close()")
            self._job = job  # a pending job is replaced: its outcome is never looked at
            if isolate and self._send_to_process(job, LOW_PRIORITY_NICE if low_priority else 0):
                return
            self._start_thread(job)

    def _start_thread(self, job: _Job) -> None:
        """Run ``job`` on an idle worker thread, or on a new one when all are busy."""
        # only the thread list's own lock: a dead process's reader calls this for its
        # orphans while poll may hold the main lock, waiting for one of them
        with self._threads_lock:
            self._workers[:] = [w for w in self._workers if w.thread.is_alive()
                                or w.thread.ident is None]
            worker = self._idle.pop() if self._idle else None
            fresh = worker is None
            if fresh:
                worker = _WorkerThread(f"{self._name}-{next(_thread_numbers)}", self._idle,
                                       self._threads_lock)
                self._workers.append(worker)
        job.thread = worker.thread
        worker.jobs.put(job)
        if fresh:
            worker.thread.start()

    def _orphaned(self, job: _Job) -> None:
        """A job the worker process died with: run it on a thread (same result)."""
        if not self._warned:
            self._warned = True
            warnings.warn("omgs_hook: the planner's worker process ended; planning "
                          "continues on a thread", RuntimeWarning, stacklevel=2)
        self._start_thread(job)

    def start_process(self, low_priority: bool = False) -> bool:
        """Start the worker process now (the low-priority one with ``low_priority``),
        ahead of the first isolated job (Python's start and imports take a few hundred
        ms, which would otherwise delay that job). True when a process is running.
        Raises ``RuntimeError`` after :meth:`close`."""
        with self._lock:
            if self._closed:
                raise RuntimeError("BackgroundPlanner.start_process after close()")
            return self._ensure_process(LOW_PRIORITY_NICE if low_priority else 0)

    def _ensure_process(self, nice: int) -> bool:
        """A live worker process of niceness ``nice`` (started, or restarted once if it
        died), or False. Called with the lock held."""
        process = self._processes.get(nice)
        if process is not None and process.alive:
            return True
        starts = self._process_starts.get(nice, 0)
        if starts >= 2:
            return False
        self._process_starts[nice] = starts + 1
        try:
            process = _WorkerProcess(self._name, self._orphaned, nice)
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            if not self._warned:
                self._warned = True
                warnings.warn(f"omgs_hook: the planner's worker process could not start "
                              f"({exc}); planning runs on a thread", RuntimeWarning,
                              stacklevel=4)
            self._process_starts[nice] = 2
            return False
        self._processes[nice] = process
        # a planner dropped without close() still ends its process
        weakref.finalize(self, process.close, 10.0)
        return True

    def _send_to_process(self, job: _Job, nice: int) -> bool:
        """Hand ``job`` to the worker process of niceness ``nice`` (started on first
        use, restarted once if it died); False when no process can take it. Called with
        the lock held."""
        for _ in range(2):
            if not self._ensure_process(nice):
                return False
            if self._processes[nice].send(job):
                return True
        return False

    def _finished(self, job: _Job) -> None:
        """A job's outcome is in (any thread): remember how long it took."""
        if job.compute_s is not None:
            self.last_compute_s = float(job.compute_s)

    # -- collecting -----------------------------------------------------------------

    def poll(self, step: int):
        """The pending job's result at or after its step (waiting for it), else None."""
        step = _check_step(step, "step")
        with self._lock:
            job = self._job
            if job is None or step < job.apply_at_step:
                return None
            # the agreed step: wait rather than skip, so that every rank switches here.
            # The lock is held while waiting: a concurrent submit/cancel then waits
            # too, so the job handed out is the one that was due.
            if job.done.is_set():
                self.last_wait_s = 0.0
            else:
                started = time.perf_counter()
                job.done.wait()
                self.last_wait_s = time.perf_counter() - started
            self._job = None
        if job.error is not None:
            error, job.error = job.error, None
            raise error
        result, job.result = job.result, None
        return result

    @property
    def pending(self) -> bool:
        with self._lock:
            return self._job is not None

    @property
    def apply_at_step(self) -> Optional[int]:
        with self._lock:
            return None if self._job is None else self._job.apply_at_step

    @property
    def ready(self) -> bool:
        with self._lock:
            return self._job is not None and self._job.done.is_set()

    # -- stopping -------------------------------------------------------------------

    def cancel(self) -> bool:
        """Drop the pending job; ``True`` if there was one."""
        with self._lock:
            had = self._job is not None
            self._job = None
            return had

    def close(self, timeout: Optional[float] = None) -> bool:
        """Cancel and join every worker thread; ``True`` when none is left running."""
        with self._lock:
            self._closed = True
            self._job = None
            processes, self._processes = list(self._processes.values()), {}
        deadline = None if timeout is None else time.monotonic() + timeout
        for process in processes:  # (orphans they leave start threads: joined below too)
            process.close(timeout if timeout is not None else 10.0)
        _stop_threads(self._workers, self._threads_lock)
        with self._threads_lock:
            self._idle.clear()
            threads = [w.thread for w in self._workers]
        for thread in threads:
            if thread.ident is None:
                continue  # (never started)
            if deadline is None:
                thread.join()
            else:
                thread.join(max(0.0, deadline - time.monotonic()))
        with self._threads_lock:
            self._workers[:] = [w for w in self._workers if w.thread.is_alive()]
            return not self._workers

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "BackgroundPlanner":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        with self._lock:
            job = self._job
            state = (
                "closed"
                if self._closed
                else "idle"
                if job is None
                else f"pending apply_at_step={job.apply_at_step}"
                + (" ready" if job.done.is_set() else " running")
            )
        return f"BackgroundPlanner({self._name!r}, {state})"

