"""Offline: how often does the measured-selection trial pick a near-tied plan over the
truly best one, under a host whose speed drifts in phases? Drives the pure
plan_selection.Trial with synthetic step times: each candidate's true time, times a host
phase (AR(1) in log space: sigma_phase, correlation rho per step, of which the forward -
the trial's pace and load probe - follows the share kappa), times the slowest of `ranks`
ranks' own noise (sigma_iid). prefer_single (an experiment, not the library's rule):
after the trial, take `single` when it reached the winner's last round and read within
the tie margin of it (the trial's, or fixed_tie). Run from the repository root with
PYTHONPATH=src; eval.py / eval2.py / calib.py beside it print the tables in README.md."""
import math, random, statistics, sys
from omgs_hook import plan_selection as ps

def cand(name, i):
    # `single` is one sparse group (the trial's baseline), every other plan has several
    groups = 1 if name == "single" else i + 2
    return ps.Candidate(name, tuple((j,) for j in range(groups)), tuple([False] * groups), 1.0)

class Host:
    """Synthetic step times: a phase (AR(1) in log space) the forward follows by
    ``kappa``, times the slowest of ``ranks`` ranks' own noise."""

    def __init__(self, rnd, sigma_phase=0.10, rho=0.9, sigma_iid=0.05, kappa=0.7, ranks=4):
        self.rnd, self.sigma_phase, self.rho = rnd, sigma_phase, rho
        self.sigma_iid, self.kappa, self.ranks = sigma_iid, kappa, ranks
        self.phase = rnd.gauss(0, sigma_phase)

    def advance(self):
        self.phase = (self.rho * self.phase
                      + math.sqrt(1 - self.rho * self.rho) * self.rnd.gauss(0, self.sigma_phase))

    def step(self, true_s):
        """(step seconds, forward seconds) of the next step of a plan of ``true_s``."""
        self.advance()
        t = true_s * math.exp(self.phase) * max(math.exp(self.rnd.gauss(0, self.sigma_iid))
                                                for _ in range(self.ranks))
        return t, 0.3 * math.exp(self.kappa * self.phase) * math.exp(self.rnd.gauss(0, 0.03))


def drive_trial(true, host, trial_cls=ps.Trial, **trial_kw):
    """Run the library's Trial (or ``trial_cls``, a variant of it) over the candidates
    ``true`` (name -> true seconds)."""
    names = list(true)
    trial = trial_cls([cand(n, i) for i, n in enumerate(names)], 0,
                      lead=ps.FIRST_TRIAL_LEAD_STEPS, **trial_kw)
    step = 0
    while not trial.done and step < 400:
        if trial.round_complete(step):
            trial.finish_round([trial.local_row()], step)
            if trial.done:
                break
        c = trial.candidate_at(step)
        if c is None:
            host.advance()
        else:
            t, fwd = host.step(true[names[c]])
            trial.record(step, t, probe=fwd, forward=fwd)
        step += 1
    return trial, step


def simulate(true, seed, sigma_phase=0.10, rho=0.9, sigma_iid=0.05, kappa=0.7, ranks=4,
             max_confirm=ps.MAX_CONFIRM, prefer_single=False, fixed_tie=None, **trial_kw):
    host = Host(random.Random(seed), sigma_phase, rho, sigma_iid, kappa, ranks)
    trial, step = drive_trial(true, host, max_confirm=max_confirm, **trial_kw)
    rep = trial.report()
    winner = rep["winner"]
    if prefer_single and winner != "single":
        by = {c["name"]: c for c in rep["candidates"]}
        s, w = by["single"], by[winner]
        tie = ps.tie_margin(trial.noise) if fixed_tie is None else fixed_tie
        if s["measured_s"] and s["samples"] >= w["samples"] and s["measured_s"] <= w["measured_s"] * (1 + tie):
            winner = "single"
    return winner, step

SCENARIOS = {
    "mixer-like (single best by 5%)": {"optimal": 1.25, "optimal-sparse": 1.06, "single": 1.00, "layerwise": 1.45, "greedy": 1.15, "3-groups": 1.05},
    "gru-like (near-ties, 3g best by 2%)": {"optimal-sparse": 0.99, "single": 1.00, "layerwise": 1.05, "2-groups": 0.985, "3-groups": 0.98},
    "resnet-like (3g best by 12%)": {"optimal": 0.92, "optimal-sparse": 0.90, "single": 1.00, "layerwise": 1.30, "greedy": 0.93, "3-groups": 0.88},
}

def main():
  for label, true in SCENARIOS.items():
      best = min(true.values())
      for rule, kw in [("current", {}), ("max_confirm=4", {"max_confirm": 4}),
                       ("prefer single in tie", {"prefer_single": True}),
                       ("both", {"max_confirm": 4, "prefer_single": True})]:
          for sp in (0.06, 0.12):
              ratios, lens, picks = [], [], {}
              for seed in range(400):
                  w, n = simulate(true, seed, sigma_phase=sp, **kw)
                  ratios.append(true[w] / best); lens.append(n); picks[w] = picks.get(w, 0) + 1
              print(f"{label:38s} {rule:22s} phase {sp:.2f}: mean regret {100*(statistics.mean(ratios)-1):5.2f}%  "
                    f"P(>2% off) {sum(r > 1.02 for r in ratios)/len(ratios):.2f}  vs single {statistics.mean(true[w]/true['single'] for w in [max(picks, key=picks.get)]):.3f} "
                    f"steps {statistics.mean(lens):.0f}  picks {dict(sorted(picks.items(), key=lambda x: -x[1]))}")

if __name__ == "__main__":
    main()
