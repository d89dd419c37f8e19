"""An independent, slow, obviously-correct model of what one OMGS step must produce.

Given every rank's local gradients and old residuals (per parameter name) and the groups
the hook used (parameter names in order, dense flag), it returns the averaged gradient
and each rank's new residual. Top-k here is a stable sort by magnitude (ties: lower
index first) - nothing is shared with the library's selectors.
"""

import math

import torch


def reference_step(local_grads, old_residuals, groups, density):
    """local_grads/old_residuals: list over ranks of {name: flat fp32 tensor}.

    groups: list of (names, dense). Returns (avg {name: tensor}, new_res list over ranks).
    """
    world = len(local_grads)
    avg = {}
    new_res = [dict() for _ in range(world)]
    for names, dense in groups:
        accs = []
        for r in range(world):
            parts = []
            for name in names:
                g = local_grads[r][name].double()
                res = old_residuals[r].get(name)
                parts.append(g + (res.double() if res is not None else 0.0))
            accs.append(torch.cat(parts))
        numel = accs[0].numel()
        if dense:
            total = sum(accs)
            sent = accs
            residual = [torch.zeros(numel, dtype=torch.float64) for _ in range(world)]
        else:
            k = max(1, math.ceil(density * numel))
            sent, residual = [], []
            for acc in accs:
                order = torch.sort(acc.abs(), descending=True, stable=True).indices[:k]
                s = torch.zeros_like(acc)
                s[order] = acc[order]
                sent.append(s)
                residual.append(acc - s)
            total = sum(sent)
        mean = total / world
        offset = 0
        for name in names:
            n = local_grads[0][name].numel()
            avg[name] = mean[offset:offset + n]
            for r in range(world):
                new_res[r][name] = residual[r][offset:offset + n]
            offset += n
    return avg, new_res
