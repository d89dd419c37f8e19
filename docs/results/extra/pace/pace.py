"""How a step's time follows the host's pace (docs/design.md, "Pace"); 2026-12-06.

Run inside the emulated cluster, e.g. (2 ranks at 20 Mbit/s, ResNet-20, d = 0.01)::

    python scripts/netem_cluster.py --nodes 2 --rate 20mbit -- \\
        python docs/results/extra/pace/pace.py timed 0.01 OUT.json PLANS.json [ROUNDS]
    python docs/results/extra/pace/spread.py OUT.json

``timed``: every plan of PLANS.json (``{"trial": {"candidates": [{"name", "groups",
"dense"}, ...]}}``: a trial report, or plans_n2.json; candidates named ``optimal`` or
``greedy`` are skipped) pinned (``plan=``) on its own DDP ResNet-20, 12 warm-up steps
each, then ROUNDS (default 12) rounds of one uncounted and 5 counted steps per plan, in
alternating order. OUT: every rank's (step seconds, forward seconds) per plan, round
and step; ``spread.py`` compares the round-to-round spread raw and divided by the pace.

``trial``: 110 steps of the default ``register()`` (its trial included), then every
candidate the trial measured within 30% of its best, pinned, interleaved as above with
the default; prints each candidate's trial reading and median pace, and its timed median
raw and divided by the pace (here the largest rank's forward ratio, as the library of
60ad64f did; 96fb46e takes the mean over ranks).

Runs (ad hoc, by the two scripts this one was made from, the same steps):
timed_n2_a.json (N=2, 20 Mbit/s, d=0.01, the candidates of trial_n2_157fc26.json, 12
rounds), timed_n2_b.json (N=2, plans_n2.json, 16 rounds), timed_n4.json (N=4, 14 Mbit/s,
d=0.01, the candidates of trial_vs_timed_n4.json, 12 rounds); trial_vs_timed_n2.json and
trial_vs_timed_n4.json (``trial``, library 60ad64f); trial_n2_157fc26.json (the default's
first 110 steps at 157fc26, no pace).
"""

import datetime
import gc
import json
import statistics
import sys
import time


class Run:
    """One rank's process group, its batches and the variants it builds."""

    def __init__(self, density):
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
        self.rank = dist.get_rank()
        self.density = density
        generator = torch.Generator().manual_seed(self.rank)
        self.batches = [(torch.randn(32, 3, 32, 32, generator=generator),
                         torch.randint(0, 10, (32,), generator=generator)) for _ in range(4)]

    def make(self, **options):
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP

        import omgs_hook
        from omgs_hook.examples.models import build_model

        torch.manual_seed(0)
        net = DDP(build_model("resnet20", in_channels=3, num_classes=10), bucket_cap_mb=0)
        state = omgs_hook.register(net, density=self.density, **options)
        return [net, torch.optim.SGD(net.parameters(), lr=0.01), state]

    def step(self, variant, i):
        """(step seconds, forward seconds) of one training step."""
        import torch.nn.functional as F

        net, opt, _ = variant
        inputs, targets = self.batches[i % 4]
        started = time.perf_counter()
        outputs = net(inputs)
        forward = time.perf_counter() - started
        loss = F.cross_entropy(outputs, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return [time.perf_counter() - started, forward]

    def interleave(self, variants, rounds):
        """Per variant, per round: its 5 counted steps (after one uncounted)."""
        out = {name: [] for name in variants}
        for r in range(rounds):
            for name in (list(variants) if r % 2 == 0 else list(reversed(variants))):
                self.step(variants[name], 0)
                out[name].append([self.step(variants[name], i) for i in range(1, 6)])
        return out

    def gather(self, table):
        """Every rank's copy of ``table`` (nested lists of numbers), as one tensor."""
        import torch
        import torch.distributed as dist

        mine = torch.tensor(table, dtype=torch.float64)
        rows = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, mine)
        return torch.stack(rows)

    @staticmethod
    def close():
        """Collect the DDP models (the caller dropped them: before the process group, or
        gloo can abort), then end the process group."""
        import torch.distributed as dist

        gc.collect()
        dist.destroy_process_group()


def pinned(run, candidates, keep):
    variants = {}
    for c in candidates:
        if keep(c):
            variants[c["name"]] = run.make(plan={"groups": c["groups"], "dense": c["dense"]})
    for variant in variants.values():
        for i in range(12):
            run.step(variant, i)
    return variants


def timed(density, out, plans_path, rounds=12):
    with open(plans_path, encoding="utf-8") as handle:
        source = json.load(handle)["trial"]
    run = Run(density)
    variants = pinned(run, source["candidates"],
                      lambda c: c["name"] not in ("optimal", "greedy"))
    record = run.interleave(variants, rounds)
    rows = run.gather([record[name] for name in variants])
    if run.rank == 0:
        with open(out, "w", encoding="utf-8") as handle:
            json.dump({"names": list(variants), "rows": rows.tolist()}, handle)
    variants.clear()
    run.close()


def trial(density, out):
    run = Run(density)
    default = run.make()
    times = [run.step(default, i) for i in range(110)]
    report = default[2].stats()["selection"]["last_trial"]
    best = min(c["measured_s"] for c in report["candidates"] if c["measured_s"])
    variants = {"default": default}
    variants.update(pinned(run, report["candidates"],
                           lambda c: c["measured_s"] is not None
                           and c["measured_s"] <= 1.3 * best))
    record = run.interleave(variants, 12)
    R = run.gather([[s for turn in record[name] for s in turn] for name in variants])
    if run.rank == 0:  # R: ranks x variants x steps x (step, forward)
        median = R[..., 1].reshape(R.shape[0], -1).median(dim=1).values
        pace = (R[..., 1] / median[:, None, None]).max(0).values
        slow = R[..., 0].max(0).values
        paced = slow / pace
        names = list(variants)
        with open(out, "w", encoding="utf-8") as handle:
            json.dump({"trial": report, "default_times": times,
                       "timed": {n: slow[j].tolist() for j, n in enumerate(names)},
                       "adjusted": {n: paced[j].tolist() for j, n in enumerate(names)}}, handle)
        for c in report["candidates"]:
            if c["name"] not in variants:
                print(c["name"], "trial", c["measured_s"])
                continue
            j = names.index(c["name"])
            print(f"{c['name']:16s} groups={len(c['groups']):3d} "
                  f"pred {c['predicted_s'] * 1e3:6.1f} trial {c['measured_s'] * 1e3:6.1f} "
                  f"pace {c.get('pace') or 0:.2f} "
                  f"timed {statistics.median(slow[j].tolist()) * 1e3:6.1f} "
                  f"adjusted {statistics.median(paced[j].tolist()) * 1e3:6.1f} "
                  f"{'*' if c['winner'] else ''}")
        print({n: round(1e3 * float(R[:, j, :, 1].median()), 1) for j, n in enumerate(names)})
        print("default timed", statistics.median(slow[0].tolist()) * 1e3,
              "adjusted", statistics.median(paced[0].tolist()) * 1e3,
              "after-trial own", statistics.median([t[0] for t in times[80:]]) * 1e3,
              "noise", report["noise"], "steps", report["steps"],
              "excess", report["excess_steps"])
    variants.clear()
    del default
    run.close()


if __name__ == "__main__":
    if sys.argv[1] == "timed":
        timed(float(sys.argv[2]), sys.argv[3], sys.argv[4],
              int(sys.argv[5]) if len(sys.argv) > 5 else 12)
    else:
        trial(float(sys.argv[2]), sys.argv[3])
