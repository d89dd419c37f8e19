"""Error feedback under a loss-scaling ``torch.amp.GradScaler`` (2 gloo ranks, CPU).

The hook sees gradients multiplied by the loss scale, and keeps its residuals in those
units. With ``grad_scaler=`` it rescales them when the scale moves (halved after an
overflow, doubled after ``growth_interval`` good steps), and ``local_clip_norm`` applies
to the unscaled gradient. The scales here are powers of two, so scaling is exact in
fp32: a run with the scaler must give, after ``unscale_``, the gradients of the same run
without one (which skips the same overflowing step by hand) to the last bit.
"""

import gc

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import omgs_hook
from ddp_harness import run_ranks

pytestmark = pytest.mark.multiprocess

OVERFLOW_STEP = 6  # rank 1's loss is inf: every rank's gradient turns non-finite


def _build(use_scaler, clip):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    ddp = DDP(model, bucket_cap_mb=0)
    scaler = (torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)
              if use_scaler else None)
    state = omgs_hook.register(ddp, density=0.02, warmup_steps=1, select="model",
                               allow_dense=False, log_every=0, local_clip_norm=clip,
                               grad_scaler=scaler)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    return model, ddp, scaler, state, opt


def scaler_worker(rank, world_size, use_scaler, clip, steps=14, resume_at=None):
    """``resume_at``: checkpoint after that many steps (model, optimizer, scaler, hook)
    and go on in a new DDP model and hook state built from it."""
    model, ddp, scaler, state, opt = _build(use_scaler, clip)
    grads, scales = [], []
    for step in range(steps):
        if step == resume_at:
            saved = {"model": model.state_dict(), "opt": opt.state_dict(),
                     "scaler": scaler.state_dict(), "hook": state.state_dict()}
            state.close()
            del ddp
            gc.collect()
            model, ddp, scaler, state, opt = _build(use_scaler, clip)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            scaler.load_state_dict(saved["scaler"])
            state.load_state_dict(saved["hook"])
        g = torch.Generator().manual_seed(step * 10 + rank)
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(x), y)
        if step == OVERFLOW_STEP and rank == 1:
            loss = loss * float("inf")
        if scaler is not None:
            scales.append(scaler.get_scale())
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
        else:
            loss.backward()
        finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone()
                     if finite else None)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        elif finite:
            opt.step()
    saved = state.state_dict()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    state.close()
    del ddp
    gc.collect()
    return {"grads": grads, "scales": scales, "params": params,
            "residual_scale": saved["residual_scale"]}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("clip", [None, 0.05])
def test_a_grad_scaler_changes_nothing_but_the_units(clip):
    plain = run_ranks("test_grad_scaler", "scaler_worker", world_size=2, timeout=200,
                      use_scaler=False, clip=clip)
    scaled = run_ranks("test_grad_scaler", "scaler_worker", world_size=2, timeout=200,
                       use_scaler=True, clip=clip)
    for a, b in zip(plain, scaled):
        scales = b["scales"]
        # the scale grew and was halved by the overflow: residuals at other scales met
        assert any(s2 > s1 for s1, s2 in zip(scales, scales[1:]))
        assert scales[OVERFLOW_STEP + 1] == scales[OVERFLOW_STEP] / 2
        assert b["residual_scale"] == scales[-1] and a["residual_scale"] is None
        assert [g is None for g in a["grads"]] == [g is None for g in b["grads"]]
        assert a["grads"][OVERFLOW_STEP] is None
        for step, (ga, gb) in enumerate(zip(a["grads"], b["grads"])):
            if ga is not None:
                assert torch.equal(ga, gb), (step, float((ga - gb).abs().max()))
        assert torch.equal(a["params"], b["params"])


def test_grad_scaler_must_have_a_scale():
    with pytest.raises(ValueError, match="grad_scaler must be a torch.amp.GradScaler"):
        omgs_hook.OMGSState(grad_scaler=2.0 ** 16)


@pytest.mark.timeout(240)
def test_a_resumed_scaled_run_is_the_uninterrupted_one():
    """Saved after the overflow (the residuals at a scale the scaler has moved from by
    the time it is restored), resumed in a new model and hook: bit-identical."""
    whole = run_ranks("test_grad_scaler", "scaler_worker", world_size=2, timeout=200,
                      use_scaler=True, clip=None)
    resumed = run_ranks("test_grad_scaler", "scaler_worker", world_size=2, timeout=200,
                        use_scaler=True, clip=None, resume_at=OVERFLOW_STEP + 1)
    for a, b in zip(whole, resumed):
        assert a["scales"] == b["scales"]
        assert torch.equal(a["params"], b["params"])
        for ga, gb in zip(a["grads"], b["grads"]):
            assert (ga is None and gb is None) or torch.equal(ga, gb)


