#!/usr/bin/env python
"""Lightning restores a module's weights from its own checkpoints, which do not carry the
hook's per-rank state; run on 2 CPU ranks under torchrun with OMGSStrategy:

* ``lr_finder``: a fit with Lightning's ``LearningRateFinder`` (its sweep trains, then
  restores the weights it started from) against the same fit without it;
* ``another_model``: a second ``trainer.fit`` of a new module (the same architecture)
  and a third of another architecture, with the same trainer and strategy.

Rank 0 writes the findings to ``--out``.
"""

import argparse
import gc
import json

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import LearningRateFinder

from omgs_hook.lightning import OMGSStrategy


class Net(pl.LightningModule):
    def __init__(self, hidden=64):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, hidden), torch.nn.ReLU(),
                                       torch.nn.Linear(hidden, 4))
        self.lr = 0.05

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class AtTrainStart(pl.Callback):
    """The hook's step count and residual norm when each fit's training starts."""

    def __init__(self):
        self.seen = []

    def on_train_start(self, trainer, pl_module):
        state = trainer.strategy.omgs_state
        residuals = state.state_dict()["residuals"].values()
        self.seen.append([state.step, float(sum(float(r.norm()) ** 2 for r in residuals)) ** 0.5])


def loader():
    gen = torch.Generator().manual_seed(0)
    y = torch.randint(0, 4, (2048,), generator=gen)
    x = torch.randn(4, 16, generator=gen)[y] * 0.5 + torch.randn(2048, 16, generator=gen)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)


def trainer_for(steps, callbacks):
    options = {"density": 0.05, "strategy": "layerwise", "allow_dense": False,
               "select": "model", "warmup_steps": 2, "log_every": 0}
    strategy = OMGSStrategy(omgs_options=options, process_group_backend="gloo",
                            bucket_cap_mb=0)
    return pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps,
                      enable_checkpointing=False, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0,
                      callbacks=callbacks)


def params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    report = {}

    seen = AtTrainStart()
    trainer = trainer_for(12, [LearningRateFinder(num_training_steps=10, update_attr=False),
                               seen])
    torch.manual_seed(0)
    swept = Net()
    trainer.fit(swept, loader())
    report["lr_finder_at_train_start"] = seen.seen
    report["lr_finder_steps"] = trainer.strategy.omgs_state.stats()["total"]["steps"]
    trainer.strategy.omgs_state.close()
    del trainer
    gc.collect()

    seen = AtTrainStart()
    trainer = trainer_for(12, [seen])
    torch.manual_seed(0)
    plain = Net()
    trainer.fit(plain, loader())
    report["lr_finder_max_diff"] = float((params(swept) - params(plain)).abs().max())
    for model in (Net(), Net(hidden=32)):  # a new module, then another architecture
        trainer.fit_loop.epoch_loop.max_steps = trainer.global_step + 6
        trainer.fit(model, loader())
    report["fits_at_train_start"] = seen.seen
    report["last_fit_total"] = trainer.strategy.omgs_state.stats()["total"]
    trainer.strategy.omgs_state.close()
    rank = trainer.global_rank
    del trainer
    gc.collect()
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(report, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
