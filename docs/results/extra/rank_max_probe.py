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
inst_mean, inputs = state._instance_from_rows(layout, gathered, meta)
n = len(layout)
g2 = gathered.clone()
for i in range(meta["optional"]):
    at = n + 2 + 3 * i
    if float(g2[:, at + 2].min()) > 0:
        g2[:, at] = g2[:, at].max(); g2[:, at + 1] = g2[:, at + 1].max()
inst_max, inputs_max = state._instance_from_rows(layout, g2, meta)
groups, dense = state.plan.unit_groups(), list(state.plan.dense)
pm = evaluate(inst_mean, groups, dense=dense).predicted_iteration_s
px = evaluate(inst_max, groups, dense=dense).predicted_iteration_s
if rank == 0:
    print("RESULT", strategy, density, "measured %.1f mean-pred %.1f (%+.1f%%) max-pred %.1f (%+.1f%%) topk_scale %s/%s over %s/%s" % (
        measured*1e3, pm*1e3, (pm/measured-1)*100, px*1e3, (px/measured-1)*100,
        round(inputs["topk_scale"] or 0, 2), round(inputs_max["topk_scale"] or 0, 2),
        round(inputs["group_overhead_s"]*1e3, 3), round(inputs_max["group_overhead_s"]*1e3, 3)), flush=True)
del net, state
dist.destroy_process_group()
