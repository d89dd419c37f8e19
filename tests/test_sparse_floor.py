"""The floor for sparse groups (``min_sparse_numel``): small groups are sent dense.

A small tensor alone in a sparse group (a LayerNorm's gain) sends 1-3 entries a step and
can diverge with momentum (docs/convergence.md); with a dense cost every plan the
planner returns, and every candidate of the measured selection, sends such groups dense.
"""

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import omgs_hook
from omgs_hook import OMGSState, planner, plan_selection
from omgs_hook.cost_model import (Instance, InstanceError, LinearCost, TopkCost, Unit,
                                  hierarchical_instance, relaxed_instance)
from ddp_harness import run_ranks
from script_loader import load_file
import test_planner

STRATEGIES = ("optimal", "greedy", "layerwise", "single", "threshold:4000")


def random_instance(seed, floor, num_units=12, dense=True):
    """test_planner's wide-ranging instances (units of 1 to 2e7 elements, so that small
    groups are in reach of every strategy), with the floor."""
    inst = test_planner.random_instance(np.random.default_rng(seed), num_units, dense)
    return dataclasses.replace(inst, min_sparse_numel=floor)


def group_numels(inst, plan):
    return [sum(inst.layers[u].numel for u in g) for g in plan.groups]


def small_sparse_groups(inst, plan, floor):
    return [n for n, d in zip(group_numels(inst, plan), plan.dense) if not d and n < floor]


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_sends_groups_under_the_floor_dense(seed, strategy):
    floor = 1024
    inst = random_instance(seed, floor)
    plan = planner.make_plan(inst, strategy)
    assert small_sparse_groups(inst, plan, floor) == []
    # exactly the plan of the instance without a floor, its small sparse groups flipped
    unfloored = planner.make_plan(dataclasses.replace(inst, min_sparse_numel=0), strategy)
    assert plan.groups == unfloored.groups
    expected = tuple(d or n < floor for d, n in zip(unfloored.dense, group_numels(inst, unfloored)))
    assert plan.dense == expected
    # and priced as it is sent
    assert plan == planner.evaluate(inst, plan.groups, plan.dense, strategy=plan.strategy)


def test_the_floor_can_change_a_plan_and_costs_what_the_model_says():
    flipped = 0
    for seed in range(40):
        inst = random_instance(seed, 1024)
        plan = planner.make_plan(inst, "layerwise")
        free = planner.make_plan(dataclasses.replace(inst, min_sparse_numel=0), "layerwise")
        if plan.dense != free.dense:
            flipped += 1
            # layerwise's modes were the cheapest ones: forcing some can only cost time
            assert plan.predicted_iteration_s >= free.predicted_iteration_s * (1 - 1e-12)
    assert flipped >= 5  # the property above was really exercised


def test_without_a_dense_cost_or_a_floor_nothing_changes():
    inst = random_instance(3, 1024, dense=False)
    plan = planner.make_plan(inst, "layerwise")
    assert not any(plan.dense)  # no dense mode to send anything with
    assert planner.small_groups_dense(inst, plan) is plan
    no_floor = random_instance(3, 0)
    plan = planner.make_plan(no_floor, "layerwise")
    assert planner.small_groups_dense(no_floor, plan) is plan


def test_evaluate_floors_the_modes_it_chooses_but_not_the_modes_it_is_given():
    inst = Instance(layers=(Unit(10, 1e-4), Unit(50_000, 1e-3), Unit(300, 1e-4)),
                    world_size=2, density=0.01, forward_s=0.0,
                    comm=LinearCost(1e-3, 1e-8), topk=TopkCost(1e-5, 1e-9, 0.0),
                    dense=LinearCost(5e-3, 1e-8), min_sparse_numel=1024)
    groups = [[0], [1], [2]]
    chosen = planner.evaluate(inst, groups)
    assert chosen.dense == (True, False, True)  # dense startup is dearer: only the floor
    given = planner.evaluate(inst, groups, [False, False, False])
    assert given.dense == (False, False, False)
    assert planner.predicted_iteration_s(inst, groups) == pytest.approx(
        chosen.predicted_iteration_s, rel=1e-12)


