"""A step whose gradient is thrown away, not applied (``on_unapplied``).

A GAN's generator step runs backward through the discriminator; the discriminator's
gradients are then cleared by its next ``zero_grad()`` without an optimizer step. Plain
DDP drops them. With error feedback their unsent part would stay in the residual and be
applied later, in the discriminator's own steps. The hook rewinds such a step's
residual update at the module's next forward (2 gloo ranks)."""

import warnings

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import omgs_hook
from omgs_hook.hook import UNAPPLIED_STREAK_LIMIT, OMGSState
from ddp_harness import run_ranks

# deterministic plans: one sparse group, no trial, no dense warm-up
SPARSE = dict(density=0.1, strategy="single", select="model", allow_dense=False,
              warmup_steps=0)


def _disc():
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _residuals(state):
    return {k: v.clone() for k, v in state.state_dict()["residuals"].items()}


def _equal(a, b):
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def gan_worker(rank, world_size, mode, iterations=8, two_level=False, set_to_none=True,
               fused=False):
    """``mode``: "rewind", "keep" (on_unapplied) or "nosync" (the generator-side backward
    under ``no_sync``, so the hook never sees it: the reference for "rewind")."""
    torch.manual_seed(0)
    disc = _disc()
    ddp = DDP(disc, bucket_cap_mb=0)
    options = dict(SPARSE, on_unapplied="keep" if mode == "keep" else "rewind")
    if two_level:  # shard stores instead of group buffers: the same rewind
        # pinned, so that the first plan goes into use at the same iteration in every
        # mode (the two-level exchange's switch from the first step's group to the plan
        # moves residuals between shards, which changes the math)
        options.update(topology="hierarchical", ranks_per_node=2,
                       plan={"groups": [[0, 1, 2, 3]]})
    state = omgs_hook.register(ddp, **options)
    # fused: updates the parameters in place without moving their versions
    opt = torch.optim.SGD(disc.parameters(), lr=0.05, momentum=0.9, fused=fused or None)
    g = torch.Generator().manual_seed(rank + 1)
    restored, moved = [], []
    after_d = None
    for it in range(iterations):
        opt.zero_grad(set_to_none=set_to_none)
        x = torch.randn(6, 8, generator=g)
        out = ddp(x)  # the forward that decides: rewind the last step or not
        if after_d is not None:
            now = _residuals(state)
            restored.append(_equal(now, after_d))
            moved.append(not _equal(now, after_g))
        out.pow(2).mean().backward()
        opt.step()
        after_d = _residuals(state)
        # the "generator step": backward through the discriminator, its gradient unused
        y = torch.randn(6, 8, generator=g)
        if mode == "nosync":
            with ddp.no_sync():
                (ddp(y) - 1).pow(2).mean().backward()
        else:
            (ddp(y) - 1).pow(2).mean().backward()
        after_g = _residuals(state)
    params = torch.cat([p.detach().reshape(-1) for p in disc.parameters()])
    total = state.stats()["total"]
    state.close()
    return {"params": params, "restored": restored, "moved": moved,
            "rewound": total["rewound_steps"], "residual_keys": len(after_d)}


def test_a_discarded_discriminator_step_is_rewound_as_if_it_never_reached_the_hook():
    rewind = run_ranks("test_unapplied", "gan_worker", world_size=2, timeout=100, mode="rewind")
    keep = run_ranks("test_unapplied", "gan_worker", world_size=2, timeout=100, mode="keep")
    nosync = run_ranks("test_unapplied", "gan_worker", world_size=2, timeout=100, mode="nosync")
    for r in range(2):
        assert rewind[r]["residual_keys"] > 0  # the sparse path ran
        # at every next forward the residuals are bit for bit those after the D step
        assert all(rewind[r]["restored"]) and all(rewind[r]["moved"])
        assert rewind[r]["rewound"] == 7  # the last generator step meets no next forward
        # ... so the training equals the one whose generator-side backward never
        # reached the hook (the same plans: one group, planned from no timing)
        assert torch.equal(rewind[r]["params"], nosync[r]["params"])
        # with "keep" the discarded gradient stays in the residual and moves the model
        assert not any(keep[r]["restored"]) and keep[r]["rewound"] == 0
        assert not torch.equal(keep[r]["params"], nosync[r]["params"])
    assert torch.equal(rewind[0]["params"], rewind[1]["params"])


def test_gradients_zeroed_in_place_count_as_cleared():
    kwargs = dict(world_size=2, timeout=100, set_to_none=False)
    rewind = run_ranks("test_unapplied", "gan_worker", mode="rewind", **kwargs)
    nosync = run_ranks("test_unapplied", "gan_worker", mode="nosync", **kwargs)
    for r in range(2):
        assert all(rewind[r]["restored"]) and rewind[r]["rewound"] == 7
        assert torch.equal(rewind[r]["params"], nosync[r]["params"])


