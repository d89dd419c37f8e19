import os, statistics, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sim
noise = dict(sigma_phase=0.2, rho=0.9, sigma_iid=0.05, kappa=0.0)
for rule, kw in [("library", {}), ("confirm=5", {"confirm": 5}), ("tiebreak_turns=3", {"tiebreak_turns": 3}),
                 ("screen_passes=3", {"screen_passes": 3}), ("measure=2", {"measure": 2})]:
    cells = []
    for label, true in sim.SCENARIOS.items():
        best = min(true.values()); ratios, lens = [], []
        for seed in range(300):
            w, n = sim.simulate(true, seed, **noise, **kw)
            ratios.append(true[w] / best); lens.append(n)
        cells.append(f"{100*(statistics.mean(ratios)-1):5.2f}% ({statistics.mean(lens):.0f} steps)")
    print(f"{rule:18s}", "  ".join(cells), flush=True)
