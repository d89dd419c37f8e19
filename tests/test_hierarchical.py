"""The two-level (hierarchical) exchange on 2 nodes x 2 gloo ranks (4 processes).

The expected gradients and residuals come from ``two_level_reference`` below, written
from the algorithm's description (docs/hierarchical.md) and sharing nothing with the
library: float64, a stable sort for top-k, each node's sum formed directly.
"""

import gc
import json
import math
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import omgs_hook
from ddp_harness import run_ranks
from omgs_hook.topology import Topology, resolve_topology

DENSITY = 0.05
NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE
#: a profile with both link classes (and a measured inter-node all-reduce), so the
#: planner models the two-level exchange
TWO_LEVEL_PROFILE = {
    "schema_version": 1, "world_size": WORLD, "backend": "gloo", "device": "cpu",
    "comm": {"alpha_s": 7e-4, "beta_s_per_byte": 4e-7},
    "dense": {"alpha_s": 5e-4, "beta_s_per_byte": 4e-7},
    "topk": {"backend": "sampled", "c0": 2e-4, "c1": 3e-9, "c2": 0.0},
    "ranks_per_node": PER_NODE,
    "intra": {"alpha_s": 2e-5, "beta_s_per_byte": 1e-10},
    "inter": {"alpha_s": 7e-4, "beta_s_per_byte": 4e-7},
    "inter_dense": {"alpha_s": 9e-4, "beta_s_per_byte": 6e-7}}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(12, 24)
        self.b = nn.Linear(24, 24)
        self.c = nn.Linear(24, 5)  # a bias of 5 elements: shards of 3 and 2 (+1 padding)

    def forward(self, x, skip_b=False):
        hidden = torch.relu(self.a(x))
        if not skip_b:
            hidden = torch.relu(self.b(hidden))
        return self.c(hidden)


def batch(step, rank, micro=0):
    gen = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randn(6, 12, generator=gen), torch.randn(6, 5, generator=gen)


def loss_fn(out, y):
    return ((out - y) ** 2).mean()


def flat_residuals(state):
    return {k: v.reshape(-1).clone() for k, v in state.state_dict()["residuals"].items()}