def test_two_level_plans_get_the_floor_and_the_relaxation_stays_a_lower_bound():
    for seed in range(6):
        flat = random_instance(seed, 1024)
        inst = hierarchical_instance(flat, 2, LinearCost(1e-5, 1e-10), LinearCost(1e-3, 3e-8))
        assert relaxed_instance(inst).min_sparse_numel == 0
        for strategy in ("optimal", "layerwise"):
            plan = planner.make_plan(inst, strategy)
            assert small_sparse_groups(inst, plan, 1024) == []
        assert planner.relaxed_lower_bound(inst) <= (
            planner.make_plan(inst, "optimal").predicted_iteration_s * (1 + 1e-9))


def test_every_trial_candidate_keeps_the_floor():
    for seed in range(8):
        inst = random_instance(seed, 1024, num_units=10)
        for strategy in ("optimal", "layerwise"):
            for c in plan_selection.model_candidates(inst, strategy):
                plan = planner.evaluate(inst, c.groups, c.dense)
                assert small_sparse_groups(inst, plan, 1024) == [], (strategy, c.name)


def test_the_floor_travels_in_the_instance_json_and_is_checked():
    inst = random_instance(0, 512)
    assert Instance.from_dict(inst.to_dict()) == inst
    assert "min_sparse_numel" not in random_instance(0, 0).to_dict()  # old files unchanged
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(InstanceError, match="min_sparse_numel"):
            Instance.from_dict(dict(inst.to_dict(), min_sparse_numel=bad))
        with pytest.raises(InstanceError, match="min_sparse_numel"):
            dataclasses.replace(inst, min_sparse_numel=bad)


@pytest.mark.parametrize("options, message", [
    ({"min_sparse_numel": -1}, "min_sparse_numel"),
    ({"min_sparse_numel": 2.5}, "min_sparse_numel"),
    ({"min_sparse_numel": True}, "min_sparse_numel"),
    ({"min_sparse_numel": "1024"}, "min_sparse_numel"),
    ({"min_sparse_numel": 64, "allow_dense": False}, "allow_dense"),
])
def test_bad_floor_options_name_the_problem(options, message):
    with pytest.raises(ValueError, match=message):
        OMGSState(**options)


def test_the_default_floor_follows_allow_dense():
    assert OMGSState().min_sparse_numel == omgs_hook.hook.DEFAULT_MIN_SPARSE_NUMEL == 1024
    assert OMGSState(allow_dense=False).min_sparse_numel == 0
    assert OMGSState(allow_dense=False, min_sparse_numel=0).min_sparse_numel == 0
    assert OMGSState(min_sparse_numel=0).min_sparse_numel == 0
    assert OMGSState(min_sparse_numel=5000).min_sparse_numel == 5000


# -------------------------------------------------------------- real DDP, 2 gloo ranks


