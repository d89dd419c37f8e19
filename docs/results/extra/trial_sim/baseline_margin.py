"""The trial's baseline margin (plan_selection.BASELINE_MARGIN: a plan other than
`single` counts its time 1 + margin times in every decision), on sim.py's host at the
noise duel_steps.py uses (phases of 20% lasting about ten steps, invisible to the
forward pass), with the library's duel. Two hosts: an unbiased one, and one where the
trial reads every multi-group plan `bias` faster than it runs afterwards - the pattern
of the stored cluster runs (docs/results/extra/trial_vs_timed.py: winners read within 3%
of `single` ran at or behind TopK-SGD's A/A copy). Per scenario: mean regret of the
chosen plan (its true time over the best's, minus 1) and the share of trials that
chose a plan more than 2% slower than `single`. Run from the repository root with
PYTHONPATH=src: python .../baseline_margin.py [TRIALS]"""
import os, random, statistics, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sim  # noqa: E402

SCENARIOS = dict(sim.SCENARIOS)
SCENARIOS["near-tie (single best by 1%)"] = {"optimal": 1.02, "optimal-sparse": 1.01,
                                              "single": 1.00, "layerwise": 1.10,
                                              "2-groups": 1.015, "3-groups": 1.01}


def choose(true, seed, margin, bias):
    host = sim.Host(random.Random(seed), 0.2, 0.9, 0.05, 0.0, 4)
    read = {n: t * (1.0 if n == "single" else 1.0 - bias) for n, t in true.items()}
    trial, steps = sim.drive_trial(read, host, baseline_margin=margin)
    return trial.candidates[trial.winner].name, steps


def main(n):
    print("scenarios:", ", ".join(SCENARIOS))
    for bias in (0.0, 0.02):
        for margin in (0.0, 0.02, 0.03, 0.05):
            cells = []
            for true in SCENARIOS.values():
                best = min(true.values())
                runs = [choose(true, seed, margin, bias) for seed in range(n)]
                regret = statistics.mean(true[w] / best for w, _ in runs) - 1
                behind = sum(true[w] > 1.02 * true["single"] for w, _ in runs) / n
                cells.append(f"{100 * regret:5.2f}% {behind:4.2f}")
            print(f"bias {bias:.2f} margin {margin:.2f}  ", "   ".join(cells), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 200)
