"""Parameters DDP does not hand the hook: a layer frozen mid-run (parameter-efficient
fine-tuning whose trainable set changes) and parameters DDP is told to ignore."""

import gc

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import omgs_hook

from ddp_harness import run_ranks

pytestmark = pytest.mark.multiprocess
MODULE = "test_parameters_ddp_does_not_reduce"  # (where run_ranks finds the workers)


def _batch(step, rank):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)


def _train(ddp, opt, start, stop, rank):
    for step in range(start, stop):
        x, y = _batch(step, rank)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()


def refreeze_worker(rank, world_size, select, save_at):
    """Train (``save_at`` steps, or None: until 2 steps into the first trial), checkpoint
    the hook state, freeze the first layer, wrap the module in a new
    DDP model (as DDP requires after a change of the trainable set), register again and
    carry the state over - dropping the frozen layer's residuals, as load_state_dict's
    error for them advises - then train on."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 4))
    options = dict(density=0.1, warmup_steps=2, log_every=0, select=select,
                   strategy="layerwise" if select == "model" else "optimal")
    ddp = DDP(model, bucket_cap_mb=0)
    state = omgs_hook.register(ddp, **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    if save_at is None:  # 2 steps into the first trial (fixed model inputs: one runs)
        from test_hook_ddp import train_into_first_trial
        from test_hook_selection import fake_planning_inputs
        fake_planning_inputs(state)
        save_at = train_into_first_trial(
            state, lambda start, stop: _train(ddp, opt, start, stop, rank), 30)
    else:
        _train(ddp, opt, 0, save_at, rank)
    sd = state.state_dict()
    carried = {"plan": sd["plan"] is not None, "trial": sd["trial"] is not None}
    state.close()
    del ddp, state
    gc.collect()

    model[0].requires_grad_(False)
    ddp = DDP(model, bucket_cap_mb=0)
    state = omgs_hook.register(ddp, **options)
    for key in ("0.weight", "0.bias"):
        sd["residuals"].pop(key, None)
    state.load_state_dict(sd)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    _train(ddp, opt, save_at, save_at + 1, rank)
    try:
        early = state.summary()  # (the plan in use right after the load)
    except Exception as exc:  # noqa: BLE001 - reported
        early = f"{type(exc).__name__}: {exc}"
    try:
        _train(ddp, opt, save_at + 1, save_at + 40, rank)
        trained = None
    except Exception as exc:  # noqa: BLE001 - reported
        trained = f"{type(exc).__name__}: {exc}"
    stats = state.stats()
    out = {"carried": carried, "early": early, "trained": trained, "plan": stats["plan"],
           "params": [p.detach().clone() for p in model.parameters()]}
    state.close()
    del ddp
    gc.collect()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("select,save_at", [("model", 6), ("measured", None)])
def test_a_checkpoint_carried_over_after_freezing_a_layer_re_plans(select, save_at):
    """Freezing a layer midway (progressive freezing, a fine-tuning schedule) needs a new
    DDP model; the hook state carried over to it held a plan (and a measured-selection
    trial) naming the now-frozen parameters: ``summary()`` raised ``KeyError: '0.bias'``
    on every rank, and (in a LoRA sweep, a trial carried over near its end) so did the
    next backward, in the trial's refit. Now such a plan and trial are dropped on load,
    as ones made for other options are, and the next steps re-plan for the trainable
    set."""
    results = run_ranks(MODULE, "refreeze_worker", world_size=2, timeout=110,
                        select=select, save_at=save_at)
    for r in results:
        assert r["carried"]["plan"]  # the checkpoint held a plan naming the frozen layer
        if select == "measured":
            assert r["carried"]["trial"]
        assert r["early"].startswith("omgs_hook after"), r["early"]
        assert r["trained"] is None, r["trained"]
        planned = {k for group in r["plan"]["group_keys"] for k in group}
        assert planned == {"2.weight", "2.bias", "4.weight", "4.bias"}, planned
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b)


def ignored_pin_worker(rank, world_size, how, pin):
    """A model whose last layer DDP ignores - named in the module's ignore list (synced by
    hand, e.g. an expert layer) or given to ``delay_all_reduce_named_params`` - trained
    with ``plan=`` pinned to a plan ``stats()["plan"]`` of the same model returned."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 4))
    kwargs = {}
    if how == "ignore_list":
        DDP._set_params_and_buffers_to_ignore_for_model(model, ["4.weight", "4.bias"])
    else:
        kwargs = dict(delay_all_reduce_named_params=[("4.weight", model[4].weight),
                                                     ("4.bias", model[4].bias)],
                      param_to_hook_all_reduce=model[0].weight)
    ddp = DDP(model, bucket_cap_mb=0, **kwargs)
    state = omgs_hook.register(ddp, density=0.1, warmup_steps=2, log_every=0,
                               strategy="layerwise", select="model", plan=pin)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(6):
        x, y = _batch(step, rank)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        if how == "ignore_list":
            for p in model[4].parameters():
                torch.distributed.all_reduce(p.grad)
                p.grad /= world_size
        opt.step()
    stats = state.stats()
    state.close()
    del ddp
    gc.collect()
    return {"plan": stats["plan"], "history": [e["reason"] for e in stats["plan_history"]],
            "params": [p.detach().clone() for p in model.parameters()]}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["ignore_list", "delay_all_reduce"])
def test_a_plan_of_a_model_with_ddp_ignored_parameters_can_be_pinned(how):
    """DDP never hands the hook a parameter it ignores, so no plan holds one; pinning
    ``stats()["plan"]`` of such a model (for a bit-identical rerun) was refused at
    ``register()`` with "the pinned plan does not match the model's parameters (not in
    the plan: ['4.bias', '4.weight'], ...)" - and a plan naming them is refused once DDP's
    buckets are known: no plan could be pinned at all."""
    first = run_ranks(MODULE, "ignored_pin_worker", world_size=2, timeout=110, how=how,
                      pin=None)
    pin = first[0]["plan"]
    assert {k for g in pin["group_keys"] for k in g} == {"0.weight", "0.bias", "2.weight",
                                                         "2.bias"}
    again = run_ranks(MODULE, "ignored_pin_worker", world_size=2, timeout=110, how=how,
                      pin=pin)
    for r in again:
        assert r["history"] == ["pinned"]
        assert r["plan"]["group_keys"] == pin["group_keys"]
    # (the layers the hook reduces: DDP's own delayed all-reduce is never waited for, and
    # beside the hook's collectives its result was seen to land late on one rank)
    for a, b in zip(again[0]["params"][:4], again[1]["params"][:4]):
        assert torch.equal(a, b)
