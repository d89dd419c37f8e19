"""scripts/train.py: options, schedule, and real 2-rank torchrun runs (gloo on CPU).

Every launch runs in its own session with a hard timeout; on expiry the whole process
group (torchrun and its workers) is killed, so a hung collective fails the test instead
of blocking the suite. Runs use the 8x8 digits and small batches to stay fast.
"""

import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from ddp_harness import run_ranks

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "train.py"
LAUNCH_TIMEOUT_S = 150
# fast settings shared by the runs: 8x8 digits, 16 samples per rank -> 44 steps/epoch
FAST = ["--model", "resnet20", "--image-size", "8", "--batch-size", "16", "--epochs", "2",
        "--no-progress", "--threads", "1"]
# the same on random 3x8x8 images: no scikit-learn import, for runs that test the hooks
SYNTHETIC = FAST + ["--synthetic"]


def _load_script():
    spec = importlib.util.spec_from_file_location("train_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def train_script():
    return _load_script()


def launch(args, nproc=2, timeout=LAUNCH_TIMEOUT_S, torchrun_args=()):
    """Run train.py under torchrun (nproc ranks, with ``torchrun_args``) or plainly
    (nproc=None); return the result."""
    if nproc is None:
        command = [sys.executable, str(SCRIPT), *args]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc_per_node={nproc}", *torchrun_args, str(SCRIPT), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # torchrun and every worker it started
        output, _ = process.communicate()
        pytest.fail(f"train.py did not finish within {timeout} s:\n{output[-4000:]}")
    return process.returncode, output


def launch_ok(args, nproc=2):
    returncode, output = launch(args, nproc)
    assert returncode == 0, f"train.py failed ({returncode}):\n{output[-6000:]}"
    return output


def _groups_of(entry):
    """The groups of one plan-history entry ({"step", "plan": {...}} or a flat plan)."""
    plan = entry.get("plan") if isinstance(entry.get("plan"), dict) else entry
    return plan["groups"]


def read_log(path):
    records = [json.loads(line) for line in Path(path).read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "test_accuracy" in r and not r.get("summary")]
    summaries = [r for r in records if r.get("summary")]
    return steps, evals, summaries


# --------------------------------------------------------------------- in-process parts


def test_options_are_validated_before_anything_starts(train_script):
    parse = train_script.parse_args
    for bad in (["--density", "0"], ["--density", "1.5"], ["--resume"],
                ["--hook", "allreduce", "--strategy", "greedy"], ["--steps", "0"],
                ["--hook", "powersgd", "--warmup-steps", "1"], ["--model", "resnet50"],
                ["--model", "vgg16", "--image-size", "16"], ["--checkpoint-every", "3"],
                ["--density-warmup-steps", "-1"]):
        with pytest.raises(SystemExit):
            parse(bad)
    args = parse(["--model", "lstm"])
    assert (args.lr, args.weight_decay, args.clip_grad_norm) == (1.0, 0.0, 1.0)


def test_zero_buckets_and_log_lines_and_the_strategy_are_checked_as_the_library_does(
        train_script, capsys):
    """0 means something for --bucket-cap-mb (a bucket per parameter, as DDP takes it) and
    --hook-log-every (no log lines, as register's log_every); a strategy the planner does
    not know is refused before any process starts, with the planner's message."""
    parse = train_script.parse_args
    args = parse(["--bucket-cap-mb", "0", "--hook-log-every", "0"])
    assert (args.bucket_cap_mb, args.hook_log_every) == (0.0, 0)
    assert train_script.hook_options(args)["log_every"] == 0
    for bad, named in ((["--bucket-cap-mb", "-1"], "--bucket-cap-mb"),
                       (["--bucket-cap-mb", "nan"], "--bucket-cap-mb"),
                       (["--hook-log-every", "-5"], "--hook-log-every"),
                       (["--strategy", "fastest"], "unknown strategy 'fastest'"),
                       (["--strategy", "threshold:0"], "must be a positive integer")):
        with pytest.raises(SystemExit):
            parse(bad)
        assert named in capsys.readouterr().err, bad
    assert parse(["--strategy", " Threshold:2.5e7 "]).strategy == "threshold:25000000"
    args = parse(["--model", "resnet20", "--lr", "0.3", "--clip-grad-norm", "0"])
    assert (args.lr, args.weight_decay, args.clip_grad_norm) == (0.3, 5e-4, None)


def test_lstm_size_and_corpus_options(train_script):
    """The convergence study's LSTM: its sizes and corpus reach the model and the data,
    and are refused where they mean nothing."""
    from omgs_hook.examples import data as example_data

    parse = train_script.parse_args
    args = parse(["--model", "lstm", "--lstm-hidden-size", "16", "--lstm-embedding-dim", "8",
                  "--text-corpus", "small", "--seq-len", "32"])
    dataset = train_script.load_data(args)
    assert dataset.info["modules"] == list(example_data.DEFAULT_TEXT_MODULES)
    model = train_script.make_model(args, dataset)
    assert (model.lstm.hidden_size, model.embedding.embedding_dim) == (16, 8)
    default = train_script.make_model(parse(["--model", "lstm"]), dataset)
    assert (default.lstm.hidden_size, default.embedding.embedding_dim) == (256, 128)
    for bad in (["--model", "resnet20", "--lstm-hidden-size", "16"],
                ["--model", "lstm", "--lstm-embedding-dim", "0"],
                ["--model", "lstm", "--text-corpus", "huge"]):
        with pytest.raises(SystemExit):
            parse(bad)


def test_invalid_option_message_names_it():
    returncode, output = launch(["--density", "2"], nproc=None, timeout=60)
    assert returncode == 2 and "--density" in output


def test_learning_rate_warms_up_linearly_then_decays_to_zero(train_script):
    args = train_script.parse_args(["--lr", "0.2", "--lr-warmup-steps", "4"])
    lrs = [train_script.learning_rate(step, args, total_steps=20) for step in range(20)]
    assert lrs[:4] == pytest.approx([0.05, 0.1, 0.15, 0.2])
    assert lrs[4] == pytest.approx(0.2)
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))  # monotone cosine decay
    assert train_script.learning_rate(20, args, 20) == pytest.approx(0.0)
    assert lrs[12] == pytest.approx(0.1, rel=0.05)  # half-way through the decay
    constant = train_script.parse_args(["--lr", "0.2", "--lr-schedule", "constant"])
    assert train_script.learning_rate(500, constant, 20) == 0.2


