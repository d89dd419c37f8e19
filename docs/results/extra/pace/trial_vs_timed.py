"""The default hook's trial against the same candidates timed afterwards (docs/design.md, "Pace").

    python scripts/netem_cluster.py --nodes 2 --rate 20mbit -- \
        python trial_vs_timed.py DENSITY OUT.json

110 steps of the default ``register()`` (its trial included), then every candidate the
trial measured within 30% of its best, pinned on its own model, interleaved as in
timed_plans.py; prints each candidate's trial reading, its median pace, and its timed
median raw and divided by the pace (the largest rank's forward ratio, as the library of
60ad64f did; 96fb46e takes the mean over ranks). Runs: trial_vs_timed_n2.json (N=2, 20
Mbit/s) and trial_vs_timed_n4.json (N=4, 14 Mbit/s), both d=0.01, library 60ad64f.
trial_n2_157fc26.json: the same first phase with the library of 157fc26 (no pace).
"""
import datetime, gc, json, statistics, sys, time
import torch, torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
import omgs_hook
from omgs_hook.examples.models import build_model

density = float(sys.argv[1]); out = sys.argv[2]
torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
rank = dist.get_rank()
g = torch.Generator().manual_seed(rank)
batches = [(torch.randn(32, 3, 32, 32, generator=g), torch.randint(0, 10, (32,), generator=g)) for _ in range(4)]

def make(**kw):
    torch.manual_seed(0)
    net = DDP(build_model("resnet20", in_channels=3, num_classes=10), bucket_cap_mb=0)
    state = omgs_hook.register(net, density=density, **kw)
    return [net, torch.optim.SGD(net.parameters(), lr=0.01), state]

def step(v, i):
    net, opt, _ = v
    t = time.perf_counter()
    o = net(batches[i % 4][0])
    f = time.perf_counter() - t
    loss = F.cross_entropy(o, batches[i % 4][1])
    opt.zero_grad(); loss.backward(); opt.step()
    return [time.perf_counter() - t, f]

default = make()
times = [step(default, i) for i in range(110)]
trial = default[2].stats()["selection"]["last_trial"]
variants = {"default": default}
for c in trial["candidates"]:
    if c["measured_s"] is None or c["measured_s"] > 1.3 * min(x["measured_s"] for x in trial["candidates"] if x["measured_s"]): continue
    variants[c["name"]] = make(plan={"groups": c["groups"], "dense": c["dense"]})
for name, v in list(variants.items()):
    if name != "default":
        for i in range(12): step(v, i)
timed = {n: [] for n in variants}
for r in range(12):
    order = list(variants) if r % 2 == 0 else list(reversed(variants))
    for n in order:
        step(variants[n], 0)
        timed[n] += [step(variants[n], i) for i in range(1, 6)]
row = torch.tensor([timed[n] for n in variants], dtype=torch.float64)
rows = [torch.zeros_like(row) for _ in range(dist.get_world_size())]
dist.all_gather(rows, row)
if rank == 0:
    R = torch.stack(rows)  # ranks x variants x steps x 2
    med = R[..., 1].reshape(R.shape[0], -1).median(dim=1).values
    pace = (R[..., 1] / med[:, None, None]).max(0).values
    slow = R[..., 0].max(0).values
    adj = slow / pace
    res = {"trial": trial, "default_times": times,
           "timed": {n: slow[j].tolist() for j, n in enumerate(variants)}, "adjusted": {n: adj[j].tolist() for j, n in enumerate(variants)}}
    json.dump(res, open(out, "w"))
    for c in trial["candidates"]:
        ms = c["measured_s"]
        if c["name"] not in variants: print(c["name"], "trial", ms); continue
        j = list(variants).index(c['name'])
        print(f"{c['name']:16s} groups={len(c['groups']):3d} pred {c['predicted_s']*1e3:6.1f} trial {ms*1e3 if ms else float('nan'):6.1f} pace {c.get('pace') or 0:.2f} timed {statistics.median(slow[j].tolist())*1e3:6.1f} adjusted {statistics.median(adj[j].tolist())*1e3:6.1f} {'*' if c['winner'] else ''}")
    print({n: round(1e3*float(R[:, j, :, 1].median()),1) for j, n in enumerate(variants)})
    print("default timed", statistics.median(slow[0].tolist())*1e3, "adjusted", statistics.median(adj[0].tolist())*1e3, "after-trial own", statistics.median([t[0] for t in times[80:]])*1e3, "noise", trial["noise"], "steps", trial["steps"], "excess", trial["excess_steps"])
del variants, default; gc.collect()
dist.destroy_process_group()
