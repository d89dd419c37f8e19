"""Module-level jobs for the background planner's worker process (tests only).

The worker process imports a job's function by module and name, so these live in a
module of their own: torch-free and cheap to import.
"""

import os
import warnings


def pid_and(value):
    """(the process this ran in, value)."""
    return os.getpid(), value


def pid_and_nice(value):
    """(the process this ran in, its niceness, value)."""
    return os.getpid(), os.nice(0), value


def warn_and_return(message, value):
    warnings.warn(message, UserWarning)
    return value


def fail(message):
    raise ValueError(message)


def die_unless_in(parent_pid, value):
    """End the worker process abruptly; in the parent (the thread fallback) return."""
    if os.getpid() != parent_pid:
        os._exit(3)
    return value


def unpicklable_result():
    return lambda: None  # a lambda cannot travel back