@pytest.mark.timeout(150)
def test_a_fused_optimizers_steps_count_as_applied_and_the_discarded_step_still_rewinds():
    """Fused optimizers (SGD/Adam fused=True) update the parameters without moving their
    versions; their steps are seen through torch.optim's step hook instead. A step no
    optimizer applied (the generator's) is still rewound."""
    kwargs = dict(world_size=2, timeout=100, fused=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no streak warning either
        rewind = run_ranks("test_unapplied", "gan_worker", mode="rewind", **kwargs)
    nosync = run_ranks("test_unapplied", "gan_worker", mode="nosync", **kwargs)
    for r in range(2):
        assert all(rewind[r]["restored"]) and all(rewind[r]["moved"])
        assert rewind[r]["rewound"] == 7  # the generator steps only, as with plain SGD
        assert torch.equal(rewind[r]["params"], nosync[r]["params"])


def fused_training_worker(rank, world_size, optimizer):
    """Ordinary training with a fused optimizer: no step is discarded. Before the step
    hook, every step looked discarded here (gradients cleared, no version moved): three
    were rewound, then rewinding was turned off with a warning."""
    torch.manual_seed(0)
    disc = _disc()
    ddp = DDP(disc, bucket_cap_mb=0)
    state = omgs_hook.register(ddp, **SPARSE)
    make = {"sgd": lambda p: torch.optim.SGD(p, lr=0.05, fused=True),
            "adam": lambda p: torch.optim.Adam(p, lr=1e-3, fused=True)}[optimizer]
    opt = make(disc.parameters())
    g = torch.Generator().manual_seed(rank + 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(UNAPPLIED_STREAK_LIMIT + 4):
            opt.zero_grad()
            ddp(torch.randn(6, 8, generator=g)).pow(2).mean().backward()
            opt.step()
    total = state.stats()["total"]
    state.close()
    return {"rewound": total["rewound_steps"], "policy": state.on_unapplied,
            "warned": sum("rewinding is off" in str(w.message) for w in caught)}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_ordinary_training_with_a_fused_optimizer_rewinds_nothing(optimizer):
    for result in run_ranks("test_unapplied", "fused_training_worker", world_size=2,
                            timeout=100, optimizer=optimizer):
        assert result == {"rewound": 0, "policy": "rewind", "warned": 0}, result


def test_the_two_level_exchange_rewinds_its_shard_residuals_the_same_way():
    kwargs = dict(world_size=4, timeout=150, two_level=True)
    rewind = run_ranks("test_unapplied", "gan_worker", mode="rewind", **kwargs)
    nosync = run_ranks("test_unapplied", "gan_worker", mode="nosync", **kwargs)
    for r in range(4):
        assert rewind[r]["residual_keys"] > 0
        assert all(rewind[r]["restored"]) and all(rewind[r]["moved"])
        assert rewind[r]["rewound"] == 7
        assert torch.equal(rewind[r]["params"], nosync[r]["params"])


def _sparse_run(rank):
    """A discriminator under DDP with the deterministic sparse hook, plain SGD and the
    rank's input generator."""
    torch.manual_seed(0)
    disc = _disc()
    ddp = DDP(disc, bucket_cap_mb=0)
    state = omgs_hook.register(ddp, **SPARSE)
    opt = torch.optim.SGD(disc.parameters(), lr=0.05)
    return disc, ddp, state, opt, torch.Generator().manual_seed(rank + 1)


def accumulate_worker(rank, world_size):
    """Two backward passes into the same gradients, one optimizer step: nothing is
    discarded, so nothing is rewound."""
    disc, ddp, state, opt, g = _sparse_run(rank)
    kept = []
    for it in range(6):
        opt.zero_grad()  # cleared after an optimizer step: applied, nothing to rewind
        ddp(torch.randn(6, 8, generator=g)).pow(2).mean().backward()
        first = _residuals(state)
        ddp(torch.randn(6, 8, generator=g)).pow(2).mean().backward()  # gradients kept
        opt.step()
        if it % 2:  # a forward with autograd right after the step (an evaluation)
            ddp(torch.randn(6, 8, generator=g))
        kept.append(not _equal(_residuals(state), first))
    total = state.stats()["total"]
    state.close()
    return {"kept": kept, "rewound": total["rewound_steps"]}


def test_accumulated_and_applied_gradients_are_never_rewound():
    for result in run_ranks("test_unapplied", "accumulate_worker", world_size=2, timeout=100):
        assert result["rewound"] == 0 and all(result["kept"])


def data_update_worker(rank, world_size):
    """An optimizer that writes ``p.data`` (no version bump): every step looks unapplied.
    After the streak limit the hook stops rewinding and warns."""
    torch.manual_seed(0)
    disc = _disc()
    ddp = DDP(disc, bucket_cap_mb=0)
    state = omgs_hook.register(ddp, **SPARSE)
    g = torch.Generator().manual_seed(rank + 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(UNAPPLIED_STREAK_LIMIT + 4):
            ddp(torch.randn(6, 8, generator=g)).pow(2).mean().backward()
            for p in disc.parameters():
                p.data.add_(p.grad, alpha=-0.05)
                p.grad = None
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)
                and "rewinding is off" in str(w.message)]
    total = state.stats()["total"]
    policy = state.on_unapplied
    state.close()
    return {"rewound": total["rewound_steps"], "policy": policy, "warned": len(messages)}


def test_an_optimizer_writing_p_data_turns_rewinding_off_after_the_streak_limit():
    for result in run_ranks("test_unapplied", "data_update_worker", world_size=2, timeout=100):
        assert result["rewound"] == UNAPPLIED_STREAK_LIMIT
        assert result["policy"] == "keep" and result["warned"] == 1


def skipped_updates_worker(rank, world_size, skipped, backward_of_skipped):
    """Training with a guard that skips the optimizer step (a loss spike): iterations in
    ``skipped`` run their backward (``backward_of_skipped``) but no ``opt.step()``, and
    the next iteration's ``zero_grad()`` clears the gradient - as plain DDP drops it; or
    they run no backward at all."""
    torch.manual_seed(0)
    disc = _disc()
    ddp = DDP(disc, bucket_cap_mb=0)
    state = omgs_hook.register(ddp, **SPARSE)
    opt = torch.optim.SGD(disc.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(rank + 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for it in range(14):
            x = torch.randn(6, 8, generator=g)
            if it in skipped and not backward_of_skipped:
                continue
            opt.zero_grad()
            ddp(x).pow(2).mean().backward()
            if it not in skipped:
                opt.step()
    messages = [str(w.message) for w in caught if "rewinding is off" in str(w.message)]
    result = {"params": [p.detach().clone() for p in disc.parameters()],
              "residuals": _residuals(state), "policy": state.on_unapplied,
              "rewound": state.stats()["total"]["rewound_steps"], "warned": len(messages)}
    state.close()
    return result


@pytest.mark.timeout(100)
def test_a_long_run_of_skipped_optimizer_steps_is_rewound_throughout():
    """A torch.optim optimizer's steps are seen (its step post-hook), so a run of steps
    without one is a run of skipped updates, not an optimizer writing ``p.data``: the
    4th skipped step in a row used to turn rewinding off for the rest of the run and
    keep the skipped steps' residual updates (parameters 0.039 apart from a run without
    those backwards after 5 skips, 2 ranks; residuals 0.28 apart, of norm 0.91)."""
    skipped = range(3, 3 + UNAPPLIED_STREAK_LIMIT + 3)
    guarded = run_ranks("test_unapplied", "skipped_updates_worker", world_size=2,
                        timeout=90, skipped=skipped, backward_of_skipped=True)
    without = run_ranks("test_unapplied", "skipped_updates_worker", world_size=2,
                        timeout=90, skipped=skipped, backward_of_skipped=False)
    for g, w in zip(guarded, without):
        assert g["policy"] == "rewind" and g["warned"] == 0, g
        assert g["rewound"] == len(skipped), g
        assert _equal(g["residuals"], w["residuals"])
        assert all(torch.equal(a, b) for a, b in zip(g["params"], w["params"]))


def test_bad_on_unapplied_names_the_option():
    with pytest.raises(ValueError, match="on_unapplied"):
        OMGSState(on_unapplied="drop")


def resume_worker(rank, world_size, resume_at=None, iterations=8, mode="rewind",
                  model_last=False):
    """The GAN loop, checkpointed at the end of iteration ``resume_at - 1`` (after the
    generator step, before the discriminator's next forward) and resumed into a new
    model, DDP, optimizer and state through ``torch.load(weights_only=True)``.
    ``model_last``: the model's weights loaded after the hook state, not before."""
    import io

    def build():
        torch.manual_seed(0)
        disc = _disc()
        ddp = DDP(disc, bucket_cap_mb=0)
        state = omgs_hook.register(ddp, **dict(SPARSE, on_unapplied=mode))
        return disc, ddp, state, torch.optim.SGD(disc.parameters(), lr=0.05, momentum=0.9)

    disc, ddp, state, opt = build()
    g = torch.Generator().manual_seed(rank + 1)
    for it in range(iterations):
        if it == resume_at:
            buf = io.BytesIO()
            torch.save({"model": disc.state_dict(), "opt": opt.state_dict(),
                        "omgs": state.state_dict()}, buf)
            buf.seek(0)
            saved = torch.load(buf, weights_only=True)
            state.close()
            disc, ddp, state, opt = build()
            if not model_last:
                disc.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            state.load_state_dict(saved["omgs"])
            if model_last:  # (through the DDP model: the same parameters)
                ddp.load_state_dict({f"module.{k}": v for k, v in saved["model"].items()})
        opt.zero_grad()
        ddp(torch.randn(6, 8, generator=g)).pow(2).mean().backward()
        opt.step()
        (ddp(torch.randn(6, 8, generator=g)) - 1).pow(2).mean().backward()
    params = torch.cat([p.detach().reshape(-1) for p in disc.parameters()])
    rewound = state.stats()["total"]["rewound_steps"]
    state.close()
    return {"params": params, "rewound": rewound}


@pytest.mark.parametrize("mode", ["rewind", "keep"])
def test_a_checkpoint_taken_after_the_generator_step_resumes_bit_exactly(mode):
    whole = run_ranks("test_unapplied", "resume_worker", world_size=2, timeout=100, mode=mode)
    resumed = run_ranks("test_unapplied", "resume_worker", world_size=2, timeout=100,
                        mode=mode, resume_at=4)
    for a, b in zip(whole, resumed):
        assert torch.equal(a["params"], b["params"])
        assert a["rewound"] == (7 if mode == "rewind" else 0)
        assert b["rewound"] == a["rewound"]  # the totals travel with the checkpoint


def test_a_resume_that_loads_the_model_after_the_hook_state_rewinds_the_same():
    """Loading the weights moves every parameter's version, as an optimizer step does:
    loaded after the hook state, the resumed run took its first decision for an applied
    step, kept the generator's step in the residual (6 rewinds instead of 7) and ended
    0.043 away from the uninterrupted run."""
    whole = run_ranks("test_unapplied", "resume_worker", world_size=2, timeout=100)
    resumed = run_ranks("test_unapplied", "resume_worker", world_size=2, timeout=100,
                        resume_at=4, model_last=True)
    for a, b in zip(whole, resumed):
        assert b["rewound"] == a["rewound"] == 7
        assert torch.equal(a["params"], b["params"])


def copy_worker(rank, world_size):
    """After register(): the module can be deep-copied (an EMA model) and pickled
    (torch.save of the whole module), as with plain DDP; the copies carry no-op hooks
    (they are not the DDP model), and the original's hooks still work."""
    import copy
    import io

    disc, ddp, state, opt, g = _sparse_run(rank)
    ema = copy.deepcopy(ddp.module)
    buffer = io.BytesIO()
    torch.save(ddp.module, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    # the DDP wrapper itself too, as plain DDP allows (a copy has no comm hook: DDP
    # rebuilds its reducer without one); register() refuses the original a second time
    ddp_copy = copy.deepcopy(ddp)
    buffer = io.BytesIO()
    torch.save(ddp, buffer)
    with pytest.raises(RuntimeError, match="already has the OMGS hook"):
        omgs_hook.register(ddp, density=0.1)
    for _ in range(3):
        opt.zero_grad()
        ddp(torch.randn(6, 8, generator=g)).pow(2).mean().backward()
        opt.step()
        ema(torch.randn(6, 8, generator=g)).sum().backward()  # not the DDP model
        loaded(torch.randn(6, 8, generator=g))
    total = state.stats()["total"]
    state.close()
    return {"steps": total["steps"], "rewound": total["rewound_steps"],
            "ema_hooks": len(ema._forward_pre_hooks), "copied": ddp_copy is not ddp}


@pytest.mark.timeout(150)
def test_the_module_can_be_deep_copied_and_pickled_after_register():
    for result in run_ranks("test_unapplied", "copy_worker", world_size=2, timeout=100):
        assert result["steps"] == 3 and result["rewound"] == 0, result
        assert result["ema_hooks"] == 1, result  # the no-op copy
        assert result["copied"]


def test_a_copy_of_the_state_is_an_inert_placeholder_that_says_so():
    import copy
    import pickle

    from omgs_hook.hook import CopiedState

    state = OMGSState(module=_disc())
    for copied in (copy.deepcopy(state), pickle.loads(pickle.dumps(state))):
        assert isinstance(copied, CopiedState)
        with pytest.raises(RuntimeError, match="copy of an OMGSState"):
            omgs_hook.omgs_hook(copied, None)
    state.close()


def test_the_optimizer_step_hook_goes_with_a_state_never_closed():
    """The step hook is torch-wide: a state dropped without close() must not leave it
    behind (a sweep that registers many models in one process)."""
    import gc

    from torch.optim.optimizer import _global_optimizer_post_hooks

    before = len(_global_optimizer_post_hooks)
    states = [OMGSState(module=_disc()) for _ in range(5)]
    assert len(_global_optimizer_post_hooks) == before + 5
    del states
    gc.collect()
    assert len(_global_optimizer_post_hooks) == before
