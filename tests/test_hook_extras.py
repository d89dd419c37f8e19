"""The hook's extras under real DDP (2 gloo ranks): local gradient clipping, the
error-feedback health and staleness figures, summary() and plot_timeline()."""

import gc
import math
import re

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import omgs_hook
from ddp_harness import run_ranks
from test_hook_ddp import Net, batch, gather, loss_fn, train_steps

pytestmark = pytest.mark.multiprocess


def clip_worker(rank, world_size, clip, scale=1.0):
    torch.manual_seed(0)
    model, reference = Net(), Net()
    reference.load_state_dict(model.state_dict())
    ddp = DDP(model, bucket_cap_mb=0)
    state = omgs_hook.register(ddp, density=0.05, strategy="layerwise", allow_dense=False,
                               select="model", warmup_steps=1, local_clip_norm=clip)
    x, y = batch(0, rank)
    (loss_fn(reference(x), y) * scale).backward()
    local = {n: p.grad.reshape(-1).clone() for n, p in reference.named_parameters()}
    (loss_fn(ddp(x), y) * scale).backward()  # step 0: the dense warm-up, one bucket of everything
    got = {n: p.grad.reshape(-1).clone() for n, p in model.named_parameters()}
    keys = state.stats()["last"]["group_keys"]
    all_local = gather(local, world_size)
    total = sum(v.numel() for v in local.values())
    expected = {}
    for group in keys:  # each rank's group scaled to norm <= clip * sqrt(D/N) / sqrt(W)
        numel = sum(local[k].numel() for k in group)
        threshold = clip * math.sqrt(numel / total) / math.sqrt(world_size)
        summed = {k: torch.zeros_like(local[k], dtype=torch.float64) for k in group}
        for r in range(world_size):
            norm = math.sqrt(sum(float(all_local[r][k].double().square().sum()) for k in group))
            factor = min(1.0, threshold / norm)
            for k in group:
                summed[k] += all_local[r][k].double() * factor
        expected.update({k: v / world_size for k, v in summed.items()})
    worst = max(float((got[k].double() - expected[k]).abs().max()) for k in got)
    norm = math.sqrt(sum(float(v.double().square().sum()) for v in got.values()))
    state.close()
    del ddp
    gc.collect()
    return worst, norm


@pytest.mark.timeout(120)
@pytest.mark.parametrize("clip", [1e-3, 1e9])
def test_local_clipping_scales_each_ranks_gradient_before_it_is_averaged(clip):
    for worst, norm in run_ranks("test_hook_extras", "clip_worker", world_size=2, timeout=100,
                                 clip=clip):
        assert worst < 1e-7
        if clip < 1:  # clipped: the average's norm is bounded by clip / sqrt(W)
            assert norm <= clip / math.sqrt(2) * (1 + 1e-5)


@pytest.mark.timeout(120)
def test_local_clipping_clips_a_huge_finite_gradient_instead_of_dropping_it():
    """Gradients of about 1e20 (finite, norm far below fp32's 3.4e38) are clipped to the
    threshold like any other. Their fp32 sum of squares overflows: the clip factor was
    threshold / inf = 0, and the whole gradient was dropped, residual included."""
    for worst, norm in run_ranks("test_hook_extras", "clip_worker", world_size=2, timeout=100,
                                 clip=1.0, scale=1e20):
        assert worst < 1e-7
        assert 0.01 < norm <= 1.0 / math.sqrt(2) * (1 + 1e-5)


