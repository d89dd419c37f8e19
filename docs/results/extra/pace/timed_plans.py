"""Pinned plans interleaved, each step's time and its forward per rank (docs/design.md, "Pace").

    python scripts/netem_cluster.py --nodes 2 --rate 20mbit -- \
        python timed_plans.py DENSITY OUT.json PLANS.json [ROUNDS]

PLANS.json: {"trial": {"candidates": [{"name", "groups", "dense"}, ...]}} (a trial
report, or plans_n2.json); candidates named ``optimal`` or ``greedy`` are skipped.
Every plan is pinned (``plan=``) on its own DDP ResNet-20, 12 warm-up steps each, then
ROUNDS (default 12) rounds of one uncounted and 5 counted steps per plan, in alternating
order. OUT: every rank's (step seconds, forward seconds) per plan, round and step.
``spread.py OUT.json`` compares the round-to-round spread raw and divided by the pace.

Runs here (ad hoc, 2026-12-06): timed_n2_a.json (N=2, 20 Mbit/s, d=0.01, the
candidates of trial_n2_157fc26.json, 12 rounds), timed_n2_b.json (N=2, plans_n2.json,
16 rounds), timed_n4.json (N=4, 14 Mbit/s, d=0.01, the candidates of
trial_vs_timed_n4.json, 12 rounds).
"""
import datetime, gc, json, statistics, sys, time
import torch, torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
import omgs_hook
from omgs_hook.examples.models import build_model

density = float(sys.argv[1]); out = sys.argv[2]; src = json.load(open(sys.argv[3]))["trial"]
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
    out_ = net(batches[i % 4][0])
    f = time.perf_counter() - t
    loss = F.cross_entropy(out_, batches[i % 4][1])
    opt.zero_grad(); loss.backward(); opt.step()
    return time.perf_counter() - t, f
variants = {}
for c in src["candidates"]:
    if c["name"] in ("optimal", "greedy"): continue
    variants[c["name"]] = make(plan={"groups": c["groups"], "dense": c["dense"]})
for v in variants.values():
    for i in range(12): step(v, i)
rec = {n: [] for n in variants}
for r in range(int(sys.argv[4]) if len(sys.argv) > 4 else 12):
    order = list(variants) if r % 2 == 0 else list(reversed(variants))
    for n in order:
        step(variants[n], 0)
        rec[n].append([step(variants[n], i) for i in range(1, 6)])
t = torch.tensor([rec[n] for n in variants], dtype=torch.float64)
rows = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
dist.all_gather(rows, t)
if rank == 0:
    json.dump({"names": list(variants), "rows": [r.tolist() for r in rows]}, open(out, "w"))
del variants; gc.collect()
dist.destroy_process_group()
