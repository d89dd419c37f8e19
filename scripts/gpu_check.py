#!/usr/bin/env python
"""One command for every CUDA check and benchmark of omgs-hook (at most ~8 minutes).

Run it on a machine with a GPU, from the repository root::

    PYTHONPATH=src python3 scripts/gpu_check.py            # writes docs/gpu.md + docs/gpu.json

On a lent machine whose files come back only from ``$OUT`` (one command of at most 10
minutes), ``PYTHONUNBUFFERED=1 PYTHONPATH=src timeout 570 python3 scripts/gpu_check.py``:
the report is also copied under ``$OUT`` after every section, and the run keeps to its
480 s budget (``--budget``). No install step is needed there: the script imports the
package from ``src/`` (the compiled CPU pass is optional and falls back).

Sections (each is independent: a failure is recorded and the next section runs):

``env``        torch, CUDA, GPU, CuPy versions.
``topk``       every top-k backend on the device against the exact reference
               (``TorchTopkSelector``: ``torch.topk`` with the lower-index tie rule),
               index for index and value for value, for D = 1e3 .. 1e8 elements in fp32,
               fp16 and bf16, on random and on tie-heavy (quantised) inputs, and with a
               NaN/inf planted (the hook's non-finite check relies on it being selected).
``topk_speed`` CUDA-event medians of ``cupy``, ``torch`` (our exact wrapper) and a raw
               ``torch.topk(|x|, k)`` at density 0.001 (target: cupy >= 3x raw torch.topk
               at D >= 1e7).
``hook``       the hook on CUDA gradients, 2 ranks on GPU 0 over gloo (NCCL refuses two
               ranks on one GPU): gradients against the independent reference
               (``tests/reference_omgs.py``), conservation of error feedback, both ranks
               holding bit-identical averaged gradients, the CUDA-event backward timers
               against a synchronised wall-clock measurement, and AMP fp16 with a
               ``GradScaler`` (an injected inf step must be skipped with the residual kept).
``nccl``       the hook on the NCCL backend: ONE rank on GPU 0 (world size 1), so that
               every collective of the hook, its statistics, the planner's agreement
               checks and the measured-selection trial goes through NCCL, which raises
               for a CPU tensor where gloo takes it. Gradients and residuals against the
               reference with ``strategy="single"`` (one sparse group of several
               buckets) and conservation; timed training steps against DDP's own
               all-reduce, with the hook's host seconds (``stats()["last"]["hook_s"]``)
               and the host seconds of ``backward()`` as shares of the step, and the
               host-device synchronisations per ``backward()`` (CUDA's sync debug mode:
               count and source lines, the hook's and plain DDP's), recorded, no
               verdict; ``register(ddp, density=0.01)`` with every other option at its
               default for 190 steps (the trial must finish, the gradients stay
               finite); the AMP check of ``hook``.
``profile``    ``omgs-profile`` on CUDA tensors (2 ranks, gloo), with a small time budget;
               the written profile must load.
``overhead``   ``scripts/bench_hook_overhead.py`` on the device: the hook's own cost per
               step in copy-equivalents against a no-op hook.

``--device cpu`` runs the same checks on the CPU (the CuPy parts are skipped; ``nccl``
runs on gloo, without the synchronisation count); the test suite does that with
``--quick`` so this script cannot rot between GPU sessions.

Time limits: the device runner gives one command 10 minutes and brings back only what
is under ``$OUT``, so the report is written after every section and the run plans for
``--budget`` (480 s) in all. Each section has a limit (``SECTION_TIMEOUT_S``, 60-150 s;
``--timeout NAME=SECONDS`` sets one), cut to what is left of the budget; a section with
less than 10 s left is skipped (no verdict; the exit status is 1). Spawned ranks and
commands (torchrun, the overhead benchmark) are killed at the limit, and the section is
recorded as failed with ``timed_out``; a section that runs in this process is stopped
by an alarm shortly after, where Python gets control back - a single CUDA call that
never returns still holds the run until the runner's limit, with the earlier sections'
report in place. The ranks' process-group timeout (``PG_TIMEOUT_S``, 90 s) is below
the limits, so a hung collective normally fails with its traceback first.
"""

import argparse
import datetime
import gc
import json
import math
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from omgs_hook import topk as topk_mod  # noqa: E402
from omgs_hook.cost_model import selected_k  # noqa: E402

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------ env
def check_env(device, quick):
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "device": str(device), "cuda_available": torch.cuda.is_available()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    cuda=torch.version.cuda, sm=f"{props.major}.{props.minor}")
    try:
        import cupy

        info["cupy"] = cupy.__version__
    except Exception as exc:  # noqa: BLE001 - reported
        info["cupy"] = f"not importable ({type(exc).__name__})"
    info["backends"] = topk_mod.available_backends(device)
    return {"ok": True, "info": info}