def test_powersgd_gets_a_single_bucket_on_gloo(train_script):
    from omgs_hook.examples.models import resnet20

    model = resnet20()
    model_mib = sum(p.numel() * 4 for p in model.parameters()) / 2**20
    powersgd = train_script.parse_args(["--hook", "powersgd"])
    assert train_script.bucket_cap_for(powersgd, model) > model_mib
    plain = train_script.parse_args(["--hook", "allreduce", "--bucket-cap-mb", "0.5"])
    assert train_script.bucket_cap_for(plain, model) == 0.5


def test_omgs_based_hooks_map_to_planner_strategies(train_script, monkeypatch):
    import omgs_hook

    calls = []
    # setitem, not setattr: reading the old value would trigger omgs_hook's lazy import
    monkeypatch.setitem(vars(omgs_hook), "register",
                        lambda ddp, **options: calls.append(options))
    expected = {"topk": "single", "lags": "layerwise", "omgs": "optimal"}
    for hook, strategy in expected.items():
        args = train_script.parse_args(["--hook", hook, "--density", "0.02",
                                        "--warmup-steps", "3", "--replan-every", "7",
                                        "--density-warmup-steps", "9"])
        train_script.attach_hook(object(), args, torch.device("cpu"))
        assert calls[-1]["strategy"] == strategy
        assert (calls[-1]["density"], calls[-1]["warmup_steps"], calls[-1]["replan_every"],
                calls[-1]["density_warmup_steps"]) == (0.02, 3, 7, 9)
    args = train_script.parse_args(["--hook", "omgs", "--strategy", "threshold:65536"])
    train_script.attach_hook(object(), args, torch.device("cpu"))
    assert calls[-1]["strategy"] == "threshold:65536"
    assert train_script.attach_hook(object(), train_script.parse_args(
        ["--hook", "allreduce"]), torch.device("cpu")) is None
    assert len(calls) == 4




def test_what_was_built_is_frozen_out_of_full_gc_passes_unless_asked_not_to(train_script):
    import gc

    assert gc.get_freeze_count() == 0
    try:
        train_script.freeze_what_was_built(train_script.parse_args(["--no-gc-freeze"]))
        assert gc.get_freeze_count() == 0
        train_script.freeze_what_was_built(train_script.parse_args([]))
        assert gc.get_freeze_count() > 1000  # torch's modules at least
    finally:
        gc.unfreeze()


def test_unset_hook_options_are_left_to_the_library(train_script):
    options = train_script.hook_options(train_script.parse_args(["--hook", "omgs"]))
    assert not {"allow_dense", "min_sparse_numel", "select", "plan"} & set(options)
    for value in (0, 4096):
        args = train_script.parse_args(["--hook", "omgs", "--min-sparse-numel", str(value)])
        assert train_script.hook_options(args)["min_sparse_numel"] == value
    assert options["strategy"] == "optimal"
    for argv, expected in ((["--no-allow-dense"], False), (["--no-dense-groups"], False),
                           (["--allow-dense"], True)):
        args = train_script.parse_args(["--hook", "lags", *argv])
        assert args.allow_dense is expected, argv
        assert train_script.hook_options(args)["allow_dense"] is expected, argv


def test_topk_and_lags_send_every_group_sparse_unless_asked(train_script, capsys):
    """--hook topk / lags are TopK-SGD and LAGS-SGD: with the library's allow_dense=True
    a group went dense wherever the model or the trial found that cheaper (on loopback
    `--hook lags` sent 5 of ResNet-20's 9 buckets dense). --allow-dense still lets them."""
    for hook in ("topk", "lags"):
        options = train_script.hook_options(train_script.parse_args(["--hook", hook]))
        assert options["allow_dense"] is False, hook
        args = train_script.parse_args(["--hook", hook, "--allow-dense",
                                        "--min-sparse-numel", "64"])
        assert train_script.hook_options(args)["allow_dense"] is True
        err = _refused(train_script.parse_args, ["--hook", hook, "--min-sparse-numel", "64"],
                       capsys)
        assert f"--hook {hook} (every group sparse)" in err and "--allow-dense" in err


def test_select_and_plan_need_an_omgs_hook(train_script, tmp_path, capsys):
    plan = tmp_path / "plan.json"
    plan.write_text("{}")
    for argv in (["--hook", "allreduce", "--select", "model"],
                 ["--hook", "powersgd", "--plan", str(plan)],
                 ["--hook", "omgs", "--select", "fastest"],
                 ["--hook", "omgs", "--plan", str(tmp_path / "missing.json")]):
        with pytest.raises(SystemExit):
            train_script.parse_args(argv)
    assert "--plan" in capsys.readouterr().err


def test_select_and_plan_are_passed_through(train_script, tmp_path, monkeypatch):
    """--select and --plan reach register()."""
    import omgs_hook

    calls = []
    monkeypatch.setitem(vars(omgs_hook), "register",
                        lambda ddp, **options: calls.append(options))
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"groups": [[0, 1], [2]], "dense": [False, False]}))
    args = train_script.parse_args(["--hook", "omgs", "--select", "model", "--plan", str(plan),
                                    "--no-allow-dense"])
    train_script.attach_hook(object(), args, torch.device("cpu"))
    assert calls[-1]["select"] == "model" and calls[-1]["allow_dense"] is False
    assert calls[-1]["plan"] == str(plan)
    args = train_script.parse_args(["--hook", "topk", "--select", "measured"])
    train_script.attach_hook(object(), args, torch.device("cpu"))
    assert calls[-1]["select"] == "measured" and calls[-1]["strategy"] == "single"
    assert "plan" not in calls[-1]


