"""Bad options and bad set-ups fail with a clear error before any training step."""

import gc
import json
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import omgs_hook
from omgs_hook import OMGSState
from omgs_hook.profile_file import ProfileError
from ddp_harness import run_ranks


@pytest.mark.parametrize(
    "options, message",
    [
        ({"density": 0.0}, "density"),
        ({"density": 1.5}, "density"),
        ({"density": float("nan")}, "density"),
        ({"density": "0.1"}, "density"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"density_warmup_steps": -2}, "density_warmup_steps"),
        ({"density_warmup_steps": 1.5}, "density_warmup_steps"),
        ({"density_warmup_start": 0.0}, "density_warmup_start"),
        ({"density_warmup_start": True}, "density_warmup_start"),
        ({"replan_every": 0}, "replan_every"),
        ({"replan_every": 2.5}, "replan_every"),
        ({"log_every": -3}, "log_every"),
        ({"topk_backend": "heap"}, "topk_backend"),
        ({"strategy": "fastest"}, "strategy"),
        ({"strategy": "threshold:abc"}, "strategy"),
        ({"nonfinite": "ignore"}, "nonfinite"),
        ({"on_world_size_change": "rescale"}, "on_world_size_change"),
        ({"select": "fastest"}, "select"),
        ({"select": None}, "select"),
        ({"plan": 3}, "plan"),
        ({"plan": {"groups": []}}, "plan"),
        ({"plan": {"groups": [[0, 1], [3]]}}, "plan"),  # not contiguous
        ({"plan": {"groups": [[0], [1]], "dense": [True]}}, "plan"),
        ({"plan": {"groups": [[0], [1]], "dense": ["yes", "no"]}}, "plan"),
        ({"plan": {"groups": [["a.weight", 1]]}}, "plan"),
        ({"plan": {"groups": [["a.weight"], ["a.weight"]]}}, "plan"),
        ({"plan": [{"groups": [[0]]}, {"groups": [[0]]}]}, "plan"),
        ({"plan": {"plan": None, "format_version": 1}}, "plan"),
        ({"plan": "/nonexistent/plan.json"}, "plan"),
        # a flag from a config file or a command line: "False" must not read as True
        ({"allow_dense": "False"}, "allow_dense must be True or False, got 'False'"),
        ({"allow_dense": 0}, "allow_dense must be True or False"),
        ({"refit_online": "no"}, "refit_online must be True or False"),
        ({"measured_comm": None}, "measured_comm must be True or False"),
        ({"track_staleness": 1}, "track_staleness must be True or False"),
        ({"density": torch.tensor(0.1)}, r"density must be a number in \(0, 1\], got a tensor"),
        ({"process_group": "x"}, "process_group must be a torch.distributed ProcessGroup"),
        ({"module": 3}, "module must be a torch.nn.Module"),  # was AttributeError
        ({"module": "model"}, "module must be a torch.nn.Module"),
    ],
)
def test_bad_options_name_the_problem(options, message):
    with pytest.raises(ValueError, match=message):
        OMGSState(**options)