# ----------------------------------------------------------------------------- top-k
def _inputs(kind, numel, dtype, device, seed):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    if kind == "random":
        x = torch.randn(numel, generator=gen)
    elif kind == "ties":  # few distinct magnitudes: the tie rule decides most of the set
        x = torch.randint(-8, 9, (numel,), generator=gen).float()
    else:  # "nonfinite": a random input with one NaN and one inf planted
        x = torch.randn(numel, generator=gen)
        x[numel // 3] = float("nan")
        x[(2 * numel) // 3] = float("inf")
    return x.to(dtype).to(device)


def check_topk(device, quick):
    sizes = [10**3, 10**4, 10**5] if quick else [10**3, 10**4, 10**5, 10**6, 10**7, 10**8]
    reference = topk_mod.TorchTopkSelector()
    names = [n for n in topk_mod.available_backends(device) if n != "torch"]
    rows, failures = [], []
    for name in names:
        selector = topk_mod.get_selector(name, device)
        for dname, dtype in DTYPES.items():
            for numel in sizes:
                kinds = ("random", "ties", "nonfinite") if numel <= 10**7 else ("random",)
                for kind in kinds:
                    for density in (0.001, 0.01):
                        k = selected_k(numel, density)
                        x = _inputs(kind, numel, dtype, device, seed=numel + k)
                        rv, ri = reference.select(x, k)
                        v, i = selector.select(x, k)
                        same = torch.equal(i.cpu(), ri.cpu()) and torch.equal(
                            v.cpu().view(torch.int16 if v.element_size() == 2 else torch.int32),
                            rv.cpu().view(torch.int16 if rv.element_size() == 2 else torch.int32))
                        flagged = kind != "nonfinite" or not bool(torch.isfinite(v).all())
                        row = {"backend": name, "dtype": dname, "numel": numel, "kind": kind,
                               "density": density, "identical": same, "nonfinite_selected": flagged}
                        rows.append(row)
                        if not (same and flagged):
                            failures.append(row)
                        del x
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"ok": not failures, "checked": len(rows), "failures": failures[:20],
            "backends": names}


def _cuda_time(fn, device, reps):
    if device.type != "cuda":
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def check_topk_speed(device, quick):
    sizes = [10**5, 10**6] if quick else [10**6, 10**7, 10**8]
    reps = 3 if quick else 20
    rows = []
    for numel in sizes:
        k = selected_k(numel, 0.001)
        x = torch.randn(numel, device=device)
        row = {"numel": numel, "k": k}
        row["raw_torch_topk_s"] = _cuda_time(lambda: torch.topk(x.abs(), k, sorted=False), device, reps)
        for name in topk_mod.available_backends(device):
            selector = topk_mod.get_selector(name, device)
            selector.select(x, k)  # compile / warm up
            row[f"{name}_s"] = _cuda_time(lambda: selector.select(x, k), device, reps)
        if "cupy_s" in row:
            row["speedup_vs_raw_torch"] = row["raw_torch_topk_s"] / row["cupy_s"]
        rows.append(row)
        del x
    target = [r for r in rows if r["numel"] >= 10**7 and "speedup_vs_raw_torch" in r]
    ok = all(r["speedup_vs_raw_torch"] >= 3.0 for r in target) if target else None
    return {"ok": ok, "rows": rows, "target": "cupy >= 3x raw torch.topk at D >= 1e7"}


# ---------------------------------------------------------------------------- limits
#: each section's limit in seconds (``--timeout NAME=SECONDS`` overrides one), several
#: times what it should take on one GPU; a section past its limit is recorded as failed
#: and the next one runs. Together they exceed the budget below, which bounds the run
SECTION_TIMEOUT_S = {"env": 60, "topk": 120, "topk_speed": 90, "hook": 150, "nccl": 150,
                     "profile": 150, "overhead": 150, "writeback": 60}
#: the whole script's budget (``--budget``): the device runner allows one command of 10
#: minutes, and the report must be written before it is killed. A section starts with at
#: most what is left of it, and none starts with less than MIN_SECTION_S left
BUDGET_S = 480
MIN_SECTION_S = 10


class SectionTimeout(Exception):
    """A section ran past its limit (its processes, if any, were killed)."""


#: (time.monotonic() at which the running section must end, its limit in seconds), set
#: by main around each section; None: no limit (a section called directly)
_limit = None


def _time_left():
    return None if _limit is None else max(0.0, _limit[0] - time.monotonic())


def _limit_text():
    return "its limit" if _limit is None else f"{_limit[1]:g} s"


def _on_alarm(signum, frame):
    raise SectionTimeout(f"did not finish within {_limit_text()} (stopped in the section's "
                         "own process)")


def _stop_alarm():
    """Called before the processes of a section are killed (a bounded wait): the
    backstop alarm must neither cut that short nor replace the timeout's message."""
    signal.setitimer(signal.ITIMER_REAL, 0)


def _spawn_ranks(worker, nprocs, args):
    """Run ``worker(rank, *args)`` in ``nprocs`` spawned processes; return their exit
    codes. Ranks still running at the section's deadline are killed and SectionTimeout
    raised: a hung collective must not eat the command's 10 minutes (``spawn``: a forked
    rank would inherit this process's CUDA context)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = []
    try:
        for rank in range(nprocs):
            proc = ctx.Process(target=worker, args=(rank,) + tuple(args), daemon=True)
            proc.start()
            procs.append(proc)
        for proc in procs:
            proc.join(_time_left())
        hung = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
        if hung:
            raise SectionTimeout(f"rank(s) {hung} of {worker.__name__} did not finish within "
                                 f"{_limit_text()} (killed)")
        return [proc.exitcode for proc in procs]
    finally:
        alive = [proc for proc in procs if proc.is_alive()]
        if alive:
            _stop_alarm()
        for proc in alive:
            proc.kill()
        for proc in alive:
            proc.join(10)


def _run_command(cmd, env, name):
    """Run ``cmd`` in a session of its own until the section's deadline: ``(returncode,
    output)``. Past the deadline the session gets SIGTERM (torchrun passes it on to its
    workers, which it starts in sessions of their own), then SIGKILL, and SectionTimeout
    is raised with the output's tail."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=_time_left())
        return proc.returncode, output
    except BaseException as exc:
        _stop_alarm()
        output = ""
        for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                output, _ = proc.communicate(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                pass
        if isinstance(exc, subprocess.TimeoutExpired):
            raise SectionTimeout(f"{name} did not finish within {_limit_text()} (killed); "
                                 "output tail:\n" + (output or "")[-2000:]) from None
        raise


# --------------------------------------------------------------- hook and nccl: shared
#: the reference checks' hook options. on_unapplied="keep": the checks run backward after
#: backward with no optimizer step and compare each with the reference step; the hook
#: would otherwise rewind those steps as gradients thrown away (as for a GAN)
REFERENCE_OPTIONS = {"density": 0.01, "strategy": "layerwise", "allow_dense": False,
                     "select": "model", "warmup_steps": 1, "log_every": 0,
                     "on_unapplied": "keep"}

#: the ranks' process-group timeout: below every section's limit, so that a hung
#: collective ends as an error with its traceback before the section kills the rank
PG_TIMEOUT_S = 90


def _init_group(rank, world_size, port, backend, device):
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))