class _FakeHook:
    """Just enough of OMGSState for PlanHistory: a plan attribute and stats()."""

    def __init__(self, with_history):
        self.plan = None
        self.with_history = with_history
        self.history = []
        self.stats_calls = 0

    def use(self, step, groups):
        self.plan = object()  # a new plan object, as the hook makes on every re-plan
        self.history.append({"step": step, "plan": {"groups": groups,
                                                   "dense": [False] * len(groups)}})

    def stats(self):
        self.stats_calls += 1
        plan = self.history[-1]["plan"] if self.history else None
        out = {"plan": plan}
        if self.with_history:
            out["plan_history"] = list(self.history)
        return out


@pytest.mark.parametrize("with_history", [True, False])
def test_plan_history_reports_every_plan_once(train_script, with_history):
    hook = _FakeHook(with_history)
    history = train_script.PlanHistory(hook)
    assert history.poll(1) == [] and hook.stats_calls == 0  # no plan yet: no stats() call
    hook.use(2, [[0, 1, 2]])
    new = history.poll(2)
    assert [e["plan"]["groups"] for e in new] == [[[0, 1, 2]]] and new[0]["step"] == 2
    calls = hook.stats_calls
    assert history.poll(3) == [] and history.poll(4) == []
    assert hook.stats_calls == calls  # same plan object: stats() is not called again
    hook.use(5, [[0], [1, 2]])
    new = history.poll(5)
    assert [e["plan"]["groups"] for e in new] == [[[0], [1, 2]]] and new[0]["step"] == 5
    assert history.poll(6, force=True) == []
    assert [e["step"] for e in history.entries] == [2, 5]
    assert history.from_hook is with_history
    line = train_script.describe_plan_entry(history.entries[1])
    assert line == "step 5: 2 groups [1, 2] (0 dense)"
    assert train_script.PlanHistory(None).poll(1) == []


def test_plans_are_logged_after_the_hooks_history_is_full(train_script):
    """The hook keeps its newest PLAN_HISTORY_LIMIT (1000) plan-history entries. New
    entries were found by count (those past the number logged so far): once the history
    was full, its length stayed at the limit and every later plan was never logged
    (the JSON log's plan events stopped for the rest of the run)."""
    limit = 3  # the library's 1000, as a fake hook keeping its newest 3

    class CappedHook(_FakeHook):
        def use(self, step, groups):
            super().use(step, groups)
            del self.history[:-limit]

    hook = CappedHook(with_history=True)
    history = train_script.PlanHistory(hook)
    logged = []
    for step in range(1, 9):
        hook.use(step, [[0], [1]] if step % 2 else [[0, 1]])
        logged += [e["step"] for e in history.poll(step)]
    assert logged == list(range(1, 9))
    assert [e["step"] for e in history.entries] == [6, 7, 8]  # the hook's newest
    # resumed from a checkpoint whose (full) history ends at step 8: only later plans
    history = train_script.PlanHistory(hook)
    history.resumed({"plan_history": list(hook.history)})
    hook.use(9, [[0], [1]])
    assert [e["step"] for e in history.poll(9)] == [9]


# --------------------------------------------------------------------- torchrun launches


@pytest.fixture(scope="module")
def full_allreduce_run(tmp_path_factory):
    """6 uninterrupted allreduce steps on the real digits, with log and checkpoint."""
    folder = tmp_path_factory.mktemp("full")
    log, checkpoint = folder / "full.jsonl", folder / "full.pt"
    output = launch_ok(FAST + ["--hook", "allreduce", "--steps", "6", "--log-file", str(log),
                               "--checkpoint", str(checkpoint)])
    return output, log, checkpoint


@pytest.mark.multiprocess
def test_allreduce_run_writes_json_lines_and_a_summary(full_allreduce_run):
    output, log, _ = full_allreduce_run
    steps, evals, summaries = read_log(log)
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    for record in steps:
        assert math.isfinite(record["loss"]) and record["loss"] > 0
        assert 0 < record["iter_s"] < 60 and record["lr"] > 0
    assert len(evals) == 1 and evals[0]["step"] == 6
    assert {"epoch", "test_accuracy", "test_loss"} <= set(evals[0])
    assert 0.0 <= evals[0]["test_accuracy"] <= 1.0 and evals[0]["test_loss"] > 0
    (summary,) = summaries
    assert summary["steps"] == 6 and summary["world_size"] == 2
    assert summary["test_accuracy"] == evals[0]["test_accuracy"]
    assert summary["bytes_sent"] == 6 * 4 * 269_434  # dense float32 gradients
    assert "summary:" in output and "test_accuracy=" in output and "mean_iter_s=" in output


