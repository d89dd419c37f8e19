"""The background planner's worker process: runs planning jobs, one at a time.

Started by :class:`omgs_hook.background_planner.BackgroundPlanner` as
``python -m omgs_hook.plan_worker`` (a fresh interpreter: no torch, no copy of the
training script's state, no lock shared with the training process). Jobs arrive on
stdin and results leave on stdout as length-prefixed pickles:

* in: ``(job_id, module, function, args, kwargs)``; the function is looked up by name
  (it must be a module-level function of a torch-free module, e.g.
  :func:`omgs_hook.plan_job.compute_plan`);
* out: ``(job_id, ok, value, warnings, seconds)``: the result, or the exception it
  raised; the warnings it emitted as ``(category, message)`` pairs, for the parent to
  re-emit; and the CPU seconds it took.

The process ends when stdin closes (its parent closed the planner, or died).
``--nice N`` lowers its OS priority by N first (the low-priority worker; where the OS
has no niceness the flag changes nothing).
"""

from __future__ import annotations

import importlib
import os
import pickle
import struct
import sys
import time
import warnings

_HEADER = struct.Struct("<Q")


def write_message(stream, message):
    """Write one length-prefixed pickle to a binary stream and flush it."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)))
    stream.write(data)
    stream.flush()


def read_message(stream):
    """Read one length-prefixed pickle; None at the end of the stream."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(header)
    data = stream.read(size)
    if len(data) < size:
        return None
    return pickle.loads(data)


def run_job(module, function, args, kwargs):
    """``(ok, value, warnings)`` of one job, the warnings as (category, message) pairs."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            value = getattr(importlib.import_module(module), function)(*args, **kwargs)
            ok = True
        except BaseException as exc:  # noqa: BLE001 - handed to the parent, raised there
            value, ok = exc, False
    return ok, value, [(w.category, str(w.message)) for w in caught]


def lower_priority(argv):
    """Apply ``--nice N`` from ``argv`` (the worker's command line); returns N (0 without
    the flag). A platform without ``os.nice`` keeps its priority."""
    if "--nice" not in argv:
        return 0
    nice = int(argv[argv.index("--nice") + 1])
    try:
        os.nice(nice)
    except (AttributeError, OSError):  # (no niceness here: the job still runs)
        pass
    return nice


def main():
    lower_priority(sys.argv[1:])
    source, sink = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing else may write into the result stream
    while True:
        message = read_message(source)
        if message is None:
            return
        job_id, module, function, args, kwargs = message
        started = time.process_time()
        ok, value, caught = run_job(module, function, args, kwargs)
        seconds = time.process_time() - started
        try:
            write_message(sink, (job_id, ok, value, caught, seconds))
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            # a result or exception that cannot be pickled: say so instead
            write_message(sink, (job_id, False, RuntimeError(
                f"omgs_hook planner process: cannot return the result of {module}.{function}: "
                f"{exc!r} (value: {value!r:.200})"), caught, seconds))


if __name__ == "__main__":
    main()
