"""The README's main job, default hook against plain all-reduce, in interleaved pairs.

    python docs/results/extra/main_job/run_pairs.py PAIRS OUT.json

Each pair runs ``torchrun --nproc_per_node=2 scripts/train.py --model resnet20 --hook H
--steps 132`` for H = omgs and allreduce (the order alternating between pairs) and
records train.py's summary line (mean s/iter over the steps after the first 5, the
trial's steps included), the median step from step 50 on (after the first trial) and
the load average before each run.
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", ".."))


def run(hook):
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "train.jsonl")
        load = os.getloadavg()[0]
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node=2", os.path.join(ROOT, "scripts", "train.py"),
                        "--model", "resnet20", "--hook", hook, "--steps", "132",
                        "--log-file", log], check=True, cwd=tmp, timeout=600,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with open(log) as f:
            records = [json.loads(line) for line in f]
    summary = [r for r in records if r.get("summary")][-1]
    # the steady state: steps after the first trial (which ends by step 49 at most)
    after = [r["iter_s"] for r in records if "iter_s" in r and r.get("step", 0) >= 50]
    keep = ("mean_iter_s", "test_accuracy")
    return {"hook": hook, "load_before": load, **{k: summary.get(k) for k in keep},
            "median_after_50_s": statistics.median(after) if after else None,
            "plan": (summary.get("plan_history") or [{}])[-1].get("strategy")}


def main():
    pairs, out = int(sys.argv[1]), sys.argv[2]
    rows = []
    for i in range(pairs):
        for hook in (("omgs", "allreduce") if i % 2 == 0 else ("allreduce", "omgs")):
            rows.append(dict(run(hook), pair=i))
            print(rows[-1], flush=True)
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)
    for key in ("mean_iter_s", "median_after_50_s"):
        ratios = []
        for i in range(pairs):
            a = {r["hook"]: r[key] for r in rows if r["pair"] == i}
            ratios.append(a["omgs"] / a["allreduce"])
        print(f"omgs / allreduce per pair, {key}:", " ".join(f"{r:.3f}" for r in ratios))


if __name__ == "__main__":
    main()