@pytest.mark.multiprocess
def test_checkpoint_and_resume_match_the_uninterrupted_run(full_allreduce_run, tmp_path):
    """3 steps, checkpoint, resume for 3 more == 6 steps in one go, bit for bit."""
    _, full_log, full_checkpoint = full_allreduce_run
    part = tmp_path / "part.pt"
    launch_ok(FAST + ["--hook", "allreduce", "--steps", "3", "--checkpoint", str(part)])
    halfway = torch.load(part, weights_only=True)
    assert halfway["step"] == 3
    assert (tmp_path / "part.pt.rank0").exists() and (tmp_path / "part.pt.rank1").exists()
    resumed_log = tmp_path / "resumed.jsonl"
    launch_ok(FAST + ["--hook", "allreduce", "--steps", "6", "--checkpoint", str(part),
                      "--resume", "--log-file", str(resumed_log)])
    resumed_steps, _, _ = read_log(resumed_log)
    full_steps, _, _ = read_log(full_log)
    assert [r["step"] for r in resumed_steps] == [4, 5, 6]
    # the same losses at the same steps: same data order, weights and learning rates
    assert [r["loss"] for r in resumed_steps] == [r["loss"] for r in full_steps[3:]]

    full = torch.load(full_checkpoint, weights_only=True)
    resumed = torch.load(part, weights_only=True)
    assert resumed["step"] == full["step"] == 6
    for name, tensor in full["model"].items():
        assert torch.equal(resumed["model"][name], tensor), name
        if tensor.is_floating_point() and name.endswith("weight"):
            assert not torch.equal(halfway["model"][name], tensor), f"{name} never trained"
    for index, state in full["optimizer"]["state"].items():
        assert torch.equal(resumed["optimizer"]["state"][index]["momentum_buffer"],
                           state["momentum_buffer"])


@pytest.mark.multiprocess
def test_resume_refuses_a_checkpoint_of_another_setup(full_allreduce_run, train_script,
                                                      tmp_path):
    _, _, checkpoint = full_allreduce_run
    args = train_script.parse_args(["--hook", "powersgd", "--checkpoint", str(checkpoint),
                                    "--resume"])
    with pytest.raises(ValueError, match=r"hook 'allreduce' \(now 'powersgd'\).*"
                                         r"world size 2 \(now 4\)"):
        train_script.load_checkpoint(args, rank=0, world_size=4)
    args = train_script.parse_args(["--hook", "allreduce", "--checkpoint", str(checkpoint),
                                    "--resume"])
    shared, own = train_script.load_checkpoint(args, rank=1, world_size=2)
    assert shared["step"] == own["step"] == 6 and own["rank"] == 1
    # (--resume itself refuses a missing file up front; --resume-if-present gets here)
    missing = train_script.parse_args(["--checkpoint", str(tmp_path / "none.pt"),
                                       "--resume-if-present"])
    with pytest.raises(FileNotFoundError, match="none.pt does not exist"):
        train_script.load_checkpoint(missing, rank=0, world_size=2)


def test_powersgd_state_round_trips_through_a_weights_only_file(train_script, tmp_path):
    class FakeDDP:
        def register_comm_hook(self, state, hook):
            self.registered = (state, hook)

    args = train_script.parse_args(["--hook", "powersgd", "--warmup-steps", "3"])
    saved = train_script.PowerSGDHook(FakeDDP(), args, torch.device("cpu"))
    saved.state.iter = 7
    saved.state.error_dict[0] = torch.randn(5)
    saved.state.p_memory_dict[1] = torch.randn(4, 2)
    saved.state.total_numel_after_compression = 99
    saved.state.rng.rand(3)  # move the RNG away from its seed
    path = tmp_path / "powersgd.pt"
    torch.save(saved.state_dict(), path)

    restored = train_script.PowerSGDHook(FakeDDP(), args, torch.device("cpu"))
    restored.load_state_dict(torch.load(path, weights_only=True))
    assert restored.state.iter == 7 and restored.state.start_powerSGD_iter == 3
    assert torch.equal(restored.state.error_dict[0], saved.state.error_dict[0])
    assert torch.equal(restored.state.p_memory_dict[1], saved.state.p_memory_dict[1])
    assert restored.stats()["total"]["numel_after_compression"] == 99
    # the projection RNG continues where it was, so every rank draws the same Q next
    assert (restored.state.rng.rand(4) == saved.state.rng.rand(4)).all()


@pytest.mark.multiprocess
def test_powersgd_compresses_on_gloo_without_hanging(tmp_path):
    checkpoint, log = tmp_path / "p.pt", tmp_path / "p.jsonl"
    launch_ok(SYNTHETIC + ["--hook", "powersgd", "--warmup-steps", "2", "--steps", "5",
                           "--checkpoint", str(checkpoint), "--log-file", str(log)])
    state = torch.load(f"{checkpoint}.rank1", weights_only=True)["hook_state"]
    assert state["iter"] == 5 and state["error_dict"]  # compressed steps 3 to 5 ran
    _, _, (summary,) = read_log(log)
    stats = summary["hook_stats"]["total"]
    assert summary["steps"] == 5 and stats["compression_rate"] > 5
    dense_step = 4 * 269_722
    assert summary["bytes_sent"] == 2 * dense_step + 4 * stats["numel_after_compression"]


@pytest.mark.multiprocess
def test_a_resumed_powersgd_run_is_the_uninterrupted_one(tmp_path):
    """Split after compression started: the resumed process's first step runs DDP's
    first-guess bucket (another parameter order than the checkpoint's), and its error
    feedback and warm-start factors must still land on their own parameters."""
    common = SYNTHETIC + ["--hook", "powersgd", "--warmup-steps", "2"]
    whole, part = tmp_path / "whole.pt", tmp_path / "part.pt"
    launch_ok(common + ["--steps", "8", "--checkpoint", str(whole)])
    launch_ok(common + ["--steps", "5", "--checkpoint", str(part)])
    saved = torch.load(f"{part}.rank0", weights_only=True)["hook_state"]
    assert saved["error_dict"] and saved["orders"]  # compressed steps 3 to 5 ran
    launch_ok(common + ["--steps", "8", "--checkpoint", str(part), "--resume"])
    a, b = (torch.load(path, weights_only=True) for path in (whole, part))
    assert a["step"] == b["step"] == 8
    for name, tensor in a["model"].items():
        assert torch.equal(b["model"][name], tensor), (
            name, float((b["model"][name].double() - tensor.double()).abs().max()))


