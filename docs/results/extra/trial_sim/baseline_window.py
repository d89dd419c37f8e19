"""The baseline's screen window (plan_selection.BASELINE_WINDOW: `single` reaches the
confirm round whenever the screen read it within this fraction of the best, in the
round's last place when it is full), with the baseline margin of 3% and the duel, on the
host of baseline_margin.py (unbiased). Per scenario: mean regret, the share of trials
whose screen left `single` out of the confirm round, and the mean trial length in steps.
Run from the repository root with PYTHONPATH=src: python .../baseline_window.py [TRIALS]"""
import os, random, statistics, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sim  # noqa: E402
from baseline_margin import SCENARIOS  # noqa: E402


def choose(true, seed, window, sigma_phase):
    host = sim.Host(random.Random(seed), sigma_phase, 0.9, 0.05, 0.0, 4)
    trial, steps = sim.drive_trial(true, host, baseline_margin=0.03, baseline_window=window)
    single = [c.name for c in trial.candidates].index("single")
    # (a screen whose only contender was `single` made it the winner without a round)
    confirmed = trial.winner == single or any(
        single in r for r, k in zip(trial.rounds, trial.round_kinds) if k == "confirm")
    return trial.candidates[trial.winner].name, steps, confirmed


def main(n):
    print("scenarios:", ", ".join(SCENARIOS))
    for sigma_phase in (0.2, 0.3):
        for window in (0.0, 0.6):
            cells = []
            for true in SCENARIOS.values():
                best = min(true.values())
                runs = [choose(true, seed, window, sigma_phase) for seed in range(n)]
                regret = statistics.mean(true[w] / best for w, _, _ in runs) - 1
                left_out = sum(not c for _, _, c in runs) / n
                steps = statistics.mean(s for _, s, _ in runs)
                cells.append(f"{100 * regret:5.2f}% {left_out:4.2f} ({steps:3.0f})")
            print(f"phases {sigma_phase:.1f} window {window:.1f}  ", "   ".join(cells), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 200)
