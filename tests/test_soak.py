"""Short soak in CI: the full 1000-step run is `python scripts/soak.py` (see docs/reliability.md)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "soak.py"

pytestmark = pytest.mark.multiprocess


@pytest.mark.timeout(240)
def test_short_soak_keeps_memory_flat_and_residual_bounded(tmp_path):
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--steps", "160", "--replan-every", "20",
         "--sample-every", "10", "--density", "0.05", "--out", str(out), "--timeout", "200"],
        capture_output=True, text=True, timeout=230,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    for samples in report["per_rank"]:
        assert samples[-1]["replans"] >= 7  # planned at step 5, then every 20 steps
        assert samples[-1]["loss"] < samples[0]["loss"]  # it trained
    assert "FAIL" not in proc.stdout
