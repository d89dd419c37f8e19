"""Offline, not adopted (2026-12-07): a knockout - after the duel, a second duel of the
survivor against the best other plan by measured_s within the confirm window - against
the library's one duel, and against one duel of 40 pairs (the same extra steps), on
sim.py's host as duel_steps.py drives it. Mean regret and mean trial length per scenario.
Run from the repository root with PYTHONPATH=src: python .../knockout.py [TRIALS]"""
import math, os, random, statistics, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sim
from omgs_hook import plan_selection as ps


class Knockout(ps.Trial):
    max_duels = 2

    def _finish_duel(self, turn_readings, step):
        survivor = super()._finish_duel(turn_readings, step)
        dueled = getattr(self, "_dueled", set()) | {self.duel["winner"], self.duel["rival"]}
        self._dueled = dueled
        self._duels = getattr(self, "_duels", 0) + 1
        if self._duels >= self.max_duels:
            return survivor
        times = {i: self.measured_s(i) for i in range(len(self.candidates))}
        best_t = min(times.values())
        others = sorted((t, i) for i, t in times.items() if i not in dueled and math.isfinite(t)
                        and t <= best_t * (1 + self.confirm_window))
        if not others:
            return survivor
        rival = others[0][1]
        self.winner = None; self.decided_at = None
        self.duel = {"winner": survivor, "rival": rival, "ratios": []}
        turns = [i for p in range(self.duel_pairs)
                 for i in ((survivor, rival) if p % 2 == 0 else (rival, survivor))]
        self._next_round(ps.DUEL, turns, step)
        return None


def choose(true, seed, cls, pairs=20, sigma_phase=0.2, rho=0.9):
    host = sim.Host(random.Random(seed), sigma_phase, rho, 0.05, 0.0, 4)
    trial, steps = sim.drive_trial(true, host, trial_cls=cls, duel_pairs=pairs)
    return trial.candidates[trial.winner].name, steps


ROWS = [("duel of 20 pairs", dict(cls=ps.Trial)),
        ("knockout, 2 duels of 20", dict(cls=Knockout)),
        ("duel, phases of 10%", dict(cls=ps.Trial, sigma_phase=0.1)),
        ("knockout, phases of 10%", dict(cls=Knockout, sigma_phase=0.1)),
        ("duel, rho 0.7", dict(cls=ps.Trial, rho=0.7)),
        ("knockout, rho 0.7", dict(cls=Knockout, rho=0.7)),
        # the same extra steps spent on one duel of 40 pairs instead of two of 20
        ("duel of 40 pairs", dict(cls=ps.Trial, pairs=40)),
        ("duel of 40, phases of 10%", dict(cls=ps.Trial, pairs=40, sigma_phase=0.1)),
        ("duel of 40, rho 0.7", dict(cls=ps.Trial, pairs=40, rho=0.7))]


def main(n):
    print("scenarios:", ", ".join(sim.SCENARIOS))
    for label, kw in ROWS:
        cells = []
        for true in sim.SCENARIOS.values():
            best = min(true.values())
            runs = [choose(true, seed, **kw) for seed in range(n)]
            regret = statistics.mean(true[w] / best for w, _ in runs) - 1
            cells.append(f"{100 * regret:5.2f}% ({statistics.mean(s for _, s in runs):3.0f})")
        print(f"{label:26s}", "  ".join(cells), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 200)
