"""Run a function on N gloo ranks in fresh processes, with a hard timeout.

``run_ranks("test_module", "function", world_size=2, **kwargs)`` starts one process per
rank; each initialises gloo on a free loopback port, calls ``function(rank, world_size,
**kwargs)`` from ``test_module`` and sends back its (picklable) return value. Any
exception in a rank fails the caller with that rank's traceback; a rank that does not
finish within ``timeout`` seconds is killed and the caller fails - nothing hangs CI.

Ranks are forked from a ``forkserver`` that has imported torch and omgs_hook once: a
spawned rank spends about 2 s importing them, and the suite starts several hundred
ranks. The server only imports (no threads, no process group, no CUDA), so every rank
still starts from freshly imported modules, as with ``spawn``; the caller's environment
at the call is passed along, since a forked rank would otherwise see the server's.
"""

import datetime
import gc
import importlib
import os
import socket
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# imported once by the forkserver, before it forks any rank. torch._dynamo: DDP's
# constructor imports it (about 2 s of CPU per rank, more than torch itself)
PRELOAD = ["torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo", "omgs_hook"]


def _context():
    try:
        ctx = mp.get_context("forkserver")
    except ValueError:  # a platform without fork
        return mp.get_context("spawn")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _entry(module_name, fn_name, rank, world_size, port, pg_timeout_s, out_dir, kwargs,
           environ):
    os.environ.clear()
    os.environ.update(environ)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    result_path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        fn = getattr(importlib.import_module(module_name), fn_name)
        value = fn(rank, world_size, **kwargs)
        torch.save({"ok": True, "value": value}, result_path)
    except BaseException:  # noqa: BLE001 - reported to the parent
        torch.save({"ok": False, "error": traceback.format_exc()}, result_path)
    finally:
        gc.collect()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass
    # gloo can abort in interpreter teardown; the result is already on disk.
    os._exit(0)


class RankFailed(AssertionError):
    pass


def run_ranks(module_name, fn_name, world_size=2, timeout=120, pg_timeout_s=60,
              allow_failure=False, **kwargs):
    """Run ``module.fn(rank, world_size, **kwargs)`` on every rank; return the values.

    With ``allow_failure=True`` a rank's exception is returned as
    ``{"error": traceback text}`` instead of failing the caller.
    """
    ctx = _context()
    port = free_port()
    environ = dict(os.environ)
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [
            ctx.Process(
                target=_entry,
                args=(module_name, fn_name, rank, world_size, port, pg_timeout_s, out_dir, kwargs,
                      environ),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
        for p in procs:
            remaining = (deadline - datetime.datetime.now()).total_seconds()
            p.join(max(0.1, remaining))
        hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        if hung:
            raise RankFailed(f"ranks {hung} did not finish within {timeout} s (hang?)")
        results = []
        for rank in range(world_size):
            path = os.path.join(out_dir, f"rank{rank}.pt")
            if not os.path.exists(path):
                if allow_failure:
                    results.append({"error": f"died, exit code {procs[rank].exitcode}"})
                    continue
                raise RankFailed(f"rank {rank} died without a result (exit code {procs[rank].exitcode})")
            record = torch.load(path, weights_only=False)
            if not record["ok"]:
                if allow_failure:
                    results.append({"error": record["error"]})
                    continue
                raise RankFailed(f"rank {rank} failed:\n{record['error']}")
            results.append(record["value"])
        return results


def run_in_session(cmd, timeout, cwd=None, env=None):
    """Run ``cmd`` (e.g. a torchrun launch) in a session of its own and return
    ``(returncode, output)``; past ``timeout`` seconds the whole session - launcher and
    workers - is killed and the calling test fails with the output's tail."""
    import signal
    import subprocess

    import pytest

    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{cmd[:4]} did not finish within {timeout} s:\n" + output[-4000:])
    return proc.returncode, output
