"""``topology="auto"`` on 2 nodes x 2 gloo ranks: the measured selection compares the flat
and the two-level exchange, and switching between them between steps keeps error
feedback exact.

References: ``reference_omgs.reference_step`` (flat) and
``test_hierarchical.two_level_reference`` (two-level), both float64 and sharing nothing
with the library.
"""

import dataclasses
import gc
import os

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import omgs_hook
from ddp_harness import run_ranks
from omgs_hook.plan_selection import MAX_CANDIDATES
from reference_omgs import reference_step
from test_hierarchical import (DENSITY, GROUPS, NODES, PER_NODE, WORLD, Net, batch,
                               flat_residuals, gather, loss_fn, two_level_reference)
from test_hook_ddp import train_into_first_trial
from test_hook_selection import fake_planning_inputs

pytestmark = pytest.mark.multiprocess

ALL = [[k for g in GROUPS for k in g]]
C_TOGETHER = [["c.bias", "c.weight"], ["b.bias", "b.weight"], ["a.bias", "a.weight"]]
# (groups, dense, exchange) per step after the warm-up: flat -> two-level -> flat, with
# dense groups on both sides and shard boundaries that move (one group, then four)
SCHEDULE = [
    (GROUPS, [False] * 4, "flat"),
    (GROUPS, [False] * 4, "hierarchical"),  # flat residuals: added before the reduce-scatter
    (GROUPS, [False] * 4, "hierarchical"),  # the shard stores' own path
    (GROUPS, [False] * 4, "flat"),  # shard stores -> the flat sparse path
    (GROUPS, [False, True, False, False], "hierarchical"),
    (GROUPS, [True, False, True, False], "flat"),  # shard stores -> the flat dense path
    (ALL, [False], "hierarchical"),
    (ALL, [False], "flat"),
    (GROUPS, [False] * 4, "hierarchical"),
    (GROUPS, [False, False, True, False], "flat"),
    # c.bias in local rank 0's shard only; then c.bias alone, dense and flat: local rank
    # 1 has no residual for it (the in-place all-reduce), local rank 0 has (staged)
    (C_TOGETHER, [False] * 3, "hierarchical"),
    (GROUPS, [True, False, False, False], "flat"),
]


def payload(k):
    return 4 * (2 * k + 1)