def extras_worker(rank, world_size, png):
    torch.manual_seed(0)
    model = Net()
    ddp = DDP(model, bucket_cap_mb=0)
    state = omgs_hook.register(ddp, density=0.05, strategy="layerwise", allow_dense=False,
                               select="model", warmup_steps=1, track_staleness=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with pytest.raises(RuntimeError, match="no planned"):
        state.plot_timeline(png)
    before = state.summary()
    for step in range(21):  # health is measured at steps 0, 10, 20 (step 20 is the last)
        x, y = batch(step, rank)
        opt.zero_grad()
        loss_fn(ddp(x), y).backward()
        opt.step()
    s = state.stats()
    health, staleness = s["error_feedback"], s["staleness"]
    residual_now = state.memory.total_norm()
    text = state.summary()
    if rank == 0:
        state.plot_timeline(png)
    state.close()
    del ddp
    gc.collect()
    return (before, health, staleness, residual_now, text, s["last"]["groups"],
            s["plan_history"][-1]["step"])


@pytest.mark.timeout(120)
def test_health_staleness_summary_and_timeline_plot(tmp_path):
    png = tmp_path / "timeline.png"
    results = run_ranks("test_hook_extras", "extras_worker", world_size=2, timeout=100,
                        png=str(png))
    for before, health, staleness, residual_now, text, groups, since in results:
        assert "no plan yet" in before
        assert health["step"] == 21
        assert health["residual_norm"] == pytest.approx(residual_now, rel=1e-5)
        assert health["residual_to_gradient"] == pytest.approx(
            health["residual_norm"] / health["gradient_norm"])
        assert health["residual_to_gradient"] > 0
        assert staleness["step"] == 21 and len(staleness["groups"]) == groups
        # density 0.05: most entries wait; none can be older than the sparse steps run
        assert all(1 <= g["max"] <= 21 and 0 < g["mean"] < g["max"] for g in staleness["groups"])
        assert f"{groups} groups" in text and "group 0:" in text and "sparse" in text
        assert "dense not allowed" in text and "achieved density" in text
        assert "bytes sent per step" in text and "predicted" in text
        assert re.search(r"\(the prediction (\d+% (low|high)|within 0\.5%)\)", text), text
        # since the plan went into use (its plan_history entry), not its last re-plan
        assert f"in use since step {since}" in text, text
    assert png.read_bytes()[:4] == b"\x89PNG"


def moduleless_plot_worker(rank, world_size, png):
    torch.manual_seed(0)
    model = Net()
    ddp = DDP(model, bucket_cap_mb=0)
    state = omgs_hook.OMGSState(density=0.05, strategy="single", allow_dense=False,
                                select="model", warmup_steps=1)
    ddp.register_comm_hook(state, omgs_hook.omgs_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    train_steps(ddp, opt, 0, 6, rank)
    try:
        state.plot_timeline(png)
        message = None
    except RuntimeError as error:
        message = str(error)
    planned = state.stats()["plan"] is not None
    state.close()
    del ddp
    gc.collect()
    return message, planned


@pytest.mark.timeout(120)
def test_a_timeline_without_the_module_says_what_it_needs(tmp_path):
    """A state built without ``module`` (registered with ddp.register_comm_hook) has no
    forward timing: after planned steps the plot names what is missing instead of
    claiming there was no measured step."""
    for message, planned in run_ranks("test_hook_extras", "moduleless_plot_worker",
                                      world_size=2, timeout=100, png=str(tmp_path / "t.png")):
        assert planned
        assert message is not None and "module=" in message and "no planned" not in message
    assert not (tmp_path / "t.png").exists()


def coarse_warning_worker(rank, world_size, warmup_steps, bucket_cap_mb, static_graph=False,
                          steps=6):
    import warnings

    torch.manual_seed(0)
    model = Net()
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb, static_graph=static_graph)
    state = omgs_hook.register(ddp, density=0.05, allow_dense=False, select="model",
                               warmup_steps=warmup_steps, min_sparse_numel=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_steps(ddp, opt, 0, steps, rank)
    state.close()
    del ddp
    gc.collect()
    return [str(w.message) for w in caught if "bucket_cap_mb" in str(w.message)]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("warmup_steps", [0, 1])
def test_the_coarse_bucket_warning_waits_for_ddps_rebuilt_buckets(warmup_steps):
    """DDP's first step runs its first guess of the buckets (one bucket for a small model)
    and rebuilds them after it: a plan made from that step must not tell the user to
    shrink a bucket_cap_mb that is fine, while a cap that is really too coarse is still
    named once the rebuilt layout is planned."""
    fine = run_ranks("test_hook_extras", "coarse_warning_worker", world_size=2, timeout=150,
                     warmup_steps=warmup_steps, bucket_cap_mb=0)
    for messages in fine:
        assert messages == []
    coarse = run_ranks("test_hook_extras", "coarse_warning_worker", world_size=2, timeout=150,
                       warmup_steps=warmup_steps, bucket_cap_mb=25)
    for messages in coarse:
        assert len(messages) == 1 and "holds 100% of the gradient" in messages[0]


@pytest.mark.timeout(180)
def test_the_coarse_bucket_warning_waits_for_static_graphs_later_rebuild():
    """With static_graph=True DDP runs its first guess of the buckets for two steps and
    rebuilds them after the second: a plan made from that second step (warmup_steps=2)
    must not tell the user to shrink bucket_cap_mb=0 either (found by an outside sweep:
    it did), while a cap that is really too coarse is still named."""
    fine = run_ranks("test_hook_extras", "coarse_warning_worker", world_size=2, timeout=150,
                     warmup_steps=2, bucket_cap_mb=0, static_graph=True, steps=12)
    for messages in fine:
        assert messages == []
    coarse = run_ranks("test_hook_extras", "coarse_warning_worker", world_size=2, timeout=150,
                       warmup_steps=2, bucket_cap_mb=25, static_graph=True, steps=12)
    for messages in coarse:
        assert len(messages) == 1 and "holds 100% of the gradient" in messages[0]


def _single_group_run(lr):
    """Net under DDP with the hook's one sparse group (TopK-SGD), and its optimizer."""
    torch.manual_seed(0)
    model = Net()
    ddp = DDP(model, bucket_cap_mb=0)
    state = omgs_hook.register(ddp, density=0.05, strategy="single", allow_dense=False,
                               select="model", warmup_steps=1)
    return model, ddp, state, torch.optim.SGD(model.parameters(), lr=lr)


def closed_worker(rank, world_size):
    model, ddp, state, opt = _single_group_run(lr=0.05)
    train_steps(ddp, opt, 0, 3, rank)
    state.close()
    steps = state.stats()["total"]["steps"]  # the reports still work
    x, y = batch(3, rank)
    try:
        loss_fn(ddp(x), y).backward()
        message = None
    except RuntimeError as error:
        message = str(error)
    del ddp
    gc.collect()
    return steps, message


@pytest.mark.timeout(120)
def test_training_on_after_close_fails_at_once_and_says_why():
    for steps, message in run_ranks("test_hook_extras", "closed_worker", world_size=2,
                                    timeout=100):
        assert steps == 3
        assert message is not None and "was closed" in message, message


def freed_worker(rank, world_size, options):
    """Train a few steps (a trial included with the default options), drop the model,
    the state and the optimizer with the cycle collector off: reference counting alone
    must free the state and so stop its planner thread."""
    import threading
    import weakref

    torch.manual_seed(0)
    model = Net()
    ddp = DDP(model, bucket_cap_mb=0)
    state = omgs_hook.register(ddp, density=0.05, **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    train_steps(ddp, opt, 0, 12, rank)
    planner_threads = [t for t in threading.enumerate() if t.name.startswith("omgs-planner")]
    gone = weakref.ref(state)
    gc.collect()
    gc.disable()
    try:
        del ddp, state, model, opt
        freed = gone() is None
    finally:
        gc.enable()
    for thread in planner_threads:
        thread.join(timeout=10)
    return freed, len(planner_threads), sum(t.is_alive() for t in planner_threads)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("options", [{}, {"select": "model", "warmup_steps": 1}],
                         ids=["default", "model"])
def test_a_dropped_state_is_freed_without_the_cycle_collector(options):
    # a sweep that builds models in one process would otherwise keep a planner thread
    # (and the state's buffers) per model until Python's cycle collector ran
    for freed, threads, alive in run_ranks("test_hook_extras", "freed_worker", world_size=2,
                                           timeout=120, options=options):
        assert threads >= 1  # the planner thread existed, so its stopping is checked
        assert freed, "the state sits in a reference cycle"
        assert alive == 0


def test_bad_extra_options_name_the_option():
    with pytest.raises(ValueError, match="local_clip_norm"):
        omgs_hook.OMGSState(local_clip_norm=-1.0, module=torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="local_clip_norm needs the module"):
        omgs_hook.OMGSState(local_clip_norm=1.0)
    with pytest.raises(ValueError, match="track_staleness"):
        omgs_hook.OMGSState(track_staleness="yes")
    state = omgs_hook.OMGSState()
    assert state.local_clip_norm is None and state.track_staleness is False


def test_the_summary_of_a_dense_run_does_not_wait_for_a_plan():
    """At density 1 every step is a dense all-reduce: the summary says so rather than
    reporting a dense warm-up that never ends and an achieved density of 0."""
    text = omgs_hook.OMGSState(density=1.0, warmup_steps=3).summary()
    assert "density 1" in text and "nothing is planned" in text
    assert "warm-up" not in text and "achieved density" not in text
    sparse = omgs_hook.OMGSState(density=0.01, warmup_steps=3).summary()
    assert "no plan yet (dense warm-up of 3 steps)" in sparse and "achieved density" in sparse


def test_the_summary_past_the_warm_up_without_a_plan_does_not_report_a_warm_up():
    """Past the warm-up with no plan in use (the first one being made, or a load that
    dropped the checkpoint's plan: other options, or a layer frozen since), the summary
    said "no plan yet (dense warm-up of 3 steps)" at step 7, while each step went out as
    one sparse group."""
    state = omgs_hook.OMGSState(density=0.01, warmup_steps=3)
    state.step = 7  # (where a load of a step-7 checkpoint whose plan was dropped leaves it)
    text = state.summary()
    assert "dense warm-up of" not in text and "no plan in use yet" in text, text
    assert "one sparse group" in text, text


def test_the_summary_says_more_or_as_much_when_sparse_saves_nothing():
    """The summary printed "(1.0x less)" for a step that sent as much as a dense one and
    "(0.5x less)" for one that sent twice as much (a high density: an index per value)."""
    from omgs_hook.hook import _saving

    assert _saving(1_000, 12_300) == "12.3x less"
    assert _saving(1_000, 1_000) == "as much"
    assert _saving(2_000, 1_000) == "2.0x more"
    assert _saving(1_000, 1_020) == "as much"  # 1.02x reads 1.0x: not "1.0x less"
    assert _saving(0, 1_000) == "nothing sent"


def eval_forward_worker(rank, world_size):
    import time

    model, ddp, state, opt = _single_group_run(lr=0.01)
    measured = []
    for step in range(4):
        x, y = batch(step, rank)
        loss = loss_fn(ddp(x), y)
        time.sleep(0.2)  # a training step of at least 0.2 s
        loss.backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():  # a quick evaluation of two batches after each step
            model.eval()
            model(x)
            model(x)
            model.train()
        measured.append(state.stats()["measured_iteration_s"])
    state.close()
    del ddp
    gc.collect()
    return measured


@pytest.mark.timeout(120)
def test_an_evaluation_forward_is_not_timed_as_an_iteration():
    for measured in run_ranks("test_hook_extras", "eval_forward_worker", world_size=2,
                              timeout=100):
        # forward start to forward start of training steps (>= 0.2 s each); timing the
        # evaluation's forwards would report the gap between its two batches (~ms)
        later = [m for m in measured[1:] if m is not None]
        assert later and all(m >= 0.2 for m in later), measured