def gather(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def two_level_reference(local, old, groups, density, per_node, parked=(), clip_norm=None,
                        factors=None):
    """local/old: per rank {name: flat tensor}; groups: [(names, dense)]. Returns the
    averaged gradient {name: tensor} and each rank's new residual {name: tensor}.
    ``clip_norm``: ``local_clip_norm`` - each rank's gradient of a group of D elements
    (out of all T) is scaled to an L2 norm of at most ``clip_norm * sqrt(D / T) /
    sqrt(world)`` before its residual is added; the scale factors go to ``factors``."""
    world = len(local)
    nodes = world // per_node
    total_numel = sum(t.numel() for t in local[0].values())
    avg, new = {}, [dict() for _ in range(world)]
    for names, dense in groups:
        sizes = [local[0][n].numel() for n in names]
        numel = sum(sizes)
        scale = [1.0] * world
        if clip_norm is not None:
            limit = clip_norm * math.sqrt(numel / total_numel) / math.sqrt(world)
            for r in range(world):
                norm = float(torch.cat([local[r][n].double() for n in names]).norm())
                scale[r] = min(1.0, limit / norm) if norm > 0 else 1.0
            if factors is not None:
                factors.append((tuple(names), dense, scale))

        def cat(r, with_residual):
            parts = []
            for n in names:
                g = local[r][n].double() * scale[r]
                if with_residual and n not in parked and n in old[r]:
                    g = g + old[r][n].double()
                parts.append(g)
            return torch.cat(parts)

        if dense:
            total = sum(cat(r, True) for r in range(world))
            result = total / world
            res = [torch.zeros(numel, dtype=torch.float64) for _ in range(world)]
        else:
            size = math.ceil(numel / per_node)
            k = max(1, math.ceil(density * size))
            total = torch.zeros(per_node * size, dtype=torch.float64)
            res = [torch.zeros(per_node * size, dtype=torch.float64) for _ in range(world)]
            parked_mask = torch.zeros(per_node * size, dtype=torch.bool)
            offset = 0
            for n, s in zip(names, sizes):
                if n in parked:
                    parked_mask[offset:offset + s] = True
                offset += s
            for node in range(nodes):
                ranks = range(node * per_node, (node + 1) * per_node)
                node_sum = torch.zeros(per_node * size, dtype=torch.float64)
                for r in ranks:
                    node_sum[:numel] += cat(r, True)
                for l in range(per_node):
                    piece = slice(l * size, (l + 1) * size)
                    acc = node_sum[piece]
                    top = torch.sort(acc.abs(), descending=True, stable=True).indices[:k]
                    sent = torch.zeros_like(acc)
                    sent[top] = acc[top]
                    total[piece] += sent
                    owner = node * per_node + l
                    res[owner][piece] = acc - sent
            for r in range(world):  # a parked parameter's residual stays where it was
                held = torch.zeros(per_node * size, dtype=torch.float64)
                held[:numel] = torch.cat([old[r].get(n, torch.zeros(s)).double()
                                          for n, s in zip(names, sizes)])
                res[r] = torch.where(parked_mask, held, res[r])[:numel]
            result = total[:numel] / world
        offset = 0
        for n, s in zip(names, sizes):
            avg[n] = result[offset:offset + s]
            for r in range(world):
                new[r][n] = res[r][offset:offset + s]
            offset += s
    return avg, new


# ----------------------------------------------------------------------------- workers
def reference_worker(rank, world_size, hook_options, ddp_options, steps, accumulate=False,
                     skip_b_on_odd_steps=False, env_local_world_size=None, dtype=torch.float32,
                     preload=None, nonfinite_step=None, skip_b_parity=1, report_instance=False,
                     health_every=None):
    """``preload``: ``{"options": hook options, "steps": n}`` - train n steps with another
    hook state first and load its ``state_dict()`` (per-parameter residuals) into this
    one. ``nonfinite_step``: at that step rank 3's input holds inf (checked, not
    compared with the reference, no optimiser step). ``report_instance``: return the
    hierarchy of the instance the hook plans with (``measured_instance()``, collective).
    ``health_every``: measure the error-feedback health figures every this many steps
    (``HEALTH_EVERY``); each step's per-group ``||gradient||^2`` is returned with the
    reference's (after its clipping), as ``health`` in the step's record."""
    from omgs_hook import hierarchical
    from omgs_hook import hook as hook_module

    if health_every is not None:
        hook_module.HEALTH_EVERY = health_every

    if env_local_world_size is not None:
        os.environ["LOCAL_WORLD_SIZE"] = str(env_local_world_size)
    torch.manual_seed(0)
    model, reference_model = Net().to(dtype), Net().to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    if preload is not None:
        first = DDP(model, bucket_cap_mb=0, **ddp_options)
        first_state = omgs_hook.register(first, density=DENSITY, **preload["options"])
        for step in range(preload["steps"]):
            x, y = batch(100 + step, rank)
            opt.zero_grad()
            loss_fn(first(x.to(dtype)), y.to(dtype)).backward()
            opt.step()
        saved = first_state.state_dict()
        del first, first_state
        gc.collect()
    ddp = DDP(model, bucket_cap_mb=0, **ddp_options)
    state = omgs_hook.register(ddp, density=DENSITY, **hook_options)
    if preload is not None:
        state.load_state_dict(saved)
    # which two-level dense groups were reduced in the bucket buffer itself
    dense_paths = {"in_place": 0, "staged": 0}
    finish_dense = hierarchical._finish_dense

    def counting_finish_dense(ex, keys, averaged, segments, sent):
        dense_paths["in_place" if segments is None else "staged"] += 1
        return finish_dense(ex, keys, averaged, segments, sent)

    hierarchical._finish_dense = counting_finish_dense
    caught = warnings.catch_warnings(record=True)
    seen = caught.__enter__()
    warnings.simplefilter("always")
    worst = {"grad": 0.0, "residual": 0.0, "conservation": 0.0, "parked_changed": 0}
    per_step = []
    clip_factors = []  # the reference's (group, dense, per-rank factor) with local_clip_norm
    nonfinite_log = None
    for step in range(steps):
        micro = [tuple(t.to(dtype) for t in batch(step, rank, m))
                 for m in range(2 if accumulate else 1)]
        skip_b = skip_b_on_odd_steps and step % 2 == skip_b_parity
        if step == nonfinite_step:
            x, y = micro[-1]
            if rank == 3:
                x[0, 0] = float("inf")
            before = flat_residuals(state)
            opt.zero_grad()
            loss_fn(ddp(x, skip_b), y).backward()
            after = flat_residuals(state)
            last = state.stats()["last"]
            nonfinite_log = {
                "nonfinite": last["nonfinite"], "dense_groups": last["dense_groups"],
                "grads_finite": all(bool(torch.isfinite(p.grad).all())
                                    for p in model.parameters() if p.grad is not None),
                "residual_unchanged": before.keys() == after.keys() and all(
                    torch.equal(before[k], after[k]) for k in before)}
            continue
        reference_model.load_state_dict(model.state_dict())
        reference_model.zero_grad()
        for x, y in micro:
            loss_fn(reference_model(x, skip_b), y).backward()
        # (the hook works on fp32 copies of the gradients)
        local = {n: (p.grad.reshape(-1).float() if p.grad is not None else torch.zeros(p.numel()))
                 for n, p in reference_model.named_parameters()}
        old = flat_residuals(state)
        all_local, all_old = gather(local), gather(old)
        state._health = None  # (set again by a step that measures it)
        opt.zero_grad()
        if accumulate:
            with ddp.no_sync():
                loss_fn(ddp(micro[0][0], skip_b), micro[0][1]).backward()
        x, y = micro[-1]
        loss_fn(ddp(x, skip_b), y).backward()
        last = state.stats()["last"]
        groups = list(zip(last["group_keys"], last["group_dense"]))
        unused = {n for n, p in reference_model.named_parameters() if p.grad is None}
        clipped_before = len(clip_factors)
        if last["exchange"] == "flat":  # a flat trial candidate (topology="auto")
            from reference_omgs import reference_step

            assert not unused and hook_options.get("local_clip_norm") is None
            avg, new = reference_step(all_local, all_old, groups, last["step_density"])
        else:
            avg, new = two_level_reference(all_local, all_old, groups, last["step_density"],
                                           PER_NODE, parked=unused,
                                           clip_norm=hook_options.get("local_clip_norm"),
                                           factors=clip_factors)
        got = flat_residuals(state)
        for name, p in model.named_parameters():
            if p.grad is None:  # unused on every rank: the residual is exactly kept
                same = torch.equal(got.get(name, torch.zeros(p.numel())),
                                   old.get(name, torch.zeros(p.numel())))
                worst["parked_changed"] += not same
                continue
            # the fp32 average is written into the (maybe bf16) gradient: compare rounded,
            # allowing one bf16 rounding step (the hook's fp32 sums and the float64
            # reference may round to neighbouring bf16 values)
            expected = avg[name].to(dtype).double()
            slack = 0.0 if dtype == torch.float32 else avg[name].abs() * 2.0 ** -8
            # (two-level dense groups, too, sum in fp32 and round once on the write-back)
            worst["grad"] = max(worst["grad"], float(
                ((p.grad.reshape(-1).double() - expected).abs() - slack).max()))
            mine = got.get(name, torch.zeros(p.numel()))
            worst["residual"] = max(worst["residual"],
                                    float((mine - new[rank][name]).abs().max()))
        # conservation with the hook's own outputs: sum(local + old) == W * avg + sum(new)
        # (local: after the reference's clipping, when local_clip_norm is on)
        scale = {n: f for names, _, f in clip_factors[clipped_before:] for n in names}
        health = None
        if state._health is not None:
            # the hook's per-group ||gradient||^2 against the reference's clipped gradient
            health = [(float(got_sq), sum(float(local[n].double().square().sum())
                                          * scale.get(n, [1.0] * world_size)[rank] ** 2
                                          for n in keys))
                      for (got_sq, _), (keys, _) in zip(state._health[1], groups)]
        all_new = gather(got)
        for name, p in model.named_parameters():
            if p.grad is None:
                continue
            lhs = sum(all_local[r][name].double() * scale.get(name, [1.0] * world_size)[r]
                      + all_old[r].get(name, torch.zeros(p.numel()))
                      for r in range(world_size))
            # the hook's own fp32 output; a bf16 gradient holds it rounded: use the reference's
            written = p.grad.reshape(-1).double() if dtype == torch.float32 else avg[name]
            rhs = world_size * written + sum(
                all_new[r].get(name, torch.zeros(p.numel())).double() for r in range(world_size))
            worst["conservation"] = max(worst["conservation"], float((lhs - rhs).abs().max()))
        per_step.append({"groups": len(groups), "dense": sum(d for _, d in groups),
                         "exchange": last["exchange"],
                         "inter": last["inter_node_bytes"], "intra": last["intra_node_bytes"],
                         "numels": [sum(dict(model.named_parameters())[n].numel() for n in keys)
                                    for keys, d in groups if not d],
                         "dense_numels": [sum(dict(model.named_parameters())[n].numel()
                                              for n in keys) for keys, d in groups if d],
                         # residual the dense groups found (all ranks), by parameter
                         "dense_old_mass": {n: sum(float(all_old[r][n].abs().sum())
                                                   for r in range(world_size) if n in all_old[r])
                                            for keys, d in groups if d for n in keys},
                         "residual_mass": sum(float(v.abs().sum()) for v in got.values()),
                         "health": health})
        opt.step()
    params = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
    planned = None
    if report_instance:
        # (measured_instance() with the factors measured_comm scaled the links by)
        instance, inputs = state._build_instance(state.meter.layout)
        planned = {"hierarchy": instance.to_dict().get("hierarchy"),
                   "inter_dense_cost": instance.inter_dense_cost().to_dict(),
                   "two_level_scale": inputs["two_level_scale"]}
    stats = state.stats()
    summary = state.summary()
    caught.__exit__(None, None, None)
    two_level_warnings = sum("planning with the flat costs" in str(w.message) for w in seen)
    hierarchical._finish_dense = finish_dense
    del ddp, state
    gc.collect()
    return {"worst": worst, "per_step": per_step, "stats": stats, "params": params,
            "summary": summary, "two_level_warnings": two_level_warnings,
            "dense_paths": dense_paths, "nonfinite": nonfinite_log, "planned": planned,
            "clip_factors": clip_factors}


def resume_worker(rank, world_size, ckpt_dir, first, second):
    options = {"density": DENSITY, "strategy": "layerwise", "warmup_steps": 1,
               "allow_dense": False, "select": "model", "topology": "hierarchical",
               "ranks_per_node": PER_NODE}

    def build(**extra):
        torch.manual_seed(0)
        model = Net()
        ddp = DDP(model, bucket_cap_mb=0, static_graph=True)
        state = omgs_hook.register(ddp, **dict(options, **extra))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        return model, ddp, state, opt

    def train(ddp, opt, start, stop):
        for step in range(start, stop):
            x, y = batch(step, rank)
            opt.zero_grad()
            loss_fn(ddp(x), y).backward()
            opt.step()

    model, ddp, state, opt = build()
    train(ddp, opt, 0, first)
    path = os.path.join(ckpt_dir, f"rank{rank}.pt")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()},
               path)
    train(ddp, opt, first, first + second)
    uninterrupted = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    del ddp, state, model, opt
    gc.collect()

    model, ddp, state, opt = build()
    ckpt = torch.load(path, weights_only=True)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    state.load_state_dict(ckpt["hook"])
    train(ddp, opt, first, first + second)
    resumed = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    del ddp, state
    gc.collect()

    # another topology on resume: an error naming it, or a reset when asked for
    outcomes = {}
    for policy in ("error", "reset"):
        _, ddp, state, _ = build(topology="flat", on_world_size_change=policy)
        try:
            state.load_state_dict(ckpt["hook"])
            outcomes[policy] = ("loaded", state.memory.total_norm())
        except ValueError as exc:
            outcomes[policy] = ("error", str(exc))
        del ddp, state
        gc.collect()
    saved = ckpt["hook"]["residuals"]
    return {"identical": torch.equal(uninterrupted, resumed),
            "max_diff": float((uninterrupted - resumed).abs().max()),
            "saved_shapes": {k: tuple(v.shape) for k, v in saved.items()},
            "saved_nonzero": {k: int((v != 0).sum()) for k, v in saved.items()},
            "saved_topology": ckpt["hook"]["topology"], "outcomes": outcomes}


