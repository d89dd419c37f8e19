"""Per-round medians (slowest rank, steps after the window start), ratios and the trials'
choices of the held-out Mixer runs: python summarize.py RATE DENSITY [PREFIX]."""
import glob
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
rate, density = sys.argv[1], sys.argv[2]
prefix = sys.argv[3] if len(sys.argv) > 3 else ""
rows, trials = {}, []
for path in sorted(glob.glob(os.path.join(HERE, "raw", f"{prefix}{rate}_d{density}_r*_*.json"))):
    name = os.path.basename(path)[:-5]
    rnd = int(name.rsplit("_r", 1)[1].split("_")[0])
    variant = name.split(f"_r{rnd}_", 1)[1]
    d = json.load(open(path))
    rows.setdefault(variant, {})[rnd] = d["median_step_s"] * 1000
    if variant == "default":
        lt = d["last_trial"]
        trials.append({"round": rnd, "winner": lt["winner"], "groups": [len(g) for g in d["plan"]["groups"]],
                       "excess_steps": lt["excess_steps"], "timed_ms": d["median_step_s"] * 1000,
                       "decided_at": lt.get("decided_at"), "duel": lt.get("duel"),
                       "candidates_ms": {c["name"]: round(c["measured_s"] * 1000, 1)
                                         for c in lt["candidates"] if c.get("measured_s")},
                       "predicted_ms": {c["name"]: round(c["predicted_s"] * 1000, 1)
                                        for c in lt["candidates"]}})
med = {v: statistics.median(r.values()) for v, r in rows.items()}
rounds = sorted(rows["default"])
peers = [v for v in ("topk", "lags") if v in rows]  # (the re-run ran TopK-SGD alone)
best = [min(rows[v][k] for v in peers) / rows["default"][k] for k in rounds]
out = {"medians_ms": med, "rounds_ms": rows, "peers": peers,
       "best_topk_lags_over_default": min(med[v] for v in peers) / med["default"],
       "per_round_best_topk_lags_over_default": best,
       "median_of_per_round": statistics.median(best),
       "aa_topk_again_over_topk": med["topk_again"] / med["topk"],
       "per_round_aa": [rows["topk_again"][k] / rows["topk"][k] for k in rounds],
       "trials": trials}
if "sparse_model" in med:
    out["sparse_model_over_default"] = med["sparse_model"] / med["default"]
if "default_single" in med:  # (TopK-SGD's plan under the default's options, pinned)
    out["topk_over_default_single"] = med["topk"] / med["default_single"]
    out["per_round_topk_over_default_single"] = [rows["topk"][k] / rows["default_single"][k]
                                                 for k in rounds]
for k, v in out.items():
    print(k, json.dumps(v, default=float)[:400])
json.dump(out, open(os.path.join(HERE, f"summary_{prefix}{rate}_d{density}.json"), "w"), indent=1)