def test_numpy_integers_are_integers_as_numpy_floats_are_numbers():
    """Options read from a NumPy array or a config parsed with NumPy: np.int64 counts
    where an int does (as np.float64 does for the density), stored as a plain int."""
    import numpy as np

    state = OMGSState(density=np.float64(0.01), warmup_steps=np.int64(5),
                      replan_every=np.int32(40), min_sparse_numel=np.int64(0),
                      ranks_per_node=np.int64(1), log_every=np.uint8(3))
    assert (state.warmup_steps, state.replan_every, state.log_every) == (5, 40, 3)
    assert all(type(v) is int for v in (state.warmup_steps, state.replan_every,
                                        state.log_every))
    for bad in ({"warmup_steps": np.float64(5.0)}, {"warmup_steps": np.bool_(True)},
                {"replan_every": np.int64(0)}, {"ranks_per_node": np.int64(0)},
                {"ranks_per_node": np.bool_(True)}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            OMGSState(**bad)


def test_numpy_numbers_are_a_local_clip_norm_as_they_are_a_density():
    """local_clip_norm refused np.float32 and np.int64 ("must be a positive number"),
    which density and the integer options take."""
    import numpy as np

    module = nn.Linear(2, 2)
    for value in (np.float32(0.5), np.int64(2), np.float64(1.5)):
        state = OMGSState(local_clip_norm=value, module=module)
        assert state.local_clip_norm == float(value) and type(state.local_clip_norm) is float
        state.close()
    for bad in (np.bool_(True), np.float32("nan"), np.int64(0)):
        with pytest.raises(ValueError, match="local_clip_norm"):
            OMGSState(local_clip_norm=bad, module=module)


def test_a_plan_of_numpy_indices_and_flags_is_a_plan():
    """A plan computed with NumPy (np.split of the bucket indices, a boolean array of
    dense flags) was refused: "groups must hold parameter names or bucket indices, not
    a mix" for indices all of one kind, "'dense' must be a list of 2 booleans"."""
    import numpy as np

    groups = [list(g) for g in np.split(np.arange(3), [2])]  # [[0, 1], [2]] of np.int64
    state = OMGSState(plan={"groups": groups, "dense": list(np.array([True, False]))})
    assert state._pinned[:3] == ("units", ((0, 1), (2,)), (True, False))
    assert all(type(u) is int for g in state._pinned[1] for u in g)
    assert all(type(d) is bool for d in state._pinned[2])
    with pytest.raises(ValueError, match="plan: groups must hold parameter names or bucket "
                                         "indices, not a mix"):
        OMGSState(plan={"groups": [[np.int64(0), "a.weight"]]})


def test_pinned_plan_forms_are_accepted_and_checked_against_the_model(tmp_path):
    from omgs_hook.group_plan import GroupPlan

    module = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    names = [n for n, _ in module.named_parameters()]
    keys = {"groups": [names[:2], names[2:]], "dense": [False, True]}
    state = OMGSState(module=module, plan=keys)
    assert state._pinned[0] == "keys" and state._pinned[1].dense == (False, True)
    # a state_dict()-like or stats()-like wrapper, a GroupPlan, a JSON file
    assert OMGSState(module=module, plan={"plan": keys, "format_version": 1})._pinned == state._pinned
    plan = GroupPlan(groups=(tuple(names),), dense=(False,), layout=(tuple(names),),
                     strategy="optimal", predicted_iteration_s=0.1, made_at_step=7)
    assert OMGSState(module=module, plan=plan)._pinned[1].made_at_step == 0
    path = tmp_path / "plan.json"
    path.write_text(json.dumps([{"strategy": "optimal", "groups": [[0, 1], [2]],
                                 "predicted_iteration_s": 0.01, "non_overlapped_s": 0.0}]))
    units = OMGSState(module=module, plan=str(path))._pinned
    assert units[0] == "units" and units[1] == ((0, 1), (2,)) and units[2] == (False, False)
    assert units[3] == 0.01
    # an entry of stats()["plan_history"] (train.py's log) keeps its predicted time too
    entry = {"step": 7, "strategy": "optimal", "groups": [[0, 1], [2, 3]],
             "dense": [False, True], "exchange": None, "reason": "model",
             "predicted_s": 0.042, "checksum": 1}
    assert OMGSState(module=module, plan=entry)._pinned[3] == 0.042
    with pytest.raises(ValueError, match="plan: .*not in the model: \\['b'\\]"):
        OMGSState(module=module, plan={"groups": [names, ["b"]]})
    with pytest.raises(ValueError, match="plan: .*not in the plan"):
        OMGSState(module=module, plan={"groups": [names[:3]]})
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(ValueError, match="plan: cannot read"):
        OMGSState(plan=bad)


def test_density_warm_up_schedule():
    state = OMGSState(density=0.001, warmup_steps=5, density_warmup_steps=4)
    got = [state.density_at(step) for step in range(12)]
    # dense warm-up steps 0-4 (density only matters once sparse), then 0.25 -> 0.001
    expected = [0.001] * 5 + [0.25 * (0.004 ** (t / 4)) for t in range(4)] + [0.001] * 3
    assert got == pytest.approx(expected, rel=1e-12)
    assert got[5] == 0.25 and got[8] > got[9] == 0.001
    # off by default, and no ramp when the start is not above the density
    assert OMGSState(density=0.001).density_at(5) == 0.001
    assert OMGSState(density=0.5, density_warmup_steps=10).density_at(7) == 0.5


def test_a_coarse_bucket_layout_warns_once_with_a_cap_that_fits_the_model():
    import warnings

    state = OMGSState(density=0.01)
    layout = [["out.bias", "norm.weight", "norm.bias", "rnn.weight"], ["emb.weight"]]
    with pytest.warns(RuntimeWarning, match=r"holds 97% of the gradient .*\(about 0\.33 for "
                                            r"this model's 5\.34 MB"):
        state._warn_if_coarse(layout, [1_360_000, 40_000])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state._warn_if_coarse(layout, [1_360_000, 40_000])  # once only
        # no warning where no bucket holds most of the gradient, or for `single`
        OMGSState(density=0.01)._warn_if_coarse(layout, [600_000, 800_000])
        OMGSState(density=0.01, strategy="single")._warn_if_coarse(layout, [1_360_000, 1])


def test_overhead_re_plan_waits_for_the_end_of_the_density_warm_up():
    from types import SimpleNamespace

    def due(step, **options):
        state = OMGSState(density=0.001, warmup_steps=5, **options)
        layout = (("a",),)
        state.plan = SimpleNamespace(made_at_step=5, layout=layout)
        state._awaiting_overhead = True  # the first plan had no overhead measurements
        state._layout_streak = (layout, step)
        state.step = step
        return state._replan_due(layout)

    assert not due(9) and due(10)  # OVERHEAD_SETTLE_STEPS after the first plan
    # with a ramp of 20 steps the samples are taken at the target density from step 25
    assert not due(10, density_warmup_steps=20) and not due(29, density_warmup_steps=20)
    assert due(30, density_warmup_steps=20)


def test_profile_problems_are_reported_at_construction(tmp_path):
    with pytest.raises(ProfileError, match="missing.json"):
        OMGSState(profile=str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ProfileError, match="JSON"):
        OMGSState(profile=str(bad))
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"schema_version": 999}))
    with pytest.raises(ProfileError, match="schema_version"):
        OMGSState(profile=str(wrong))
    with pytest.raises(TypeError, match="profile"):
        OMGSState(profile=3.5)


