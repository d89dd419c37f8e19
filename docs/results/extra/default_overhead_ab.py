"""Is the library default slower than TopK-SGD when both run the same plan?
(docs/benchmarks.md, the 4dcf9c7 re-run.) ResNet-20 on 2 ranks: TopK-SGD twice (the A/A
pair), the default after its trial, and the default's options with the plan it chose
pinned, in interleaved rounds of 5 steps; prints each one's median step (slowest rank)
over TopK-SGD's. Self-contained, like the other probes here.

    DENS=0.01 ROUNDS=30 PROFILE=profile.json PYTHONPATH=src \
        python scripts/netem_cluster.py --nodes 2 --rate 36mbit -- python default_overhead_ab.py

ORDER=drawn (added 2026-12-07, after the rotation's bias was found: bench_cluster's
round_order) runs each round in an order drawn from the round's number instead of the
rotation, and also prints the median over rounds of each one's round median over
TopK-SGD's (paired by round). QUIET=1 adds `default_quiet`: the default's options with
no periodic re-plan (replan_every=10**6).
"""
import os, sys, json, time, statistics, datetime, gc, random
import torch, torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
import omgs_hook
from omgs_hook.examples.models import build_model

density = float(os.environ.get("DENS", "0.001"))
profile = os.environ["PROFILE"]
rounds = int(os.environ.get("ROUNDS", "12"))
torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
rank = dist.get_rank()
torch.manual_seed(0)
init = build_model("resnet20", in_channels=3, num_classes=10).state_dict()
g = torch.Generator().manual_seed(17 + rank)
batches = [(torch.randn(32, 3, 32, 32, generator=g), torch.randint(0, 10, (32,), generator=g)) for _ in range(4)]
fixed = dict(strategy="single", select="model", allow_dense=False, log_every=0, measure_window=30,
             warmup_steps=5, replan_every=100)
specs = {
  "topk": fixed,
  "topk_again": fixed,
  "default": {},
  "default_pinned": "PIN",
}
if os.environ.get("QUIET"):  # the default's options, but no periodic re-plan
    specs["default_quiet"] = {"replan_every": 10 ** 6}
variants = {}
for name, opts in specs.items():
    m = build_model("resnet20", in_channels=3, num_classes=10); m.load_state_dict(init)
    net = DistributedDataParallel(m, bucket_cap_mb=0.0)
    opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    variants[name] = [net, opt, opts, None, []]
def step(v, i):
    net, opt = v[0], v[1]
    x, y = batches[i % 4]
    t = time.perf_counter()
    loss = F.cross_entropy(net(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return time.perf_counter() - t
# register + warm up; the default settles first, the pinned one copies its plan's groups
for name in ("topk", "topk_again", "default") + (("default_quiet",) if "default_quiet" in specs else ()):
    v = variants[name]
    v[3] = omgs_hook.register(v[0], density=density, profile=profile, **v[2])
    for i in range(200 if name.startswith("default") else 10):
        step(v, i)
d = variants["default"][3]
plan = d.plan
if rank == 0:
    print("default plan", plan.strategy, len(plan.groups), flush=True)
v = variants["default_pinned"]
v[3] = omgs_hook.register(v[0], density=density, profile=profile, plan=plan)
for i in range(20):
    step(v, i)
if rank == 0:
    print("pinned plan", v[3].plan.strategy, len(v[3].plan.groups), flush=True)
names = list(variants)
drawn = os.environ.get("ORDER", "rotate") == "drawn"
per_round = {name: [] for name in names}
for r in range(rounds):
    order = names[r % len(names):] + names[:r % len(names)]
    if drawn:
        random.Random(f"probe-round:{r}").shuffle(order)
    for name in order:
        v = variants[name]
        ts = [step(v, i) for i in range(5)]
        t = torch.tensor(ts, dtype=torch.float64); dist.all_reduce(t, op=dist.ReduceOp.MAX)
        v[4].extend(t.tolist())
        per_round[name].append(statistics.median(t.tolist()))
if rank == 0:
    base = statistics.median(variants["topk"][4])
    for name in names:
        med = statistics.median(variants[name][4])
        paired = statistics.median(a / b for a, b in zip(per_round[name], per_round["topk"]))
        print("RESULT", name, round(med * 1e3, 2), round(med / base, 4), variants[name][3].plan.strategy,
              "paired", round(paired, 4), flush=True)
variants.clear(); gc.collect()
dist.destroy_process_group()