@pytest.mark.multiprocess
def test_each_ranks_own_buffers_survive_a_resume_without_their_broadcast(tmp_path):
    """--no-broadcast-buffers: each rank's BatchNorm statistics are its own; a resumed
    run continues from them, not from rank 0's (the shared file's)."""
    common = SYNTHETIC + ["--hook", "allreduce", "--no-broadcast-buffers"]
    whole, part = tmp_path / "whole.pt", tmp_path / "part.pt"
    launch_ok(common + ["--steps", "6", "--checkpoint", str(whole)])
    launch_ok(common + ["--steps", "3", "--checkpoint", str(part)])
    launch_ok(common + ["--steps", "6", "--checkpoint", str(part), "--resume"])
    for rank in range(2):
        a, b = (torch.load(f"{path}.rank{rank}", weights_only=True)["buffers"]
                for path in (whole, part))
        assert a.keys() == b.keys() and a
        for name, tensor in a.items():
            assert torch.equal(b[name], tensor), (rank, name)
    ranks = [torch.load(f"{whole}.rank{rank}", weights_only=True)["buffers"] for rank in (0, 1)]
    assert any(not torch.equal(ranks[0][n], ranks[1][n]) for n in ranks[0]
               if ranks[0][n].is_floating_point())  # the ranks' statistics do differ


@pytest.mark.multiprocess
def test_omgs_trains_sparsely_and_resumes_its_state(tmp_path):
    checkpoint, log = tmp_path / "o.pt", tmp_path / "o.jsonl"
    # --no-allow-dense: on loopback the plan would send most groups dense
    common = SYNTHETIC + ["--hook", "omgs", "--density", "0.05", "--warmup-steps", "2",
                          "--no-allow-dense", "--checkpoint", str(checkpoint),
                          "--log-file", str(log)]
    output = launch_ok(common + ["--steps", "5"])
    assert "plan history (" in output and "  step " in output
    # the end-of-run summary: the plan in words, the density, the bytes against dense
    assert "omgs_hook after 5 steps: plan" in output
    assert "achieved density after the warm-up" in output and "bytes sent per step" in output
    saved = torch.load(f"{checkpoint}.rank1", weights_only=True)["hook_state"]
    assert saved["step"] == 5 and saved["residuals"]
    launch_ok(common + ["--steps", "8", "--resume"])
    steps, evals, summaries = read_log(log)
    assert [r["step"] for r in steps] == list(range(1, 9))
    assert all(math.isfinite(r["loss"]) for r in steps)
    stats = summaries[-1]["hook_stats"]
    assert stats["step"] == 8 and stats["total"]["steps"] == 8  # counters continued
    # the plan history: logged as it happens, and whole in the summary
    records = [json.loads(line) for line in log.read_text().splitlines()]
    plan_lines = [r for r in records if r.get("event") == "plan"]
    assert plan_lines and all(r["step"] >= 2 for r in plan_lines)
    # the resumed run logs only plans the checkpoint did not have, and one summary in all
    logged = [json.dumps(r["plan_history_entry"], sort_keys=True) for r in plan_lines]
    assert len(logged) == len(set(logged)) and len(summaries) == 1
    history = summaries[-1]["plan_history"]
    assert history and _groups_of(history[-1]) == stats["plan"]["groups"]
    assert stats["plan"] is not None and stats["plan"]["num_groups"] >= 1
    assert stats["plan"]["dense"] == [False] * stats["plan"]["num_groups"]
    assert len(stats["backward_s_per_unit"]) > 1, "bucket_cap_mb=0.1 gives several buckets"
    # 2 dense steps of 4-byte values, then 6 sparse ones at 5 % of 8-byte (value, index)
    dense_step = 4 * 269_722
    total = stats["total"]
    assert summaries[-1]["bytes_sent"] == total["bytes_sent"]
    expected = 2 * dense_step + 6 * 0.1 * dense_step
    assert expected <= total["bytes_sent"] < expected + 0.01 * dense_step


@pytest.mark.multiprocess
def test_a_pinned_plan_is_used(tmp_path):
    """--plan FILE: the run uses that plan (here: one written like omgs-plan's output)."""
    log = tmp_path / "pinned.jsonl"
    # resnet20 with --bucket-cap-mb 0.1 has 9 DDP buckets; pin 3 sparse groups of 3
    plan = {"strategy": "pinned", "groups": [[0, 1, 2], [3, 4, 5], [6, 7, 8]],
            "dense": [False, False, False]}
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(plan))
    launch_ok(SYNTHETIC + ["--hook", "omgs", "--density", "0.05", "--warmup-steps", "2",
                           "--steps", "6", "--plan", str(plan_file), "--log-file", str(log)])
    _, _, (summary,) = read_log(log)
    assert summary["hook_stats"]["plan"]["groups"] == plan["groups"]
    assert summary["hook_stats"]["plan"]["dense"] == plan["dense"]
    assert _groups_of(summary["plan_history"][-1]) == plan["groups"]


@pytest.mark.multiprocess
def test_model_selection_logs_the_hooks_plan_history(tmp_path):
    log = tmp_path / "model.jsonl"
    output = launch_ok(SYNTHETIC + ["--hook", "omgs", "--density", "0.05", "--warmup-steps",
                                    "2", "--steps", "10", "--select", "model",
                                    "--no-allow-dense", "--log-file", str(log)])
    _, _, (summary,) = read_log(log)
    assert summary["plan_history_source"] == "hook" and summary["plan_history"]
    assert "hook_stats" in summary and summary["hook_stats"]["plan_history"] == \
        summary["plan_history"]
    assert "plan history (" in output and "as seen by train.py" not in output