class _Normed(nn.Module):
    """A 64k-element layer and a LayerNorm of 2 x 128 elements, one parameter per
    bucket (``bucket_cap_mb=0``): layerwise puts the LayerNorm's tensors in groups of
    their own."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(256, 256)
        self.norm = nn.LayerNorm(128)
        self.head = nn.Linear(256, 128, bias=False)

    def forward(self, x):
        return self.norm(self.head(torch.relu(self.body(x))))


def _dense_priced_out(world_size):
    """The default profile with a dense all-reduce priced at a second: the model itself
    never sends a group dense, so only the floor can (with ``measured_comm=False``, or
    the warm-up's dense steps would rescale it)."""
    from omgs_hook.profile_file import default_profile

    return dataclasses.replace(default_profile("cpu", world_size), dense=LinearCost(1.0, 1e-6))


def layerwise_worker(rank, world_size, allow_dense):
    torch.manual_seed(0)
    ddp = DDP(_Normed(), bucket_cap_mb=0)
    state = omgs_hook.register(ddp, density=0.01, strategy="layerwise", select="model",
                               allow_dense=allow_dense, warmup_steps=1, log_every=0,
                               profile=_dense_priced_out(world_size), measured_comm=False)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(12):
        ddp(torch.randn(8, 256, generator=gen)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    plan = state.stats()["plan"]
    sizes = {name: p.numel() for name, p in ddp.module.named_parameters()}
    groups = [(sum(sizes[k] for k in keys), dense)
              for keys, dense in zip(plan["group_keys"], plan["dense"])]
    residual_keys = sorted(state.state_dict()["residuals"])
    summary = state.summary()
    state.close()
    return {"groups": groups, "residual_keys": residual_keys,
            "min_sparse_numel": state.min_sparse_numel, "summary": summary}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("allow_dense", [True, False])
def test_a_layernorm_alone_in_a_group_is_sent_dense_by_default(allow_dense):
    results = run_ranks("test_sparse_floor", "layerwise_worker", world_size=2,
                        allow_dense=allow_dense)
    assert results[0]["groups"] == results[1]["groups"]
    groups = results[0]["groups"]
    assert len(groups) == 5  # layerwise over one parameter per bucket
    small = [dense for numel, dense in groups if numel < 1024]
    large = [dense for numel, dense in groups if numel >= 1024]
    assert len(small) == 3 and len(large) == 2  # body.bias 256, norm.weight, norm.bias
    if allow_dense:  # (the model prices dense out: only the floor sends these dense)
        assert results[0]["min_sparse_numel"] == 1024
        assert all(small) and not any(large)
        # dense groups leave no residual: only the large tensors keep one
        assert results[0]["residual_keys"] == ["body.weight", "head.weight"]
        # and state.summary() says why each small group is dense
        assert results[0]["summary"].count("under min_sparse_numel (1024)") == 3
    else:  # the paper's algorithm: every group sparse, every tensor its residual
        assert results[0]["min_sparse_numel"] == 0
        assert not any(small) and not any(large)
        assert len(results[0]["residual_keys"]) == 5
        assert "min_sparse_numel" not in results[0]["summary"]


# --------------------------------------- what the floor is for: training that diverged

TIED_LM = (Path(__file__).resolve().parents[1]
           / "docs" / "results" / "extra" / "tied_lm" / "tied_lm.py")


def _tied_lm():
    """docs/results/extra/tied_lm/tied_lm.py (the study's model and data), by path: an
    embedding tied to the output layer, a GRU and a LayerNorm of 128 elements (its own
    group under ``layerwise``)."""
    return load_file("tied_lm", TIED_LM)


def tied_lm_worker(rank, world_size, floor, steps):
    lm = _tied_lm()
    torch.manual_seed(0)
    ddp = DDP(lm.LM(), bucket_cap_mb=0)
    options = {} if floor is None else {"min_sparse_numel": floor}
    state = omgs_hook.register(ddp, density=0.01, strategy="layerwise", select="model",
                               profile=_dense_priced_out(world_size), measured_comm=False,
                               log_every=0, **options)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(steps):
        x, y = lm.data(step, rank)
        loss = nn.functional.cross_entropy(ddp(x).reshape(-1, lm.VOCAB), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    plan = state.stats()["plan"]
    state.close()
    return {"last": sum(losses[-10:]) / 10, "first": sum(losses[:10]) / 10,
            "dense": plan["dense"], "group_keys": plan["group_keys"]}


@pytest.mark.timeout(240)
def test_the_floor_turns_a_diverging_layerwise_run_into_a_training_one():
    runs = {floor: run_ranks("test_sparse_floor", "tied_lm_worker", world_size=2,
                             floor=floor, steps=150, timeout=200)[0]
            for floor in (0, None)}
    no_floor, default = runs[0], runs[None]
    norm_groups = [i for i, keys in enumerate(default["group_keys"])
                   if any(k.startswith("norm.") for k in keys)]
    assert norm_groups and all(default["dense"][i] for i in norm_groups)
    assert not any(no_floor["dense"])  # every group sparse: the LayerNorm's k is 2
    # allreduce reaches 0.225 in these 150 steps; the sparse LayerNorm diverges (24.6)
    assert no_floor["last"] > 5.0, no_floor
    assert default["last"] < 1.0 < default["first"], default
