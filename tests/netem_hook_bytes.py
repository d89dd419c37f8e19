"""Run inside an emulated cluster (tests/test_netem_hierarchical.py): the bytes a node puts
on its shaped link, read from its tc qdisc, for an intra-node and a world all-reduce,
then per training step of the OMGS hook with topology flat and hierarchical."""

import gc
import json
import os
import re
import subprocess
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import omgs_hook


def node_sent_bytes():
    out = subprocess.run(["tc", "-s", "qdisc", "show", "dev", os.environ["GLOO_SOCKET_IFNAME"]],
                         capture_output=True, text=True, check=True).stdout
    return int(re.search(r"Sent (\d+) bytes", out).group(1))


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    groups = [dist.new_group([n * per_node + l for l in range(per_node)])
              for n in range(world // per_node)]
    report = {"rank": rank, "env": [os.environ[k] for k in
                                    ("RANK", "WORLD_SIZE", "GROUP_RANK", "LOCAL_RANK",
                                     "LOCAL_WORLD_SIZE")]}
    big = torch.ones(250_000)  # 1 MB
    dist.barrier()
    before = node_sent_bytes()
    dist.all_reduce(big, group=groups[rank // per_node])
    dist.barrier()
    middle = node_sent_bytes()
    dist.all_reduce(big)
    dist.barrier()
    report["intra_all_reduce"], report["world_all_reduce"] = middle - before, node_sent_bytes() - middle

    steps, measured = 12, 4
    for topology in ("flat", "hierarchical"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(500, 1000), nn.ReLU(), nn.Linear(1000, 10))
        ddp = DDP(model, bucket_cap_mb=0)
        state = omgs_hook.register(ddp, density=0.01, strategy="single", warmup_steps=1,
                                   allow_dense=False, select="model", topology=topology,
                                   log_every=0)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        gen = torch.Generator().manual_seed(rank)
        counted = 0
        for step in range(steps):
            if step == steps - measured:
                dist.barrier()
                start = node_sent_bytes()
            x, y = torch.randn(16, 500, generator=gen), torch.randn(16, 10, generator=gen)
            opt.zero_grad()
            (ddp(x) - y).pow(2).mean().backward()
            opt.step()
            if step >= steps - measured:
                counted += state.stats()["last"]["inter_node_bytes"]
        dist.barrier()
        report[topology] = {"wire_per_step": (node_sent_bytes() - start) / measured,
                            "counted_per_step": counted / measured,
                            "kind": state.stats()["topology"]["kind"]}
        del ddp, state
        gc.collect()
    print("REPORT " + json.dumps(report), flush=True)
    gc.collect()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