def unscaled_rewind_worker(rank, world_size):
    """A GAN-like loop under a scaler (residuals at scale 1024), saved after the
    generator-side backward (``residuals_before_last_step`` present), then the
    discriminator's next forward decides the rewind: uninterrupted with the scaler, and
    resumed without one. Returns both runs' residuals after that forward, unscaled."""
    options = dict(density=0.1, strategy="single", select="model", allow_dense=False,
                   warmup_steps=0, log_every=0)

    def build(use_scaler):
        torch.manual_seed(0)
        disc = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        ddp = DDP(disc, bucket_cap_mb=0)
        scaler = (torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000)
                  if use_scaler else None)
        state = omgs_hook.register(ddp, grad_scaler=scaler, **options)
        return disc, ddp, scaler, state, torch.optim.SGD(disc.parameters(), lr=0.05)

    disc, ddp, scaler, state, opt = build(True)
    g = torch.Generator().manual_seed(rank + 1)
    for _ in range(3):
        opt.zero_grad()
        scaler.scale(ddp(torch.randn(6, 8, generator=g)).pow(2).mean()).backward()
        scaler.step(opt)
        scaler.update()
        # the generator's step: a backward through the discriminator, never applied
        scaler.scale((ddp(torch.randn(6, 8, generator=g)) - 1).pow(2).mean()).backward()
    saved = state.state_dict()
    assert saved["residual_scale"] == 2.0 ** 10
    assert saved["residuals_before_last_step"] is not None
    model = {k: v.clone() for k, v in disc.state_dict().items()}
    x = torch.randn(6, 8, generator=g)
    opt.zero_grad()
    ddp(x)  # the discriminator's next forward: the generator step is rewound
    whole = {k: v / 2.0 ** 10 for k, v in state.state_dict()["residuals"].items()}
    state.close()

    disc, ddp, _, state, opt = build(False)
    disc.load_state_dict(model)
    state.load_state_dict(saved)  # no scaler: the residuals come back unscaled
    opt.zero_grad()
    ddp(x)
    resumed = state.state_dict()
    state.close()
    return {"whole": whole, "resumed": resumed["residuals"],
            "residual_scale": resumed["residual_scale"]}


@pytest.mark.timeout(120)
def test_a_rewind_after_resuming_without_the_scaler_is_in_unscaled_units():
    """The residuals from before the checkpoint's last step were restored at the saved
    loss scale while the residuals themselves were brought to unscaled units: the
    rewound residual was then applied 1024 times too large."""
    for r in run_ranks("test_grad_scaler", "unscaled_rewind_worker", world_size=2,
                       timeout=100):
        assert r["residual_scale"] is None
        assert set(r["whole"]) == set(r["resumed"]) and r["whole"]
        for key, expected in r["whole"].items():
            assert torch.equal(r["resumed"][key], expected), (
                key, float(r["resumed"][key].abs().max() / expected.abs().max()))


def no_sync_gan_worker(rank, world_size, through_ddp):
    """A GAN under AMP with the documented way to keep the generator step's gradient out
    of the discriminator's hook: that backward under ``ddp.no_sync()``
    (``through_ddp``), against the same loop whose generator loss goes through a plain
    copy of the discriminator (the hook never sees it). One scaler, doubling its scale
    every step (``growth_interval=1``), updated after each of the two optimizer steps."""
    torch.manual_seed(0)
    disc = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    ddp = DDP(disc, bucket_cap_mb=0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1)
    state = omgs_hook.register(ddp, density=0.1, strategy="single", select="model",
                               allow_dense=False, warmup_steps=0, log_every=0,
                               grad_scaler=scaler)
    opt = torch.optim.SGD(disc.parameters(), lr=0.05, momentum=0.9)
    gen = nn.Linear(8, 8)
    gen_opt = torch.optim.SGD(gen.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank + 1)
    for _ in range(8):
        opt.zero_grad()
        scaler.scale(ddp(torch.randn(6, 8, generator=g)).pow(2).mean()).backward()
        scaler.step(opt)
        scaler.update()
        gen_opt.zero_grad()
        fake = gen(torch.randn(6, 8, generator=g))
        if through_ddp:
            with ddp.no_sync():
                scaler.scale((ddp(fake) - 1).pow(2).mean()).backward()
        else:
            copy = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
            copy.load_state_dict(disc.state_dict())
            copy.requires_grad_(False)
            scaler.scale((copy(fake) - 1).pow(2).mean()).backward()
        scaler.step(gen_opt)
        scaler.update()
    saved = state.state_dict()
    state.close()
    return {"params": [p.detach().clone() for p in disc.parameters()],
            "residuals": saved["residuals"], "scale": saved["residual_scale"]}


@pytest.mark.timeout(120)
def test_a_forward_under_no_sync_does_not_leave_its_loss_scale_to_the_next_step():
    """The hook reads the loss scale at a step's first forward and takes it at bucket 0.
    A forward whose backward ran under no_sync() never reached bucket 0, so its reading
    stayed: the next step took it although scaler.update() had doubled the scale since,
    and its residuals were kept at half their units (2 ranks, 8 iterations: residuals
    0.09 apart, of norm 0.25; parameters 0.011 apart). The reading is refreshed when the
    scaler's scale moved."""
    synced = run_ranks("test_grad_scaler", "no_sync_gan_worker", world_size=2, timeout=100,
                       through_ddp=True)
    apart = run_ranks("test_grad_scaler", "no_sync_gan_worker", world_size=2, timeout=100,
                      through_ddp=False)
    for a, b in zip(synced, apart):
        assert a["scale"] == b["scale"]
        assert set(a["residuals"]) == set(b["residuals"])
        for key in a["residuals"]:
            assert torch.equal(a["residuals"][key], b["residuals"][key]), key
        assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
