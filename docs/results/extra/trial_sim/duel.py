"""What a steady-state duel after the trial would buy (an idea, not the library's rule):
the trial's winner and its runner-up alternate in blocks (1 settle + `counted` steps each,
the order alternating) for `pairs` pairs; the one with the lower median of per-pair ratios
is kept. Same synthetic host as sim.py; the trial itself is the library's."""
import math, os, random, statistics, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sim
from omgs_hook import plan_selection as ps


def run(true, seed, pairs, counted=4, sigma_phase=0.2, rho=0.9, sigma_iid=0.05, kappa=0.0, ranks=4):
    rnd = random.Random(seed)
    names = list(true)
    trial = ps.Trial([sim.cand(n, i) for i, n in enumerate(names)], 0, lead=ps.FIRST_TRIAL_LEAD_STEPS)
    phase, step = rnd.gauss(0, sigma_phase), 0

    def step_time(name):
        nonlocal phase
        phase = rho * phase + math.sqrt(1 - rho * rho) * rnd.gauss(0, sigma_phase)
        t = true[name] * math.exp(phase) * max(math.exp(rnd.gauss(0, sigma_iid)) for _ in range(ranks))
        return t, 0.3 * math.exp(kappa * phase) * math.exp(rnd.gauss(0, 0.03))

    while not trial.done and step < 400:
        if trial.round_complete(step):
            trial.finish_round([trial.local_row()], step)
            if trial.done:
                break
        c = trial.candidate_at(step)
        t, fwd = step_time(names[c] if c is not None else names[0])
        if c is not None:
            trial.record(step, t, probe=fwd, forward=fwd)
        step += 1
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
