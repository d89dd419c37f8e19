"""The default's trial against its timed rounds, over every stored benchmark run that has
the default beside TopK-SGD (docs/results/bench_*.json and extra/bench_*.json): per run,
the trial winner's measured time over `single`'s, the duel's ratio if one ran, and the
timed default over TopK-SGD (with the A/A control where there is one). Then medians by
kind of winner, and last the duel's reading of a multi-group plan against `single` beside
the same plan's timed rounds. Run from the repository root:
python docs/results/extra/trial_vs_timed.py"""
import glob
import json
import os
import statistics

HERE = os.path.dirname(os.path.abspath(__file__))
paths = sorted(glob.glob(os.path.join(HERE, "bench_*.json")))
paths += sorted(glob.glob(os.path.join(HERE, "..", "bench_*.json")))
results = {}  # path -> its result, read once for both sections
for path in paths:
    with open(path) as handle:
        results[path] = json.load(handle)
rows = []
for path in paths:
    variants = results[path].get("variants", {})
    if "default" not in variants or "topk" not in variants:
        continue
    hook = variants["default"].get("hook") or {}
    trial = (hook.get("selection") or {}).get("last_trial") or {}
    measured = {c["name"]: c.get("measured_s") for c in trial.get("candidates") or []}
    winner = trial.get("winner")
    if not measured.get("single") or not measured.get(winner):
        continue
    duel = trial.get("duel")
    again = variants.get("topk_again")
    rows.append({
        "run": os.path.basename(path)[len("bench_"):-len(".json")], "winner": winner,
        "groups": len(hook.get("plan_groups") or []),
        "trial_over_single": measured[winner] / measured["single"],
        "duel_ratio": duel["median_ratio"] if duel else None,
        "timed_over_topk": variants["default"]["median_s"] / variants["topk"]["median_s"],
        "aa": again["median_s"] / variants["topk"]["median_s"] if again else None})
for r in rows:
    print(f"{r['run']:40s} {r['winner']:15s} {r['groups']:3d} groups  trial {r['trial_over_single']:.3f}"
          f"  duel {'-' if r['duel_ratio'] is None else format(r['duel_ratio'], '.3f')}"
          f"  timed {r['timed_over_topk']:.3f}  A/A {'-' if r['aa'] is None else format(r['aa'], '.3f')}")


def summary(label, subset):
    if subset:
        print(f"{label}: {len(subset)} runs, trial winner over single median "
              f"{statistics.median(r['trial_over_single'] for r in subset):.3f}, timed default "
              f"over TopK-SGD median {statistics.median(r['timed_over_topk'] for r in subset):.3f} "
              f"({min(r['timed_over_topk'] for r in subset):.3f}-"
              f"{max(r['timed_over_topk'] for r in subset):.3f}), more than 2% behind: "
              f"{sum(r['timed_over_topk'] > 1.02 for r in subset)}")


multi = [r for r in rows if r["winner"] != "single"]
summary("winner of several groups", multi)
summary("... read within 5% of single in the trial", [r for r in multi if r["trial_over_single"] >= 0.95])
summary("winner single", [r for r in rows if r["winner"] == "single"])

# the same runs against the A/A copy of TopK-SGD (the variant run after it: a default
# that ran `single` reads about 1.00 of it, against 0.98 of TopK-SGD itself), by how far
# the trial read a multi-group winner ahead of `single` (plan_selection.BASELINE_MARGIN)
print("timed default over the TopK-SGD A/A copy, by the trial's reading of the winner over single:")
with_aa = [r for r in rows if r["aa"]]
ones = [r["timed_over_topk"] / r["aa"] for r in with_aa if r["groups"] == 1]
print(f"  winner single: {len(ones)} runs, median {statistics.median(ones):.3f}, mean {statistics.mean(ones):.3f}")
for lo, hi in ((0.0, 0.95), (0.95, 0.97), (0.97, 0.98), (0.98, 1.02)):
    ratios = [r["timed_over_topk"] / r["aa"] for r in with_aa
              if r["groups"] > 1 and lo <= r["trial_over_single"] < hi]
    if ratios:
        print(f"  several groups, trial {lo:.2f}-{hi:.2f}: {len(ratios)} runs, "
              f"{min(ratios):.3f}-{max(ratios):.3f}, mean {statistics.mean(ratios):.3f}")

# The duel against the timed rounds (plan_selection.BASELINE_MARGIN applies to the duel's
# reading): per run whose duel set `single` against a plan X of several groups, how much
# faster the duel read X than `single`, and how much faster X ran in the timed rounds -
# the default's own rows when it ran X, else a fixed variant whose groups are exactly X's
# - against the mean of TopK-SGD and its A/A copy (the two positions of the same plan,
# so the round order's favour cancels as far as it can). Runs in the drawn order
# (``round_orders`` in the JSON, since e54d13b) are listed apart from the rotated ones.
print("the duel's reading of a plan of several groups against `single`, and the same plan timed:")
errors = {"rotated": [], "drawn": []}
for path in paths:
    result = results[path]
    variants = result.get("variants", {})
    if "default" not in variants or "topk" not in variants:
        continue
    trial = (((variants["default"].get("hook") or {}).get("selection") or {})
             .get("last_trial") or {})
    duel = trial.get("duel") or {}
    if duel.get("median_ratio") is None or "single" not in (duel["winner"], duel["rival"]):
        continue
    other = duel["rival"] if duel["winner"] == "single" else duel["winner"]
    # median_ratio is the rival's reading over the winner's: read as single over X
    read = duel["median_ratio"] if duel["rival"] == "single" else 1.0 / duel["median_ratio"]
    groups = {c["name"]: c["groups"] for c in trial["candidates"]}
    again = variants.get("topk_again")
    reference = (variants["topk"]["median_s"] + again["median_s"]) / 2 if again else None
    timed, source = None, None
    if trial.get("winner") == other:
        timed, source = variants["default"]["median_s"], "default"
    else:
        for name in ("omgs", "greedy", "omgs_dense", "lags"):
            if ((variants.get(name) or {}).get("hook") or {}).get("plan_groups") == groups[other]:
                timed, source = variants[name]["median_s"], name
                break
    if timed is None or reference is None:
        continue
    order = "drawn" if "round_orders" in result else "rotated"
    read_gain, timed_gain = read - 1.0, reference / timed - 1.0
    errors[order].append(read_gain - timed_gain)
    print(f"  {os.path.basename(path)[len('bench_'):-len('.json')]:42s} {order:7s} {other:15s} "
          f"read {100 * read_gain:+5.1f}%  timed ({source}) {100 * timed_gain:+5.1f}%")
for order, values in errors.items():
    if values:
        print(f"  {order} order: {len(values)} runs, read minus timed gain: median "
              f"{100 * statistics.median(values):+.1f}%, mean {100 * statistics.mean(values):+.1f}%, "
              f"{100 * min(values):+.1f}% to {100 * max(values):+.1f}%")
