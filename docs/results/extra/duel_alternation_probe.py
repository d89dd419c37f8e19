"""A probe (issue 10, the N=2 d=0.01 cell): does switching plans every other step, as the
trial's duel does, read the difference between two plans as turns of several steps do?
ResNet-20, one hook, two plans set in turn from between steps (as the trial does):
A = TopK-SGD's one group, B = GROUPS_B (unit groups as JSON). Schedules, repeated
REPEATS times: "duel" (pairs A B, B A of 1 settle + 1 counted step), "turn4" (1 + 4),
"turn9" (1 + 9). Prints, per schedule, the median over pairs of B's reading over A's
(slowest rank per step, gathered at the end), and the model's price of both and of its
own optimal plan from the hook's measured instance after 20 steps and at the end.
Self-contained, like the other probes.

    DENS=0.01 GROUPS_B='[[0,49],[50,58]]' PROFILE=profile.json PYTHONPATH=src \
        python scripts/netem_cluster.py --nodes 2 --rate 36mbit -- python duel_alternation_probe.py
"""
import os, json, time, statistics, datetime
import torch, torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
import omgs_hook
from omgs_hook.examples.models import build_model
from omgs_hook import planner
from omgs_hook.group_plan import GroupPlan

density = float(os.environ.get("DENS", "0.01"))
profile = os.environ["PROFILE"]
ranges_b = json.loads(os.environ.get("GROUPS_B", "[[0,49],[50,58]]"))
repeats = int(os.environ.get("REPEATS", "4"))
torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
rank = dist.get_rank()
torch.manual_seed(0)
model = build_model("resnet20", in_channels=3, num_classes=10)
net = DistributedDataParallel(model, bucket_cap_mb=0.0)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
state = omgs_hook.register(net, density=density, strategy="single", select="model",
                           warmup_steps=5, replan_every=100000, profile=profile, log_every=0,
                           allow_dense=False)
g = torch.Generator().manual_seed(17 + rank)
batches = [(torch.randn(32, 3, 32, 32, generator=g), torch.randint(0, 10, (32,), generator=g))
           for _ in range(4)]
count = 0


def step():
    global count
    x, y = batches[count % 4]
    count += 1
    t = time.perf_counter()
    loss = F.cross_entropy(net(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return time.perf_counter() - t


for _ in range(20):
    step()
layout = state.plan.layout
n = len(layout)
priced = {}


def price(label):
    """The model's step for single, B and its own optimal sparse plan, from the hook's
    measured instance now (a collective: every rank)."""
    inst = state.measured_instance(layout)
    best = planner.make_plan(inst, "optimal")
    priced[label] = {"single": planner.evaluate(inst, [list(range(n))]).predicted_iteration_s,
                     "B": planner.evaluate(inst, [list(range(a, b + 1)) for a, b in ranges_b]
                                           ).predicted_iteration_s,
                     "optimal": best.predicted_iteration_s,
                     "optimal_groups": [[g[0], g[-1]] for g in best.groups]}


price("step 20")


def group_plan(groups):
    unit = planner.Plan(strategy="fixed", groups=tuple(tuple(g) for g in groups),
                        dense=(False,) * len(groups), predicted_iteration_s=0.0,
                        non_overlapped_s=0.0)
    return GroupPlan.from_unit_plan(unit, layout, made_at_step=state.step,
                                    exchange=state.plan.exchange)


plans = {"A": group_plan([list(range(n))]),
         "B": group_plan([list(range(a, b + 1)) for a, b in ranges_b])}
for name in ("B", "A"):  # one warm turn of each (buffers, hints)
    state.plan = plans[name]
    for _ in range(5):
        step()
schedules = {"duel": 1, "turn4": 4, "turn9": 9}
log = []  # (schedule, pair, plan, counted?) per step, and the times beside it
times = []
for rep in range(repeats):
    for sched, counted in schedules.items():
        pairs = 10 if counted == 1 else 2
        for p in range(pairs):
            for name in (("A", "B") if p % 2 == 0 else ("B", "A")):
                state.plan = plans[name]
                for i in range(1 + counted):
                    times.append(step())
                    log.append((sched, rep * 100 + p, name, i > 0))
price("end")
t = torch.tensor(times, dtype=torch.float64)
dist.all_reduce(t, op=dist.ReduceOp.MAX)
t = t.tolist()
if rank == 0:
    for sched in schedules:
        reads = {}
        for (s, pair, name, counted), x in zip(log, t):
            if s == sched and counted:
                reads.setdefault(pair, {}).setdefault(name, []).append(x)
        ratios = [statistics.median(r["B"]) / statistics.median(r["A"]) for r in reads.values()]
        all_a = [x for r in reads.values() for x in r["A"]]
        all_b = [x for r in reads.values() for x in r["B"]]
        print("RESULT %s B=%s %s pairs %d median B/A %.4f (A %.1f ms, B %.1f ms over %d steps each)"
              % (sched, json.dumps(ranges_b), density, len(ratios), statistics.median(ratios),
                 statistics.median(all_a) * 1e3, statistics.median(all_b) * 1e3, len(all_a)),
              flush=True)
    for label, p in priced.items():
        print("PRICED %s: single %.1f ms, B %.1f ms (B/single %.4f), the model's optimal %s %.1f ms"
              % (label, p["single"] * 1e3, p["B"] * 1e3, p["B"] / p["single"],
                 p["optimal_groups"], p["optimal"] * 1e3), flush=True)
del net, state
dist.destroy_process_group()