def test_rank_zero_shows_the_hooks_info_log_and_the_others_stay_quiet(train_script, capsys):
    """--hook-log-every: the hook logs at INFO, which Python drops unless shown."""
    import logging

    hook_logger = logging.getLogger("omgs_hook")
    saved = (list(hook_logger.handlers), hook_logger.level, hook_logger.propagate)
    try:
        train_script.show_hook_log(1)
        hook_logger.info("omgs_hook: from rank 1")
        train_script.show_hook_log(0)
        hook_logger.info("omgs_hook: step 100, the log line")
        out = capsys.readouterr().out
        assert "omgs_hook: step 100, the log line" in out
        assert "from rank 1" not in out
    finally:
        hook_logger.handlers[:], hook_logger.level, hook_logger.propagate = (
            saved[0], saved[1], saved[2])


def test_a_checkpoint_into_a_missing_folder_creates_it(train_script, tmp_path):
    path = tmp_path / "new" / "deeper" / "ckpt.pt"
    train_script._replace_with(train_script._write_tmp({"step": 3}, str(path)), str(path))
    assert torch.load(path)["step"] == 3 and not (path.parent / "ckpt.pt.tmp").exists()


# --------------------------------------------------------------------- bad input, resume


def _refused(parse, argv, capsys):
    """parse(argv) must stop with a parser error; its message (stderr)."""
    with pytest.raises(SystemExit) as stopped:
        parse(argv)
    assert stopped.value.code == 2, argv
    return capsys.readouterr().err


def test_bad_files_are_refused_up_front_naming_the_option(train_script, tmp_path, capsys):
    """Paths train.py writes or reads, refused before any process group exists (before,
    these failed with a traceback after set-up - a checkpoint path only after an epoch)."""
    parse = train_script.parse_args
    folder, afile = tmp_path / "adir", tmp_path / "afile"
    folder.mkdir()
    afile.write_text("x")
    truncated = tmp_path / "truncated.json"
    truncated.write_text('{"groups": [[0, 1],')
    for argv, named in (
            (["--log-file", str(folder)], "--log-file: "),
            (["--log-file", str(afile / "run.jsonl")], "--log-file: "),
            (["--checkpoint", str(folder)], "--checkpoint: "),
            (["--checkpoint", str(afile / "sub" / "c.pt")], "--checkpoint: "),
            (["--checkpoint", str(tmp_path / "none.pt"), "--resume"], "--resume: "),
            (["--profile", str(tmp_path / "missing.json")], "--profile: "),
            (["--profile", str(truncated)], "--profile: "),
            (["--profile", str(folder)], "--profile: "),
            (["--plan", str(truncated)], "--plan "),
            (["--hook", "omgs", "--plan", str(afile)], "--plan ")):
        err = _refused(parse, argv, capsys)
        assert named in err and "Traceback" not in err, (argv, err)
    # missing folders of a log or checkpoint are still created when writing
    args = parse(["--log-file", str(tmp_path / "new" / "run.jsonl"),
                  "--checkpoint", str(tmp_path / "new" / "c.pt")])
    assert args.log.endswith("run.jsonl") and not (tmp_path / "new").exists()


def test_bad_values_and_options_of_other_hooks_are_refused(train_script, tmp_path, capsys):
    from omgs_hook.profile_file import SCHEMA_VERSION

    parse = train_script.parse_args
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({
        "schema_version": SCHEMA_VERSION, "world_size": 2, "backend": "gloo", "device": "cpu",
        "comm": {"alpha_s": 2.4e-4, "beta_s_per_byte": 1.1e-9},
        "dense": {"alpha_s": 2.6e-4, "beta_s_per_byte": 6e-10},
        "topk": {"backend": "sampled", "c0": 1e-5, "c1": 2e-9, "c2": 0.0}}))
    for argv, named in (
            (["--topk-backend", "bogus"], "--topk-backend"),
            (["--topk-backend", "cupy"], "--topk-backend cupy needs --device cuda"),
            (["--hook", "allreduce", "--topk-backend", "torch"], "--topk-backend only"),
            (["--hook", "powersgd", "--profile", str(profile)], "--profile only"),
            (["--backend", "bogus"], "--backend"),
            (["--backend", "nccl"], "--backend nccl"),
            (["--min-sparse-numel", "-5"], "--min-sparse-numel: must be >= 0"),
            (["--min-sparse-numel", "64", "--no-allow-dense"], "--min-sparse-numel")):
        err = _refused(parse, argv, capsys)
        assert named in err, (argv, err)
    args = parse(["--hook", "lags", "--topk-backend", "torch", "--profile", str(profile),
                  "--backend", "gloo"])
    assert train_script.hook_options(args)["topk_backend"] == "torch"
    assert train_script.hook_options(args)["profile"] == str(profile)


def test_non_finite_numbers_are_refused_naming_the_option(train_script, capsys):
    """--lr nan (or inf) passed the "must be positive" check (nan <= 0 is False) and the
    run trained to NaN; --weight-decay, --clip-grad-norm and --local-clip-norm likewise
    (the hook refused a NaN local_clip_norm only after the process group was up)."""
    for option in ("--lr", "--weight-decay", "--clip-grad-norm", "--local-clip-norm"):
        for value in ("nan", "inf"):
            err = _refused(train_script.parse_args, [option, value], capsys)
            assert option in err, (option, value, err)


def test_help_shows_no_default_that_the_run_does_not_use(train_script, capsys):
    """--no-dense-groups showed "(default: True)" (store_false's own default), options left
    to the library "(default: None)" after saying so."""
    with pytest.raises(SystemExit):
        train_script.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    start = text.index("--no-dense-groups omgs")
    entry = text[start:text.index("--min-sparse-numel MIN", start)]
    assert "older spelling" in entry and "default" not in entry, entry
    assert "the library's default) (default: None)" not in text
    assert "(default: 0.01)" in text  # the others still show theirs
    # --hook said "(see above)", but --help shows only the docstring's first line
    assert "see above" not in text and "omgs (OMGS" in text and "planned groups" in text
    # --lr said "0.1 for the CNNs", but vgg16's default is 0.05 (MODEL_DEFAULTS)
    for model, defaults in train_script.MODEL_DEFAULTS.items():
        assert f"{float(defaults['lr'])!r} for {model}" in text, model
    assert train_script.parse_args([]).allow_dense is None


