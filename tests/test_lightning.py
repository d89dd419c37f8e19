"""Lightning: OMGSStrategy registers the hook on Lightning's DDP model (2 CPU ranks with a
real Trainer under torchrun), and rejects bad options before anything starts."""

import json
import os
import sys
from pathlib import Path

import pytest

from ddp_harness import run_in_session

pytest.importorskip("lightning")

from omgs_hook.lightning import OMGSStrategy  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_trainer_fit_with_omgs_strategy_on_two_cpu_ranks(tmp_path):
    out = tmp_path / "lightning.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           str(ROOT / "scripts" / "lightning_example.py"), "--steps", "30", "--out", str(out)]
    returncode, output = run_in_session(cmd, 280, cwd=ROOT,
                                        env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert returncode == 0, output[-4000:]
    report = json.loads(out.read_text())
    total = report["total"]
    assert report["steps"] == 30 and total["steps"] == 30
    # the hook really ran sparse (Lightning's own comm-hook path would skip it on CPU)
    assert 0 < total["bytes_sent"] < total["dense_bytes"] / 5
    # residuals carry the module's parameter names, and the forward pass is timed
    assert report["residual_names"] == sorted(
        f"net.{i}.{kind}" for i in (0, 2, 4) for kind in ("weight", "bias"))
    assert report["forward_s"] > 0
    assert report["last_loss"] < report["first_loss"] / 10


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_second_fit_carries_the_hook_state_over(tmp_path):
    # each fit wraps the module in a new DDP model, and the strategy registered a fresh
    # state there: the first fit's residuals were dropped without a word
    out = tmp_path / "lightning.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           str(ROOT / "scripts" / "lightning_example.py"), "--steps", "12", "--fits", "2",
           "--out", str(out)]
    returncode, output = run_in_session(cmd, 280, cwd=ROOT,
                                        env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert returncode == 0, output[-4000:]
    report = json.loads(out.read_text())
    total = report["total"]
    assert report["steps"] == 24 and total["steps"] == 24  # one count over both fits
    assert total["warmup_steps"] == 2  # the dense warm-up ran once, not once per fit
    assert total["rewound_steps"] == 0


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("fits", [1, 2])
def test_a_manual_optimization_gan_rewinds_the_dropped_discriminator_gradient(tmp_path, fits):
    # Lightning's DDP forward is the whole training_step: the GAN's two backwards and
    # their zero_grad() calls all come after it, so the rewind - decided at the forward -
    # never saw the discriminator's gradient cleared (0 rewinds; parameters 0.02 apart
    # after 12 iterations). Decided before each backward, the loop that lets the
    # generator's backward reach the discriminator trains bit for bit as the one that
    # toggles it off, as plain DDP does. fits=2: the decision pending at the first fit's
    # end was lost when the second fit's DDP constructor moved the parameters' versions
    # (0.0024 apart)
    out = tmp_path / "gan.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "lightning_gan.py"), "--iterations", "12", "--fits", str(fits),
           "--out", str(out)]
    returncode, output = run_in_session(cmd, 110, cwd=ROOT,
                                        env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert returncode == 0, output[-4000:]
    report = json.loads(out.read_text())
    assert report["cleared"]["steps"] == report["toggled"]["steps"] == 24
    assert report["toggled"]["partly_rewound_steps"] == 0
    assert report["cleared"]["partly_rewound_steps"] >= 20
    assert report["max_diff"] == 0.0


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_weights_restored_by_lightning_or_another_module_start_the_hook_afresh(tmp_path):
    # LearningRateFinder sweeps the learning rate for 10 steps, then restores the weights
    # it started from: plain ddp then trains bit for bit as without it, but the hook went
    # on with the sweep's residuals and step count (residual norm 1.45 at the real
    # training's start, 20 steps in). A second fit of a new module took over the first
    # one's residuals; one of another architecture failed with a checkpoint's error
    out = tmp_path / "restore.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "lightning_restore.py"), "--out", str(out)]
    returncode, output = run_in_session(cmd, 110, cwd=ROOT,
                                        env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert returncode == 0, output[-4000:]
    report = json.loads(out.read_text())
    assert report["lr_finder_at_train_start"] == [[0, 0.0]]
    assert report["lr_finder_steps"] == 12  # the sweep's steps are not counted
    assert report["lr_finder_max_diff"] == 0.0
    assert report["fits_at_train_start"] == [[0, 0.0]] * 3
    total = report["last_fit_total"]
    assert total["steps"] == 6 and total["warmup_steps"] == 2


def test_bad_options_are_rejected_when_the_strategy_is_built():
    with pytest.raises(ValueError, match="density"):
        OMGSStrategy(omgs_options={"density": 2.0})
    with pytest.raises(ValueError, match="ddp_comm_hook"):
        OMGSStrategy(ddp_comm_hook=lambda state, bucket: None)
    with pytest.raises(ValueError, match="process_group"):
        OMGSStrategy(omgs_options={"process_group": None})
    with pytest.raises(TypeError, match="omgs_options"):
        OMGSStrategy(omgs_options=["density"])


def test_options_that_need_the_module_are_accepted_when_the_strategy_is_built():
    # the strategy supplies the module (register() at configure_ddp); validating the
    # options without one refused local_clip_norm, telling the user to use register()
    strategy = OMGSStrategy(omgs_options={"density": 0.01, "local_clip_norm": 1.0})
    assert strategy.omgs_options == {"density": 0.01, "local_clip_norm": 1.0}
    with pytest.raises(ValueError, match="local_clip_norm"):
        OMGSStrategy(omgs_options={"local_clip_norm": -1.0})  # still validated
    # a pinned plan of parameter names is checked against the model only at register()
    plan = {"groups": [["net.0.weight", "net.0.bias"]]}
    OMGSStrategy(omgs_options={"plan": plan, "local_clip_norm": 1.0})


def test_a_mixed_precision_plugins_scaler_reaches_the_hook():
    """"16-mixed" has a GradScaler: the hook gets it (the residuals must follow the loss
    scale); options that name one keep theirs, bf16/full precision pass none."""
    from types import SimpleNamespace

    import torch

    from omgs_hook.lightning import options_with_scaler

    scaler = torch.amp.GradScaler("cpu")
    mixed = SimpleNamespace(scaler=scaler)
    assert options_with_scaler({"density": 0.01}, mixed) == {"density": 0.01,
                                                            "grad_scaler": scaler}
    own = torch.amp.GradScaler("cpu")
    assert options_with_scaler({"grad_scaler": own}, mixed)["grad_scaler"] is own
    assert options_with_scaler({"density": 0.01}, SimpleNamespace(scaler=None)) == {
        "density": 0.01}
    assert options_with_scaler({"density": 0.01}, None) == {"density": 0.01}
