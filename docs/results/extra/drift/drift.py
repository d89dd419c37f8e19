"""Step and forward time over the first 100 steps of a fresh process (fixed TopK-SGD)."""
import json, sys, time, statistics
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import omgs_hook
from omgs_hook.examples.models import resnet20
profile, out, nvar = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
variants = []
for i in range(nvar):  # extra models, as the benchmark builds, idle
    torch.manual_seed(0)
    m = resnet20()
    ddp = DDP(m, bucket_cap_mb=0, broadcast_buffers=False, init_sync=False)
    st = omgs_hook.register(ddp, density=0.001, profile=profile, strategy="single", select="model", allow_dense=False)
    variants.append((ddp, st, torch.optim.SGD(m.parameters(), lr=0.01)))
g = torch.Generator().manual_seed(rank)
x = torch.randn(32, 3, 32, 32, generator=g); y = torch.randint(0, 10, (32,), generator=g)
for k in range(min(2, nvar)):
    ddp, st, opt = variants[k]
    rows = []
    for s in range(100):
        t = time.perf_counter()
        opt.zero_grad(); out_ = ddp(x); t1 = time.perf_counter()
        torch.nn.functional.cross_entropy(out_, y).backward(); opt.step()
        rows.append([time.perf_counter() - t, t1 - t])
    tt = torch.tensor(rows, dtype=torch.float64); dist.all_reduce(tt, op=dist.ReduceOp.MAX)
    if rank == 0:
        r = tt.tolist()
        print("model", k, " ".join("%d:%.0f/%.0f" % (a, 1e3 * statistics.median(x[0] for x in r[a:a + 10]), 1e3 * statistics.median(x[1] for x in r[a:a + 10])) for a in range(0, 100, 10)))
for v in variants: v[1].close()
dist.destroy_process_group()
