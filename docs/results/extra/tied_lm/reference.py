"""The same training as tied_lm.py in one process, two simulated workers: per-parameter
top-k with error feedback (LAGS-SGD; the hook's `layerwise` plan with one parameter per
bucket) after 5 dense steps, averaged, then momentum SGD. No omgs_hook involved.

    python reference.py dense|layerwise [MIN]

MIN: parameters with fewer elements are sent whole (default 0: none).
"""
import sys

import torch
import torch.nn as nn

from tied_lm import LM, VOCAB, data

mode = sys.argv[1]
least = int(sys.argv[2]) if len(sys.argv) > 2 else 0
density, workers = 0.01, 2
torch.manual_seed(0)
model = LM()
params = list(model.parameters())
opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
residual = [[torch.zeros_like(p) for p in params] for _ in range(workers)]
losses = []
for step in range(150):
    grads = []
    for w in range(workers):
        x, y = data(step, w)
        model.zero_grad()
        loss = nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        grads.append([p.grad.clone() for p in params])
        if w == 0:
            losses.append(loss.item())
    for i, p in enumerate(params):
        total = torch.zeros(p.numel())
        for w in range(workers):
            v = (grads[w][i] + residual[w][i]).reshape(-1)
            sent = v
            if mode == "layerwise" and step >= 5 and v.numel() >= least:
                k = max(1, -int(-density * v.numel() // 1))
                index = v.abs().topk(k).indices
                sent = torch.zeros_like(v)
                sent[index] = v[index]
            residual[w][i] = (v - sent).reshape(p.shape)
            total += sent
        p.grad = (total / workers).reshape(p.shape)
    opt.step()
first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
print(mode, least, "loss first/last 10: %.3f %.3f" % (first, last))
