"""Measured plan selection and pinned plans under real DDP (gloo, CPU, 2 ranks).

Step times are made deterministic with a fake clock per rank (``state._clock``, read at
the end of every step): it advances by a cost that depends on the plan in use and
on the rank, and rank 1's clock has another origin and rate. The decision must come
from the gathered numbers, so both ranks pick the same winner: the plan whose *slowest*
rank is fastest.
"""

import gc
import json
import math
import os

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import omgs_hook
from omgs_hook import background_planner, plan_selection
from omgs_hook.hook import OVERHEAD_SETTLE_STEPS, PLAN_LAG
from ddp_harness import run_ranks
from test_hook_ddp import (DENSITY, Net, _train_planner_settled, batch, loss_fn,
                           train_into_first_trial, train_steps, train_until)

pytestmark = pytest.mark.multiprocess


def fake_cost(rank, plan):
    """Seconds one step takes on ``rank`` with ``plan`` (a GroupPlan or None).

    Rank 0 alone would keep the model's choice (named after the strategy, "optimal");
    rank 1 is slow under it, so on the slowest-rank measure the model's choice loses."""
    if plan is None:
        return 0.01
    base = 0.010 + 0.001 * len(plan.groups) + 0.0025 * sum(plan.dense)
    if plan.strategy == "optimal":
        return base - 0.009 if rank == 0 else base + 0.05
    return base


class FakeClock:
    def __init__(self, state, rank):
        self.state, self.rank = state, rank
        # rank 1's clock has another origin and runs 1.5x fast
        self.now = 1e5 * rank
        self.rate = 1.0 + 0.5 * rank

    def __call__(self):
        # called when a step ends: the plan in use is that step's
        self.now += self.rate * fake_cost(self.rank, self.state.plan)
        return self.now


def fake_planning_inputs(state, bucket_s=0.002, forward_s=0.004, tail_s=0.001, scale=None,
                         overhead=None):
    """Make the model's predictions deterministic: every re-plan's row of measured numbers
    (``state._planning_row``) gets fixed backward, forward and tail times and reports none
    of the optional measurements (online comm refit, the hook's per-group work, the
    measured collectives, the per-step timelines, the forward's load). The step time stays
    (it comes from the fake clock). With the predictions taken from really measured
    times, a loaded host could price one candidate far off, and a check of how well the
    refit predicts the trial depended on the host (it failed CI, 2026-12-04). ``scale``:
    a function of the step number that multiplies the three compute times (a workload
    that changes). ``overhead``: the hook's per-group work and write-back as known
    ``(a, b)`` lines (else unknown, which makes the hook re-plan for them after a plan
    switch without a trial)."""
    real = state._planning_row

    def planning_row(layout):
        row, meta = real(layout)
        row = row.copy()
        n = len(layout)
        factor = 1.0 if scale is None else scale(state.step)
        row[:n] = bucket_s * factor
        row[n], row[n + 1] = forward_s * factor, tail_s * factor
        row[n + 2:meta["step_at"]] = 0.0  # the optional (a, b, known) triples: unknown
        if overhead is not None:  # (the refit's triple first, then these two)
            for i, (a, b) in enumerate(overhead, start=1):
                row[n + 2 + 3 * i:n + 5 + 3 * i] = (a, b, 1.0)
        row[meta["load_at"]:meta["load_at"] + 2] = 0.0
        row[meta["comm_at"]:meta["width"]] = 0.0  # no measured collectives (two-level too)
        row[meta["width"]:] = -1.0  # no timelines: the rank-mean of the numbers above
        return row, meta

    state._planning_row = planning_row


def build(rank, fake_clock=True, fake_inputs=False, **options):
    torch.manual_seed(0)
    model = Net()
    ddp = DDP(model, bucket_cap_mb=0)
    options.setdefault("warmup_steps", 2)
    # every parameter of Net is under 1024 elements: with the floor for sparse groups
    # every candidate would be all dense, and the trials these tests are about could
    # shrink to one candidate (tests/test_sparse_floor.py tests the floor)
    options.setdefault("min_sparse_numel", 0)
    state = omgs_hook.register(ddp, density=DENSITY, **options)
    if fake_clock:
        state._clock = FakeClock(state, rank)
        state._load_probe = lambda: 0.01  # no load spell: the fake clock decides
    if fake_inputs:
        fake_planning_inputs(state)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, ddp, state, opt


def selection_worker(rank, world_size, steps, duel_pairs=None, clock=None, **options):
    if duel_pairs is not None:
        plan_selection.DUEL_PAIRS = duel_pairs  # (the Trial's default, read at its creation)
    model, ddp, state, opt = build(rank, **options)
    if clock is not None:
        state._clock = globals()[clock](state, rank)
    train_steps(ddp, opt, 0, steps, rank)
    stats = state.stats()
    summary = state.summary_line()
    del ddp, state
    gc.collect()
    return {"stats": stats, "summary": summary}


def expected_winner(report, world_size):
    """The candidate whose slowest rank is fastest under fake_cost (ties: lower index)."""
    from omgs_hook.group_plan import GroupPlan

    def cost(entry, rank):
        plan = GroupPlan(groups=tuple(tuple(g) for g in entry["groups"]),
                         dense=tuple(entry["dense"]), layout=(), strategy=entry["name"],
                         predicted_iteration_s=0.0, made_at_step=0)
        return (1.0 + 0.5 * rank) * fake_cost(rank, plan)

    slowest = [max(cost(e, r) for r in range(world_size)) for e in report["candidates"]]
    best = min(range(len(slowest)), key=lambda i: (slowest[i], i))
    return report["candidates"][best]["name"], slowest


