"""Per-round medians (slowest rank, steps after the window start) and ratios of this re-run."""
import glob, json, os, statistics
HERE = os.path.dirname(os.path.abspath(__file__))
rows = {}
for path in sorted(glob.glob(os.path.join(HERE, "raw", "200mbit_d0.01_r*_*.json"))):
    name = os.path.basename(path)[:-5]
    rnd = int(name.split("_r")[1].split("_")[0])
    variant = name.split(f"_r{rnd}_", 1)[1]
    rows.setdefault(variant, {})[rnd] = json.load(open(path))["median_step_s"] * 1000
med = {v: statistics.median(r.values()) for v, r in rows.items()}
rounds = sorted(rows["default"])
best_per_round = [min(rows["topk"][k], rows["lags"][k]) / rows["default"][k] for k in rounds]
out = {"medians_ms": med, "rounds_ms": rows,
       "best_topk_lags_over_default": min(med["topk"], med["lags"]) / med["default"],
       "per_round_best_topk_lags_over_default": best_per_round,
       "median_of_per_round": statistics.median(best_per_round),
       "aa_topk_again_over_topk": med["topk_again"] / med["topk"],
       "per_round_aa": [rows["topk_again"][k] / rows["topk"][k] for k in rounds]}
for k, v in out.items():
    print(k, json.dumps(v, default=float)[:300])
json.dump(out, open(os.path.join(HERE, "summary.json"), "w"), indent=1)
