import json, os, statistics, subprocess, sys, tempfile
ROOT = "/work/main"
def run(hook, extra=()):
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "train.jsonl"); load = os.getloadavg()[0]
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        os.path.join(ROOT, "scripts", "train.py"), "--model", "resnet20", "--hook", hook,
                        "--steps", "132", "--log-file", log, *extra], check=True, cwd=tmp, timeout=600,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        recs = [json.loads(l) for l in open(log)]
    summ = [r for r in recs if r.get("summary")][-1]
    steps = [(r["step"], r["iter_s"]) for r in recs if "iter_s" in r and "step" in r]
    return {"hook": hook, "extra": list(extra), "load": load, "mean_iter_s": summ.get("mean_iter_s"),
            "steps": steps, "plan_history": summ.get("plan_history"), "trial": summ.get("last_trial") or summ.get("trial")}
out = []
pairs = int(sys.argv[1])
for i in range(pairs):
    order = ["omgs", "allreduce"] if i % 2 == 0 else ["allreduce", "omgs"]
    for h in order:
        r = run(h); r["pair"] = i; out.append(r)
        print(i, h, round(r["mean_iter_s"]*1e3, 1), "load", round(r["load"], 1), flush=True)
json.dump(out, open(sys.argv[2], "w"))
