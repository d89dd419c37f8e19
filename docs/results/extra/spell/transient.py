"""Fixed TopK-SGD vs the default after its trial: top-k time and selector retries per block."""
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
for name, opts in [("topk", {"strategy": "single", "select": "model", "allow_dense": False}), ("default", {})]:
    torch.manual_seed(0)
    m = resnet20()
    ddp = DDP(m, bucket_cap_mb=0, broadcast_buffers=False, init_sync=False)
    st = omgs_hook.register(ddp, density=0.001, profile=profile, **opts)
    variants[name] = (ddp, st, torch.optim.SGD(m.parameters(), lr=0.01))
g = torch.Generator().manual_seed(rank)
x = torch.randn(32, 3, 32, 32, generator=g); y = torch.randint(0, 10, (32,), generator=g)
def step(name):
    ddp, st, opt = variants[name]
    t = time.perf_counter()
    opt.zero_grad(); torch.nn.functional.cross_entropy(ddp(x), y).backward(); opt.step()
    return time.perf_counter() - t, st.stats()["last"]["topk_s"]
for i in range(10): step("topk")
st = variants["default"][1]
for i in range(80):
    step("default")
    if st.step > 20 and st._trial is None and st._plan_job is None: break
res = {n: [] for n in variants}
for r in range(16):
    for name in (["topk", "default"] if r % 2 else ["default", "topk"]):
        sel = variants[name][1]._selector
        c0 = dict(sel._counts)
        ts = [step(name) for _ in range(5)]
        c1 = dict(sel._counts)
        tt = torch.tensor([a for a, b in ts], dtype=torch.float64)
        dist.all_reduce(tt, op=dist.ReduceOp.MAX)
        res[name].append({"step_ms": statistics.median(tt.tolist()) * 1e3,
                          "topk_ms": statistics.median(b for a, b in ts) * 1e3,
                          "counts": {k: c1[k] - c0.get(k, 0) for k in c1}})
if rank == 0:
    rec = {"winner": st.stats()["plan"]["strategy"], "groups": len(st.plan.groups), "blocks": res}
    json.dump(rec, open(out, "w"), indent=1)
    print("winner", rec["winner"], rec["groups"])
    for name, blocks in res.items():
        print(name, "step", [round(b["step_ms"]) for b in blocks])
        print(name, "topk", [round(b["topk_ms"], 1) for b in blocks])
        print(name, "counts", blocks[0]["counts"], blocks[-1]["counts"])
for v in variants.values(): v[1].close()
dist.destroy_process_group()
