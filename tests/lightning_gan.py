#!/usr/bin/env python
"""A GAN in Lightning's manual optimization, generator and discriminator in one
LightningModule (one DDP model, ``find_unused_parameters=True``), trained on 2 CPU ranks
under torchrun with :class:`omgs_hook.lightning.OMGSStrategy` - twice:

* ``cleared``: the loop of Lightning's manual-optimization docs - each optimizer's
  ``zero_grad()`` right before its ``manual_backward``; the generator's backward also
  computes the discriminator's gradient, which its ``zero_grad()`` clears next iteration
  (plain DDP drops it);
* ``toggled``: the same with ``toggle_optimizer``, so that gradient is never computed.

Plain DDP trains the two alike. With per-parameter groups (a pinned plan) the hook must
too: the dropped gradient's residual update rewound. Rank 0 writes the largest parameter
difference and the hook's totals to ``--out``.
"""

import argparse
import gc
import json

import lightning.pytorch as pl
import torch
from torch import nn

from omgs_hook.lightning import OMGSStrategy

NAMES = ["G.0.weight", "G.0.bias", "G.2.weight", "G.2.bias",
         "D.0.weight", "D.0.bias", "D.2.weight", "D.2.bias"]


class GAN(pl.LightningModule):
    def __init__(self, toggled):
        super().__init__()
        self.automatic_optimization = False
        self.toggled = toggled
        self.G = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))
        self.D = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x = batch[0]
        opt_g, opt_d = self.optimizers()
        gen = torch.Generator().manual_seed(1000 * self.global_rank + batch_idx)
        z = torch.randn(x.shape[0], 8, generator=gen)
        bce = nn.functional.binary_cross_entropy_with_logits
        ones, zeros = torch.ones(x.shape[0], 1), torch.zeros(x.shape[0], 1)
        fake = self.G(z)
        if self.toggled:
            self.toggle_optimizer(opt_d)
        d_loss = (bce(self.D(x), ones) + bce(self.D(fake.detach()), zeros)) / 2
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        if self.toggled:
            self.untoggle_optimizer(opt_d)
            self.toggle_optimizer(opt_g)
        g_loss = bce(self.D(fake), ones)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        if self.toggled:
            self.untoggle_optimizer(opt_g)

    def configure_optimizers(self):
        return [torch.optim.SGD(self.G.parameters(), lr=0.01, momentum=0.5),
                torch.optim.SGD(self.D.parameters(), lr=0.01, momentum=0.5)]


def fit(toggled, iterations, fits=1):
    torch.manual_seed(0)
    options = {"density": 0.1, "warmup_steps": 2, "log_every": 0,
               "plan": {"groups": [[name] for name in NAMES]}}
    strategy = OMGSStrategy(omgs_options=options, process_group_backend="gloo",
                            find_unused_parameters=True)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy,
                         max_steps=2 * (iterations // fits), enable_checkpointing=False, logger=False,
                         enable_progress_bar=False, enable_model_summary=False)
    model = GAN(toggled)
    data = torch.randn(64 * iterations, 16, generator=torch.Generator().manual_seed(0)) + 1
    for fit_index in range(fits):
        # (a second fit of the same module carries the hook's state over, a decision on
        # the last step's gradient still pending)
        trainer.fit_loop.epoch_loop.max_steps = 2 * (iterations // fits) * (fit_index + 1)
        trainer.fit(model, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data),
                                                       batch_size=32))
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    total = strategy.omgs_state.stats()["total"]
    strategy.omgs_state.close()
    rank = trainer.global_rank
    del trainer
    gc.collect()
    return rank, params, total


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--fits", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank, cleared, cleared_total = fit(False, args.iterations, args.fits)
    _, toggled, toggled_total = fit(True, args.iterations, args.fits)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"max_diff": max(float((cleared[k] - toggled[k]).abs().max())
                                       for k in NAMES),
                       "cleared": cleared_total, "toggled": toggled_total}, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
