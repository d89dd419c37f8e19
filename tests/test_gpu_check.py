"""scripts/gpu_check.py - the one command for CUDA checks - runs its checks on the CPU
too, so it cannot rot between sessions that have a GPU."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from script_loader import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_cpu_dry_run_passes_and_writes_the_report(tmp_path):
    doc, out = tmp_path / "gpu.md", tmp_path / "gpu.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--quick",
         "--sections", "topk,topk_speed,hook,nccl,writeback", "--doc", str(doc),
         "--json", str(out)],
        capture_output=True, text=True, timeout=280, cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    sections = report["sections"]
    assert sections["topk"]["ok"] is True and sections["topk"]["checked"] > 50
    hook = sections["hook"]
    assert hook["ok"] is True, hook
    assert hook["reference_worst"]["rank_disagreement"] == 0.0
    assert all(4 in a["nonfinite_steps"] and a["residual_kept"] for a in hook["amp"])
    # the NCCL section's code on gloo: one rank, the reference, the defaults' trial
    nccl = sections["nccl"]
    assert nccl["ok"] is True and nccl["backend"] == "gloo", nccl
    assert nccl["reference_worst"]["conservation"] < 1e-4
    assert nccl["measured"]["trial_finished"] and len(nccl["measured"]["candidates"]) >= 2
    assert 4 in nccl["amp"]["nonfinite_steps"] and nccl["amp"]["residual_kept"]
    timing = nccl["timing"]
    assert timing["omgs"]["hook_s_median"] > 0 and timing["ddp_allreduce"]["step_s_median"] > 0
    assert timing["syncs_in_backward"] is None  # CUDA only
    writeback = sections["writeback"]
    assert writeback["ok"] is True and writeback["elements_differing_from_cpu"] == 0
    assert [row["runs"] for row in writeback["timing"]] == [1, 16, 256]
    text = doc.read_text()
    assert "## hook: passed" in text and "## topk_speed" in text
    assert "## nccl: passed" in text and "| DDP all-reduce |" in text


@pytest.mark.multiprocess
def test_ranks_past_the_section_limit_are_killed_and_the_next_section_runs(tmp_path):
    """A hung collective must not eat the device runner's one command: the ranks are
    killed at the section's limit, the section is recorded as failed and the next runs."""
    out = tmp_path / "gpu.json"
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--sections", "hook,writeback",
         "--timeout", "hook=1", "--doc", str(tmp_path / "gpu.md"), "--json", str(out)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert time.perf_counter() - started < 60  # (the hook section alone takes ~8 s)
    sections = json.loads(out.read_text())["sections"]
    hook = sections["hook"]
    assert hook["ok"] is False and hook["timed_out"] is True and hook["limit_s"] == 1
    assert "did not finish within 1 s (killed)" in hook["error"]
    assert sections["writeback"]["ok"] is True


# (method="thread": the script's alarm is SIGALRM, which pytest-timeout's default uses too)
@pytest.mark.timeout(60, method="thread")
def test_a_section_in_process_is_stopped_and_the_budget_skips_the_rest(tmp_path, monkeypatch):
    """A section that runs in the script's own process is stopped by the alarm; a section
    with less than the minimum left of the run's budget is not started (no verdict,
    exit status 1)."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # gpu_check puts scripts/ first
    gpu_check = load_script("gpu_check")

    def stuck(device, quick):
        while True:
            time.sleep(0.05)

    monkeypatch.setitem(gpu_check.SECTIONS, "stuck", stuck)
    monkeypatch.setitem(gpu_check.SECTION_TIMEOUT_S, "stuck", 0.5)
    monkeypatch.setattr(gpu_check, "MIN_SECTION_S", 1)
    out = tmp_path / "gpu.json"
    code = gpu_check.main(["--device", "cpu", "--quick", "--sections", "stuck,writeback",
                           "--budget", "1.2", "--doc", str(tmp_path / "gpu.md"),
                           "--json", str(out)])
    assert code == 1
    sections = json.loads(out.read_text())["sections"]
    assert sections["env"]["ok"] is True
    stopped = sections["stuck"]
    assert stopped["ok"] is False and stopped["timed_out"] is True
    assert "did not finish within 0.5 s" in stopped["error"] and stopped["section_s"] < 2
    assert sections["writeback"]["ok"] is None and "not started" in sections["writeback"]["skipped"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_without_a_gpu_is_a_clear_error(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--doc", str(tmp_path / "x.md"),
                           "--json", str(tmp_path / "x.json")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "no CUDA device" in proc.stderr


def test_unknown_section_is_named(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--sections", "nope"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "nope" in proc.stderr


def test_the_report_is_copied_under_OUT_after_every_section(tmp_path):
    """The device runner brings back only the files under $OUT: the report goes there too
    (written after each section, so a run killed later keeps what was done)."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    doc, js = tmp_path / "gpu.md", tmp_path / "gpu.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--sections", "env",
         "--doc", str(doc), "--json", str(js)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
        env=dict(os.environ, OUT=str(out_dir)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert doc.exists() and js.exists()
    copied = json.loads((out_dir / "gpu.json").read_text())
    assert copied["sections"]["env"]["ok"] is True
    assert "## env: passed" in (out_dir / "gpu.md").read_text()