def test_non_floating_parameter_is_rejected():
    module = nn.Linear(2, 2)
    module.register_parameter("counter", nn.Parameter(torch.zeros(3, dtype=torch.int64),
                                                      requires_grad=False))
    OMGSState(module=module)  # frozen integer parameters are fine
    module2 = nn.Linear(2, 2).to(torch.complex64)
    with pytest.raises(TypeError, match="weight"):
        OMGSState(module=module2)


def test_sparse_gradient_embedding_is_rejected_at_construction():
    class Net(nn.Module):
        def __init__(self, sparse):
            super().__init__()
            self.table = nn.Embedding(10, 4, sparse=sparse)
            self.bag = nn.EmbeddingBag(10, 4)

    OMGSState(module=Net(sparse=False))  # dense-gradient embeddings are fine
    with pytest.raises(ValueError, match=r"'table'.*sparse=True"):
        OMGSState(module=Net(sparse=True))


def test_frozen_sparse_embedding_is_accepted():
    """A frozen sparse table produces no gradient (DDP gives it no bucket, and plain DDP
    trains such a model), so it must not be refused as a sparse-gradient module."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.Embedding.from_pretrained(torch.randn(10, 4), freeze=True,
                                                      sparse=True)
            self.bag = nn.EmbeddingBag(10, 4, sparse=True)
            self.bag.weight.requires_grad_(False)
            self.head = nn.Linear(4, 2)

    OMGSState(module=Net())
    net = Net()
    net.table.weight.requires_grad_(True)  # now it does produce sparse gradients
    with pytest.raises(ValueError, match=r"'table'.*sparse=True"):
        OMGSState(module=net)


def sparse_gradient_worker(rank, world_size):
    """A hook registered without its module (so nothing was checked up front) meets a
    sparse-gradient bucket: a clear error names the parameter, no KeyError."""
    from omgs_hook import omgs_hook as hook_fn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True))
    ddp = DDP(model)
    ddp.register_comm_hook(OMGSState(), hook_fn)
    try:
        model(torch.tensor([[1, 2]])).sum().backward()  # (the hook sees DDP's bucket)
        ddp(torch.tensor([[1, 2]])).sum().backward()
        return "no error"
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return f"{type(exc).__name__}: {exc}"
    finally:
        del ddp
        gc.collect()


@pytest.mark.timeout(60)
def test_sparse_gradient_bucket_fails_with_a_clear_error():
    (message,) = run_ranks("test_hook_validation", "sparse_gradient_worker", world_size=1)
    assert "sparse" in message and "param0" in message and "KeyError" not in message, message


def test_register_rejects_a_plain_module():
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        omgs_hook.register(nn.Linear(2, 2))


def test_hook_function_carries_register():
    from omgs_hook import omgs_hook as hook_fn

    assert hook_fn.register is omgs_hook.register


def register_twice_worker(rank, world_size):
    ddp = DDP(nn.Linear(4, 4))
    omgs_hook.register(ddp)
    messages = []
    try:
        omgs_hook.register(ddp)
    except RuntimeError as exc:
        messages.append(str(exc))
    ddp2 = DDP(nn.Linear(4, 4))
    ddp2.register_comm_hook(None, lambda state, bucket: None)
    try:
        omgs_hook.register(ddp2)
    except RuntimeError as exc:
        messages.append(str(exc))
    del ddp, ddp2
    gc.collect()
    return messages


@pytest.mark.timeout(60)
def test_register_twice_is_an_error():
    (messages,) = run_ranks("test_hook_validation", "register_twice_worker", world_size=1)
    assert len(messages) == 2
    assert "already has the OMGS hook" in messages[0]
    assert "refused" in messages[1]


def skip_unused_worker(rank, world_size):
    ddp = DDP(nn.Linear(4, 4), find_unused_parameters=True,
              skip_all_reduce_unused_params=True)
    try:
        omgs_hook.register(ddp)
    except ValueError as exc:
        return str(exc)
    return None


def _register_refused_for_ddp_option(option, worker):
    """What ``worker`` (one rank) got from register() on a DDP model built with
    ``option``; skipped where this torch's DDP has no such option."""
    import inspect

    if option not in inspect.signature(DDP.__init__).parameters:
        pytest.skip(f"this torch's DDP has no {option}")
    (message,) = run_ranks("test_hook_validation", worker, world_size=1)
    return message