@pytest.mark.timeout(180)
def test_trial_is_identical_on_every_rank_and_the_slowest_rank_decides():
    # the model's inputs are fixed too (fake_planning_inputs): the refit check at the end
    # compares its predictions with the model's, which must not come from the host's load
    results = run_ranks("test_hook_selection", "selection_worker", world_size=2, steps=84,
                        fake_inputs=True, duel_pairs=4)
    stats = [r["stats"] for r in results]
    report = stats[0]["selection"]["last_trial"]
    assert report is not None and stats[0]["selection"]["trial"] is None
    # the schedule, the measurements (gathered) and the decision are the same everywhere
    assert report == stats[1]["selection"]["last_trial"]
    assert stats[0]["plan_history"] == stats[1]["plan_history"]
    assert stats[0]["plan"] == stats[1]["plan"]
    names = [c["name"] for c in report["candidates"]]
    # how many candidates survive the model's pruning (PRUNE_FACTOR) depends on the
    # model's inputs (fixed here); the set itself is tested in test_plan_selection.py
    assert names[0] == "optimal" and len(names) >= 2, names
    assert len({(json.dumps(c["groups"]), json.dumps(c["dense"])) for c in report["candidates"]}) == len(names)
    winner, slowest = expected_winner(report, 2)
    assert report["winner"] == winner == stats[0]["plan"]["strategy"]
    # the model's choice lost (rank 0 alone would have kept it: its clock says it is the
    # fastest there), and the measured times are rank 1's, read on its 1.5x clock
    assert winner != "optimal"
    for entry, expected in zip(report["candidates"], slowest):
        assert entry["measured_s"] == pytest.approx(expected, rel=1e-6), entry
        assert entry["samples"] >= 2 and entry["predicted_s"] > 0
    history = stats[0]["plan_history"]
    trial_entries = [h for h in history if h["reason"] == "trial"]
    assert [h["strategy"] for h in trial_entries][:len(names)] == names
    # from step 4 the model's best sparse plan runs (its per-group work unknown: the
    # fake inputs report none), the "overhead" re-plan OVERHEAD_SETTLE_STEPS later makes
    # the candidates, PLAN_LAG steps later the trial starts with no lead of its own; then
    # one settle and one counted step per screen turn
    assert history[0]["reason"] == "sparse lead" and history[0]["step"] == 4, history[0]
    assert history[0]["strategy"] == "optimal-sparse" and not any(history[0]["dense"])
    start, per = 4 + OVERHEAD_SETTLE_STEPS + PLAN_LAG, 2
    assert report["lead"] == 0 and report["reason"] == "first"
    assert [h["step"] for h in trial_entries][:len(names)] == (
        [start + per * i for i in range(len(names))])
    # the second pass runs them back in reverse order
    assert [h["strategy"] for h in trial_entries][len(names):2 * len(names) - 1] == names[-2::-1]
    assert history[-1]["reason"] == "trial winner" and history[-1]["strategy"] == winner
    # the winner and the runner-up of the last round ran side by side (W R, R W, ...);
    # the fake clock's winner stays the faster
    duel = report["duel"]
    assert duel["winner"] == winner and duel["pairs"] == 4 and duel["switched"] is False
    assert duel["rival"] in names and duel["rival"] != winner and duel["median_ratio"] > 1.0
    # W R, R W, W R, R W: a plan change is noted where the plan changes
    assert [h["strategy"] for h in trial_entries[-4:]] == [duel["rival"], winner] * 2
    # (the first plan's and the "overhead" re-plan's)
    assert stats[0]["total"]["trials"] == 1 and stats[0]["total"]["replans"] == 2
    assert stats[0]["step_s"] is not None
    # the model is refitted from the trial, identically on every rank; the refit predicts
    # the candidates better than the model did
    correction = stats[0]["cost_correction"]
    assert correction is not None and correction == stats[1]["cost_correction"]
    check = stats[0]["model_check"]
    if check is None:
        assert correction == report["correction"]
    else:  # the model check after the trial refitted it against the model of then
        assert check == stats[1]["model_check"] and check["correction"] == correction
    # (in absolute errors, leaving out the candidate furthest above the refit line, as the
    # fit does: plan_selection._least_absolute. The model's inputs are fixed by
    # fake_planning_inputs: with really measured ones, a loaded host priced one candidate
    # 25 ms above its fake time, and that point - below the zero line, above the refit's -
    # made this check fail 2 of 5 full suites and once in CI: 0.0599 after, 0.0344 before)
    outlier = max(report["candidates"], key=lambda c: c["measured_s"] - c["refit_s"])
    others = [c for c in report["candidates"] if c is not outlier]
    before = sum(abs(c["measured_s"] - c["predicted_s"]) for c in others)
    after = sum(abs(c["measured_s"] - c["refit_s"]) for c in others)
    assert after < before, (after, before)


class MisleadingPhaseClock(FakeClock):
    """FakeClock where the plan that is fastest on the fake costs runs 1.2x slow on every
    rank during the trial's rounds before the duel - a phase of the host over its turns
    that the forward does not show - and at its own speed in the duel and after."""

    def __call__(self):
        trial, plan = self.state._trial, self.state.plan
        cost = fake_cost(self.rank, plan)
        if trial is not None and plan is not None and trial.round_kinds[-1] != "duel":
            best, _ = expected_winner(trial.report(), 2)
            if plan.strategy == best:
                cost *= 1.2
        self.now += self.rate * cost
        return self.now


@pytest.mark.timeout(180)
def test_the_duel_corrects_a_trial_misled_by_a_phase_over_the_best_plans_turns():
    results = run_ranks("test_hook_selection", "selection_worker", world_size=2, steps=100,
                        fake_inputs=True, duel_pairs=4, clock="MisleadingPhaseClock")
    stats = [r["stats"] for r in results]
    report = stats[0]["selection"]["last_trial"]
    assert report is not None and report == stats[1]["selection"]["last_trial"]
    best, slowest = expected_winner(report, 2)
    names = [c["name"] for c in report["candidates"]]
    measured = {c["name"]: c["measured_s"] for c in report["candidates"]}
    # the rounds before read the best plan 1.2x slow and put another ahead of it ...
    assert measured[best] == pytest.approx(1.2 * slowest[names.index(best)], rel=1e-6)
    duel = report["duel"]
    assert duel["winner"] != best and duel["rival"] == best, (duel, measured)
    # ... side by side it is faster, it takes over, identically on both ranks
    assert duel["switched"] is True and duel["median_ratio"] < 1.0
    assert report["winner"] == best == stats[0]["plan"]["strategy"] == stats[1]["plan"]["strategy"]
    assert stats[0]["plan_history"] == stats[1]["plan_history"]
    assert "side by side" in results[0]["summary"]


class SpellClock(FakeClock):
    """FakeClock with a load spell over the screen turns of the trial's would-be winner:
    its first 4 steps (both passes' settle and counted steps) take twice as
    long on every rank, and so does the load probe (10 ms quiet). The real
    forward times the hook offered as probes are kept in ``real``."""

    def __init__(self, state, rank):
        super().__init__(state, rank)
        self.victim, self.hits, self.in_spell, self.real = None, 0, False, []

    def __call__(self):
        trial = self.state._trial
        if trial is not None and self.victim is None:
            self.victim = expected_winner(trial.report(), 2)[0]
        plan = self.state.plan
        self.in_spell = (trial is not None and plan is not None
                         and plan.strategy == self.victim and self.hits < 4)
        self.hits += self.in_spell
        self.now += self.rate * fake_cost(self.rank, plan) * (2.0 if self.in_spell else 1.0)
        return self.now

    def probe(self):
        self.real.append(self.state.meter.forward_in_progress_s())
        return 0.02 if self.in_spell else 0.01


def spell_worker(rank, world_size, steps, spell_factor, adjust_pace=True):
    from omgs_hook import plan_selection
    plan_selection.SPELL_FACTOR = spell_factor  # (the Trial's defaults, read at its creation)
    plan_selection.ADJUST_PACE = adjust_pace
    plan_selection.DUEL_PAIRS = 0  # (the rounds' retake is tested)
    # (fixed model inputs: a trial with a full set, see resume_in_trial_worker)
    model, ddp, state, opt = build(rank, fake_inputs=True)
    clock = state._clock = SpellClock(state, rank)
    state._load_probe = clock.probe
    train_steps(ddp, opt, 0, steps, rank)
    stats = state.stats()
    del ddp, state
    gc.collect()
    return {"stats": stats, "victim": clock.victim, "hits": clock.hits, "real": clock.real}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("guard", [True, False])
