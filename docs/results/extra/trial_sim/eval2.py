import os, statistics, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sim
for label, true in sim.SCENARIOS.items():
    best = min(true.values())
    for rule, kw in [("current", {}), ("prefer single within 3%", {"prefer_single": True, "fixed_tie": 0.03}),
                     ("prefer single within 5%", {"prefer_single": True, "fixed_tie": 0.05})]:
        noise = dict(sigma_phase=0.2, rho=0.9, sigma_iid=0.05, kappa=0.0)
        ratios, vs_single = [], []
        for seed in range(300):
            w, n = sim.simulate(true, seed, **noise, **kw)
            ratios.append(true[w] / best); vs_single.append(true[w] / true["single"])
        print(f"{label[:22]:22s} {rule:24s} regret {100*(statistics.mean(ratios)-1):5.2f}%  P(>2% off best) {sum(r > 1.02 for r in ratios)/len(ratios):.2f}  mean vs single {statistics.mean(vs_single):.3f}  P(>2% behind single) {sum(r > 1.02 for r in vs_single)/len(vs_single):.2f}")
