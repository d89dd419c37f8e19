"""How a trial's step time reads on shaped ranks (docs/design.md, "Step time").

Run inside the emulated cluster, e.g. (4 ranks at 14 Mbit/s, ResNet-20, d = 0.01)::

    python scripts/netem_cluster.py --nodes 4 --rate 14mbit -- \
        python docs/results/extra/step_time/step_time.py pace 140 out.json
    python docs/results/extra/step_time/step_time.py report out.json

``pace``: the default ``register()`` for N steps; per rank and step it keeps the arrival
of bucket 0, the step's end (its last write-back) and the training loop's own time of the
step, and rank 0 writes them with the trial's report. ``report`` compares, over the steps
after the trial, the per-step slowest rank's interval of each kind with the ranks' mean
pace (and its median absolute deviation: the step-to-step noise a trial sees).

``interleave``: the default hook and a TopK-SGD hook in one process; 110 steps of the
default, then 8 rounds of 5 TopK-SGD and 5 default steps, then 40 more default steps:
whether the benchmark's interleaved rounds change the default's step time.
"""

import datetime
import gc
import json
import statistics
import sys
import time


def _setup(hooks):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import omgs_hook
    from omgs_hook.examples.models import build_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank = dist.get_rank()
    variants = []
    for name in hooks:
        torch.manual_seed(0)
        net = DDP(build_model("resnet20", in_channels=3, num_classes=10), bucket_cap_mb=0)
        if name == "default":
            state = omgs_hook.register(net, density=0.01)
        else:
            state = omgs_hook.register(net, density=0.01, strategy="single", select="model",
                                       allow_dense=False)
        variants.append((net, torch.optim.SGD(net.parameters(), lr=0.01), state))
    generator = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(32, 3, 32, 32, generator=generator),
                torch.randint(0, 10, (32,), generator=generator)) for _ in range(4)]
    return rank, variants, batches


def _step(variant, batch):
    import torch.nn.functional as F

    net, opt, _ = variant
    started = time.perf_counter()
    loss = F.cross_entropy(net(batch[0]), batch[1])
    opt.zero_grad()
    loss.backward()
    opt.step()
    return time.perf_counter() - started


def pace(steps, out):
    import torch
    import torch.distributed as dist

    rank, (variant,), batches = _setup(["default"])
    state = variant[2]
    rows = [[], [], []]
    for i in range(steps):
        rows[2].append(_step(variant, batches[i % 4]))
        rows[0].append(state.meter._arrive[0])  # (host clock: perf_counter)
        rows[1].append(state._last_exchange.finish_wall)
    row = torch.tensor(rows, dtype=torch.float64)
    gathered = [torch.zeros_like(row) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, row)
    if rank == 0:
        with open(out, "w", encoding="utf-8") as handle:
            json.dump({"bucket0": [g[0].tolist() for g in gathered],
                       "end": [g[1].tolist() for g in gathered],
                       "loop": [g[2].tolist() for g in gathered],
                       "trial": state.stats()["selection"]["last_trial"]}, handle)
    del variant, state  # (the DDP model before the process group: gloo can abort otherwise)
    gc.collect()
    dist.destroy_process_group()


def report(path):
    with open(path, encoding="utf-8") as handle:
        data = json.load(handle)
    first = data["trial"]["decided_at"] + 5
    for kind in ("bucket0", "end"):
        marks = data[kind]
        per_rank = [[b - a for a, b in zip(m[first:], m[first + 1:])] for m in marks]
        slowest = [max(column) for column in zip(*per_rank)]
        median = statistics.median(slowest)
        mad = statistics.median(abs(x - median) for x in slowest) / median
        pace_s = statistics.mean(statistics.mean(r) for r in per_rank)
        print(f"{kind:8s} slowest rank per step: median {1e3 * median:.1f} ms, MAD "
              f"{100 * mad:.1f}%; the ranks' mean pace {1e3 * pace_s:.1f} ms")


def interleave():
    import torch.distributed as dist

    rank, variants, batches = _setup(["default", "topk"])
    default, other = variants
    for i in range(20):
        _step(other, batches[i % 4])
    alone = [_step(default, batches[i % 4]) for i in range(110)]
    mixed = []
    for _ in range(8):
        for i in range(5):
            _step(other, batches[i % 4])
        mixed += [_step(default, batches[i % 4]) for i in range(5)]
    again = [_step(default, batches[i % 4]) for i in range(40)]
    if rank == 0:
        print(f"default alone, steps 80-110: {1e3 * statistics.median(alone[80:]):.1f} ms; "
              f"interleaved: {1e3 * statistics.median(mixed):.1f} ms; alone again: "
              f"{1e3 * statistics.median(again):.1f} ms")
    del variants, default, other
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "pace":
        pace(int(sys.argv[2]), sys.argv[3])
    elif sys.argv[1] == "report":
        report(sys.argv[2])
    else:
        interleave()
