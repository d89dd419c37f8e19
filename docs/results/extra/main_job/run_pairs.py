"""The README's main job, default hook against plain all-reduce, in interleaved pairs.

    python docs/results/extra/main_job/run_pairs.py PAIRS OUT.json

Each pair runs ``torchrun --nproc_per_node=2 scripts/train.py --model resnet20 --hook H
--steps 132`` for H = omgs and allreduce (the order alternating between pairs) and
records train.py's summary line (mean s/iter over the steps after the first 5, the
trial's steps included) and the load average before each run.
"""
import json
import os
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
            summary = [json.loads(line) for line in f if '"summary": true' in line][-1]
    keep = ("mean_iter_s", "test_accuracy", "bytes_per_step", "plan_strategy")
    return {"hook": hook, "load_before": load, **{k: summary.get(k) for k in keep},
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
    ratios = []
    for i in range(pairs):
        a = {r["hook"]: r["mean_iter_s"] for r in rows if r["pair"] == i}
        ratios.append(a["omgs"] / a["allreduce"])
    print("omgs / allreduce per pair:", " ".join(f"{r:.3f}" for r in ratios))


if __name__ == "__main__":
    main()
