"""A trial's winner that runs slower once settled than another candidate measured in the
trial is tried once more against it (``plan_selection.regret_rival``, the hook's
settled check): the pure rule, and under real DDP (gloo, 2 ranks) with fake clocks."""

import gc
import os

import pytest
import torch

from omgs_hook.plan_selection import regret_rival
from test_hook_selection import trials_in


def report(winner_s, others, noise=None):
    """A finished trial's report: the winner ``w`` at ``winner_s``, then ``others`` as
    ``(name, measured_s)`` (None: not measured)."""
    cands = [{"name": "w", "groups": [[0, 1]], "dense": [False], "predicted_s": 0.1,
              "measured_s": winner_s, "winner": True}]
    for i, (name, measured) in enumerate(others):
        cands.append({"name": name, "groups": [[0], [1]], "dense": [False, bool(i % 2)],
                      "predicted_s": 0.1, "measured_s": measured, "winner": False})
    return {"candidates": cands, "noise": noise, "winner": "w"}


def test_no_rival_while_the_winner_runs_as_the_trial_measured_it():
    r = report(0.100, [("a", 0.104), ("b", 0.120)])
    assert regret_rival(r, 0.100) is None
    # within the tie margin of the best other candidate (3%): no
    assert regret_rival(r, 0.104 * 1.029) is None


def test_the_fastest_candidate_the_settled_winner_lost_to_is_the_rival():
    r = report(0.100, [("a", 0.110), ("b", 0.104), ("c", None)])
    assert regret_rival(r, 0.104 * 1.031)["name"] == "b"
    assert regret_rival(r, 0.130)["name"] == "b"  # (a too, but b is the faster)


def test_the_trials_own_noise_widens_the_margin():
    r = report(0.100, [("a", 0.104)], noise=0.04)  # margin max(3%, 1.5 * 4%) = 6%
    assert regret_rival(r, 0.104 * 1.05) is None
    assert regret_rival(r, 0.104 * 1.07)["name"] == "a"


@pytest.mark.parametrize("settled", [None, 0.0, -1.0, float("nan")])
def test_nothing_to_compare_gives_none(settled):
    assert regret_rival(report(0.1, [("a", 0.05)]), settled) is None


def test_no_winner_or_no_report_gives_none():
    r = report(0.1, [("a", 0.05)])
    r["candidates"][0]["winner"] = False
    assert regret_rival(r, 0.2) is None
    assert regret_rival(None, 0.2) is None


# ------------------------------------------------------------------ under real DDP
def _slow_winner_clock(state, rank, slow):
    """test_hook_selection's FakeClock; with ``slow`` the first trial's winner costs 40 ms
    more per step once that trial is over (as a plan can run slower in the steady state
    than in its trial's short turns)."""
    from test_hook_selection import FakeClock, fake_cost

    class SlowWinnerClock(FakeClock):
        winner = None  # the first trial's winner, once it is decided

        def __call__(self):
            plan = self.state.plan
            if self.winner is None and self.state._last_trial is not None:
                self.winner = self.state._last_trial["winner"]
            extra = 0.04 if slow and plan is not None and plan.strategy == self.winner else 0.0
            self.now += self.rate * (fake_cost(self.rank, plan) + extra)
            return self.now

    return SlowWinnerClock(state, rank)


