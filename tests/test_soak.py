"""Short soak in CI: the full 1000-step run is `python scripts/soak.py` (see docs/reliability.md)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"

pytestmark = pytest.mark.multiprocess

# scripts/soak.py registers the hook with the library's defaults, under which the plan -
# chosen from measured times - may send every group dense on loopback (nothing in the
# residual) in one stretch of the run and sparse in another, which would make the
# residual-growth check pass or fail by timing. This launcher runs soak.py with
# allow_dense=False, so every group of every step keeps a residual. soak.py's ranks are
# spawned: each re-runs this file as its main module, so the patch holds there too.
# It also leaves out the first trial's side-by-side duel (80 steps), so that the short
# run's 160 steps hold periodic re-plans after the trial; the full soak runs it.
SPARSE_LAUNCHER = f"""
import sys
sys.path.append({str(SCRIPTS)!r})  # behind the standard library (scripts/profile.py)
import omgs_hook

_register = omgs_hook.register


def register(ddp_model, **options):
    options.setdefault("allow_dense", False)
    return _register(ddp_model, **options)


omgs_hook.register = register
omgs_hook.plan_selection.DUEL_PAIRS = 0
import soak  # noqa: E402

if __name__ == "__main__":
    sys.exit(soak.main())
"""


@pytest.mark.timeout(240)
def test_short_soak_keeps_memory_flat_and_residual_bounded(tmp_path):
    out = tmp_path / "soak.json"
    launcher = tmp_path / "sparse_soak.py"
    launcher.write_text(SPARSE_LAUNCHER)
    proc = subprocess.run(
        [sys.executable, str(launcher), "--steps", "160", "--replan-every", "20",
         "--sample-every", "10", "--density", "0.05", "--out", str(out), "--timeout", "200"],
        capture_output=True, text=True, timeout=230,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    # planned at step 5, then every 20 steps after the plan in use was made; the measured
    # selection's first trial (the sparse lead's steps before it included) and a regret
    # trial after it postpone the periodic re-plans by up to their step bounds (they end
    # at a timing-dependent step), so count only those that fit after both, minus one
    # for a re-plan computed in the background: 1 + (160 - 5 - 73 - 36) // 20 - 1 = 2. (This
    # said 41 steps and 5 re-plans until the trial's tie-break round and lead steps made
    # the bound 72: a run whose trial took 60-odd steps failed with 4 re-plans.)
    from omgs_hook import plan_selection
    from omgs_hook.hook import OVERHEAD_SETTLE_STEPS, PLAN_LAG
    # (the first trial starts after the sparse lead, without a lead of its own)
    trials = (plan_selection.trial_steps_bound(plan_selection.MAX_CANDIDATES,
                                               lead=OVERHEAD_SETTLE_STEPS + PLAN_LAG,
                                               duel_pairs=0)
              + plan_selection.trial_steps_bound(2, duel_pairs=0))
    least = 1 + (160 - 5 - trials) // 20 - 1
    assert least >= 2  # at least one periodic re-plan after the trials
    for samples in report["per_rank"]:
        assert samples[-1]["replans"] >= least
        assert samples[-1]["loss"] < samples[0]["loss"]  # it trained
        assert all(s["residual_norm"] > 0 for s in samples)  # sparse: residual in use
    assert report["total"]["bytes_sent"] < report["total"]["dense_bytes"] / 4
    assert "FAIL" not in proc.stdout