def bytes_and_faults_worker(rank, world_size):
    """Inter-node bytes of flat against two-level on the same pinned plan; a non-finite
    step; options that do not fit the world."""
    out = {}
    for topology in ("flat", "hierarchical"):
        torch.manual_seed(0)
        model = Net()
        ddp = DDP(model, bucket_cap_mb=0)
        state = omgs_hook.register(ddp, density=DENSITY, strategy="single", warmup_steps=1,
                                   allow_dense=False, select="model", topology=topology,
                                   ranks_per_node=PER_NODE)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        log = []
        for step in range(4):
            x, y = batch(step, rank)
            if step == 2 and rank == 3:
                x[0, 0] = float("inf")
            before = flat_residuals(state)
            opt.zero_grad()
            loss_fn(ddp(x), y).backward()
            after = flat_residuals(state)
            log.append({
                "nonfinite": state.stats()["last"]["nonfinite"],
                "grads_finite": all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()),
                "residual_unchanged": before.keys() == after.keys() and all(
                    torch.equal(before[k], after[k]) for k in before),
            })
            if step != 2:
                opt.step()
        stats = state.stats()
        out[topology] = {"last": stats["last"], "topology": stats["topology"], "log": log,
                         "line": state.summary_line()}
        del ddp, state
        gc.collect()
    errors = {}
    for name, options in {"not dividing": {"ranks_per_node": 3},
                          "unknown topology": {"topology": "ring"},
                          "bad ranks_per_node": {"ranks_per_node": 0}}.items():
        model = Net()
        ddp = DDP(model, bucket_cap_mb=0)
        try:
            omgs_hook.register(ddp, density=DENSITY, **options)
            errors[name] = "no error"
        except ValueError as exc:
            errors[name] = str(exc)
        del ddp
        gc.collect()
    out["errors"] = errors
    return out


