"""What a steady-state duel after the trial would buy (an idea, not the library's rule):
the trial's winner and its runner-up alternate in blocks (1 settle + `counted` steps each,
the order alternating) for `pairs` pairs; the one with the lower median of per-pair ratios
is kept. Same synthetic host as sim.py; the trial itself is the library's."""
import os, random, statistics, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sim


def run(true, seed, pairs, counted=4, sigma_phase=0.2, rho=0.9, sigma_iid=0.05, kappa=0.0, ranks=4):
    host = sim.Host(random.Random(seed), sigma_phase, rho, sigma_iid, kappa, ranks)
    trial, _ = sim.drive_trial(true, host)

    def step_time(name):
        return host.step(true[name])

    rep = trial.report()
    ranked = sorted((c for c in rep["candidates"] if c["measured_s"]), key=lambda c: c["measured_s"])
    winner = rep["winner"]
    if pairs and len(ranked) > 1:
        rival = next(c["name"] for c in ranked if c["name"] != winner)
        ratios = []
        for p in range(pairs):
            blocks = {}
            for name in ((winner, rival) if p % 2 == 0 else (rival, winner)):
                step_time(name)  # settle
                blocks[name] = statistics.median(step_time(name)[0] for _ in range(counted))
            ratios.append(blocks[rival] / blocks[winner])
        if statistics.median(ratios) < 1.0:
            winner = rival
    return winner


if __name__ == "__main__":
    for pairs in (0, 4, 8, 12):
        cells = []
        for label, true in sim.SCENARIOS.items():
            best = min(true.values())
            regrets = [true[run(true, seed, pairs)] / best for seed in range(300)]
            cells.append(f"{100 * (statistics.mean(regrets) - 1):5.2f}%")
        print(f"duel of {pairs:2d} pairs ({pairs * 10:3d} steps):", "  ".join(cells), flush=True)