def test_a_load_spell_in_the_trial_is_seen_by_the_probe_and_retaken(guard):
    # (without the guard the pace is off too: it would divide the spell's steps by their
    # doubled forwards)
    results = run_ranks("test_hook_selection", "spell_worker", world_size=2, steps=70,
                        spell_factor=plan_selection.SPELL_FACTOR if guard else 1e9,
                        adjust_pace=guard)
    stats = [r["stats"] for r in results]
    report = stats[0]["selection"]["last_trial"]
    assert report is not None and report == stats[1]["selection"]["last_trial"]
    victim = results[0]["victim"]
    assert victim is not None and results[0]["hits"] == 4
    disturbed = {c["name"]: c["disturbed"] for c in report["candidates"]}
    if guard:
        # the spell's two counted steps were seen, the candidate ran again, and it won
        assert report["retaken"] == [victim] and disturbed[victim] == 2
        assert sum(disturbed.values()) == 2
        assert report["winner"] == victim == stats[0]["plan"]["strategy"]
    else:  # the same spell without the guard: nothing is seen or retaken
        assert report["retaken"] == [] and sum(disturbed.values()) == 0
        # and the victim loses its screen round whenever another candidate beats its
        # doubled time by more than the confirm window (closer, it is measured again,
        # undisturbed, in the confirm round, which it may win). How many candidates
        # survive the model's pruning depends on the really measured backward times:
        # with only the model's choice besides it (rank 1's +50 ms makes that one slower
        # than any doubled plan) it still wins.
        _, slowest = expected_winner(report, 2)
        names = [c["name"] for c in report["candidates"]]
        doubled = 2 * slowest[names.index(victim)]
        best_other = min(t for n, t in zip(names, slowest) if n != victim)
        if doubled > (1 + plan_selection.CONFIRM_WINDOW) * best_other:
            assert report["winner"] != victim
        elif doubled <= best_other:
            assert report["winner"] == victim
        else:  # within the confirm window: the confirm round decides
            assert report["winner"] in names
    # the hook's real probe on CPU: this step's forward, measured at bucket 0
    for r in results:
        assert r["real"] and all(x is not None and 0 < x < 5 for x in r["real"]), r["real"]


class PhaseClock(FakeClock):
    """FakeClock with a slow phase of the host over every step of the trial's would-be
    winner: its steps take 1.25x as long, and so do their forwards (10 ms otherwise).
    The forward the hook asks for at bucket 0 of step N is step N's."""

    def __init__(self, state, rank):
        super().__init__(state, rank)
        self.victim = None

    def _victim(self):
        trial = self.state._trial
        if trial is not None and self.victim is None:
            self.victim = expected_winner(trial.report(), 2)[0]
        return self.victim

    def __call__(self):
        plan = self.state.plan
        slow = plan is not None and self.state._trial is not None and \
            plan.strategy == self._victim()
        self.now += self.rate * fake_cost(self.rank, plan) * (1.25 if slow else 1.0)
        return self.now

    def probe(self):
        trial = self.state._trial
        index = None if trial is None else trial.candidate_at(self.state.step)
        slow = index is not None and trial.candidates[index].name == self._victim()
        return 0.0125 if slow else 0.01


def phase_worker(rank, world_size, steps, adjust_pace):
    plan_selection.ADJUST_PACE = adjust_pace
    plan_selection.DUEL_PAIRS = 0  # (the rounds' pace is tested; the phase lasts the trial)
    model, ddp, state, opt = build(rank, fake_inputs=True)  # (a trial: see above)
    clock = state._clock = PhaseClock(state, rank)
    state._load_probe = clock.probe
    trial = None
    for step in range(steps):
        train_steps(ddp, opt, step, step + 1, rank)
        trial = state._trial or trial  # (the hook lets go of it once decided)
    stats = state.stats()
    del ddp, state
    gc.collect()
    return {"stats": stats, "victim": clock.victim, "trial": trial.state_dict()}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("adjust_pace", [True, False])
def test_a_step_is_divided_by_the_pace_of_its_own_forward(adjust_pace):
    """The host runs the would-be winner's steps 25% slow, their forwards too. With the
    pace each step is divided by its own forward's pace (the next step's forward
    belongs to another candidate's turn at every screen turn's end): in every round the
    would-be winner's pace is 1.25x the others', and the winner is the fastest plan."""
    results = run_ranks("test_hook_selection", "phase_worker", world_size=2, steps=62,
                        adjust_pace=adjust_pace)
    stats = [r["stats"] for r in results]
    report = stats[0]["selection"]["last_trial"]
    assert report is not None and report == stats[1]["selection"]["last_trial"]
    victim = results[0]["victim"]
    assert victim is not None and len(report["candidates"]) >= 2
    _, slowest = expected_winner(report, 2)
    state = results[0]["trial"]
    names = [c["name"] for c in report["candidates"]]
    for i, (samples, paces) in enumerate(zip(state["samples"], state["paces"])):
        phase = 1.25 if names[i] == victim else 1.0
        assert samples and len(samples) == len(paces)
        # every sample is the slowest rank's step (the fake cost, in the phase) divided
        # by the pace it was given
        for x, pace in zip(samples, paces):
            if not math.isnan(x):  # (a step with no time, e.g. after a resume)
                assert x * pace == pytest.approx(slowest[i] * phase, rel=1e-6)
        if not adjust_pace:
            assert set(paces) == {1.0}
    if adjust_pace:
        # within each round (one reference forward for all) the victim's pace is 1.25x
        # every other candidate's: the pace is the step's own forward
        at = [0] * len(names)
        for samples in state["round_samples"]:  # (no spells here: no retake rounds)
            paces = {}
            for index, values in samples:
                paces[index] = state["paces"][index][at[index]:at[index] + len(values)]
                at[index] += len(values)
            v = names.index(victim)
            for index, values in paces.items():
                expected = 1.0 if index == v else 1.0 / 1.25
                for p in values:
                    assert p / paces[v][0] == pytest.approx(expected), (index, paces)
        assert report["winner"] == victim


@pytest.mark.timeout(180)
def test_select_model_keeps_the_model_choice():
    results = run_ranks("test_hook_selection", "selection_worker", world_size=2, steps=12,
                        select="model", allow_dense=False)
    stats = results[0]["stats"]
    assert stats["selection"]["last_trial"] is None and stats["total"]["trials"] == 0
    assert stats["plan"]["strategy"] == "optimal"
    assert [h["reason"] for h in stats["plan_history"]] == ["model"] * len(stats["plan_history"])


@pytest.mark.timeout(180)
def test_gradients_after_plan_switches_equal_the_reference():
    # the real clock: whichever plan wins, every step must match the reference (the
    # model's inputs fixed, so that a trial runs: measured ones can price every other
    # plan of this small net over PRUNE_FACTOR times the model's choice)
    results = run_ranks("test_hook_ddp", "check_against_reference", world_size=2,
                        fixed_inputs=True,
                        hook_options={"strategy": "optimal", "warmup_steps": 1}, ddp_options={},
                        steps=16)
    for r in results:
        assert r["worst"]["grad"] < 1e-6, r["worst"]
        assert r["worst"]["residual"] < 1e-6, r["worst"]
        assert r["worst"]["conservation"] < 1e-5, r["worst"]
    history = results[0]["stats"]["plan_history"]
    used = {(json.dumps(h["groups"]), json.dumps(h["dense"])) for h in history}
    assert len(used) >= 3, history  # the trial switched plans between steps
    assert history == results[1]["stats"]["plan_history"]


def save_train_and_resume(rank, model, ddp, state, opt, ckpt_dir, first, total, probe):
    """Checkpoint at step ``first`` and train on to ``total``; then a new hook (fixed model
    inputs, as the callers') resumed from the checkpoint trains to ``total`` again.
    ``identical``: the two runs' parameters bit for bit; ``stats``: both runs'; ``probe``:
    ``probe(state)`` of the resumed hook right after the load."""
    path = os.path.join(ckpt_dir, f"rank{rank}.pt")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()}, path)
    train_steps(ddp, opt, first, total, rank)
    uninterrupted = {n: p.detach().clone() for n, p in model.named_parameters()}
    stats_a = state.stats()
    del ddp, state, model, opt
    gc.collect()

    model, ddp, state, opt = build(rank, fake_inputs=True)
    ckpt = torch.load(path, weights_only=True)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    state.load_state_dict(ckpt["hook"])
    probed = probe(state)
    train_steps(ddp, opt, first, total, rank)
    resumed = {n: p.detach().clone() for n, p in model.named_parameters()}
    stats_b = state.stats()
    del ddp, state
    gc.collect()
    return {"identical": all(torch.equal(uninterrupted[n], resumed[n]) for n in uninterrupted),
            "stats": (stats_a, stats_b), "probe": probed}