# ----------------------------------------------------------------------------- tests
def test_auto_resolution_is_pure_and_names_the_option():
    env = {"LOCAL_WORLD_SIZE": "2"}
    assert resolve_topology("auto", None, 4, 3, env) == Topology("hierarchical", 2, 2, 3, "auto")
    assert resolve_topology("auto", None, 2, 0, env).kind == "flat"  # one node
    assert resolve_topology("auto", 1, 4, 0, env).kind == "flat"  # one rank per node
    assert resolve_topology("auto", None, 4, 0, {}).kind == "flat"  # nothing known
    assert resolve_topology("flat", None, 4, 0, env).kind == "flat"
    topo = resolve_topology("hierarchical", 4, 8, 6, {})
    assert (topo.nodes, topo.node, topo.local_rank) == (2, 1, 2)
    assert resolve_topology("hierarchical", 2, 2, 1, {}).nodes == 1  # one node: allowed
    with pytest.raises(ValueError, match="ranks_per_node"):
        resolve_topology("hierarchical", None, 4, 0, {})
    with pytest.raises(ValueError, match="ranks_per_node.*divide"):
        resolve_topology("auto", 3, 4, 0, {})
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        resolve_topology("auto", None, 4, 0, {"LOCAL_WORLD_SIZE": "3"})
    with pytest.raises(ValueError, match="topology"):
        resolve_topology("tree", None, 4, 0, {})
    with pytest.raises(ValueError, match="ranks_per_node"):
        omgs_hook.OMGSState(ranks_per_node=-1)
    with pytest.raises(ValueError, match="topology"):
        omgs_hook.OMGSState(topology="Hierarchical")
    with pytest.raises(ValueError, match="track_staleness"):
        omgs_hook.OMGSState(topology="hierarchical", track_staleness=True)


