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
background; :meth:`close` waits for it. A result is handed out once: after ``poll``
returned it, nothing is pending. Because ``None`` means "nothing due", a function used
with ``poll`` should not return ``None`` (``make_plan`` returns a ``Plan``).

GIL: the worker is a Python thread. Numpy releases the GIL only inside its larger
operations, so the planner and the training thread's Python code share one core's worth
of interpreter time while a plan is computed. Python switches threads every
``sys.getswitchinterval()`` (5 ms by default), so the training thread is delayed by that
much at a time, not by the whole plan. Backward kernels that run without the GIL
(torch's autograd engine) are not held up at all.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any, Callable, List, Optional

__all__ = ["BackgroundPlanner"]

_thread_numbers = itertools.count(1)


class _Job:
    """One submitted call and its outcome (written by the worker before ``done`` is set)."""

    __slots__ = ("fn", "args", "kwargs", "apply_at_step", "done", "result", "error", "thread")

    def __init__(self, fn, args, kwargs, apply_at_step):
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.apply_at_step = apply_at_step
        self.done = threading.Event()
        self.result: Any = None
        self.error: Optional[BaseException] = None
        self.thread: Optional[threading.Thread] = None

    def run(self) -> None:
        try:
            self.result = self.fn(*self.args, **self.kwargs)
        except BaseException as exc:  # noqa: BLE001 - re-raised by poll, on the caller
            self.error = exc
        finally:
            # drop the references to the inputs (an instance can be large)
            self.fn = self.args = self.kwargs = None
            self.done.set()


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

    ``submit(fn, *args, apply_at_step, **kwargs)``
        Start ``fn(*args, **kwargs)`` on a new daemon thread. The result is due at step
        ``apply_at_step`` (keyword only, an int). It replaces a pending job, whose
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
    ``last_wait_s`` (float)
        How long the last ``poll`` that handed out a result waited for the worker (0.0
        when it had finished in time). The stall that planning cost that step.
    """

    def __init__(self, name: str = "omgs-planner"):
        self._name = str(name)
        self._lock = threading.Lock()
        self._job: Optional[_Job] = None
        self._threads: List[threading.Thread] = []
        self._closed = False
        self.last_wait_s = 0.0

    # -- submitting -----------------------------------------------------------------

    def submit(self, fn: Callable[..., Any], *args, apply_at_step: int, **kwargs) -> None:
        """Start ``fn(*args, **kwargs)`` in the background; its result is due at
        ``apply_at_step``. Replaces (cancels) a pending job."""
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        apply_at_step = _check_step(apply_at_step, "apply_at_step")
        job = _Job(fn, args, kwargs, apply_at_step)
        thread = threading.Thread(
            target=job.run, name=f"{self._name}-{next(_thread_numbers)}", daemon=True
        )
        job.thread = thread
        with self._lock:
            if self._closed:
                raise RuntimeError("BackgroundPlanner.submit after close()")
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
            self._job = job  # a pending job is replaced: its outcome is never looked at
            thread.start()

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
            threads = list(self._threads)
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in threads:
            if deadline is None:
                thread.join()
            else:
                thread.join(max(0.0, deadline - time.monotonic()))
        alive = [t for t in threads if t.is_alive()]
        with self._lock:
            self._threads = alive
        return not alive

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