def resume_in_trial_worker(rank, world_size, ckpt_dir, total, into_duel=False):
    plan_selection.DUEL_PAIRS = 4  # (read when the trial starts, and by the resumed one)
    # fixed model inputs: a candidate set with a runner-up within 30% for the duel, and a
    # trial at all (measured per-group work can price every other plan of this small net
    # over PRUNE_FACTOR times the model's choice: then no trial runs)
    model, ddp, state, opt = build(rank, fake_inputs=True)
    # checkpoint 3 steps into the trial's screen (after the sparse lead, the trial has
    # no lead of its own), or 3 steps into its duel: when it starts and how long it runs
    # depend on
    # how many candidates survive the model's pruning (really measured backward times);
    # the trial state is gathered, so every rank stops at the same step
    first = train_into_first_trial(
        state, lambda start, stop: train_steps(ddp, opt, start, stop, rank), total - 2, into=0)
    while into_duel and state._trial is not None and state._trial.round_kinds[-1] != "duel":
        train_steps(ddp, opt, first, first + 1, rank)
        first += 1
    into = 3
    train_steps(ddp, opt, first, first + into, rank)
    first += into
    in_trial = state.stats()["selection"]["trial"] is not None
    in_duel = in_trial and state._trial.round_kinds[-1] == "duel"
    out = save_train_and_resume(rank, model, ddp, state, opt, ckpt_dir, first, total,
                                lambda resumed: resumed.stats()["selection"]["trial"] is not None)
    stats_a, stats_b = out["stats"]
    return {"in_trial": in_trial, "in_duel": in_duel, "resumed_in_trial": out["probe"],
            "identical": out["identical"],
            "winner": (stats_a["selection"]["last_trial"]["winner"],
                       stats_b["selection"]["last_trial"]["winner"]),
            "history": (stats_a["plan_history"], stats_b["plan_history"]),
            "residual": (stats_a["residual_norm"], stats_b["residual_norm"]), "first": first}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("into_duel", [False, True])
def test_checkpoint_and_resume_during_a_trial_is_bit_exact(tmp_path, into_duel):
    results = run_ranks("test_hook_selection", "resume_in_trial_worker", world_size=2,
                        ckpt_dir=str(tmp_path), total=100, into_duel=into_duel)
    assert results[0]["first"] == results[1]["first"] < 80
    for r in results:
        assert r["in_trial"] and r["resumed_in_trial"] and r["in_duel"] == into_duel, r
        assert r["winner"][0] == r["winner"][1] and r["winner"][0] != "optimal", r["winner"]
        assert r["history"][0] == r["history"][1]
        assert r["residual"][0] == r["residual"][1] > 0
        assert r["identical"]


def resume_pending_replan_worker(rank, world_size, ckpt_dir, after):
    """Checkpoint right after a step whose end started a periodic re-plan (its gather in
    flight, its plan job not made yet), run ``after`` more steps, then resume from the
    checkpoint and run them again. (``after`` ends before the plan's model check, the
    next re-plan: the steps after a resume measure other times.)"""
    options = {"fake_clock": False, "select": "model", "replan_every": 6}
    model, ddp, state, opt = build(rank, **options)
    first, started = 0, []
    while first < 40:
        train_steps(ddp, opt, first, first + 1, rank)
        first += 1
        if state._pending_replan is not None:
            started.append((first, state._pending_replan[1]))
            if started[-1][1] == "periodic":  # a re-plan of the plan in use
                break
    path = os.path.join(ckpt_dir, f"rank{rank}.pt")
    saved = state.state_dict()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "hook": saved}, path)
    train_steps(ddp, opt, first, first + after, rank)
    uninterrupted = {n: p.detach().clone() for n, p in model.named_parameters()}
    made_at = [state.plan.made_at_step, state.stats()["total"]["replans"]]
    del ddp, state, model, opt
    gc.collect()

    model, ddp, state, opt = build(rank, **options)
    ckpt = torch.load(path, weights_only=True)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    state.load_state_dict(ckpt["hook"])
    train_steps(ddp, opt, first, first + after, rank)
    resumed = {n: p.detach().clone() for n, p in model.named_parameters()}
    made_at += [state.plan.made_at_step, state.stats()["total"]["replans"]]
    del ddp, state
    gc.collect()
    return {"started": started, "saved_job": saved["plan_job"] is not None,
            "identical": all(torch.equal(uninterrupted[n], resumed[n]) for n in uninterrupted),
            "made_at": made_at}


@pytest.mark.timeout(180)
def test_a_checkpoint_taken_while_a_re_plan_is_in_flight_resumes_bit_exactly(tmp_path):
    """A re-plan gathers its numbers asynchronously at the end of a step and plans at the
    next bucket 0. ``state_dict()`` in between finishes it, so the checkpoint holds its
    job: the resumed run puts the plan in use at the step the uninterrupted one does
    (with the re-plan lost, it would re-plan a step later, from other measurements)."""
    results = run_ranks("test_hook_selection", "resume_pending_replan_worker", world_size=2,
                        ckpt_dir=str(tmp_path), after=5)
    assert results[0]["started"] == results[1]["started"]
    for r in results:
        first, reason = r["started"][-1]
        assert reason == "periodic" and r["saved_job"], r["started"]
        # the job's plan went into use PLAN_LAG steps after the checkpoint, in both runs
        made_uninterrupted, replans_uninterrupted, made_resumed, replans_resumed = r["made_at"]
        assert made_uninterrupted == made_resumed == first + 2, (r["made_at"], first)
        assert replans_uninterrupted == replans_resumed
        assert r["identical"]


def test_a_re_plan_in_flight_is_finished_once_and_other_threads_wait_for_it(monkeypatch):
    """stats() on a logging thread while bucket 0 finishes the pending re-plan: one of
    them runs it, the other returns only once it is done (never reads it half-made)."""
    import threading
    import time

    monkeypatch.setattr(omgs_hook.OMGSState, "world_size", property(lambda self: 1))
    state = omgs_hook.OMGSState(density=DENSITY)
    events = []

    class SlowWork:
        def wait(self):
            time.sleep(0.2)  # the gathered rows arriving

    state._instance_from_rows = lambda layout, gathered, meta: ("instance", {})
    state._replan = lambda layout, reason, built: events.append(("replanned", reason))
    state._pending_replan = (((("w",),)), "periodic", SlowWork(), torch.zeros(2), {}, 0.0)

    def other():
        time.sleep(0.05)  # the bucket-0 thread is inside the finish by now
        state._finish_replan()
        events.append("other returned")

    thread = threading.Thread(target=other)
    thread.start()
    state._finish_replan()
    thread.join()
    assert events == [("replanned", "periodic"), "other returned"]
    assert state._pending_replan is None
    state.close()


def pinned_worker(rank, world_size, plan, steps):
    model, ddp, state, opt = build(rank, fake_clock=False, plan=plan)
    train_steps(ddp, opt, 0, steps, rank)
    stats = state.stats()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    del ddp, state
    gc.collect()
    return {"params": params, "stats": stats}