def _check_reference(results):
    for r in results:
        assert any(s["dense"] < s["groups"] for s in r["per_step"])  # sparse groups ran
        assert r["worst"]["grad"] < 1e-6, r["worst"]
        assert r["worst"]["residual"] < 1e-6, r["worst"]
        assert r["worst"]["conservation"] < 1e-5, r["worst"]
        assert r["worst"]["parked_changed"] == 0, r["worst"]
        assert torch.equal(r["params"], results[0]["params"])  # every rank agrees
        assert r["stats"]["topology"]["kind"] == "hierarchical"
    assert [r["stats"]["topology"]["local_rank"] for r in results] == [0, 1, 0, 1]
    assert [r["stats"]["topology"]["node"] for r in results] == [0, 0, 1, 1]


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_two_level_matches_reference_across_plan_changes(tmp_path):
    # topology="auto" with torchrun's LOCAL_WORLD_SIZE; the measured selection switches
    # plans between steps (shard boundaries move, residuals migrate). The profile has
    # both link classes, so the planner models the two-level exchange.
    profile = tmp_path / "two_level.json"
    profile.write_text(json.dumps(TWO_LEVEL_PROFILE))
    results = run_ranks("test_hierarchical", "reference_worker", world_size=WORLD, timeout=130,
                        hook_options={"strategy": "optimal", "warmup_steps": 1,
                                      "profile": str(profile)},
                        ddp_options={"gradient_as_bucket_view": True}, steps=9,
                        env_local_world_size=PER_NODE, report_instance=True)
    _check_reference(results)
    assert all(r["stats"]["planned_with"]["two_level_model"] is True for r in results)
    # the profile's measured inter_dense reaches the planner: dense groups are priced by
    # it (times the factor measured_comm found for it, when the window held dense groups)
    factor = results[0]["planned"]["two_level_scale"]["inter_dense"] or 1.0
    measured = {"alpha_s": 9e-4, "beta_s_per_byte": 6e-7}
    for r in results:
        assert r["planned"]["two_level_scale"] == results[0]["planned"]["two_level_scale"]
        for cost in (r["planned"]["hierarchy"]["inter_dense"], r["planned"]["inter_dense_cost"]):
            assert cost == pytest.approx({k: v * factor for k, v in measured.items()},
                                         rel=1e-12), r["planned"]
    steps = results[0]["per_step"]
    assert steps[0]["inter"] > 0 and steps[0]["groups"] == steps[0]["dense"]  # the warm-up
    sparse_steps = [s for s in steps if s["dense"] < s["groups"]]
    assert sparse_steps, steps
    assert max(s["residual_mass"] for s in steps) > 0
    for s in sparse_steps:
        if s["dense"] == 0 and s["exchange"] == "hierarchical":  # (N-1) * payload(k) each
            expected = sum((NODES - 1) * 4 * (2 * max(1, math.ceil(DENSITY * -(-n // PER_NODE))) + 1)
                           for n in s["numels"])
            assert s["inter"] == expected, s
    assert "topology hierarchical 2x2" in results[0]["summary"]


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_two_level_find_unused_parameters_no_sync_and_bf16_gradients():
    results = run_ranks("test_hierarchical", "reference_worker", world_size=WORLD, timeout=130,
                        hook_options={"strategy": "layerwise", "warmup_steps": 1,
                                      "topology": "hierarchical", "ranks_per_node": PER_NODE},
                        ddp_options={"find_unused_parameters": True}, steps=5, accumulate=True,
                        skip_b_on_odd_steps=True, dtype=torch.bfloat16)
    _check_reference(results)
    # the default profile has no intra/inter link classes: planned with the flat costs
    # (with a RuntimeWarning, once), the exchange is two-level all the same
    assert all(r["stats"]["planned_with"]["two_level_model"] is False for r in results)
    assert all(r["two_level_warnings"] == 1 for r in results)


def two_level_bytes(numel, dense):
    """The documented per-rank counts of one two-level group (docs/hierarchical.md)."""
    shard = -(-numel // PER_NODE)
    if dense:
        return (round(2 * 4 * shard * (NODES - 1) / NODES), 2 * (PER_NODE - 1) * 4 * shard)
    payload = 4 * (2 * max(1, math.ceil(DENSITY * shard)) + 1)
    return (NODES - 1) * payload, (PER_NODE - 1) * 4 * shard + (PER_NODE - 1) * NODES * payload


GROUPS = [["c.bias"], ["c.weight"], ["b.bias", "b.weight"], ["a.bias", "a.weight"]]


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_two_level_dense_groups_match_reference():
    # a pinned plan with three dense groups (c.bias: 5 elements, padded shards; c.weight:
    # one bucket, reduced in place once it has no residual; b: two parameters) and one
    # sparse group. The residuals come from an all-sparse run of the same groups, loaded
    # per parameter, so the dense groups first send gradient + residual; b is unused on
    # even steps (find_unused_parameters): at step 0 its loaded residual must stay, at
    # step 1 go out with the dense sum; step 2 is non-finite.
    sparse_plan = {"groups": GROUPS, "dense": [False] * 4}
    mixed_plan = {"groups": GROUPS, "dense": [True, True, True, False]}
    common = {"warmup_steps": 1, "topology": "hierarchical", "ranks_per_node": PER_NODE}
    results = run_ranks("test_hierarchical", "reference_worker", world_size=WORLD, timeout=130,
                        hook_options=dict(common, plan=mixed_plan),
                        ddp_options={"find_unused_parameters": True}, steps=5,
                        skip_b_on_odd_steps=True, skip_b_parity=0, nonfinite_step=2,
                        preload={"options": dict(common, plan=sparse_plan), "steps": 3})
    _check_reference(results)
    sizes = {n: p.numel() for n, p in Net().named_parameters()}
    for r in results:
        steps = r["per_step"]  # the 4 finite steps (the non-finite one is checked below)
        assert [s["dense"] for s in steps] == [3] * 4 and all(s["groups"] == 4 for s in steps)
        assert steps[0]["residual_mass"] > 0
        found = [s["dense_old_mass"] for s in steps]
        # loaded residuals: sent by c's dense groups at step 0; b's kept (unused), sent at 1
        assert found[0]["c.bias"] > 0 and found[0]["c.weight"] > 0 and found[0]["b.weight"] > 0
        assert found[1]["b.weight"] == found[0]["b.weight"] and found[1]["c.weight"] == 0
        assert all(v == 0 for v in found[2].values()), found
        for s in steps:  # the documented counts, dense and sparse
            inter = sum(two_level_bytes(n, True)[0] for n in s["dense_numels"]) + sum(
                two_level_bytes(n, False)[0] for n in s["numels"])
            intra = sum(two_level_bytes(n, True)[1] for n in s["dense_numels"]) + sum(
                two_level_bytes(n, False)[1] for n in s["numels"])
            assert (s["inter"], s["intra"]) == (inter, intra), s
        assert sorted(steps[0]["dense_numels"]) == sorted(
            [sizes["c.bias"], sizes["c.weight"], sizes["b.bias"] + sizes["b.weight"]])
        # the in-place path ran (c.weight is a bucket of its own, even length)
        assert r["dense_paths"]["in_place"] > 0 and r["dense_paths"]["staged"] > 0, r
        bad = r["nonfinite"]
        assert bad["nonfinite"] and bad["dense_groups"] == 3 and not bad["grads_finite"], bad
        assert bad["residual_unchanged"], bad


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_two_level_dense_groups_clip_the_local_gradient_as_the_reference_says():
    # local_clip_norm on the pinned mixed plan (three two-level dense groups, one sparse),
    # with residuals loaded first: each rank's gradient alone is scaled before its
    # residual is added (clipping gradient + residual, or not clipping, fails the
    # comparison); small enough that every group on every rank is clipped
    sparse_plan = {"groups": GROUPS, "dense": [False] * 4}
    mixed_plan = {"groups": GROUPS, "dense": [True, True, True, False]}
    common = {"warmup_steps": 1, "topology": "hierarchical", "ranks_per_node": PER_NODE}
    results = run_ranks("test_hierarchical", "reference_worker", world_size=WORLD, timeout=130,
                        hook_options=dict(common, plan=mixed_plan, local_clip_norm=0.3),
                        ddp_options={"find_unused_parameters": True}, steps=4,
                        skip_b_on_odd_steps=True, skip_b_parity=0,
                        preload={"options": dict(common, plan=sparse_plan), "steps": 3},
                        health_every=1)
    _check_reference(results)
    for r in results:
        steps = r["per_step"]
        assert [s["dense"] for s in steps] == [3] * 4, steps
        # the health figure measures the clipped gradient, on the dense and on the sparse
        # two-level path alike (the sparse one measured it before clipping until 2026-12-06)
        measured = [pair for s in steps if s["health"] for pair in s["health"]]
        assert len(measured) == 4 * 4, steps
        for got_sq, want_sq in measured:
            assert got_sq == pytest.approx(want_sq, rel=1e-5), measured
        assert steps[0]["residual_mass"] > 0
        dense_factors = [f for _, dense, scale in r["clip_factors"] if dense for f in scale]
        assert len(dense_factors) == 4 * 3 * WORLD
        # clipping acts on every dense group of every rank, except b's while it is unused
        # (steps 0 and 2: a zero gradient)
        clipped = [f for f in dense_factors if f < 1.0]
        assert len(clipped) == (4 * 3 - 2) * WORLD and max(clipped) < 0.9, dense_factors
        # staged, never in place: the clipped gradient is not the bucket's
        assert r["dense_paths"]["in_place"] == 0 and r["dense_paths"]["staged"] > 0, r


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_two_level_resume_is_bit_exact_and_topology_is_checked(tmp_path):
    results = run_ranks("test_hierarchical", "resume_worker", world_size=WORLD, timeout=130,
                        ckpt_dir=str(tmp_path), first=5, second=3)
    shapes = dict((n, tuple(p.shape)) for n, p in Net().named_parameters())
    for r in results:
        assert r["identical"], r["max_diff"]
        assert r["saved_topology"] == {"kind": "hierarchical", "nodes": 2, "ranks_per_node": 2}
        assert r["saved_shapes"] == shapes  # full-shaped, per rank
        # zeros outside the shard: each rank holds at most its shard of each group (about
        # half of the gradient; the groups are at most the 6 parameters)
        total = sum(math.prod(s) for s in shapes.values())
        assert 0 < sum(r["saved_nonzero"].values()) <= total // PER_NODE + 6, r["saved_nonzero"]
        kind, text = r["outcomes"]["error"]
        assert kind == "error" and "topology" in text and "reset" in text, text
        assert r["outcomes"]["reset"] == ("loaded", 0.0)


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_inter_node_bytes_nonfinite_step_and_bad_options():
    results = run_ranks("test_hierarchical", "bytes_and_faults_worker", world_size=WORLD,
                        timeout=130)
    numel = sum(p.numel() for p in Net().parameters())
    payload_flat = 4 * (2 * math.ceil(DENSITY * numel) + 1)
    shard = -(-numel // PER_NODE)
    payload_two = 4 * (2 * math.ceil(DENSITY * shard) + 1)
    for r in results:
        flat, two = r["flat"], r["hierarchical"]
        assert flat["topology"]["kind"] == "flat" and two["topology"]["kind"] == "hierarchical"
        # flat: the payload goes to each of the 2 ranks on the other node
        assert flat["last"]["inter_node_bytes"] == payload_flat * (WORLD - PER_NODE)
        assert flat["last"]["intra_node_bytes"] == payload_flat * (PER_NODE - 1)
        # two-level: its own all-gather goes to the 1 other node
        assert two["last"]["inter_node_bytes"] == payload_two * (NODES - 1)
        assert two["last"]["intra_node_bytes"] == (PER_NODE - 1) * 4 * shard + (
            PER_NODE - 1) * NODES * payload_two
        assert "topology hierarchical 2x2 inter-node" in two["line"]
        for topology in ("flat", "hierarchical"):
            log = r[topology]["log"]
            bad = log[2]
            assert bad["nonfinite"] and not bad["grads_finite"] and bad["residual_unchanged"], bad
            for entry in log[:2] + log[3:]:
                assert entry["grads_finite"] and not entry["nonfinite"], entry
            assert not log[3]["residual_unchanged"]
        errors = r["errors"]
        assert "ranks_per_node=3 does not divide the world size 4" in errors["not dividing"]
        assert "topology must be one of" in errors["unknown topology"]
        assert "ranks_per_node must be a positive integer" in errors["bad ranks_per_node"]


def test_train_script_passes_topology_options():
    from script_loader import load_script

    train = load_script("train")
    options = train.hook_options(train.parse_args(["--hook", "omgs"]))
    assert "topology" not in options and "ranks_per_node" not in options  # the library's "auto"
    args = train.parse_args(["--hook", "omgs", "--topology", "hierarchical", "--ranks-per-node", "2"])
    options = train.hook_options(args)
    assert options["topology"] == "hierarchical" and options["ranks_per_node"] == 2
    with pytest.raises(SystemExit):
        train.parse_args(["--hook", "allreduce", "--topology", "flat"])


def test_shard_store_commits_migrates_and_saves_full_shaped():
    from omgs_hook.residual_memory import ResidualMemory

    memory = ResidualMemory()
    memory.note_layout("w", torch.empty(2, 3))
    memory.note_layout("b", torch.empty(3))
    keys, numels = ("w", "b"), (6, 3)
    # local rank 1 of 2: the shard is elements [5, 10) of the 9-element group (1 padding)
    store = memory.shard_store(keys, numels, 5, 5, 10, torch.device("cpu"))
    store.spare.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0, 0.0]))
    memory.stage_shard(store)
    memory.discard_staged()  # a non-finite step: nothing changes
    assert memory.total_norm() == 0.0
    memory.stage_shard(store)
    memory.commit_staged()
    saved = memory.state_dict()
    assert torch.equal(saved["w"], torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 1.0]]))
    assert torch.equal(saved["b"], torch.tensor([2.0, 3.0, 4.0]))
    # the same store again, and a checkpoint of it adopted straight back in
    assert memory.shard_store(keys, numels, 5, 5, 10, torch.device("cpu")) is store
    fresh = ResidualMemory()
    fresh.load_state_dict(saved)
    again = fresh.shard_store(keys, numels, 5, 5, 10, torch.device("cpu"))
    assert fresh.adopt_into_shard(again, list(keys)) == []
    assert torch.equal(again.current, store.current) and fresh.get("w") is None
    # a group with other keys touching "b": the store becomes per-parameter residuals
    memory.migrate_overlapping(("b",))
    assert memory.shard_store(("w",), (6,), 3, 3, 6, torch.device("cpu")) is not store
    assert torch.equal(memory.get("b"), torch.tensor([2.0, 3.0, 4.0]))
    assert torch.equal(memory.get("w"), torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 1.0]))
    # a residual that is not zero outside the new shard cannot be adopted: it is left
    # for the pre-reduce-scatter path
    w_store = memory.shard_store(("w",), (6,), 3, 3, 6, torch.device("cpu"))
    assert memory.adopt_into_shard(w_store, ["w"]) == []  # only element 5: inside [3, 6)
    other = memory.shard_store(("b",), (3,), 0, 2, 4, torch.device("cpu"))
    assert memory.adopt_into_shard(other, ["b"]) == ["b"]  # element 2 lies outside [0, 2)
    assert abs(memory.total_norm() - math.sqrt(1 + 4 + 9 + 16)) < 1e-6


