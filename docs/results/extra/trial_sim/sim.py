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
    return ps.Candidate(name, tuple((j,) for j in range(i + 1)), tuple([False] * (i + 1)), 1.0)

def simulate(true, seed, sigma_phase=0.10, rho=0.9, sigma_iid=0.05, kappa=0.7, ranks=4,
             max_confirm=ps.MAX_CONFIRM, prefer_single=False, fixed_tie=None, **trial_kw):
    rnd = random.Random(seed)
    names = list(true)
    cands = [cand(n, i) for i, n in enumerate(names)]
    trial = ps.Trial(cands, 0, lead=ps.FIRST_TRIAL_LEAD_STEPS, max_confirm=max_confirm, **trial_kw)
    phase = rnd.gauss(0, sigma_phase)
    step = 0
    while not trial.done and step < 400:
        if trial.round_complete(step):
            trial.finish_round([trial.local_row()], step)
            if trial.done:
                break
        c = trial.candidate_at(step)
        phase = rho * phase + math.sqrt(1 - rho * rho) * rnd.gauss(0, sigma_phase)
        if c is not None:
            # slowest of `ranks` ranks: the max of iid noises
            t = true[names[c]] * math.exp(phase) * max(math.exp(rnd.gauss(0, sigma_iid)) for _ in range(ranks))
            fwd = 0.3 * math.exp(kappa * phase) * math.exp(rnd.gauss(0, 0.03))
            trial.record(step, t, probe=fwd, forward=fwd)
        step += 1
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
