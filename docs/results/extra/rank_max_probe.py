"""A probe (docs/cost-model.md, "The slowest rank's per-group work"): train ResNet-20
with one fixed plan (STRAT, DENS, PROFILE from the environment) on the emulated cluster,
then price the plan in use from the same gathered numbers with the ranks' per-group work
(h, w, the top-k's factor) taken as their mean and as their largest, against the slowest
rank's median step of the last 40; RESULT2: the same (largest) with the measured
collective factor reduced over ranks by mean or max instead of the library's least.

    STRAT=layerwise DENS=0.001 PROFILE=profile.json PYTHONPATH=src \
        python scripts/netem_cluster.py --nodes 2 --rate 36mbit -- python rank_max_probe.py
"""
import os, sys, json, time, statistics, datetime
import torch, torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
import omgs_hook
from omgs_hook.examples.models import build_model
from omgs_hook.planner import evaluate

strategy = os.environ.get("STRAT", "layerwise")
density = float(os.environ.get("DENS", "0.001"))
profile = os.environ["PROFILE"]
torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = build_model("resnet20", in_channels=3, num_classes=10)
net = DistributedDataParallel(model, bucket_cap_mb=0.0)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
state = omgs_hook.register(net, density=density, strategy=strategy, select="model", warmup_steps=5,
                           replan_every=1000, profile=profile, log_every=0, allow_dense=False,
                           measure_window=40)
g = torch.Generator().manual_seed(17 + rank)
batches = [(torch.randn(32, 3, 32, 32, generator=g), torch.randint(0, 10, (32,), generator=g)) for _ in range(4)]
times = []
for step in range(80):
    x, y = batches[step % 4]
    t0 = time.perf_counter()
    loss = F.cross_entropy(net(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    times.append(time.perf_counter() - t0)
t = torch.tensor(times[40:], dtype=torch.float64); dist.all_reduce(t, op=dist.ReduceOp.MAX)
measured = statistics.median(t.tolist())
state._ingest_finished()
layout = state.plan.layout
row, meta = state._planning_row(layout)
gathered = state._gather_rows(row)
n = len(layout)


def agreed(reduce):
    """The gathered rows with every rank's optional pairs (h, w, the top-k's factor; the
    refit is unused here) replaced by their ``reduce`` over ranks: the same instance
    whichever reduction the library applies."""
    rows = gathered.clone()
    for i in range(1, meta["optional"]):
        at = n + 2 + 3 * i
        if float(rows[:, at + 2].min()) > 0:
            for j in (at, at + 1):
                rows[:, j] = reduce(rows[:, j])
    return rows


inst_mean, inputs = state._instance_from_rows(layout, agreed(lambda c: c.mean()), meta)
inst_max, inputs_max = state._instance_from_rows(layout, agreed(lambda c: c.max()), meta)
groups, dense = state.plan.unit_groups(), list(state.plan.dense)
pm = evaluate(inst_mean, groups, dense=dense).predicted_iteration_s
import statistics as _st
import omgs_hook.hook as _hk
from omgs_hook import measurements as _ms
_orig = _ms.least_median_factor
def _other(reduce):
    def f(table, at, line, bytes_per=1):
        if line is None:
            return None
        found = []
        for steps in table:
            ratios = [_ms.comm_scale(r[at], int(r[at + 1]), r[at + 2] * bytes_per, line.alpha_s, line.beta_s_per_byte) for r in steps]
            ratios = [x for x in ratios if x is not None]
            if ratios:
                found.append(_st.median(ratios))
        return reduce(found) if found else None
    return f
alt = {}
for label, red in (("meanC", lambda v: sum(v) / len(v)), ("maxC", max)):
    _hk.least_median_factor = _other(red)
    i2, inp2 = state._instance_from_rows(layout, agreed(lambda c: c.max()), meta)
    alt[label] = (evaluate(i2, groups, dense=dense).predicted_iteration_s, inp2["comm_scale"])
_hk.least_median_factor = _orig
px = evaluate(inst_max, groups, dense=dense).predicted_iteration_s
if rank == 0:
    print("RESULT", strategy, density, "measured %.1f mean-pred %.1f (%+.1f%%) max-pred %.1f (%+.1f%%) topk_scale %s/%s over %s/%s" % (
        measured*1e3, pm*1e3, (pm/measured-1)*100, px*1e3, (px/measured-1)*100,
        round(inputs["topk_scale"] or 0, 2), round(inputs_max["topk_scale"] or 0, 2),
        round(inputs["group_overhead_s"]*1e3, 3), round(inputs_max["group_overhead_s"]*1e3, 3)), flush=True)
    print("RESULT2", " ".join("%s %.1f (%+.1f%%) %s" % (k, v[0]*1e3, (v[0]/measured-1)*100, v[1]) for k, v in alt.items()), "base comm", inputs["comm_scale"], flush=True)
del net, state
dist.destroy_process_group()