@pytest.mark.timeout(240)
def test_a_pinned_plan_gives_bit_identical_training(tmp_path):
    # a plan saved from a previous run (stats()["plan"]), through a JSON file
    first = run_ranks("test_hook_selection", "selection_worker", world_size=2, steps=6,
                      fake_clock=False, select="model")
    saved = first[0]["stats"]["plan"]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(saved))
    runs = [run_ranks("test_hook_selection", "pinned_worker", world_size=2, plan=str(path), steps=12)
            for _ in range(2)]
    for rank in range(2):
        a, b = runs[0][rank], runs[1][rank]
        assert a["params"].keys() == b["params"].keys()
        assert all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])
        for run in (a, b):
            stats = run["stats"]
            assert stats["total"]["replans"] == 0 and stats["total"]["trials"] == 0
            assert stats["plan"]["group_keys"] == saved["group_keys"]
            assert stats["plan"]["dense"] == saved["dense"]
            assert [h["reason"] for h in stats["plan_history"]] == ["pinned"]
            assert stats["plan_history"][0]["step"] == 2  # the end of the warm-up
            # recorded over DDP's buckets (the saved plan has no layout): the bucket
            # indices the first run recorded, in the plan and in the history
            assert stats["plan"]["groups"] == saved["groups"]
            assert stats["plan_history"][0]["groups"] == saved["groups"]
    # that history entry replays the same plan (bucket indices, as the docs say)
    entry = runs[0][0]["stats"]["plan_history"][0]
    replay = run_ranks("test_hook_selection", "pinned_worker", world_size=2, plan=entry, steps=12)
    for rank in range(2):
        assert replay[rank]["stats"]["plan"]["group_keys"] == saved["group_keys"]
        assert all(torch.equal(replay[rank]["params"][n], runs[0][rank]["params"][n])
                   for n in replay[rank]["params"])


@pytest.mark.timeout(180)
def test_an_omgs_plan_unit_plan_is_pinned_over_the_buckets():
    plan = {"strategy": "optimal", "groups": [[0, 1], [2, 3, 4], [5]], "dense": [False, True, False],
            "predicted_iteration_s": 0.01}
    results = run_ranks("test_hook_selection", "pinned_worker", world_size=2, plan=plan, steps=8)
    for r in results:
        stats = r["stats"]
        assert stats["plan"]["groups"] == plan["groups"] and stats["plan"]["dense"] == plan["dense"]
        assert stats["last"]["groups"] == 3 and stats["last"]["dense_groups"] == 1
        assert stats["total"]["replans"] == 0
    assert results[0]["stats"]["plan"]["group_keys"] == results[1]["stats"]["plan"]["group_keys"]


@pytest.mark.timeout(180)
def test_a_pinned_plan_for_another_layout_is_refused():
    plan = {"groups": [[0, 1], [2]]}  # three buckets; this model has six
    results = run_ranks("test_hook_selection", "pinned_worker", world_size=2, plan=plan, steps=8,
                        allow_failure=True)
    for r in results:
        assert "plan: the pinned plan has 3 buckets" in r["error"], r


def background_worker(rank, world_size, steps, slow_rank_sleep_s):
    """Re-plans run on the planner thread; rank 1 plans slowly, yet switches with rank 0."""
    import threading
    import time

    from omgs_hook import hook as hook_mod

    threads = []
    original = hook_mod.planner_mod.make_plan

    def make_plan(*args, **kwargs):
        threads.append(threading.current_thread() is threading.main_thread())
        if rank == 1:
            time.sleep(slow_rank_sleep_s)
        return original(*args, **kwargs)

    hook_mod.planner_mod.make_plan = make_plan
    model, ddp, state, opt = build(rank, fake_clock=False, select="model", replan_every=4)
    submitted, applied = [], []
    submit, apply = state._submit_plan_job, state._put_plans_in_use

    def record_submit(job):
        submitted.append(state.step)
        submit(job)

    def record_apply(result, plans):
        applied.append(state.step)
        apply(result, plans)

    state._submit_plan_job, state._put_plans_in_use = record_submit, record_apply
    gather, gathered_by = state._gather_rows, []

    def record_gather(*args, **kwargs):
        import sys

        gathered_by.append(sys._getframe(1).f_code.co_name)
        return gather(*args, **kwargs)

    state._gather_rows = record_gather
    for step in range(steps):  # steps of ~20 ms, so a slow plan spans several of them
        train_steps(ddp, opt, step, step + 1, rank)
        time.sleep(0.02)
    stats = state.stats()
    del ddp, state
    gc.collect()
    hook_mod.planner_mod.make_plan = original
    return {"on_main_thread": threads, "submitted": submitted, "applied": applied,
            "wait": stats["planner_wait_s"], "replans": stats["total"]["replans"],
            "stall": stats["replan_stall_s"], "gathered_by": gathered_by,
            "history": stats["plan_history"]}


@pytest.mark.timeout(180)
def test_re_planning_runs_off_the_autograd_thread_and_every_rank_switches_at_the_same_step():
    results = run_ranks("test_hook_selection", "background_worker", world_size=2, steps=40,
                        slow_rank_sleep_s=0.25)
    fast, slow = results
    assert fast["on_main_thread"] and not any(fast["on_main_thread"] + slow["on_main_thread"])
    # gathered at the end of step 1 (self.step == 2); switched once both planners were
    # done - rank 1's takes 0.25 s, a dozen steps, so later than the earliest agreed
    # step 4 - at the same step on both ranks; then periodic
    assert fast["submitted"][0] == 2 and fast["applied"][0] > 4
    assert slow["submitted"] == fast["submitted"] and slow["applied"] == fast["applied"]
    assert all(a >= s + 2 for s, a in zip(fast["submitted"], fast["applied"]))
    assert fast["replans"] == slow["replans"] == len(fast["submitted"]) >= 2
    # nobody waited for a planner: the slow plan cost no step more than its small gather
    assert slow["wait"] == 0.0 and fast["wait"] == 0.0
    assert slow["stall"]["max"] < 0.5 and fast["stall"]["max"] < 0.5
    # the switch itself gathers nothing at bucket 0: the readiness flags and the plans'
    # checksums travel in an all-gather issued at the end of the step before; rank 0's
    # plans, polled at a probe while rank 1 was still planning, went into use with
    # rank 1's, at the same step, identical
    assert "_begin_step" not in fast["gathered_by"] + slow["gathered_by"]
    # nor does a re-plan block for its numbers: they are gathered asynchronously from the
    # end of the step that starts it to the next bucket 0
    assert "_build_instance" not in fast["gathered_by"] + slow["gathered_by"]
    # the same plans on both ranks, each from a step a re-plan was put in use at. (Whether
    # a re-plan *changes* the plan depends on the timings: on a busy host the 6-bucket
    # model's re-plans kept the first plan, and the history, which records changes,
    # held one entry - a 1-in-4 failure when the test asked for two.)
    assert fast["history"] == slow["history"] and len(fast["history"]) >= 1
    assert {entry["step"] for entry in fast["history"]} <= set(fast["applied"])


def start_worker(rank, world_size, steps):
    """Every planning job and the plan in use when it was submitted."""
    model, ddp, state, opt = build(rank, fake_clock=False, select="model", replan_every=4)
    seen = []
    submit = state._submit_plan_job

    def record(job):
        plan = state.plan
        seen.append({"start": job["start"],
                     "in_use": None if plan is None else {"groups": plan.unit_groups(),
                                                          "dense": list(plan.dense)}})
        submit(job)

    state._submit_plan_job = record
    train_steps(ddp, opt, 0, steps, rank)
    del ddp, state
    gc.collect()
    return seen


