"""Elastic restart: torchrun --max-restarts relaunches after a killed worker, and training
resumes from the last checkpoint (model, optimizer and every rank's hook state)."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.multiprocess


@pytest.mark.timeout(300)
def test_torchrun_max_restarts_resumes_from_checkpoint(tmp_path):
    log = tmp_path / "log.jsonl"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--max-restarts=1",
        "--monitor-interval=0.5", str(ROOT / "scripts" / "train.py"),
        "--model", "resnet20", "--hook", "omgs", "--density", "0.05", "--warmup-steps", "2",
        # every group sparse: with dense groups allowed, the plan (chosen from timings) can
        # send every group dense on loopback, and then no residual is left to check
        "--no-allow-dense",
        "--steps", "12", "--batch-size", "16", "--no-progress",
        "--checkpoint", str(tmp_path / "ckpt.pt"), "--checkpoint-every", "4",
        "--resume-if-present", "--fail-at-step", "6", "--log-file", str(log),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # a session of its own, so a hang kills torchrun *and* its workers
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=280)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail("torchrun did not finish within 280 s:\n" + output[-4000:])
    assert proc.returncode == 0, output[-4000:]
    assert "fails on purpose after step 6" in output
    records = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r and "summary" not in r]
    # first attempt: steps 1..6; the restart resumes from the step-4 checkpoint: 5..12,
    # after cutting the log back to step 4 (each step's record once)
    assert steps == list(range(1, 13)), steps
    summary = [r for r in records if r.get("summary")][-1]
    assert summary["steps"] == 12 or summary.get("step") == 12, summary
    # the checkpoint written at the end carries each rank's hook residuals
    import torch

    for rank in range(2):
        own = torch.load(f"{tmp_path / 'ckpt.pt'}.rank{rank}", weights_only=True)
        assert own["step"] == 12 and own["hook_state"]["step"] == 12
        assert own["hook_state"]["residuals"]