def regret_worker(rank, world_size, slow_after_trial, steps, ckpt_dir=None,
                  save_after_winner=None):
    """Fake clocks (:func:`_slow_winner_clock`), fixed model inputs. ``save_after_winner``:
    checkpoint that many steps after the first trial's winner went into use, run on,
    then resume from it and run again."""
    from test_hook_selection import build
    from test_hook_ddp import _train_planner_settled
    from omgs_hook import plan_selection
    # the regret trial is tested: the first trial without its duel (whose loser the
    # regret check leaves out; tests/test_plan_selection.py)
    plan_selection.DUEL_PAIRS = 0

    def save_due(state, step):
        winners = [h["step"] for h in state._plan_history if h["reason"] == "trial winner"]
        return bool(winners) and step == winners[0] + save_after_winner

    def run(resume_from=None):
        model, ddp, state, opt = build(rank, fake_inputs=True)
        state._clock = _slow_winner_clock(state, rank, slow_after_trial)
        start, saved = 0, None
        if resume_from is not None:
            ckpt = torch.load(resume_from, weights_only=False)
            model.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["opt"])
            state.load_state_dict(ckpt["hook"])
            state._clock.winner, state._clock.now = ckpt["winner"], ckpt["clock"]
            start = ckpt["step"]
        for step in range(start, steps):
            _train_planner_settled(ddp, opt, state, step, step + 1, rank)
            if (save_after_winner is not None and resume_from is None and saved is None
                    and save_due(state, step + 1)):
                saved = (os.path.join(ckpt_dir, f"rank{rank}.pt"), step + 1)
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                            "hook": state.state_dict(), "winner": state._clock.winner,
                            "clock": state._clock.now, "step": step + 1}, saved[0])
        stats = state.stats()
        stats["summary_text"] = state.summary()
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        state.close()
        del ddp, state
        gc.collect()
        return stats, params, saved

    stats, params, saved = run()
    out = {"stats": stats}
    if saved is not None:
        resumed_stats, resumed_params, _ = run(resume_from=saved[0])
        out["saved_at"] = saved[1]
        out["resumed_history"] = resumed_stats["plan_history"]
        out["identical"] = all(torch.equal(params[n], resumed_params[n]) for n in params)
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_winner_that_runs_slower_once_settled_is_tried_again_against_its_rival():
    from ddp_harness import run_ranks

    results = run_ranks("test_regret_trial", "regret_worker", world_size=2, timeout=280,
                        slow_after_trial=True, steps=130)
    stats = [r["stats"] for r in results]
    assert stats[0]["plan_history"] == stats[1]["plan_history"]
    assert stats[0]["selection"]["last_trial"] == stats[1]["selection"]["last_trial"]
    trials = trials_in(stats[0]["plan_history"])
    assert len(trials) == 2, trials  # the first trial, then once more: never a third
    first_names = trials[0][1]
    winners = [h for h in stats[0]["plan_history"] if h["reason"] == "trial winner"]
    first_winner = winners[0]["strategy"]
    # the second trial: the winner first (it keeps a tie), then the fastest other
    # candidate of the first trial
    step, names = trials[1]
    assert len(names) == 2 and names[0] == first_winner and names[1] in first_names, names
    last = stats[0]["selection"]["last_trial"]
    assert last["reason"] == "regret"
    # at the settled check of the first winner (SETTLED_CHECK_STEPS after it went in)
    assert step == winners[0]["step"] + 20, (step, winners)
    # the winner's 40 ms more per step lose it the second trial
    assert last["winner"] == names[1] == stats[0]["plan"]["strategy"]
    assert stats[0]["selection"]["trial"] is None
    assert "a second trial" in stats[0]["summary_text"]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_winner_that_runs_as_measured_is_kept_without_a_second_trial():
    from ddp_harness import run_ranks

    results = run_ranks("test_regret_trial", "regret_worker", world_size=2, timeout=280,
                        slow_after_trial=False, steps=110)
    for r in results:
        history = r["stats"]["plan_history"]
        assert len(trials_in(history)) == 1, trials_in(history)
        assert r["stats"]["total"]["trials"] == 1
        assert "a second trial" not in r["stats"]["summary_text"]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_checkpoint_before_the_settled_check_resumes_into_the_same_second_trial(tmp_path):
    """The settled check (and the trial layout it needs) comes back with the state: a run
    resumed a few steps after the first trial's winner started the same second trial, at
    the same step, and ends bit-identical."""
    from ddp_harness import run_ranks

    results = run_ranks("test_regret_trial", "regret_worker", world_size=2, timeout=280,
                        slow_after_trial=True, steps=130, ckpt_dir=str(tmp_path),
                        save_after_winner=5)
    for r in results:
        winner_step = [h for h in r["stats"]["plan_history"]
                       if h["reason"] == "trial winner"][0]["step"]
        saved_at = r["saved_at"]
        assert saved_at == winner_step + 5
        uninterrupted = trials_in(r["stats"]["plan_history"])
        assert len(uninterrupted) == 2
        assert [t for t in trials_in(r["resumed_history"]) if t[0] > saved_at] == \
            [t for t in uninterrupted if t[0] > saved_at]
        assert r["identical"]
