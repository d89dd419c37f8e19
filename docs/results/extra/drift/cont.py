"""Continuous steps vs 5-step interleaved blocks, same fixed TopK-SGD model."""
import json, sys, time, statistics
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import omgs_hook
from omgs_hook.examples.models import resnet20
profile, out = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
variants = {}
for name in ("a", "b"):
    torch.manual_seed(0)
    m = resnet20()
    ddp = DDP(m, bucket_cap_mb=0, broadcast_buffers=False, init_sync=False)
    st = omgs_hook.register(ddp, density=0.001, profile=profile, strategy="single", select="model", allow_dense=False)
    variants[name] = (ddp, st, torch.optim.SGD(m.parameters(), lr=0.01))
g = torch.Generator().manual_seed(rank)
x = torch.randn(32, 3, 32, 32, generator=g); y = torch.randint(0, 10, (32,), generator=g)
def step(name):
    ddp, st, opt = variants[name]
    t = time.perf_counter()
    opt.zero_grad(); torch.nn.functional.cross_entropy(ddp(x), y).backward(); opt.step()
    return time.perf_counter() - t
def slowest(ts):
    tt = torch.tensor(ts, dtype=torch.float64); dist.all_reduce(tt, op=dist.ReduceOp.MAX); return tt.tolist()
for n in ("a", "b"):
    for i in range(10): step(n)
res = {}
for phase in range(2):
    res[f"continuous{phase}"] = slowest([step("a") for _ in range(40)])
    blocks = []
    for r in range(8):
        for n in (("a", "b") if r % 2 else ("b", "a")):
            ts = slowest([step(n) for _ in range(5)])
            if n == "a": blocks.append(ts)
    res[f"blocks{phase}"] = [t for b in blocks for t in b]
    res[f"blocks{phase}_first"] = [b[0] for b in blocks]
if rank == 0:
    json.dump(res, open(out, "w"))
    for k, v in res.items():
        print(k, "median %.1f" % (1e3 * statistics.median(v)), "n", len(v))
    pred = variants["a"][1].stats()
    print("a predicted %.1f" % (1e3 * pred["predicted_iteration_s"]), "check", pred["model_check"] and round(1e3 * pred["model_check"]["measured_s"], 1))
for v in variants.values(): v[1].close()
dist.destroy_process_group()
