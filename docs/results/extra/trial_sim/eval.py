import os, statistics, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sim
for label, true in sim.SCENARIOS.items():
    best = min(true.values())
    for rule, kw in [("current", {}), ("max_confirm=4", {"max_confirm": 4}),
                     ("prefer single in tie", {"prefer_single": True}),
                     ("both", {"max_confirm": 4, "prefer_single": True})]:
        for noise in [dict(sigma_phase=0.2, rho=0.9, sigma_iid=0.05, kappa=0.0),
                      dict(sigma_phase=0.15, rho=0.8, sigma_iid=0.08, kappa=0.3)]:
            ratios, vs_single, lens = [], [], []
            for seed in range(300):
                w, n = sim.simulate(true, seed, **noise, **kw)
                ratios.append(true[w] / best); vs_single.append(true[w] / true["single"]); lens.append(n)
            print(f"{label[:22]:22s} {rule:21s} phase {noise['sigma_phase']}: regret {100*(statistics.mean(ratios)-1):5.2f}%  "
                  f"P(>2% off best) {sum(r > 1.02 for r in ratios)/len(ratios):.2f}  mean vs single {statistics.mean(vs_single):.3f}  P(>2% behind single) {sum(r > 1.02 for r in vs_single)/len(vs_single):.2f} steps {statistics.mean(lens):.0f}")
