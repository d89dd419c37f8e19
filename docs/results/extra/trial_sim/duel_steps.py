"""The library's trial with and without its duel (plan_selection.DUEL_PAIRS; the duel
is the library's own round since this file, not a wrapper as in duel.py), on sim.py's
synthetic host at the noise calib.py matched to the cluster (phases of 20% lasting about
ten steps, invisible to the forward pass), and at other phase lengths and sizes. Mean
regret of the chosen plan (true time over the best's, minus 1), and the trial's mean
length in steps, per scenario. Run from the repository root with PYTHONPATH=src."""
import os, random, statistics, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sim  # noqa: E402


def choose(true, seed, pairs, sigma_phase=0.2, rho=0.9):
    host = sim.Host(random.Random(seed), sigma_phase, rho, 0.05, 0.0, 4)
    trial, steps = sim.drive_trial(true, host, duel_pairs=pairs)
    return trial.candidates[trial.winner].name, steps


if __name__ == "__main__":
    print("scenarios:", ", ".join(sim.SCENARIOS))
    for label, kw in [("no duel", dict(pairs=0)), ("duel of 20 pairs", dict(pairs=20)),
                      ("no duel, phases rho 0.7", dict(pairs=0, rho=0.7)),
                      ("duel, phases rho 0.7", dict(pairs=20, rho=0.7)),
                      ("no duel, phases rho 0.95", dict(pairs=0, rho=0.95)),
                      ("duel, phases rho 0.95", dict(pairs=20, rho=0.95)),
                      ("no duel, phases of 10%", dict(pairs=0, sigma_phase=0.1)),
                      ("duel, phases of 10%", dict(pairs=20, sigma_phase=0.1))]:
        cells = []
        for true in sim.SCENARIOS.values():
            best = min(true.values())
            runs = [choose(true, seed, **kw) for seed in range(400)]
            regret = statistics.mean(true[w] / best for w, _ in runs) - 1
            cells.append(f"{100 * regret:5.2f}% ({statistics.mean(n for _, n in runs):3.0f})")
        print(f"{label:26s}", "  ".join(cells), flush=True)
