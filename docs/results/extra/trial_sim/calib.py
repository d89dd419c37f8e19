import os, statistics, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sim
true = sim.SCENARIOS["mixer-like (single best by 5%)"]
for sp, rho, si, ka in [(0.10, 0.9, 0.05, 0.3), (0.15, 0.9, 0.05, 0.3), (0.10, 0.9, 0.10, 0.7), (0.15, 0.8, 0.08, 0.3), (0.20, 0.9, 0.05, 0.0)]:
    picks = {}
    for seed in range(300):
        w, n = sim.simulate(true, seed, sigma_phase=sp, rho=rho, sigma_iid=si, kappa=ka)
        picks[w] = picks.get(w, 0) + 1
    print(sp, rho, si, ka, dict(sorted(picks.items(), key=lambda x: -x[1])))