@pytest.mark.timeout(180)
def test_every_re_plan_starts_from_the_plan_in_use():
    """The planner gets the plan in use as its start (a bound, and the least a search the
    valve stops returns); the first plan has none. The same jobs on both ranks."""
    first, second = run_ranks("test_hook_selection", "start_worker", world_size=2, steps=20)
    assert first == second
    assert first[0]["start"] is None and first[0]["in_use"] is None
    later = first[1:]
    assert len(later) >= 2
    assert all(job["start"] == job["in_use"] for job in later)
    assert all(job["start"] is not None for job in later)


def pinned_exchange_worker(rank, world_size):
    """A pinned plan's "exchange" must be one the registration can run."""
    out = {}
    cases = {"two-level on a flat run": ({"exchange": "hierarchical"}, {}),
             "flat on an explicit two-level run": (
                 {"exchange": "flat"}, {"topology": "hierarchical", "ranks_per_node": 2})}
    for case, (extra, options) in cases.items():
        torch.manual_seed(0)
        ddp = DDP(Net(), bucket_cap_mb=0)
        plan = dict({"groups": [[0, 1], [2, 3, 4], [5]]}, **extra)
        try:
            omgs_hook.register(ddp, density=DENSITY, plan=plan, **options)
            out[case] = "no error"
        except ValueError as exc:
            out[case] = str(exc)
        del ddp
        gc.collect()
    # a flat pinned plan where both are allowed: it runs flat (this world is flat anyway)
    model, ddp, state, opt = build(rank, fake_clock=False,
                                   plan={"groups": [[0, 1], [2, 3, 4], [5]], "exchange": "flat"})
    train_steps(ddp, opt, 0, 4, rank)
    out["runs"] = (state.stats()["plan"]["exchange"], state.stats()["last"]["exchange"])
    del ddp, state
    gc.collect()
    return out


@pytest.mark.timeout(180)
def test_a_pinned_plan_keeps_its_exchange_or_is_refused_clearly():
    with pytest.raises(ValueError, match="plan: 'exchange' must be one of"):
        omgs_hook.OMGSState(plan={"groups": [[0]], "exchange": "ring"})
    results = run_ranks("test_hook_selection", "pinned_exchange_worker", world_size=2)
    for r in results:
        text = r["two-level on a flat run"]
        assert text.startswith("plan: the pinned plan uses the two-level exchange"), text
        text = r["flat on an explicit two-level run"]
        assert text.startswith("plan: the pinned plan uses the flat exchange") and \
            "topology='hierarchical'" in text, text
        assert r["runs"] == ("flat", "flat")


def isolated_selection_worker(rank, world_size, steps, isolate_units, has_a_core=True):
    """selection_worker with planning jobs isolated from ``isolate_units`` units on, on
    a host with a core to spare for the planner or (``has_a_core=False``) without."""
    from omgs_hook import hook as hook_mod

    hook_mod.ISOLATE_UNITS = isolate_units
    hook_mod.planner_has_a_core = lambda world_size: has_a_core  # (2 ranks, 2 cores: none)
    # (re-plans after the trial are what is tested: a trial without its duel, which would
    # take up to 80 of the run's steps when a runner-up is within 30%)
    plan_selection.DUEL_PAIRS = 0
    # (fixed model inputs: a trial, see resume_in_trial_worker)
    model, ddp, state, opt = build(rank, replan_every=6, fake_inputs=True)
    where = []
    submit = state._planner.submit

    def noting_submit(*args, isolate, low_priority, **kwargs):
        where.append("low" if isolate and low_priority else "process" if isolate else "thread")
        return submit(*args, isolate=isolate, low_priority=low_priority, **kwargs)

    state._planner.submit = noting_submit
    # a job is put in use at the first step every rank's planner is done: waiting for it
    # after each step keeps a process's start-up from moving the switch to a later step
    _train_planner_settled(ddp, opt, state, 0, steps, rank)
    stats = state.stats()
    alive = sorted(nice for nice, p in state._planner._processes.items() if p.alive)
    del ddp, state
    gc.collect()
    return {"history": [(h["step"], h["strategy"], h["groups"], h["dense"])
                        for h in stats["plan_history"]],
            "processes": alive, "where": where, "replans": stats["total"]["replans"]}


@pytest.mark.timeout(180)
def test_plans_computed_in_the_worker_process_go_into_use_on_every_rank_alike():
    """Every planning job in the planner's worker process (ISOLATE_UNITS 1): the trial and
    its plans go into use at the same steps with the same plans on both ranks (the
    switch's checksum all-gather would raise otherwise). That the process computes what
    the thread would is tested on the job itself (test_background_planner.py)."""
    isolated = run_ranks("test_hook_selection", "isolated_selection_worker", world_size=2,
                         steps=20, isolate_units=1)
    assert all(r["processes"] == [0] for r in isolated)
    assert all(set(r["where"]) == {"process"} for r in isolated)
    assert isolated[0]["replans"] >= 1
    assert isolated[0]["history"] == isolated[1]["history"]
    assert len(isolated[0]["history"]) >= 3  # the first plan and the trial's candidates


@pytest.mark.timeout(240)
def test_without_a_core_to_spare_re_plans_run_in_the_low_priority_process_alike():
    """No core to spare: the first plan on a thread (at training's priority), every
    re-plan in the low-priority worker process; the plans go into use at the same steps
    with the same plans on both ranks. (That a process computes what a thread would is
    tested on the job itself, test_background_planner.py.)"""
    low = run_ranks("test_hook_selection", "isolated_selection_worker", world_size=2,
                    steps=72, isolate_units=1, has_a_core=False)
    for r in low:
        assert r["where"][0] == "thread" and len(r["where"]) >= 3, r["where"]
        assert set(r["where"][1:]) == {"low"}, r["where"]
        assert r["processes"] == [background_planner.LOW_PRIORITY_NICE]
    assert low[0]["history"] == low[1]["history"]
    assert len(low[0]["history"]) >= 3


def test_planner_processes_only_where_the_host_has_cores_to_spare(monkeypatch):
    from omgs_hook import hook as hook_mod

    monkeypatch.setattr(hook_mod.os, "sched_getaffinity", lambda pid: set(range(8)),
                        raising=False)
    monkeypatch.setattr(hook_mod.torch, "get_num_threads", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert hook_mod.planner_has_a_core(16)  # 8 cores, 4 ranks of 1 thread: 4 to spare
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "5")
    assert not hook_mod.planner_has_a_core(16)  # 3 to spare for 5 planners
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert hook_mod.planner_has_a_core(2) and not hook_mod.planner_has_a_core(8)
    monkeypatch.setattr(hook_mod.torch, "get_num_threads", lambda: 4)
    assert not hook_mod.planner_has_a_core(2)  # 2 ranks of 4 threads fill the 8 cores