@pytest.mark.timeout(60)
def test_ddp_that_skips_buckets_of_unused_parameters_is_refused():
    # DDP(skip_all_reduce_unused_params=True) (torch 2.13) never hands over a bucket
    # whose parameters all went unused: with an unused layer in the last bucket the hook
    # never saw a step end - steps counted 0 and a sparse first step hung
    message = _register_refused_for_ddp_option("skip_all_reduce_unused_params",
                                               "skip_unused_worker")
    assert message and "skip_all_reduce_unused_params" in message, message


def mixed_precision_worker(rank, world_size):
    from torch.distributed.algorithms.ddp_comm_hooks.mixed_precision_hooks import \
        _AllreduceUpcastHookState  # noqa: F401 - (the hook DDP registers for it)
    from torch.nn.parallel.distributed import _MixedPrecision

    ddp = DDP(nn.Linear(4, 4), mixed_precision=_MixedPrecision(param_dtype=torch.float16))
    try:
        omgs_hook.register(ddp)
    except (ValueError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


@pytest.mark.timeout(60)
def test_ddp_with_its_own_mixed_precision_hook_is_refused_naming_it():
    # DDP(mixed_precision=...) registers a communication hook of its own: register() said
    # "DDP refused the hook (register_comm_hook ... can only be called once)", about a
    # call the user never made
    message = _register_refused_for_ddp_option("mixed_precision", "mixed_precision_worker")
    assert message and message.startswith("ValueError") and "mixed_precision" in message, message


def world_size_policy_worker(rank, world_size):
    saved = {
        "format_version": 1, "step": 10, "world_size": 4, "rank": 0, "density": 0.01,
        "strategy": "optimal", "residuals": {"weight": torch.ones(4, 4)}, "plan": None,
        "measurements": {}, "totals": {},
    }
    model = nn.Linear(4, 4)
    outcomes = []
    state = OMGSState(module=model)
    try:
        state.load_state_dict(saved)
        outcomes.append("loaded")
    except ValueError as exc:
        outcomes.append(str(exc))
    state = OMGSState(module=model, on_world_size_change="reset")
    state.load_state_dict(saved)
    outcomes.append(len(state.memory))
    same_world = dict(saved, world_size=1, residuals={"weight": torch.ones(2, 2)})
    try:
        OMGSState(module=model).load_state_dict(same_world)
    except ValueError as exc:
        outcomes.append(str(exc))
    return outcomes


@pytest.mark.timeout(60)
def test_world_size_change_policy_and_shape_checks():
    (outcomes,) = run_ranks("test_hook_validation", "world_size_policy_worker", world_size=1)
    assert "world_size=4" in outcomes[0] and "on_world_size_change" in outcomes[0]
    assert outcomes[1] == 0  # explicitly reset: no residual applied to the wrong split
    assert "'weight'" in outcomes[2] and "shape" in outcomes[2]


def test_state_dict_format_is_checked():
    with pytest.raises(ValueError, match="format_version"):
        OMGSState().load_state_dict({"residuals": {}})


def profile_warning_worker(rank, world_size, profile_path):
    import warnings

    model = nn.Linear(8, 4)
    ddp = DDP(model)
    state = omgs_hook.register(ddp, profile=profile_path, warmup_steps=0, density=0.25)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ddp(torch.randn(2, 8)).sum().backward()
    comm = state.stats()["comm_model"]
    del ddp, state
    gc.collect()
    return [str(w.message) for w in caught if "omgs_hook" in str(w.message)], comm


@pytest.mark.timeout(60)
def test_profile_from_another_world_size_is_used_with_a_warning(tmp_path):
    profile = {
        "schema_version": 1, "world_size": 4, "backend": "gloo", "device": "cpu",
        "comm": {"alpha_s": 2.5e-4, "beta_s_per_byte": 1.5e-9},
        "dense": {"alpha_s": 2.6e-4, "beta_s_per_byte": 6e-10},
        "topk": {"backend": "sampled", "c0": 1e-5, "c1": 2e-9, "c2": 0.0},
    }
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    ((messages, comm),) = run_ranks("test_hook_validation", "profile_warning_worker",
                                    world_size=1, profile_path=str(path))
    assert any("world_size=4" in m and "world_size=1" in m for m in messages), messages
    assert comm["alpha_s"] == 2.5e-4 and comm["beta_s_per_byte"] == 1.5e-9
    # the profile's top-k density (here 0.001) against the run's (0.25): said too
    profile["settings"] = {"topk_density": 0.001}
    path.write_text(json.dumps(profile))
    ((messages, _),) = run_ranks("test_hook_validation", "profile_warning_worker",
                                 world_size=1, profile_path=str(path))
    assert any("density 0.001" in m and "omgs-profile --density 0.25" in m
               for m in messages), messages


def test_resuming_with_a_pinned_plan_uses_the_pinned_plan():
    from omgs_hook.group_plan import GroupPlan

    module = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    names = [n for n, _ in module.named_parameters()]
    saved = OMGSState(module=module).state_dict()
    other = GroupPlan(groups=(tuple(names),), dense=(False,), layout=tuple((n,) for n in names),
                      strategy="optimal", predicted_iteration_s=0.1, made_at_step=6)
    saved.update(step=10, plan=other.to_dict())
    pinned = {"groups": [names[:2], names[2:]], "dense": [True, False]}
    state = OMGSState(module=module, plan=pinned)
    state.load_state_dict(saved)
    assert [list(g) for g in state.plan.groups] == pinned["groups"]
    # another plan than the checkpoint's from step 10 on, and the history says so (it
    # kept the checkpoint's plan as the last entry, and the step it was made at)
    assert state.plan.dense == (True, False) and state.plan.made_at_step == 10
    last = state.stats()["plan_history"][-1]
    assert (last["step"], last["reason"], last["dense"]) == (10, "pinned", [True, False])
    # the checkpoint's own plan pinned again: in use since it was made, on record once
    state = OMGSState(module=module, plan=other.to_dict())
    saved_history = [{"step": 6, "strategy": "optimal", "groups": [[0]], "dense": [False],
                      "exchange": None, "reason": "model", "predicted_s": 0.1,
                      "checksum": other.checksum()}]
    state.load_state_dict(dict(saved, plan_history=saved_history))
    assert state.plan.made_at_step == 6 and state.stats()["plan_history"] == saved_history
    # a bucket-index plan is laid over the saved plan's buckets when their number fits
    state = OMGSState(module=module, plan={"groups": [[0], [1, 2, 3]]})
    state.load_state_dict(saved)
    assert state.plan.groups == ((names[0],), tuple(names[1:]))
    state = OMGSState(module=module, plan={"groups": [[0], [1]]})
    state.load_state_dict(saved)
    assert state.plan is None  # resolved at the end of the next step (or refused there)
    # before the end of the warm-up nothing is pinned yet
    saved.update(step=2)
    state = OMGSState(module=module, plan=pinned)
    state.load_state_dict(saved)
    assert state.plan is None


def test_background_planning_job_decides_trial_keep_or_model():
    """hook._compute_plan: what runs on the planner thread for one re-plan (pure)."""
    from omgs_hook import planner
    from omgs_hook.cost_model import Instance, LinearCost, TopkCost, Unit
    from omgs_hook.hook import _compute_plan

    inst = Instance(layers=tuple(Unit(numel=1000 * (i + 1) ** 2, backward_s=0.001) for i in range(5)),
                    world_size=2, density=0.01, forward_s=0.002,
                    comm=LinearCost(alpha_s=0.002, beta_s_per_byte=2e-8),
                    topk=TopkCost(c0=1e-4, c1=2e-9, c2=0.0),
                    dense=LinearCost(alpha_s=0.0005, beta_s_per_byte=1e-9), tail_s=0.001)
    model = planner.make_plan(inst, "optimal")
    key = [[list(g) for g in model.groups], list(model.dense)]
    job = {"instance": inst.to_dict(), "kept": None, "model_key": None, "retrial_ok": True}
    out = _compute_plan(job, "optimal", "model")
    assert out["candidates"] is None and out["plan"].groups == model.groups
    out = _compute_plan(job, "optimal", "measured")  # a full trial, the model's choice first
    assert len(out["candidates"]) >= 3 and out["candidates"][0].key == (model.groups, model.dense)
    other = {"name": "single", "groups": [[0, 1, 2, 3, 4]], "dense": [False]}
    same = dict(job, kept=other, model_key=key)
    out = _compute_plan(same, "optimal", "measured")  # the model's inputs gave the same plan
    assert out["candidates"] is None and out["plan"] is None and out["reason"] == "kept"
    changed = dict(job, kept=other, model_key=[[[0], [1], [2], [3], [4]], [False] * 5])
    out = _compute_plan(changed, "optimal", "measured")  # a short trial: new plan vs kept
    assert [c.name for c in out["candidates"]] == ["optimal", "kept:single"]
    # kept again by a later trial: one prefix, not "kept:kept:single" (it grew by one
    # each time, over a long run: kept:kept:kept:kept:kept:optimal-sparse at step 3000)
    again = dict(changed, kept=dict(other, name="kept:single"))
    assert [c.name for c in _compute_plan(again, "optimal", "measured")["candidates"]] == [
        "optimal", "kept:single"]
    out = _compute_plan(dict(changed, retrial_ok=False), "optimal", "measured")
    assert out["candidates"] is None and out["plan"] is None  # over budget: keep


def rank_zero_checkpoint_worker(rank, world_size, path):
    """The usual pattern for model weights - rank 0 writes the checkpoint, every rank
    loads it - applied to the hook's state, whose residuals are per rank."""
    torch.manual_seed(0)
    model = nn.Linear(16, 8)
    ddp = DDP(model)
    state = omgs_hook.register(ddp, density=0.1, warmup_steps=0, strategy="single",
                               select="model", allow_dense=False, log_every=0)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(3):
        ddp(torch.randn(4, 16, generator=generator)).square().mean().backward()
        model.zero_grad()
    if rank == 0:
        torch.save(state.state_dict(), path)
    dist.barrier()
    saved = torch.load(path, weights_only=True)
    outcomes = {"saved_norm": sum(float(t.norm()) for t in saved["residuals"].values())}
    try:
        OMGSState(module=model).load_state_dict(saved)
        outcomes["error"] = None
    except ValueError as exc:
        outcomes["error"] = str(exc)
    reset = OMGSState(module=model, on_world_size_change="reset")
    reset.load_state_dict(saved)
    outcomes["reset_residuals"] = len(reset.memory)
    state.close()
    return outcomes


@pytest.mark.timeout(90)
def test_a_checkpoint_written_by_rank_zero_alone_is_refused_on_the_other_ranks(tmp_path):
    """Loaded on every rank, rank 0's residuals would count world_size times and the
    other ranks' error feedback would be lost, silently."""
    results = run_ranks("test_hook_validation", "rank_zero_checkpoint_worker", world_size=2,
                        path=str(tmp_path / "hook.pt"))
    assert results[0]["saved_norm"] > 0  # there was error feedback to lose
    assert results[0]["error"] is None and results[0]["reset_residuals"] > 0  # its own state
    error = results[1]["error"]
    assert error is not None and error.startswith("rank: state saved by rank 0, loaded on rank 1")
    assert "on_world_size_change='reset'" in error
    assert results[1]["reset_residuals"] == 0  # reset drops rank 0's residuals on rank 1


def rank_zero_checkpoint_reset_training_worker(rank, world_size, path):
    """Rank 0 alone saves the hook's state mid-run (a plan in use, a trial behind it);
    every rank loads it with on_world_size_change="reset" into a fresh DDP model and
    trains on."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    options = dict(density=0.1, warmup_steps=1, log_every=0, allow_dense=False)
    ddp = DDP(model, bucket_cap_mb=0)
    state = omgs_hook.register(ddp, **options)
    generator = torch.Generator().manual_seed(rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def train(ddp, steps):
        for _ in range(steps):
            opt.zero_grad()
            ddp(torch.randn(4, 16, generator=generator)).square().mean().backward()
            opt.step()

    train(ddp, 6)
    if rank == 0:
        torch.save(state.state_dict(), path)
    dist.barrier()
    saved = torch.load(path, weights_only=True)
    state.close()
    del ddp
    ddp = DDP(model, bucket_cap_mb=0)
    state = omgs_hook.register(ddp, on_world_size_change="reset", **options)
    state.load_state_dict(saved)
    out = {"residuals_after_load": len(state.memory),
           "plan_after_load": state.plan.to_dict() if state.plan is not None else None,
           "saved_plan": saved.get("plan")}
    try:
        train(ddp, 4)
        out["error"] = None
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["error"] = f"{type(exc).__name__}: {exc}"
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    out["replicas_equal"] = all(torch.equal(gathered[0], g) for g in gathered)
    out["residuals_after_training"] = len(state.memory)
    state.close()
    return out


@pytest.mark.timeout(90)
def test_reset_of_a_rank_zero_checkpoint_keeps_the_ranks_in_agreement(tmp_path):
    """on_world_size_change="reset" with one checkpoint loaded everywhere: rank 0 keeps
    its own residuals, rank 1 drops rank 0's, and both keep the checkpoint's plan and
    trial state, which every rank shares: the first step's consistency check passes and
    training goes on (before, rank 1 alone dropped the plan and the first step failed
    with "ranks are configured differently: plan ...")."""
    results = run_ranks("test_hook_validation", "rank_zero_checkpoint_reset_training_worker",
                        world_size=2, path=str(tmp_path / "hook.pt"))
    assert results[0]["residuals_after_load"] > 0 and results[1]["residuals_after_load"] == 0
    for r in results:
        assert r["saved_plan"] is not None and r["plan_after_load"] == r["saved_plan"], r
        assert r["error"] is None, r
        assert r["replicas_equal"] and r["residuals_after_training"] > 0, r


def test_a_parameter_beyond_the_int32_index_range_is_refused_at_construction(monkeypatch):
    from omgs_hook import cost_model

    monkeypatch.setattr(cost_model, "MAX_SPARSE_GROUP_NUMEL", 100)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 16))  # 128 weights in '1.weight'
    with pytest.raises(ValueError, match=r"'1\.weight' has 128 elements, more than one sparse"):
        OMGSState(module=model)
    OMGSState(module=model, density=1.0)  # plain all-reduce indexes nothing
    # a pinned plan whose sparse group does not fit is refused before training, too
    monkeypatch.setattr(cost_model, "MAX_SPARSE_GROUP_NUMEL", 150)
    pinned = {"groups": [["1.weight", "1.bias", "0.weight", "0.bias"]], "dense": [False]}
    with pytest.raises(ValueError, match=r"plan: the pinned plan's sparse group 0 holds 216"):
        OMGSState(module=model, plan=pinned)
    OMGSState(module=model, plan={**pinned, "dense": [True]})


def test_groups_are_sent_when_their_last_parameter_arrives_in_plan_order():
    """The per-step tracking of plan groups (a counter per group, no scan of every
    pending group at each bucket): a group goes out at the bucket that completes it,
    groups completed by the same bucket in plan order, and the last bucket flushes
    whatever a plan group still misses."""
    from omgs_hook.group_plan import GroupPlan

    class FakeExchange:
        def __init__(self):
            self.arrived, self.sent, self.calls, self.layout = {}, set(), [], []

        def send_group(self, keys, dense):
            self.calls.append((tuple(keys), dense))
            self.sent.update(keys)

    state = OMGSState()
    state.plan = GroupPlan(groups=(("d", "a"), ("b",), ("c", "e"), ("x",)),
                           dense=(False, True, False, False),
                           layout=(("a",), ("b", "d"), ("c",), ("e",), ("x",)),
                           strategy="fixed", predicted_iteration_s=0.0, made_at_step=0)
    exchange = FakeExchange()
    state._start_group_tracking()
    arrivals = [["a"], ["b", "d"], ["c"], ["e"]]  # "x" never arrives (unused this step)
    sent_after = []
    for bucket in arrivals:
        exchange.layout.append(tuple(bucket))
        for key in bucket:
            exchange.arrived[key] = True
        state._send_ready_groups(exchange, bucket)
        sent_after.append(list(exchange.calls))
    assert sent_after[0] == []
    # bucket ("b", "d") completes group 1 (b) and group 0 (d, a): plan order, 0 first
    assert sent_after[1] == [(("d", "a"), False), (("b",), True)]
    assert sent_after[2] == sent_after[1]
    assert sent_after[3][-1] == (("c", "e"), False)
    exchange.arrived["y"] = True  # a parameter the plan does not know
    exchange.layout.append(("y",))
    state._flush(exchange)
    assert exchange.calls[-1] == (("y",), False)  # (the absent "x" sends nothing)
    assert len(exchange.calls) == 4
    # the next step starts afresh
    state._start_group_tracking()
    assert state._group_missing == [2, 1, 2, 1]  # (every group pending again)


def test_a_residual_of_a_parameter_gone_since_the_checkpoint_is_named_with_the_way_out():
    """A layer frozen or removed since the checkpoint: the error says how to go on
    without its residual - nothing is dropped silently."""
    from omgs_hook.residual_memory import check_residuals

    saved = {"0.weight": torch.zeros(8, 16), "frozen.bias": torch.ones(8)}
    shapes = {"0.weight": (8, 16)}
    with pytest.raises(ValueError) as caught:
        check_residuals(saved, shapes)
    assert "'frozen.bias': no such trainable parameter" in str(caught.value)
    assert "sd['residuals'].pop('frozen.bias')" in str(caught.value)
    with pytest.raises(ValueError, match=r"sd\['residuals_before_last_step'\]\.pop"):
        check_residuals(saved, shapes, where="residuals_before_last_step")
    saved.pop("frozen.bias")  # the way out the message gives
    check_residuals(saved, shapes)


def moduleless_resume_worker(rank, world_size, source, target):
    """Train 4 steps with ``source`` ("named": register(); "raw": register_comm_hook
    without a module), save, and load into a fresh DDP model of ``target`` ("raw",
    "raw_bigger": a layer more, "raw_smaller": a layer less), then train one step."""
    options = dict(density=0.1, strategy="layerwise", select="model", allow_dense=False,
                   warmup_steps=1, log_every=0)

    def build(kind):
        torch.manual_seed(0)
        layers = [nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2)]
        if kind == "raw_bigger":
            layers[4:4] = [nn.Linear(16, 16), nn.Tanh()]
        if kind == "raw_smaller":  # the last parameters of the first step's order gone
            layers = layers[:4]
        ddp = DDP(nn.Sequential(*layers), bucket_cap_mb=0)
        if kind == "named":
            state = omgs_hook.register(ddp, **options)
        else:
            state = OMGSState(**options)
            ddp.register_comm_hook(state, omgs_hook.omgs_hook)
        return ddp, state

    def step(ddp, seed):
        g = torch.Generator().manual_seed(seed * 10 + rank)
        ddp.zero_grad()
        ddp(torch.randn(4, 8, generator=g)).pow(2).mean().backward()

    ddp, state = build(source)
    for i in range(4):
        step(ddp, i)
    saved = state.state_dict()
    assert any(float(t.abs().sum()) > 0 for t in saved["residuals"].values())
    state.close()
    ddp, state = build(target)
    try:
        state.load_state_dict(saved)
        step(ddp, 4)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return f"{type(exc).__name__}: {exc}"
    finally:
        state.close()
    return None


@pytest.mark.timeout(180)
@pytest.mark.parametrize("source, target, error", [
    # the module's names: never sent by a state that names its parameters param0, ...
    ("named", "raw", r"ValueError: residual for '\d\.(weight|bias)': no such parameter in "
                     r"this state: this state has no module"),
    ("raw", "raw_bigger", r"ValueError: residual for 'param\d' has shape \(\d+, \d+\), the "
                          r"parameter has \(16, 16\): this state has no module"),
    ("raw", "raw_smaller", r"ValueError: residual for 'param\d' \(2 in all\): no such "
                           r"parameter in the model"),
    ("raw", "raw", None),
])
def test_a_checkpoint_that_does_not_fit_a_moduleless_state_is_refused(source, target, error):
    """Without a module the residuals are keyed param0, param1, ... (bucket order), and
    load_state_dict cannot check them against the model: a state saved by register()
    was loaded without a word and its residuals were never sent again (kept aside,
    forever), and another model's failed inside the first step with a bare tensor-size
    RuntimeError, or not at all."""
    for result in run_ranks("test_hook_validation", "moduleless_resume_worker",
                            world_size=2, timeout=150, source=source, target=target):
        if error is None:
            assert result is None
        else:
            assert result is not None and re.match(error, result), result


@pytest.mark.parametrize("field, bad", [
    ("plan", {"dense": [False]}),                          # no "groups"
    ("trial", {"candidates": []}),                          # no "start_step"
    ("correction", {"scale": "fast"}),
    ("residuals_before_last_step", {"0.weight": torch.ones(5)}),  # wrong shape
    ("layout", 3),
    ("trial_layout", [1, 2]),
    ("layout_streak", "x"),
    ("first_due_at", [4]),
])
def test_a_malformed_checkpoint_field_is_refused_before_anything_is_loaded(field, bad):
    """A hand-edited checkpoint with a malformed plan, trial or correction failed with a
    bare KeyError deep inside load_state_dict, after the residuals, plan and step had
    been replaced: the state was left half loaded."""
    module = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    good = OMGSState(module=module).state_dict()
    good.update(step=7, residuals={"0.weight": torch.full((3, 2), 0.5)})
    state = OMGSState(module=module)
    state.load_state_dict(good)
    bad_sd = dict(good, step=30, residuals={"0.weight": torch.full((3, 2), 9.0)})
    bad_sd[field] = bad
    with pytest.raises(ValueError, match=field):
        state.load_state_dict(bad_sd)
    assert state.step == 7
    assert torch.equal(state.state_dict()["residuals"]["0.weight"], torch.full((3, 2), 0.5))