def _make_net(device):
    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                               torch.nn.Linear(512, 512), torch.nn.ReLU(),
                               torch.nn.Linear(512, 10)).to(device)


def _ddp(device):
    """The test net (seed 0: the same weights on every rank) in DDP; bucket_cap_mb=0
    gives several buckets, so a merged group has several runs."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = _make_net(device)
    ddp = DDP(model, bucket_cap_mb=0,
              device_ids=[device.index] if device.type == "cuda" else None)
    return model, ddp


def _model_and_hook(device, **options):
    import omgs_hook

    model, ddp = _ddp(device)
    return model, ddp, omgs_hook.register(ddp, **dict(REFERENCE_OPTIONS, **options))


def _batch(seed, device):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 256, generator=gen).to(device)
    y = torch.randint(0, 10, (32,), generator=gen).to(device)
    return x, y


def _reference_check(model, ddp, state, device, rank, world_size, steps):
    """``steps`` backward passes through the hook, each against the independent reference
    (``tests/reference_omgs.py``) from every rank's local gradient and residual: the
    worst differences, conservation of error feedback, rank agreement, and per step
    (hook's backward timers, synchronised wall seconds of forward + backward)."""
    import torch.distributed as dist

    from reference_omgs import reference_step

    def gather(obj):
        out = [None] * world_size
        dist.all_gather_object(out, obj)
        return out

    worst = {"grad": 0.0, "residual": 0.0, "conservation": 0.0, "rank_disagreement": 0.0}
    timer_pairs = []
    for step in range(steps):
        x, y = _batch(1000 * step + rank, device)
        model.zero_grad()
        ref_model = _make_net(device)  # same weights, no hook
        ref_model.load_state_dict(model.state_dict())
        torch.nn.functional.cross_entropy(ref_model(x), y).backward()
        names = [n for n, _ in model.named_parameters()]
        local = {n: p.grad.reshape(-1).float().cpu() for n, p in zip(names, ref_model.parameters())}
        old = {k: v.reshape(-1).cpu() for k, v in state.memory.state_dict().items()}
        all_local, all_old = gather(local), gather(old)
        _sync(device)
        t0 = time.perf_counter()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        _sync(device)
        wall = time.perf_counter() - t0
        last = state.stats()["last"]
        groups = list(zip(last["group_keys"], last["group_dense"]))
        avg, new_res = reference_step(all_local, all_old, groups, last["step_density"])
        got = {k: v.reshape(-1).cpu() for k, v in state.memory.state_dict().items()}
        grads = {n: p.grad.reshape(-1).float().cpu() for n, p in model.named_parameters()}
        all_grads, all_new = gather(grads), gather(got)
        for n in names:
            worst["grad"] = max(worst["grad"], float((grads[n] - avg[n].float()).abs().max()))
            mine = got.get(n, torch.zeros_like(grads[n]))
            worst["residual"] = max(worst["residual"],
                                    float((mine - new_res[rank][n].float()).abs().max()))
            lhs = sum(all_local[r][n] + all_old[r].get(n, 0.0) for r in range(world_size))
            rhs = world_size * grads[n] + sum(all_new[r].get(n, torch.zeros_like(lhs))
                                              for r in range(world_size))
            worst["conservation"] = max(worst["conservation"], float((lhs - rhs).abs().max()))
            for other in all_grads[1:]:
                if not torch.equal(all_grads[0][n], other[n]):
                    worst["rank_disagreement"] = max(
                        worst["rank_disagreement"], float((all_grads[0][n] - other[n]).abs().max()))
        timed = state.stats()["backward_s_per_unit"]
        timer_pairs.append((sum(timed) if timed else None, wall))
    return worst, timer_pairs


def _reference_ok(worst):
    return (worst["grad"] < 1e-5 and worst["residual"] < 1e-5 and worst["conservation"] < 1e-4
            and worst["rank_disagreement"] == 0.0)


def _amp_check(device, rank):
    """AMP fp16 with a GradScaler (CUDA; plain fp32 on the CPU); step 4 gets an inf on
    rank 0: the step must be skipped (every rank sees it non-finite) with the residual
    kept and, under AMP, the scale lowered."""
    model, ddp, state = _model_and_hook(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    amp = device.type == "cuda"
    scaler = torch.amp.GradScaler("cuda", enabled=amp)
    nonfinite_steps, kept = [], True
    for step in range(8):
        x, y = _batch(7 * step + rank, device)
        if step == 4 and rank == 0:
            x[0, 0] = float("inf")
        opt.zero_grad()
        before = {k: v.clone() for k, v in state.memory.state_dict().items()}
        with torch.autocast(device.type, dtype=torch.float16, enabled=amp):
            loss = torch.nn.functional.cross_entropy(ddp(x), y)
        scale_before = scaler.get_scale() if amp else 1.0
        scaler.scale(loss).backward()
        nonfinite = state.stats()["last"]["nonfinite"]
        if amp or not nonfinite:  # (without AMP nothing would skip the NaN step)
            scaler.step(opt)
            scaler.update()
        if nonfinite:
            nonfinite_steps.append(step)
            after = state.memory.state_dict()
            kept = kept and all(torch.equal(before[k], after[k]) for k in before)
            if amp:
                kept = kept and scaler.get_scale() < scale_before
    state.close()
    return {"enabled": amp, "nonfinite_steps": nonfinite_steps, "residual_kept": kept}


def _amp_ok(amp):
    return 4 in amp["nonfinite_steps"] and amp["residual_kept"]


def _save_result(result, out_dir, rank):
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def _rank_results(out_dir, exitcodes):
    """Every rank's saved result, or (None, why) when a rank died without one (a CUDA
    abort, NCCL's watchdog tearing the process down)."""
    results = []
    for rank, code in enumerate(exitcodes):
        path = os.path.join(out_dir, f"rank{rank}.pt")
        if not os.path.exists(path):
            return None, f"rank {rank} exited with code {code} without writing its result"
        results.append(torch.load(path, weights_only=False))
    errors = [r["error"] for r in results if "error" in r]
    return results, (errors[0][-3000:] if errors else None)


# ------------------------------------------------------------------------------ hook
def _hook_worker(rank, world_size, port, device_name, steps, out_dir):
    """2 ranks, one device: reference check, rank agreement, timers, AMP fp16."""
    import torch.distributed as dist

    device = torch.device(device_name)
    _init_group(rank, world_size, port, "gloo", device)
    result = {}
    try:
        # 1. gradients against the reference, conservation, rank agreement, timers
        model, ddp, state = _model_and_hook(device)
        worst, timer_pairs = _reference_check(model, ddp, state, device, rank, world_size, steps)
        timer_pairs = timer_pairs[3:]
        result["reference"] = worst
        # the hook's per-bucket backward timers (CUDA events on CUDA) against backward
        # alone, synchronised, without communication (inside no_sync)
        plain = []
        for step in range(5):
            x = torch.randn(32, 256).to(device)
            y = torch.randint(0, 10, (32,)).to(device)
            with ddp.no_sync():
                loss = torch.nn.functional.cross_entropy(ddp(x), y)
                _sync(device)
                t0 = time.perf_counter()
                loss.backward()
                _sync(device)
                plain.append(time.perf_counter() - t0)
        timed = [a for a, _ in timer_pairs if a is not None]
        result["timers"] = {
            "hook_timed_backward_s_median": statistics.median(timed) if timed else None,
            "synchronised_backward_s_median": statistics.median(plain),
            "synchronised_step_with_hook_s_median": statistics.median(b for _, b in timer_pairs)
            if timer_pairs else None,
        }
        state.close()
        del ddp, state, model
        gc.collect()

        # 2. AMP fp16 with a GradScaler; step 4 gets an inf: skipped, residual kept
        result["amp"] = _amp_check(device, rank)
    except Exception:  # noqa: BLE001 - reported
        result["error"] = traceback.format_exc()
    finally:
        gc.collect()
        dist.destroy_process_group()
    _save_result(result, out_dir, rank)


def check_hook(device, quick):
    with tempfile.TemporaryDirectory() as tmp:
        steps = 6 if quick else 12
        codes = _spawn_ranks(_hook_worker, 2, (2, _free_port(), str(device), steps, tmp))
        results, error = _rank_results(tmp, codes)
    if error:
        return {"ok": False, "error": error}
    worst = {k: max(r["reference"][k] for r in results) for k in results[0]["reference"]}
    amp = [r["amp"] for r in results]
    ok = _reference_ok(worst) and all(_amp_ok(a) for a in amp)
    return {"ok": ok, "reference_worst": worst, "timers": results[0]["timers"], "amp": amp}


# ------------------------------------------------------------------------------ nccl
def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _timed_steps(model, ddp, state, device, steps):
    """``steps`` training steps (SGD), each synchronised at its end: the step's wall
    seconds, the host seconds of ``backward()`` alone (kernel launches plus whatever the
    host waited for) and the hook's own host seconds (``stats()["last"]["hook_s"]``).
    Medians over the steps after the first two."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rows = []
    for step in range(steps):
        x, y = _batch(31 * step, device)
        _sync(device)
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        _sync(device)
        rows.append((time.perf_counter() - t0, t2 - t1,
                     state.stats()["last"]["hook_s"] if state is not None else None))
    warm = rows[2:] or rows
    return {"step_s": [round(r[0], 6) for r in rows],
            "step_s_median": _median(r[0] for r in warm),
            "backward_host_s_median": _median(r[1] for r in warm),
            "hook_s_median": _median(r[2] for r in warm)}


def _count_syncs(model, ddp, device, steps):
    """Host-device synchronisations inside ``backward()`` per step (CUDA's sync debug
    mode warns at each), and where they were issued: the Python line that called the
    synchronising op (the hook runs on autograd's thread; its warnings carry its frame);
    DDP's own C++ ones show as this file's ``backward()`` line. ``probe_seen``: a
    gradient hook that calls ``.item()`` (autograd's thread, as the comm hook) was
    counted - without it a count of 0 means nothing. None on the CPU."""
    import collections
    import warnings

    if device.type != "cuda":
        return None
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def backward_counted(loss):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                loss.backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        opt.step()
        opt.zero_grad()
        return [w for w in caught if "synchroniz" in str(w.message)]

    x, y = _batch(57, device)
    out = ddp(x)
    probe = lambda grad: grad if grad.sum().item() is not None else grad  # noqa: E731
    out.register_hook(probe)
    hits = backward_counted(torch.nn.functional.cross_entropy(out, y))
    line = (os.path.abspath(probe.__code__.co_filename), probe.__code__.co_firstlineno)
    probe_seen = any((os.path.abspath(w.filename), w.lineno) == line for w in hits)
    per_step, where = [], collections.Counter()
    for step in range(steps):
        x, y = _batch(57 * step + 1, device)
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        _sync(device)
        hits = backward_counted(loss)
        per_step.append(len(hits))
        where.update(f"{os.path.relpath(w.filename, ROOT)}:{w.lineno}" for w in hits)
    return {"probe_seen": probe_seen, "per_step": per_step, "where": where.most_common(12)}


#: the defaults' run: the warm-up and the first plan (about 10 steps), the first trial at
#: its longest (its lead, every round and the side-by-side duel: 152 steps), and 20 more
MEASURED_STEPS = 190


def _measured_run(device, steps):
    """``register(ddp, density=0.01)`` with every other option at its default: dense
    warm-up, the model plan and the measured-selection trial (its gathers, the planner's
    agreement checks, the background plan's readiness probe), dense groups where the
    plan says so; then ``stats()``, ``summary()`` and ``state_dict()``."""
    import omgs_hook

    model, ddp = _ddp(device)
    state = omgs_hook.register(ddp, density=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    walls, finite = [], True
    for step in range(steps):
        x, y = _batch(13 * step, device)
        _sync(device)
        t0 = time.perf_counter()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        _sync(device)
        walls.append(time.perf_counter() - t0)
        finite = finite and all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
        opt.zero_grad()
    stats = state.stats()
    state.summary()
    state.state_dict()
    trial = stats["selection"]["last_trial"]
    out = {"steps": steps, "finite": finite, "trial_finished": trial is not None,
           "trials": stats["total"]["trials"], "replans": stats["total"]["replans"],
           "winner": trial["winner"] if trial else None,
           "candidates": [c["name"] for c in trial["candidates"]] if trial else None,
           "plan": {k: stats["plan"][k] for k in ("strategy", "groups", "dense")}
           if stats["plan"] else None,
           "step_s_median_last_10": _median(walls[-10:]),
           "hook_s_last": stats["last"]["hook_s"] if stats["last"] else None}
    state.close()
    return out


def _nccl_worker(rank, world_size, port, device_name, backend, quick, out_dir):
    """One rank on the backend: the reference with merged groups, timed steps against
    DDP's own all-reduce, synchronisations per backward, the default (measured) options,
    AMP. Any CPU tensor handed to an NCCL collective raises here."""
    import torch.distributed as dist

    device = torch.device(device_name)
    _init_group(rank, world_size, port, backend, device)
    steps = 6 if quick else 20
    result = {"backend": dist.get_backend()}
    try:
        # 1. the reference, "single": every bucket in one sparse group of several runs
        model, ddp, state = _model_and_hook(device, strategy="single")
        worst, pairs = _reference_check(model, ddp, state, device, rank, world_size, steps)
        result["reference"] = worst
        result["reference_step_s"] = [round(wall, 6) for _, wall in pairs]
        # 2. training steps with the hook, then the same with DDP's own all-reduce
        result["timing"] = {"omgs": _timed_steps(model, ddp, state, device, steps),
                            "syncs_in_backward": _count_syncs(model, ddp, device, 3)}
        state.close()
        del model, ddp, state
        gc.collect()
        model, ddp = _ddp(device)
        result["timing"]["ddp_allreduce"] = _timed_steps(model, ddp, None, device, steps)
        result["timing"]["ddp_syncs_in_backward"] = _count_syncs(model, ddp, device, 3)
        del model, ddp
        gc.collect()
        # 3. the defaults: the trial and its collectives on the backend
        result["measured"] = _measured_run(device, MEASURED_STEPS)
        gc.collect()
        # 4. the non-finite path (its flag travels in the payload) under AMP
        result["amp"] = _amp_check(device, rank)
    except Exception:  # noqa: BLE001 - reported
        result["error"] = traceback.format_exc()
    finally:
        gc.collect()
        dist.destroy_process_group()
    _save_result(result, out_dir, rank)


def check_nccl(device, quick):
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and not dist.is_nccl_available():
        return {"ok": False, "error": "this torch build has no NCCL"}
    with tempfile.TemporaryDirectory() as tmp:
        codes = _spawn_ranks(_nccl_worker, 1, (1, _free_port(), str(device), backend, quick, tmp))
        results, error = _rank_results(tmp, codes)
    if error:
        return {"ok": False, "backend": backend, "error": error}
    r = results[0]
    measured = r["measured"]
    timing = r["timing"]
    omgs, plain = timing["omgs"], timing["ddp_allreduce"]
    # does the hook hold the host? its share of the step, and the syncs it adds
    blocking = {
        "hook_s_over_step_s": omgs["hook_s_median"] / omgs["step_s_median"]
        if omgs["hook_s_median"] is not None and omgs["step_s_median"] else None,
        "backward_host_s_over_step_s": omgs["backward_host_s_median"] / omgs["step_s_median"]
        if omgs["step_s_median"] else None,
        "ddp_backward_host_s_over_step_s": plain["backward_host_s_median"] / plain["step_s_median"]
        if plain["step_s_median"] else None,
    }
    if timing["syncs_in_backward"] is not None:
        blocking["sync_count_works"] = timing["syncs_in_backward"]["probe_seen"]
        blocking["syncs_per_backward"] = timing["syncs_in_backward"]["per_step"]
        blocking["ddp_syncs_per_backward"] = timing["ddp_syncs_in_backward"]["per_step"]
        blocking["syncs_where"] = timing["syncs_in_backward"]["where"]
    ok = (_reference_ok(r["reference"]) and measured["trial_finished"] and measured["finite"]
          and _amp_ok(r["amp"]))
    return {"ok": ok, "backend": r["backend"], "reference_worst": r["reference"],
            "measured": measured, "amp": r["amp"], "blocking": blocking, "timing": timing,
            "reference_step_s": r["reference_step_s"]}


# --------------------------------------------------------------------------- profile
def check_profile(device, quick):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "profile.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
               os.path.join(ROOT, "scripts", "profile.py"), "--out", out, "--backend", "gloo",
               "--device", device.type, "--no-plot", "--no-progress"]
        cmd += ["--quick"] if quick else ["--time-budget", "60"]
        # (the ranks' process-group timeout: a hung collective fails them before the
        # section's limit kills them)
        cmd += ["--timeout", str(PG_TIMEOUT_S)]
        started = time.perf_counter()
        code, output = _run_command(cmd, _child_env(), "omgs-profile (torchrun)")
        wall = time.perf_counter() - started
        if code != 0:
            return {"ok": False, "wall_s": wall, "error": output[-3000:]}
        from omgs_hook.profile_file import load_profile

        profile = load_profile(out)
        with open(out) as f:
            raw = json.load(f)
    return {"ok": True, "wall_s": wall, "comm": profile.comm.to_dict(),
            "dense": profile.dense.to_dict() if profile.dense else None,
            "topk_backends": sorted(raw.get("topk_all", {}) or {}), "device": raw.get("device")}


# -------------------------------------------------------------------------- overhead
def check_overhead(device, quick):
    # as a command, not bench_hook_overhead.measure(): its ranks (a process group with a
    # 600 s timeout) are then killed with it when it runs past the section's limit
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "overhead.json")
        cmd = [sys.executable, os.path.join(ROOT, "scripts", "bench_hook_overhead.py"),
               "--sizes", "1e5" if quick else "1e6,12e6,50e6",
               "--rounds", "2" if quick else "5", "--steps", "2" if quick else "4",
               "--device", device.type, "--json", out]
        code, output = _run_command(cmd, _child_env(), "bench_hook_overhead.py")
        if code != 0:
            return {"ok": False, "error": output[-3000:]}
        with open(out) as f:
            bench = json.load(f)
    slim = [{k: v for k, v in r.items() if not k.endswith("steps_s")} for r in bench["results"]]
    return {"ok": True, "rows": slim, "fused_pass": bench.get("fused_pass"),
            "target": "<= 5 copy-equivalents per sparse group"}


def _child_env():
    return dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"), OMP_NUM_THREADS="1")


def check_writeback(device, quick):
    """The sparse write-back on the device: the same sums, bit for bit, as the CPU path
    when the ranks' entries collide at the same indices (CUDA's index_add_ adds with
    atomics: one call per payload keeps it deterministic), and its time for one run
    against many runs (kernel launches must not grow with the runs)."""
    from omgs_hook.group_exchange import _scatter_average

    world, numel = 8, (10**5 if quick else 10**7)
    k = max(1, numel // 1000)
    gen = torch.Generator().manual_seed(0)
    pool = torch.randperm(numel, generator=gen)[:2 * k]  # the ranks pick from one pool
    indices = torch.cat([pool[torch.randperm(2 * k, generator=gen)[:k]].sort().values
                         for _ in range(world)])
    values = torch.randn(indices.numel(), generator=gen)
    rows = {}
    worst_bits = 0
    for runs in (1, 16, 256):
        edges = torch.linspace(0, numel, runs + 1).long().tolist()
        results = {}
        # the CPU's own path as the reference; the per-payload path (the GPU's) on the device
        for name, dev, per_payload in (("reference", torch.device("cpu"), False),
                                       ("device", device, True)):
            buffer = torch.zeros(numel, device=dev)
            segments = [(a, b - a, buffer[a:b]) for a, b in zip(edges, edges[1:])]
            idx, val = indices.to(dev), values.to(dev)

            def call():
                _scatter_average(segments, idx, val, 1 / world, numel, rows=world,
                                 per_payload=per_payload)
            call()
            results[name] = buffer.cpu()
            if name == "device":
                seconds = _cuda_time(call, device, reps=3 if quick else 20)
                rows[runs] = {"runs": runs, "ms": round(1e3 * seconds, 4)}
        differ = int((results["reference"].view(torch.int32)
                      != results["device"].view(torch.int32)).sum())
        worst_bits = max(worst_bits, differ)
    return {"ok": worst_bits == 0, "elements_differing_from_cpu": worst_bits,
            "world": world, "numel": numel, "k": k, "timing": list(rows.values())}


SECTIONS = {"env": check_env, "topk": check_topk, "topk_speed": check_topk_speed,
            "hook": check_hook, "nccl": check_nccl, "profile": check_profile,
            "overhead": check_overhead, "writeback": check_writeback}


# ---------------------------------------------------------------------------- report
def render_markdown(report):
    lines = ["# GPU check (`scripts/gpu_check.py`)", "",
             f"Run {report['started']} on {report['sections']['env'].get('info', {}).get('gpu', report['device'])}, "
             f"{report['wall_s']:.0f} s in all. Generated by the script; re-run to refresh.", ""]
    for name, result in report["sections"].items():
        status = {True: "passed", False: "FAILED", None: "no verdict"}[result.get("ok")]
        lines += [f"## {name}: {status}", ""]
        body = {k: v for k, v in result.items() if k != "ok"}
        if name == "topk_speed" and "rows" in result:
            lines += ["| D | k | raw torch.topk (ms) | " + " | ".join(
                f"{b} (ms)" for b in ("torch", "sampled", "cupy")) + " | cupy speed-up |",
                "|---|---|---|---|---|---|---|"]
            for r in result["rows"]:
                cells = [f"{r.get(b + '_s', float('nan')) * 1e3:.3f}" for b in ("torch", "sampled", "cupy")]
                lines.append(f"| {r['numel']:.0e} | {r['k']} | {r['raw_torch_topk_s'] * 1e3:.3f} | "
                             + " | ".join(cells) + f" | {r.get('speedup_vs_raw_torch', float('nan')):.2f}x |")
            lines.append("")
        elif name == "overhead" and "rows" in result:
            lines += ["| elements | copy (ms) | no-op step (ms) | OMGS step (ms) | copies |",
                      "|---|---|---|---|---|"]
            for r in result["rows"]:
                lines.append(f"| {r['numel']:.0e} | {r['copy_s'] * 1e3:.3f} | {r['noop_step_s'] * 1e3:.2f} "
                             f"| {r['omgs_step_s'] * 1e3:.2f} | {r['overhead_copies']:.2f} |")
            lines.append("")
        elif name == "nccl" and "timing" in result:
            lines += [f"Backend {result['backend']}, one rank. Medians of the timed steps:", "",
                      "| | step (ms) | backward() on the host (ms) | hook body (ms) | "
                      "syncs per backward() |", "|---|---|---|---|---|"]
            blocking = result["blocking"]
            rows = (("OMGS", "omgs", "syncs_per_backward"),
                    ("DDP all-reduce", "ddp_allreduce", "ddp_syncs_per_backward"))
            for label, key, syncs in rows:
                t = result["timing"][key]
                hook = f"{t['hook_s_median'] * 1e3:.3f}" if t["hook_s_median"] is not None else "-"
                lines.append(f"| {label} | {t['step_s_median'] * 1e3:.3f} | "
                             f"{t['backward_host_s_median'] * 1e3:.3f} | {hook} | "
                             f"{blocking.get(syncs, '-')} |")
            lines.append("")
        lines += ["```", json.dumps(body, indent=1, default=str)[:4000], "```", ""]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help="comma-separated subset of: " + ", ".join(SECTIONS))
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    parser.add_argument("--doc", default=os.path.join(ROOT, "docs", "gpu.md"))
    parser.add_argument("--json", default=os.path.join(ROOT, "docs", "gpu.json"))
    parser.add_argument("--budget", type=float, default=BUDGET_S,
                        help=f"seconds for the whole run (default {BUDGET_S}); a section "
                             "starts with at most what is left")
    parser.add_argument("--timeout", action="append", default=[], metavar="NAME=SECONDS",
                        help="a section's limit in seconds instead of its default "
                             "(repeatable)")
    args = parser.parse_args(argv)
    limits = dict(SECTION_TIMEOUT_S)
    for item in args.timeout:
        name, _, seconds = item.partition("=")
        try:
            value = float(seconds)
        except ValueError:
            value = -1.0
        if name not in SECTIONS or not value > 0:
            parser.error(f"--timeout {item!r}: expected NAME=SECONDS with NAME one of "
                         f"{list(SECTIONS)} and SECONDS > 0")
        limits[name] = value
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here (use --device cpu for a dry run)")
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    wanted = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in SECTIONS]
    if unknown:
        parser.error(f"--sections: unknown {unknown}; choose from {list(SECTIONS)}")
    if "env" not in wanted:
        wanted.insert(0, "env")
    report = {"started": datetime.datetime.now().isoformat(timespec="seconds"),
              "device": str(device), "quick": args.quick, "sections": {}}
    # the device runner brings back only what is written under $OUT: a copy goes there
    targets = [(args.json, args.doc)]
    if os.environ.get("OUT") and os.path.isdir(os.environ["OUT"]):
        targets.append((os.path.join(os.environ["OUT"], os.path.basename(args.json)),
                        os.path.join(os.environ["OUT"], os.path.basename(args.doc))))

    def write_report():
        for json_path, doc_path in targets:
            with open(json_path, "w") as f:
                json.dump(report, f, indent=1, default=str)
            with open(doc_path, "w") as f:
                f.write(render_markdown(report))

    global _limit
    started = time.perf_counter()
    skipped = []
    previous_handler = signal.signal(signal.SIGALRM, _on_alarm)
    for name in wanted:
        t0 = time.perf_counter()
        budget_left = args.budget - (t0 - started)
        limit = min(limits[name], budget_left)
        if limit < min(MIN_SECTION_S, limits[name]):
            result = {"ok": None, "skipped": f"not started: {budget_left:.0f} s of the run's "
                                             f"budget of {args.budget:g} s were left"}
            skipped.append(name)
        else:
            # ranks and commands end at the deadline (_spawn_ranks, _run_command); the
            # alarm a little later stops a section that runs in this process, wherever
            # Python gets control back (not inside one hung CUDA call)
            _limit = (time.monotonic() + limit, round(limit, 1))
            try:
                try:
                    signal.setitimer(signal.ITIMER_REAL, limit + min(3.0, limit))
                    result = SECTIONS[name](device, args.quick)
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
                    _limit = None
            except SectionTimeout as exc:
                result = {"ok": False, "timed_out": True,
                          "error": f"{name}: {exc}\n" + traceback.format_exc()[-2000:]}
            except Exception:  # noqa: BLE001 - recorded, next section runs
                result = {"ok": False, "error": traceback.format_exc()[-3000:]}
        result["section_s"] = round(time.perf_counter() - t0, 1)
        result["limit_s"] = round(max(0.0, limit), 1)
        report["sections"][name] = result
        print(f"[gpu_check] {name}: ok={result.get('ok')} ({result['section_s']} s"
              f" of {result['limit_s']:g})", flush=True)
        if result.get("ok") is False and "error" in result:
            print(result["error"][-1500:], flush=True)
        # after every section: a run killed later (a hang, the runner's time limit)
        # still leaves the sections done so far
        report["wall_s"] = time.perf_counter() - started
        write_report()
    signal.signal(signal.SIGALRM, previous_handler)
    failed = [n for n, r in report["sections"].items() if r.get("ok") is False]
    print(f"[gpu_check] wrote {' and '.join(p for pair in targets for p in pair)}; "
          f"failed: {failed or 'none'}; skipped: {skipped or 'none'}")
    return 1 if failed or skipped else 0


if __name__ == "__main__":
    sys.exit(main())