def test_only_large_or_slow_planning_jobs_go_to_the_worker_process(monkeypatch):
    # (the rule of _submit_plan_job; the 2-rank test above it runs every job isolated)
    from omgs_hook import hook as hook_mod

    state = omgs_hook.OMGSState(density=DENSITY)
    monkeypatch.setattr(hook_mod.dist, "get_world_size", lambda group=None: 2)
    submitted = []
    monkeypatch.setattr(state._planner, "submit",
                        lambda fn, *args, apply_at_step, isolate, low_priority:
                        submitted.append("low" if isolate and low_priority
                                         else "process" if isolate else "thread"))

    def where(units, last_compute_s=0.0, has_a_core=True, plan_in_use=False):
        monkeypatch.setattr(hook_mod, "planner_has_a_core", lambda world_size: has_a_core)
        state.plan = object() if plan_in_use else None
        state._planner.last_compute_s = last_compute_s
        state._submit_plan_job({"instance": {"layers": [{}] * units}, "apply_at_step": 3})
        return submitted[-1]

    large = hook_mod.ISOLATE_UNITS
    for plan_in_use in (False, True):
        assert where(large - 1, plan_in_use=plan_in_use) == "thread"  # small ones stay
        assert where(large, plan_in_use=plan_in_use) == "process"
        # after a slow job
        assert where(10, 2 * hook_mod.REPLAN_STALL_BUDGET_S, plan_in_use=plan_in_use) == "process"
        assert where(large - 1, has_a_core=False, plan_in_use=plan_in_use) == "thread"
    # no core to spare: the first plan on the thread, a re-plan at the lowest priority
    assert where(large, has_a_core=False) == "thread"
    assert where(large, has_a_core=False, plan_in_use=True) == "low"
    # (a small model's job that was slow once stays on the thread)
    assert where(10, 2 * hook_mod.REPLAN_STALL_BUDGET_S, has_a_core=False,
                 plan_in_use=True) == "thread"
    monkeypatch.setattr(hook_mod, "LOW_PRIORITY_REPLANS", False)
    assert where(large, has_a_core=False, plan_in_use=True) == "thread"
    state.plan = None


# the real-clock worker's steps at most, its trial unfinished (see below)
MAX_REAL_CLOCK_STEPS = 240


def real_clock_worker(rank, world_size, steps, pause_every=None, slow_in_turn=None):
    """Real clocks. ``pause_every``: before every ``pause_every``-th step the loop sleeps
    0.3 s, as an evaluation after an epoch would, on both ranks. ``slow_in_turn``: at
    every step one of the two ranks (in turn) spends that many seconds more in its
    forward, so every step waits that long for one rank and the ranks' bucket-0
    arrivals alternate between early and late."""
    import time

    # (the step timing the trial reads is tested: its rounds, without the duel, so that
    # the trial has ended within the test's steps whatever the real clocks read)
    plan_selection.DUEL_PAIRS = 0
    # (the model's inputs fixed: a trial, see resume_in_trial_worker; the clock is real)
    model, ddp, state, opt = build(rank, fake_clock=False, fake_inputs=True)
    if slow_in_turn:
        state._load_probe = lambda: 0.01  # the slow forwards are the steps' pace, not spells
        forward, calls = model.forward, [0]

        def forward_in_turn(x):
            if (calls[0] + rank) % 2:
                time.sleep(slow_in_turn)
            calls[0] += 1
            return forward(x)

        model.forward = forward_in_turn
    step = 0
    # ``steps``, then on until the trial is over (on a loaded host load spells retake
    # turns, and 60 steps did not always hold the whole trial: 3 of 10 runs beside three
    # busy loops). The trial ends at the same step on every rank (gathered numbers), so
    # both ranks stop together.
    while step < steps or (state.stats()["selection"]["last_trial"] is None
                           and step < MAX_REAL_CLOCK_STEPS):
        if pause_every and step % pause_every == pause_every - 1:
            time.sleep(0.3)
        train_steps(ddp, opt, step, step + 1, rank)
        step += 1
    stats = state.stats()
    del ddp, state
    gc.collect()
    return {"stats": stats}


@pytest.mark.timeout(150)
def test_the_loops_own_work_between_steps_is_not_charged_to_a_trial_candidate():
    """A pause between two steps (an evaluation, a checkpoint) lands in the interval
    from one step's end to the next one's, so it used to count as the step of whichever
    candidate was on trial then: in the README job the evaluation after the first epoch
    always fell on LAGS-SGD, which read 2-3x slower than it is. The gap's excess over the
    usual one is now left out: every candidate's measurement stays far below the pause."""
    # (a trial of 5-6 candidates ends by step 19-30 here; steps for retakes under load)
    results = run_ranks("test_hook_selection", "real_clock_worker", world_size=2,
                        steps=60, pause_every=4, timeout=140)
    report = results[0]["stats"]["selection"]["last_trial"]
    measured = [c["measured_s"] for c in report["candidates"] if c.get("measured_s")]
    assert len(measured) >= 2
    assert max(measured) < 0.15, report["candidates"]


@pytest.mark.timeout(150)
def test_a_step_is_timed_from_the_previous_steps_end_not_from_bucket_0():
    """Every step here takes about ``delay`` more than its compute (one rank is slow in
    turn). A rank's bucket-0 to bucket-0 intervals alternate between the step's time
    plus and minus ``delay``, so the slowest rank's read about ``2 * delay`` per step for
    every candidate; the steps' ends come together on both ranks and read their pace."""
    delay = 0.1
    results = run_ranks("test_hook_selection", "real_clock_worker", world_size=2,
                        steps=72, slow_in_turn=delay, timeout=140)
    report = results[0]["stats"]["selection"]["last_trial"]
    assert report is not None and report == results[1]["stats"]["selection"]["last_trial"]
    measured = [c["measured_s"] for c in report["candidates"] if c.get("measured_s")]
    assert len(measured) >= 2
    assert all(delay < m < 1.5 * delay for m in measured), report["candidates"]
    for r in results:  # the model check's steps too
        assert delay < r["stats"]["step_s"] < 1.5 * delay


def failing_planner_worker(rank, world_size, steps):
    """The first plan job fails on every rank: where does the error come out?"""
    from omgs_hook import hook as hook_mod

    def make_plan(*args, **kwargs):
        raise RuntimeError("planner boom")

    hook_mod.planner_mod.make_plan = make_plan
    model, ddp, state, opt = build(rank, fake_clock=False, select="model")
    seen = {}
    original_begin = state._begin_step

    def begin(bucket):
        seen["bucket0_step"] = state.step
        return original_begin(bucket)

    state._begin_step = begin
    try:
        for step in range(steps):
            train_steps(ddp, opt, step, step + 1, rank)
            while state._planner.pending and not state._planner.ready:
                import time

                time.sleep(0.005)
    except RuntimeError as exc:
        seen["error"] = str(exc)
    seen["residual_entries"] = len(state.state_dict()["residuals"])
    del ddp, state
    gc.collect()
    return seen


@pytest.mark.timeout(180)
def test_a_failed_plan_job_raises_at_the_switch_step_on_every_rank():
    from omgs_hook.hook import PLAN_LAG

    results = run_ranks("test_hook_selection", "failing_planner_worker", world_size=2, steps=12)
    for r in results:
        assert "planner boom" in r.get("error", ""), r
        # raised at bucket 0 of the agreed step (warm-up 2 steps, planned at the end
        # of step 1, agreed step 2 later), not inside the step before it
        assert r["bucket0_step"] == results[0]["bucket0_step"] == 2 + PLAN_LAG
        assert r["residual_entries"] > 0


