"""A held-out convergence check: a small tied-weight language model on 2 gloo ranks.

The embedding is shared with the output layer (one parameter used twice), a GRU body
and a LayerNorm of 128 elements. Next-token data: token t+1 = (7 token t + 3) mod 2000.

    torchrun --nproc_per_node=2 tied_lm.py allreduce|omgs

Environment: LR (0.1), MOM (momentum, 0.9), RHO (density, 0.01), CAP (DDP bucket_cap_mb,
1), DENSE (allow_dense, 1), STRAT (a fixed strategy with select="model"; unset: the
default register()), PLAN (a pinned plan: groups of parameter names as JSON), PDENSE
(the pinned plan's dense flags as JSON; unset: all sparse), FLOOR (min_sparse_numel;
unset: the library's default).
Prints the mean loss of the first and last 10 of 150 steps.
"""
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

import omgs_hook

VOCAB = 2000


class LM(nn.Module):
    def __init__(self, vocab=VOCAB, dim=128):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.rnn = nn.GRU(dim, dim, batch_first=True)
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab)
        self.out.weight = self.emb.weight  # tied

    def forward(self, x):
        h, _ = self.rnn(self.emb(x))
        return self.out(self.norm(h))


def data(step, rank):
    g = torch.Generator().manual_seed(step * 10 + rank)
    x = torch.randint(0, VOCAB, (16, 33), generator=g)
    for t in range(1, 33):
        x[:, t] = (x[:, t - 1] * 7 + 3) % VOCAB
    return x[:, :-1], x[:, 1:]


def env(name, default):
    return os.environ.get(name, default)


def main(mode):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = LM()
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=float(env("CAP", "1")))
    state = None
    if mode == "omgs":
        fixed = {"strategy": env("STRAT", ""), "select": "model"} if env("STRAT", "") else {}
        if env("PLAN", ""):  # groups of parameter names, as JSON
            fixed = {"plan": {"group_keys": json.loads(env("PLAN", ""))}}
            if env("PDENSE", ""):
                fixed["plan"]["dense"] = json.loads(env("PDENSE", ""))
        if env("FLOOR", ""):
            fixed["min_sparse_numel"] = int(env("FLOOR", ""))
        state = omgs_hook.register(ddp, density=float(env("RHO", "0.01")),
                                   allow_dense=env("DENSE", "1") == "1", **fixed)
    opt = torch.optim.SGD(ddp.parameters(), lr=float(env("LR", "0.1")),
                          momentum=float(env("MOM", "0.9")))
    losses = []
    for step in range(150):
        x, y = data(step, rank)
        loss = nn.functional.cross_entropy(ddp(x).reshape(-1, VOCAB), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    if rank == 0:
        plan = state.stats()["plan"] if state is not None else None
        first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
        print(mode, "loss first/last 10: %.3f %.3f" % (first, last),
              "plan:", plan and (plan["strategy"], plan["groups"], plan["dense"]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
