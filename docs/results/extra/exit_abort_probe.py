"""Does a rank abort at exit (SIGABRT, "terminate called without an active exception") when a
script calls destroy_process_group() with its DDP model still alive - with the hook, and with
plain DDP? (docs/benchmarks.md, the held-out runs.) 2 ranks on loopback, 30 steps of a
small MLP; run it 12 times per kind and count the launches that fail:

    for i in $(seq 12); do torchrun --nproc_per_node=2 --master_port=$((29600+i)) \
        exit_abort_probe.py omgs; done      # or: ... exit_abort_probe.py plain
"""
import os, sys, datetime, torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
import omgs_hook
hook = sys.argv[1]
torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)], nn.Linear(64, 10))
net = DistributedDataParallel(model, bucket_cap_mb=0.01)
if hook == "omgs":
    state = omgs_hook.register(net, density=0.01, warmup_steps=2, log_every=0)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for i in range(int(os.environ.get("STEPS", "30"))):
    x = torch.randn(16, 64); y = torch.randint(0, 10, (16,))
    loss = F.cross_entropy(net(x), y); opt.zero_grad(); loss.backward(); opt.step()
dist.destroy_process_group()