def workload_worker(rank, world_size, grow_at, steps, slow_until=0):
    """A fake clock and fixed model inputs whose compute grows 3x from step ``grow_at``
    (None: never), and reads 3x before step ``slow_until`` (the dense warm-up's backward,
    slowed by the all-reduce on the same cores); re-plans every 20 steps with the
    later-trial budget lifted, and no duel (the full set's rounds are what is tested)."""
    plan_selection.RETRIAL_SHARE = 1.0  # (this rank's process only)
    plan_selection.DUEL_PAIRS = 0
    model, ddp, state, opt = build(rank, replan_every=20)

    def scale(step):
        grown = grow_at is not None and step >= grow_at
        return 3.0 if grown or step < slow_until else 1.0

    fake_planning_inputs(state, scale=scale, overhead=((1e-4, 1e-9), (3e-5, 1e-9)))
    _train_planner_settled(ddp, opt, state, 0, steps, rank)
    stats = state.stats()
    state.close()
    del ddp, state
    gc.collect()
    return {"stats": stats}


def trials_in(history):
    """``(first step, candidate names in order)`` of each trial in a plan history (its
    entries up to its winner)."""
    trials, names, first = [], [], None
    for entry in history:
        if entry["reason"] == "trial":
            first = entry["step"] if first is None else first
            if entry["strategy"] not in names:
                names.append(entry["strategy"])
        elif entry["reason"] == "trial winner":
            trials.append((first, names))
            names, first = [], None
    return trials


@pytest.mark.timeout(240)
def test_a_workload_that_moves_is_trialled_again_with_the_full_set():
    """The batch grows (the model's compute inputs 3x) after the first trial: the next
    periodic re-plan trials the model's whole candidate set again, the kept winner among
    them, on every rank alike, whether or not the model's own plan changed; with the same
    inputs after the first trial a later trial is only the model's new plan against the
    kept one, even when the steps the first trial was planned from read 3x slower (the
    baseline is the first periodic re-plan after the trial, not the warm-up)."""
    steady = run_ranks("test_hook_selection", "workload_worker", world_size=2, timeout=200,
                       grow_at=None, steps=150, slow_until=10)
    for r in steady:
        trials = trials_in(r["stats"]["plan_history"])
        assert trials and trials[0][0] < 10 and len(trials[0][1]) > 2, trials
        later = trials[1:]
        assert all(len(names) <= 2 for _, names in later), later
    moved = run_ranks("test_hook_selection", "workload_worker", world_size=2, timeout=200,
                      grow_at=80, steps=150)
    stats = [r["stats"] for r in moved]
    assert stats[0]["plan_history"] == stats[1]["plan_history"]
    assert stats[0]["selection"]["last_trial"] == stats[1]["selection"]["last_trial"]
    trials = trials_in(stats[0]["plan_history"])
    first_winner = [h for h in stats[0]["plan_history"] if h["reason"] == "trial winner"][0]
    after = [(step, names) for step, names in trials if step > 80]
    assert after, trials
    step, names = after[0]
    # the model's choice first, then the kept winner, then the rest of the model's set
    assert len(names) > 2 and names[1] == "kept:" + first_winner["strategy"], (names, trials)
    report = stats[0]["selection"]["last_trial"]
    assert report["reason"] == "periodic" and [c["name"] for c in report["candidates"]] == names


def sparse_lead_worker(rank, world_size, steps):
    """Train with the default options until the first plan after the sparse lead is in
    use; what the re-plan that made it (and its candidates) was given."""
    model, ddp, state, opt = build(rank, fake_clock=False)
    seen = None
    for step in range(steps):
        train_steps(ddp, opt, step, step + 1, rank)
        history = state.stats()["plan_history"]
        if len(history) >= 2 and seen is None:  # (gathered decisions: the same everywhere)
            seen = {"planned_with": dict(state._planned_with), "history": history,
                    "trial": state._trial is not None}
            break
    del ddp, state
    gc.collect()
    return seen


@pytest.mark.timeout(180)
def test_the_first_trial_is_planned_from_the_sparse_path_s_own_steps():
    # the first plan is made from the dense warm-up: no sparse group ran yet, so neither
    # the top-k as training runs it nor the hook's per-group work is known, and backward
    # was timed beside the warm-up's all-reduce. The model's best sparse plan runs first;
    # the candidates (or, pruned to one, the plan) come from its steps
    results = run_ranks("test_hook_selection", "sparse_lead_worker", world_size=2, steps=30)
    assert results[0] is not None and results[0]["history"] == results[1]["history"]
    lead, after = results[0]["history"][:2]
    assert lead["reason"] == "sparse lead" and lead["step"] == 4, lead  # warm-up 2 + PLAN_LAG
    assert not any(lead["dense"]) and lead["strategy"] in ("optimal", "optimal-sparse"), lead
    assert after["reason"] in ("trial", "model"), after
    assert after["step"] >= lead["step"] + OVERHEAD_SETTLE_STEPS + PLAN_LAG, after
    for r in results:
        inputs = r["planned_with"]
        assert inputs["overhead_measured"] and inputs["topk_scale"] is not None, inputs


def test_the_sparse_lead_runs_the_model_s_first_plan_with_the_fewest_dense_groups():
    from omgs_hook.hook import OMGSState
    from omgs_hook.plan_selection import Candidate

    def c(name, dense):
        return Candidate(name, tuple((i,) for i in range(len(dense))), tuple(dense), 1.0)

    def lead(candidates, exchange=None):
        index = OMGSState._sparse_lead(candidates, exchange)
        return None if index is None else candidates[index]

    mixed, sparse, other, dense = (c("optimal", [True, False]), c("optimal-sparse", [False, False]),
                                   c("single", [False]), c("all-dense", [True, True]))
    assert lead([mixed, sparse, other, dense]) is sparse
    assert lead([mixed, dense]) is mixed
    assert lead([dense, c("x", [True])]) is None
    # on the registration's exchange where a candidate there sends something sparse
    flat = Candidate("flat:single", ((0,),), (False,), 1.0, "flat")
    two_level = Candidate("optimal", ((0,), (1,)), (True, False), 1.0, "hierarchical")
    assert lead([flat, two_level], "hierarchical") is two_level
    assert lead([two_level, flat]) is flat  # (no exchange named)
    assert lead([flat, dense], "hierarchical") is flat


def resume_in_lead_worker(rank, world_size, ckpt_dir, total):
    """Checkpoint 2 steps into the sparse lead, train on to ``total``; resume from the
    checkpoint in a new hook and train to ``total`` again."""
    model, ddp, state, opt = build(rank, fake_inputs=True)
    first = train_until(lambda: state._awaiting_overhead,
                        lambda start, stop: train_steps(ddp, opt, start, stop, rank), total,
                        into=2)
    in_lead = state._awaiting_overhead and state._trial is None
    out = save_train_and_resume(rank, model, ddp, state, opt, ckpt_dir, first, total,
                                lambda resumed: resumed._awaiting_overhead
                                and resumed.plan is not None)
    stats_a, stats_b = out["stats"]
    return {"in_lead": in_lead, "resumed_in_lead": out["probe"], "first": first,
            "identical": out["identical"],
            "history": (stats_a["plan_history"], stats_b["plan_history"])}


@pytest.mark.timeout(180)
def test_checkpoint_and_resume_during_the_sparse_lead_is_bit_exact(tmp_path):
    results = run_ranks("test_hook_selection", "resume_in_lead_worker", world_size=2,
                        ckpt_dir=str(tmp_path), total=30)
    assert results[0]["first"] == results[1]["first"]
    for r in results:
        assert r["in_lead"] and r["resumed_in_lead"], r
        a, b = r["history"]
        assert a == b and a[0]["reason"] == "sparse lead", a
        # the trial started from the "overhead" re-plan, at the same step in both runs
        assert any(h["reason"] == "trial" for h in a), a
        assert r["identical"]
