"""Per-round medians (slowest rank, steps after the window start) and ratios of the held-out GRU runs."""
import json, statistics, sys, glob, os
HERE = os.path.dirname(os.path.abspath(__file__))
out = {}
for density in sys.argv[1:]:
    rows = {}
    for path in sorted(glob.glob(os.path.join(HERE, "raw", f"200mbit_d{density}_r*_*.json"))):
        name = os.path.basename(path)[:-5]
        rnd = int(name.split("_r")[1].split("_")[0])
        variant = name.split(f"_r{rnd}_", 1)[1]
        d = json.load(open(path))
        rows.setdefault(variant, {})[rnd] = d["median_step_s"] * 1000
    med = {v: statistics.median(r.values()) for v, r in rows.items()}
    print(f"== density {density}: per-round median step (ms), slowest rank")
    for v, r in rows.items():
        print(f"  {v:13s} {[round(r[k], 1) for k in sorted(r)]} median {med[v]:.1f}")
    best = min(med["topk"], med["lags"])
    res = {"medians_ms": med, "rounds_ms": rows,
           "default_over_best_topk_lags": med["default"] / best,
           "default_over_sparse_model": med["default"] / med["sparse_model"],
           "aa_topk_again_over_topk": med["topk_again"] / med["topk"],
           "per_round_default_over_topk": [rows["default"][k] / rows["topk"][k] for k in sorted(rows["topk"]) if k in rows["default"]],
           "per_round_aa": [rows["topk_again"][k] / rows["topk"][k] for k in sorted(rows["topk"]) if k in rows["topk_again"]]}
    for k, v in res.items():
        if k not in ("medians_ms", "rounds_ms"):
            print(f"  {k}: {[round(x, 3) for x in v] if isinstance(v, list) else round(v, 3)}")
    out[density] = res
json.dump(out, open(os.path.join(HERE, "summary.json"), "w"), indent=1)
