"""The default's trial with a CPU load spell injected at a fixed trial step, with the
load-spell guard on or off; then the default against pinned single and pinned [50, 9]
(and, with a 6th argument "winner", the default's winner pinned in a fresh model),
interleaved in 5-step blocks.

Run on the emulated cluster (as root), e.g.:
  PYTHONPATH=src python scripts/netem_cluster.py --nodes 2 --rate 20mbit -- \
      python docs/results/extra/spell/spell_ab.py PROFILE.json OUT.json on 6 1.5
(arguments: profile, output, guard on|off, trial step at which the spell starts, its
seconds; the spell is two busy processes started by rank 0, on the 2 shared cores).
"""
import json, os, sys, time, statistics, subprocess
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import omgs_hook
from omgs_hook import plan_selection
from omgs_hook.examples.models import resnet20

profile, out, guard, spell_at, spell_s = sys.argv[1], sys.argv[2], sys.argv[3] == "on", int(sys.argv[4]), float(sys.argv[5])
pin_winner = sys.argv[6:7] == ["winner"]
if not guard:
    plan_selection.SPELL_FACTOR = 1e9
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
single = [list(range(59))]
two = [list(range(50)), list(range(50, 59))]
variants = {}
for name, opts in [("single", {"plan": {"groups": single}}), ("pin2", {"plan": {"groups": two}}),
                   ("default", {})]:
    torch.manual_seed(0)
    m = resnet20()
    ddp = DDP(m, bucket_cap_mb=0, broadcast_buffers=False, init_sync=False)
    st = omgs_hook.register(ddp, density=0.001, profile=profile, **opts)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    variants[name] = (ddp, st, opt)
g = torch.Generator().manual_seed(rank)
x = torch.randn(32, 3, 32, 32, generator=g); y = torch.randint(0, 10, (32,), generator=g)
HOG = ("import multiprocessing as m, time\n"
       "def f():\n  t = time.time()\n  while time.time() - t < %f: pass\n"
       "if __name__ == '__main__':\n  ps = [m.Process(target=f) for _ in range(2)]\n"
       "  [p.start() for p in ps]\n  [p.join() for p in ps]\n")

def step(name):
    ddp, st, opt = variants[name]
    t = time.perf_counter()
    opt.zero_grad()
    torch.nn.functional.cross_entropy(ddp(x), y).backward()
    opt.step()
    return time.perf_counter() - t

for name in ("single", "pin2"):
    for i in range(8):
        step(name)
st = variants["default"][1]
trial_start, hog = None, None
for i in range(90):
    step("default")
    if trial_start is None and st._trial is not None:
        trial_start = st.step
    if rank == 0 and trial_start is not None and hog is None and st.step >= trial_start + spell_at:
        hog = subprocess.Popen([sys.executable, "-c", HOG % spell_s])
    if trial_start is not None and st._trial is None and st.step > trial_start + 5:
        break
if hog is not None:
    hog.wait()
for i in range(3):
    step("default")
# the winner's own plan, pinned in a fresh model: is the plan slow, or the default?
if pin_winner:
    torch.manual_seed(0)
    m = resnet20()
    ddp = DDP(m, bucket_cap_mb=0, broadcast_buffers=False, init_sync=False)
    pst = omgs_hook.register(ddp, density=0.001, profile=profile,
                             plan={"groups": [list(g) for g in st.plan.unit_groups()]})
    variants["winner_pinned"] = (ddp, pst, torch.optim.SGD(m.parameters(), lr=0.01))
    for i in range(8):
        step("winner_pinned")
before = dict(st.stats()["total"]); hist_before = len(st.stats()["plan_history"])
times = {n: [] for n in variants}
order = list(variants)
n = len(order)
for r in range(6 if n == 3 else 8):
    for name in order[r % n:] + order[:r % n]:
        ts = [step(name) for _ in range(5)]
        tt = torch.tensor(ts, dtype=torch.float64)
        dist.all_reduce(tt, op=dist.ReduceOp.MAX)
        times[name].append(tt.tolist())
if rank == 0:
    s = st.stats()
    t = s["selection"]["last_trial"]
    res = {n: statistics.median([x for b in v for x in b]) for n, v in times.items()}
    rec = {"blocks": {n: [[round(x * 1e3) for x in b] for b in v] for n, v in times.items()}, "guard": guard, "spell_at": spell_at, "spell_s": spell_s, "medians": res,
           "winner": t["winner"], "retaken": t.get("retaken"), "trial_start": trial_start,
           "trial": [(c["name"], c["measured_s"], c.get("disturbed")) for c in t["candidates"]]}
    after = s["total"]
    rec["total_delta"] = {k: after[k] - before[k] for k in after if isinstance(after[k], (int, float)) and k in before and after[k] != before[k]}
    rec["history_after"] = s["plan_history"][hist_before - 1:]
    rec["plan"] = s["plan"]["groups"]
    rec["model_check"] = s["model_check"]
    rec["stall"] = s.get("replan_stall_s")
    json.dump(rec, open(out, "w"), indent=1)
    print("delta", rec["total_delta"], "plan", [len(g) for g in rec["plan"]], "hist", [(h["step"], h["reason"], h["strategy"]) for h in rec["history_after"]])
    print(json.dumps({k: round(v * 1e3, 1) for k, v in res.items()}), "winner", t["winner"],
          "retaken", t.get("retaken"), [(n, m and round(m * 1e3), d) for n, m, d in rec["trial"]])
for v in variants.values():
    v[1].close()
dist.destroy_process_group()