def expected_inter_bytes(numels, dense, exchange):
    """``inter_node_bytes`` of one step by docs/hierarchical.md's table."""
    import math

    total = 0
    for n, d in zip(numels, dense):
        if exchange == "flat":
            if d:
                total += round(2.0 * 4 * n / WORLD * (WORLD - PER_NODE))
            else:
                total += payload(max(1, math.ceil(DENSITY * n))) * (WORLD - PER_NODE)
        else:
            shard = -(-n // PER_NODE)
            if d:
                total += round(2 * 4 * shard * (NODES - 1) / NODES)
            else:
                total += payload(max(1, math.ceil(DENSITY * shard))) * (NODES - 1)
    return total


def switch_worker(rank, world_size):
    """A pinned plan on topology="auto" whose exchange (and groups) the test changes
    between steps; every step is checked against the reference of the exchange it ran."""
    torch.manual_seed(0)
    model, reference_model = Net(), Net()
    ddp = DDP(model, bucket_cap_mb=0)
    state = omgs_hook.register(ddp, density=DENSITY, warmup_steps=1, topology="auto",
                               ranks_per_node=PER_NODE,
                               plan={"groups": GROUPS, "dense": [False] * 4})
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    worst = {"grad": 0.0, "residual": 0.0, "conservation": 0.0}
    log = []
    for step in range(1 + len(SCHEDULE)):
        if step >= 1:
            groups, dense, exchange = SCHEDULE[step - 1]
            state.plan = dataclasses.replace(
                state.plan, groups=tuple(tuple(g) for g in groups), dense=tuple(dense),
                exchange=exchange)
        x, y = batch(step, rank)
        reference_model.load_state_dict(model.state_dict())
        reference_model.zero_grad()
        loss_fn(reference_model(x), y).backward()
        local = {n: p.grad.reshape(-1).float() for n, p in reference_model.named_parameters()}
        old = flat_residuals(state)
        all_local, all_old = gather(local), gather(old)
        opt.zero_grad()
        loss_fn(ddp(x), y).backward()
        last = state.stats()["last"]
        used = list(zip(last["group_keys"], last["group_dense"]))
        if last["exchange"] == "flat":
            avg, new = reference_step(all_local, all_old, used, last["step_density"])
        else:
            avg, new = two_level_reference(all_local, all_old, used, last["step_density"],
                                           PER_NODE)
        got = flat_residuals(state)
        all_new = gather(got)
        for name, p in model.named_parameters():
            worst["grad"] = max(worst["grad"], float(
                (p.grad.reshape(-1).double() - avg[name].double()).abs().max()))
            mine = got.get(name, torch.zeros(p.numel())).double()
            worst["residual"] = max(worst["residual"],
                                    float((mine - new[rank][name].double()).abs().max()))
            # the whole error-feedback mass: what every rank had, and its gradient, is
            # what was applied (W times the average) plus what every rank keeps
            lhs = sum(all_local[r][name].double() + all_old[r].get(name, torch.zeros(p.numel()))
                      .double() for r in range(world_size))
            rhs = world_size * p.grad.reshape(-1).double() + sum(
                all_new[r].get(name, torch.zeros(p.numel())).double() for r in range(world_size))
            worst["conservation"] = max(worst["conservation"], float((lhs - rhs).abs().max()))
        numels = [sum(sizes[k] for k in keys) for keys in last["group_keys"]]
        log.append({"exchange": last["exchange"], "inter": last["inter_node_bytes"],
                    "expected_inter": expected_inter_bytes(numels, last["group_dense"],
                                                           last["exchange"]),
                    "plan_exchange": state.stats()["plan"]["exchange"]
                    if state.plan is not None else None,
                    "mass": sum(float(v.abs().sum()) for v in got.values()),
                    "line": state.summary_line()})
        opt.step()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    del ddp, state
    gc.collect()
    return {"worst": worst, "log": log, "params": params}


@pytest.mark.timeout(180)
def test_switching_exchanges_between_steps_conserves_error_feedback():
    results = run_ranks("test_exchange_selection", "switch_worker", world_size=WORLD,
                        timeout=160)
    for r in results:
        assert r["worst"]["grad"] < 1e-6, r["worst"]
        assert r["worst"]["residual"] < 1e-6, r["worst"]
        assert r["worst"]["conservation"] < 1e-5, r["worst"]
        assert torch.equal(r["params"], results[0]["params"])
        log = r["log"]
        # the warm-up runs the registration's (two-level) exchange, then the schedule's
        assert [e["exchange"] for e in log] == ["hierarchical"] + [s[2] for s in SCHEDULE]
        assert [e["plan_exchange"] for e in log[1:]] == [s[2] for s in SCHEDULE]
        for e in log:  # bytes by the exchange each step really used
            assert e["inter"] == e["expected_inter"], e
        assert all(e["mass"] > 0 for e in log[1:])
        assert log[4]["line"].endswith("exchange flat"), log[4]["line"]
        assert log[3]["line"].endswith("exchange hierarchical"), log[3]["line"]


def fake_cost(rank, plan):
    """Seconds a step takes on ``rank``: the flat exchange is 4 ms faster; under the
    model's choice rank 2 is slow (so the slowest rank decides against it)."""
    if plan is None:
        return 0.01
    base = 0.010 + 0.001 * len(plan.groups) + 0.0025 * sum(plan.dense)
    if plan.exchange == "flat":
        base -= 0.004
    if plan.strategy == "optimal" and rank == 2:
        base += 0.05
    return base


class FakeClock:
    def __init__(self, state, rank):
        self.state, self.rank = state, rank
        self.now = 1e4 * rank  # other origins and rates per rank
        self.rate = 1.0 + 0.25 * rank

    def __call__(self):
        self.now += self.rate * fake_cost(self.rank, self.state.plan)
        return self.now


def expected_winner(report):
    from omgs_hook.group_plan import GroupPlan

    def cost(entry, rank):
        plan = GroupPlan(groups=tuple(tuple(g) for g in entry["groups"]),
                         dense=tuple(entry["dense"]), layout=(), strategy=entry["name"],
                         predicted_iteration_s=0.0, made_at_step=0, exchange=entry["exchange"])
        return (1.0 + 0.25 * rank) * fake_cost(rank, plan)

    slowest = [max(cost(e, r) for r in range(WORLD)) for e in report["candidates"]]
    best = min(range(len(slowest)), key=lambda i: (slowest[i], i))
    return report["candidates"][best]["name"], slowest


def build(rank, **options):
    torch.manual_seed(0)
    model = Net()
    ddp = DDP(model, bucket_cap_mb=0)
    state = omgs_hook.register(ddp, density=DENSITY, warmup_steps=2, **options)
    state._clock = FakeClock(state, rank)
    state._load_probe = lambda: 0.01  # no load spell: the fake clock decides
    # the model's inputs fixed too: measured per-group work can price the flat
    # candidates of this small net over PRUNE_FACTOR times the best and leave them out
    fake_planning_inputs(state)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, ddp, state, opt


def train(ddp, opt, start, stop, rank):
    for step in range(start, stop):
        x, y = batch(step, rank)
        opt.zero_grad()
        loss_fn(ddp(x), y).backward()
        opt.step()


def trial_worker(rank, world_size, steps, ckpt_dir=None, save_at=False):
    os.environ["LOCAL_WORLD_SIZE"] = str(PER_NODE)  # as torchrun sets it
    out = {}
    # an explicit topology="hierarchical": the trial's candidates are all two-level
    model, ddp, state, opt = build(rank, topology="hierarchical")
    # until the trial starts (after the sparse lead)
    train_into_first_trial(state, lambda start, stop: train(ddp, opt, start, stop, rank), 20,
                           into=0)
    trial = state.stats()["selection"]["trial"]
    out["explicit"] = [(c["name"], c["exchange"]) for c in trial["candidates"]]
    del ddp, state, model, opt
    gc.collect()

    model, ddp, state, opt = build(rank)  # topology="auto"
    if not save_at:
        train(ddp, opt, 0, steps, rank)
    else:  # saved after the second step of the first flat candidate (mid-trial)
        flat_steps = 0
        for save_at in range(1, steps):
            train(ddp, opt, save_at - 1, save_at, rank)
            flat_steps += state.plan is not None and state.plan.exchange == "flat"
            if flat_steps == 2:
                break
        out["saved_in_trial"] = state.stats()["selection"]["trial"] is not None
        out["saved_plan_exchange"] = state.plan.exchange
        path = os.path.join(ckpt_dir, f"rank{rank}.pt")
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                    "hook": state.state_dict()}, path)
        train(ddp, opt, save_at, steps, rank)
    stats = state.stats()
    out["params"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    del ddp, state, model, opt
    gc.collect()
    out["stats"] = stats
    if save_at:
        model, ddp, state, opt = build(rank)
        ckpt = torch.load(path, weights_only=True)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        state.load_state_dict(ckpt["hook"])
        out["resumed_plan_exchange"] = state.plan.exchange
        train(ddp, opt, save_at, steps, rank)
        out["resumed_params"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        out["resumed_stats"] = state.stats()
        del ddp, state, model, opt
        gc.collect()
    return out


def _check_trial(results):
    stats = [r["stats"] for r in results]
    report = stats[0]["selection"]["last_trial"]
    assert report is not None and stats[0]["selection"]["trial"] is None
    for s in stats[1:]:  # the same decision, plan and exchange everywhere
        assert s["selection"]["last_trial"] == report
        assert s["plan"] == stats[0]["plan"] and s["plan_history"] == stats[0]["plan_history"]
        assert s["last"]["exchange"] == stats[0]["last"]["exchange"]
    for r in results:
        assert torch.equal(r["params"], results[0]["params"])
    names = [c["name"] for c in report["candidates"]]
    exchanges = {c["name"]: c["exchange"] for c in report["candidates"]}
    assert names[0] == "optimal" and exchanges["optimal"] == "hierarchical", names
    flat = [n for n in names if n.startswith("flat:")]
    assert flat and names[-len(flat):] == flat, names  # the flat ones come last
    assert all(exchanges[n] == "flat" for n in flat)
    assert all(exchanges[n] == "hierarchical" for n in names if n not in flat)
    assert len(names) <= MAX_CANDIDATES
    winner, _ = expected_winner(report)
    assert report["winner"] == winner and winner.startswith("flat:"), (winner, names)
    plan = stats[0]["plan"]
    assert plan["strategy"] == winner and plan["exchange"] == "flat"
    assert stats[0]["last"]["exchange"] == "flat"  # the winner's exchange really runs
    history = stats[0]["plan_history"]
    assert history[-1]["reason"] == "trial winner" and history[-1]["exchange"] == "flat"
    tried = {h["strategy"]: h["exchange"] for h in history if h["reason"] == "trial"}
    assert tried == {n: exchanges[n] for n in tried} and set(flat) <= set(tried)
    return report


@pytest.mark.timeout(300)
def test_the_trial_picks_a_flat_candidate_on_every_rank_and_explicit_topology_adds_none():
    results = run_ranks("test_exchange_selection", "trial_worker", world_size=WORLD,
                        timeout=280, steps=48)
    _check_trial(results)
    for r in results:
        assert r["explicit"] == results[0]["explicit"]
        assert len(r["explicit"]) >= 2
        assert all(exchange == "hierarchical" and not name.startswith("flat:")
                   for name, exchange in r["explicit"]), r["explicit"]


@pytest.mark.timeout(420)
def test_resume_during_a_trial_with_flat_candidates_is_bit_exact(tmp_path):
    # saved while a flat candidate runs (its residuals per parameter; the two-level
    # candidates of the later rounds then start from them)
    results = run_ranks("test_exchange_selection", "trial_worker", world_size=WORLD,
                        timeout=400, steps=48, ckpt_dir=str(tmp_path), save_at=True)
    _check_trial(results)
    for r in results:
        assert r["saved_in_trial"] and r["saved_plan_exchange"] == "flat", r["saved_plan_exchange"]
        assert torch.equal(r["params"], r["resumed_params"])
        assert r["resumed_plan_exchange"] == r["saved_plan_exchange"]
        a, b = r["stats"], r["resumed_stats"]
        # (the model check after the trial re-predicts the winner from measured times)
        assert ({k: v for k, v in a["plan"].items() if k != "predicted_iteration_s"}
                == {k: v for k, v in b["plan"].items() if k != "predicted_iteration_s"})
        assert a["plan_history"] == b["plan_history"]
        # (the first step after the resume has no previous step end: one sample
        # fewer, by design)
        ta, tb = a["selection"]["last_trial"], b["selection"]["last_trial"]
        assert ta["winner"] == tb["winner"]
        assert [(c["name"], c["exchange"], c["groups"]) for c in ta["candidates"]] == [
            (c["name"], c["exchange"], c["groups"]) for c in tb["candidates"]]