def test_steps_beyond_the_schedule_are_named(train_script):
    """--steps 60 with one 44-step epoch ran 44 steps without a word."""
    args = train_script.parse_args(["--epochs", "1", "--steps", "60"])
    assert train_script.schedule_length(args, 44) == (
        44, 44, "--steps 60 > 44 steps of --epochs 1 (44 per epoch): stopping at 44")
    args = train_script.parse_args(["--epochs", "2", "--steps", "60"])
    assert train_script.schedule_length(args, 44) == (88, 60, None)
    assert train_script.schedule_length(train_script.parse_args(["--epochs", "2"]), 44) == \
        (88, 88, None)


def _save_set(path, steps):
    """A checkpoint set in train.py's layout: shared file and rank files of these steps."""
    torch.save({"format": "omgs-hook-train-checkpoint", "version": 1, "step": steps[0],
                "world_size": 2, "model_name": "resnet20", "hook": "allreduce",
                "model": {}, "optimizer": {}}, path)
    for rank, step in enumerate(steps[1:]):
        torch.save({"step": step, "rank": rank, "world_size": 2, "hook": "allreduce",
                    "hook_state": None, "rng_state": torch.get_rng_state()}, f"{path}.rank{rank}")


def test_an_unusable_checkpoint_is_named_in_one_line(train_script, tmp_path):
    checkpoint = tmp_path / "c.pt"
    args = train_script.parse_args(["--hook", "allreduce", "--checkpoint", str(checkpoint),
                                    "--resume-if-present"])
    _save_set(checkpoint, [12, 12, 8])
    with pytest.raises(train_script.ResumeError) as refused:
        train_script.load_checkpoint(args, rank=1, world_size=2)
    message = str(refused.value)
    assert "c.pt.rank1 is from step 8 but" in message and "from step 12" in message
    assert "was written with" not in message  # (it read "was written with c.pt.rank1 is ...")
    rank1 = tmp_path / "c.pt.rank1"
    rank1.write_bytes(rank1.read_bytes()[:100])  # a truncated file
    with pytest.raises(train_script.ResumeError, match=r"cannot read checkpoint file \S*c.pt.rank1"
                       ) as refused:
        train_script.load_checkpoint(args, rank=1, world_size=2)
    assert "\n" not in str(refused.value)


@pytest.mark.multiprocess
def test_a_truncated_checkpoint_stops_the_run_with_one_line(tmp_path):
    checkpoint = tmp_path / "c.pt"
    _save_set(checkpoint, [3, 3])
    checkpoint.write_bytes(checkpoint.read_bytes()[:200])
    returncode, output = launch(FAST + ["--hook", "allreduce", "--checkpoint", str(checkpoint),
                                        "--resume", "--steps", "4"], nproc=None, timeout=60)
    assert returncode == 1, output
    assert f"error: --resume: cannot read checkpoint file {checkpoint}" in output
    assert "Traceback" not in output


def test_a_topology_change_on_resume_says_what_to_do_with_train_py(train_script):
    """The library's advice (register()'s on_world_size_change) is no option of train.py."""
    class Refusing:
        def load_state_dict(self, state):
            raise ValueError(  # the library's message
                "topology: state saved with topology flat, this run has hierarchical: "
                "residuals are per-rank (per-shard with the two-level exchange) error feedback "
                "and cannot be re-split; pass on_world_size_change='reset' to drop them")

    args = train_script.parse_args(["--checkpoint", "c.pt", "--resume-if-present"])
    with pytest.raises(train_script.ResumeError) as refused:
        train_script.load_hook_state(Refusing(), {}, args, rank=1)
    message = str(refused.value)
    assert "on_world_size_change" not in message and "c.pt.rank1" in message
    assert "--topology" in message and "without --resume" in message
    assert "state saved with topology flat, this run has hierarchical" in message


def test_a_failed_save_leaves_no_temporary_file(train_script, tmp_path):
    target = tmp_path / "c.pt"
    target.mkdir()  # os.replace cannot put a file there
    with pytest.raises(OSError):
        train_script._replace_with(train_script._write_tmp({"step": 1}, str(target)),
                                   str(target))
    assert not (tmp_path / "c.pt.tmp").exists()
    blocked = tmp_path / "d.pt"
    (tmp_path / "d.pt.tmp").mkdir()  # torch.save cannot write the temporary file
    with pytest.raises(RuntimeError):
        train_script._write_tmp({"step": 1}, str(blocked))
    assert not blocked.exists()


@pytest.mark.multiprocess
def test_a_save_failing_on_one_rank_keeps_the_previous_checkpoint_set(train_script, tmp_path):
    """Rank 0 used to replace the shared file before rank 1 had written its file: a failed
    save left c.pt at the new step, c.pt.rank1 at the old one, and no resume possible."""
    checkpoint = tmp_path / "c.pt"
    common = FAST + ["--hook", "allreduce", "--checkpoint", str(checkpoint)]
    launch_ok(common + ["--steps", "3"])
    (tmp_path / "c.pt.rank1.tmp").mkdir()  # rank 1's next write fails
    returncode, output = launch(common + ["--steps", "5", "--resume"])
    assert returncode != 0
    args = train_script.parse_args(common + ["--resume-if-present"])
    for rank in (0, 1):
        shared, own = train_script.load_checkpoint(args, rank=rank, world_size=2)
        assert shared["step"] == own["step"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "c.pt", "c.pt.rank0", "c.pt.rank1", "c.pt.rank1.tmp"]  # (the blocking folder)
    assert "(rank 1): error: --checkpoint: the checkpoint of step 5 was not saved" in output
    assert "[rank1]: Traceback" not in output  # (torchrun's own traceback follows)