def raise_worker(rank, world_size):
    torch.manual_seed(0)
    model = Net()
    ddp = DDP(model, bucket_cap_mb=0)
    state = omgs_hook.register(ddp, density=DENSITY, warmup_steps=1, topology="hierarchical",
                               ranks_per_node=PER_NODE, nonfinite="raise",
                               plan={"groups": GROUPS, "dense": [True] * len(GROUPS)})
    outcomes = []
    for step in range(4):
        x, y = batch(step, rank)
        if step == 3 and rank == 3:
            x = x.clone()
            x[0, 0] = float("inf")  # one rank's gradient turns non-finite
        try:
            loss_fn(ddp(x), y).backward()
            outcomes.append(None)
        except Exception as exc:  # noqa: BLE001 - the test checks the type
            outcomes.append(f"{type(exc).__name__}: {exc}")
    dense = state.stats()["last"]["group_dense"]
    del ddp, state
    gc.collect()
    return {"outcomes": outcomes, "dense": dense}


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_two_level_dense_groups_raise_on_nonfinite_when_asked():
    results = run_ranks("test_hierarchical", "raise_worker", world_size=WORLD, timeout=130)
    for r in results:
        # steps 0-2 finite (the warm-up, then the pinned plan: every group on the two-level
        # dense path); at step 3 every rank's backward fails with the hook's error, not
        # only rank 3's
        assert r["dense"] == [True] * len(GROUPS), r
        assert r["outcomes"][:3] == [None, None, None], r
        assert r["outcomes"][3] is not None and r["outcomes"][3].startswith(
            "FloatingPointError: omgs_hook: a rank's gradient holds NaN/Inf"), r


def disagreeing_topology_worker(rank, world_size):
    """Rank 3 resolves another topology than ranks 0-2: registration must fail on every
    rank with a ValueError naming the option, before any ``new_group`` waits."""
    from omgs_hook import topology

    out = {}
    for case, odd in (("ranks_per_node 4", {"ranks_per_node": 4}),
                      ("ranks_per_node 1", {"ranks_per_node": 1}),
                      ("flat via register", {"topology": "flat"})):
        options = {"topology": "hierarchical", "ranks_per_node": PER_NODE}
        if rank == 3:
            options.update(odd)
        ddp = DDP(Net(), bucket_cap_mb=0)
        try:
            omgs_hook.register(ddp, density=DENSITY, **options)
            out[case] = "no error"
        except ValueError as exc:
            out[case] = str(exc)
        del ddp
        gc.collect()
    # flat against hierarchical, at the level of the check itself (every rank calls it)
    topo = resolve_topology("flat" if rank == 3 else "hierarchical", PER_NODE, world_size, rank)
    try:
        topology.check_agreement(topo)
        out["flat against hierarchical"] = "no error"
    except ValueError as exc:
        out["flat against hierarchical"] = str(exc)
    # ranks that agree pass; flat ranks may differ in ranks_per_node (only byte labels)
    topology.check_agreement(resolve_topology("hierarchical", PER_NODE, world_size, rank))
    topology.check_agreement(resolve_topology("flat", 4 if rank == 0 else None, world_size, rank))
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_ranks_that_disagree_on_the_topology_fail_clearly_on_every_rank():
    # a short process-group timeout: without the check, new_group would wait for it
    results = run_ranks("test_hierarchical", "disagreeing_topology_worker", world_size=WORLD,
                        timeout=75, pg_timeout_s=20)
    for r in results:  # the same error on every rank, naming the option and both sides
        text = r["ranks_per_node 4"]
        assert text.startswith("ranks_per_node: the ranks resolved different topologies"), text
        assert ("ranks 0-2: hierarchical with ranks_per_node=2 (topology='hierarchical'); "
                "rank 3: hierarchical with ranks_per_node=4") in text, text
        text = r["ranks_per_node 1"]
        assert text.startswith("ranks_per_node:") and "rank 3: hierarchical with " \
            "ranks_per_node=1" in text, text
        text = r["flat via register"]  # the flat rank checks too: nobody waits
        assert text.startswith("topology:") and "rank 3: flat" in text, text
        text = r["flat against hierarchical"]
        assert text.startswith("topology:"), text
        assert "ranks 0-2: hierarchical with ranks_per_node=2" in text, text
        assert "rank 3: flat with ranks_per_node=2 (topology='flat')" in text, text
    assert len({json.dumps(r, sort_keys=True) for r in results}) == 1