class _KilledHere(BaseException):
    """Stands for the process being killed (SIGKILL, preemption) at that point."""


def interrupted_save_worker(rank, world_size, checkpoint):
    """Save a checkpoint set of step 1, then one of step 2 during which rank 0 is 'killed'
    right before it puts the shared file in place: every rank file is of step 2 by then,
    the shared file still of step 1. Returns what each rank then resumes from."""
    train_script = _load_script()
    args = train_script.parse_args(["--hook", "allreduce", "--checkpoint", checkpoint,
                                    "--resume-if-present"])
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train_script.save_checkpoint(args, rank, world_size, 1, model, optimizer, None)
    replace = train_script._replace_with

    def killed_before_the_shared_file(tmp, path):
        if path == checkpoint:
            raise _KilledHere()
        replace(tmp, path)

    train_script._replace_with = killed_before_the_shared_file
    try:
        train_script.save_checkpoint(args, rank, world_size, 2, model, optimizer, None)
    except _KilledHere:
        pass  # rank 0: dies here (its process group goes with it)
    except RuntimeError:
        pass  # rank 1: the final barrier fails when rank 0 is gone
    if rank == 1:
        # the relaunch reads the files only once the dead rank is gone
        time.sleep(0.5)
    try:
        shared, own = train_script.load_checkpoint(args, rank, world_size)
    except train_script.TrainError as error:
        return str(error)
    return shared["step"], own["step"]


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_kill_between_the_rank_files_and_the_shared_file_keeps_a_set_to_resume(tmp_path):
    """A save puts the rank files of the new step in place first and the shared file last
    (its step says which set is whole). A rank killed between the two used to leave the
    new rank files beside the old shared file: the previous set's rank files were gone,
    and every relaunch stopped with "the checkpoint set is incomplete" - the whole run
    lost. The previous rank file is kept until the new set is whole."""
    checkpoint = str(tmp_path / "c.pt")
    results = run_ranks("test_train_script", "interrupted_save_worker", world_size=2,
                        timeout=50, pg_timeout_s=5, checkpoint=checkpoint)
    assert results == [(1, 1), (1, 1)], results
    # the set is whole again: a second resume reads step 1 without falling back
    train_script = _load_script()
    args = train_script.parse_args(["--hook", "allreduce", "--checkpoint", checkpoint])
    for rank in (0, 1):
        shared, own = train_script.load_checkpoint(args, rank=rank, world_size=2)
        assert shared["step"] == own["step"] == 1


def test_a_resumed_log_is_cut_back_to_the_checkpoint(train_script, tmp_path):
    log = tmp_path / "run.jsonl"
    records = [{"step": s, "epoch": 0, "loss": 1.0} for s in (1, 2, 3, 4)]
    records[2:2] = [{"event": "plan", "step": 2, "plan_history_entry": {"step": 2}}]
    records.append({"epoch": 0, "step": 4, "test_accuracy": 0.5, "test_loss": 1.0})
    records.append({"summary": True, "steps": 4})
    log.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 5, "lo')
    train_script.JsonLog(str(log), True, resume_step=3).close()
    assert [json.loads(line) for line in log.read_text().splitlines()] == records[:4]
    train_script.JsonLog(str(log), True, resume_step=None).close()  # a fresh run
    assert log.read_text() == ""


def test_plans_the_checkpoint_had_are_not_logged_again(train_script):
    hook = _FakeHook(with_history=True)
    hook.use(2, [[0, 1, 2]])
    hook.use(5, [[0], [1, 2]])
    history = train_script.PlanHistory(hook)
    history.resumed({"plan_history": list(hook.history)})  # the loaded hook state's
    assert history.poll(6) == [] and len(history.entries) == 2
    hook.use(7, [[0, 1], [2]])
    assert [e["step"] for e in history.poll(7)] == [7]


@pytest.mark.multiprocess
def test_an_elastic_restart_logs_every_step_once(tmp_path):
    """torchrun --max-restarts: the relaunch resumes from step 4; the first attempt had
    logged steps 5 and 6 too, which were then logged again."""
    checkpoint, log = tmp_path / "e.pt", tmp_path / "e.jsonl"
    returncode, output = launch(FAST + ["--hook", "allreduce", "--steps", "10",
                                        "--checkpoint", str(checkpoint), "--checkpoint-every",
                                        "4", "--fail-at-step", "6", "--resume-if-present",
                                        "--log-file", str(log)],
                                torchrun_args=["--max-restarts=1"])
    assert returncode == 0, output[-6000:]
    assert "fails on purpose after step 6" in output
    steps, evals, summaries = read_log(log)
    assert [r["step"] for r in steps] == list(range(1, 11))
    assert [r["step"] for r in evals] == [10] and len(summaries) == 1


def test_a_resumed_launch_leaves_out_ddps_set_up_iterations(train_script):
    # every launch builds a new DDP model, whose first iteration (one bucket) and bucket
    # rebuild run slow; docs/training.md: the summary leaves out the first steps of the
    # launch. A launch resumed at step 15 timed them (its first step 89 ms against 55).
    args = train_script.parse_args(["--hook", "allreduce"])
    times = [0.9, 0.5] + [0.1] * 8
    summary = train_script.summarise(args, 1, 15, 25, times, (0, 0.5, 0.9), None,
                                     torch.nn.Linear(2, 2))
    assert summary["timed_steps"] == 8
    assert summary["mean_iter_s"] == pytest.approx(0.1)
    # a fresh launch still leaves out max(2, --warmup-steps)
    fresh = train_script.summarise(args, 1, 0, 10, times, (0, 0.5, 0.9), None,
                                   torch.nn.Linear(2, 2))
    assert fresh["timed_steps"] == 5
