#!/usr/bin/env python
"""Lightning with OMGS-SGD: a small classifier trained by ``lightning.pytorch.Trainer``
on 2 CPU ranks with :class:`omgs_hook.lightning.OMGSStrategy`.

Run (needs the ``lightning`` extra)::

    torchrun --nproc_per_node=2 scripts/lightning_example.py --steps 30 --out runs/lightning.json

Rank 0 prints the hook's totals and writes them, the residuals' parameter names and the
final training loss to ``--out``.
"""

import argparse
import gc
import json
import os

import lightning.pytorch as pl
import torch

from omgs_hook.lightning import OMGSStrategy


class Classifier(pl.LightningModule):
    def __init__(self, lr=0.05):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(),
                                       torch.nn.Linear(128, 128), torch.nn.ReLU(),
                                       torch.nn.Linear(128, 4))
        self.lr = lr
        self.losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def synthetic_data(samples=2048, seed=0):
    """Four Gaussian blobs in 32 dimensions (the same on every rank)."""
    gen = torch.Generator().manual_seed(seed)
    centres = torch.randn(4, 32, generator=gen) * 2
    y = torch.randint(0, 4, (samples,), generator=gen)
    x = centres[y] + torch.randn(samples, 32, generator=gen)
    return torch.utils.data.TensorDataset(x, y)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--out", default=None)
    parser.add_argument("--fits", type=int, default=1,
                        help="call trainer.fit this many times, --steps steps each")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    # this tiny job is about wiring, not plan choice: the model's sparse plan
    options = {"density": args.density, "strategy": "layerwise", "allow_dense": False,
               "select": "model", "warmup_steps": 2, "log_every": 0}
    strategy = OMGSStrategy(omgs_options=options, process_group_backend="gloo", bucket_cap_mb=0)
    trainer = pl.Trainer(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                         num_nodes=1, strategy=strategy, max_steps=args.fits * args.steps,
                         enable_checkpointing=False, logger=False, enable_progress_bar=False,
                         enable_model_summary=False)
    model = Classifier()
    loader = torch.utils.data.DataLoader(synthetic_data(), batch_size=32, shuffle=False)
    for fit in range(args.fits):
        trainer.fit_loop.epoch_loop.max_steps = (fit + 1) * args.steps
        trainer.fit(model, loader)
    stats = strategy.omgs_state.stats()
    if trainer.global_rank == 0:
        report = {"steps": stats["step"], "total": stats["total"],
                  "forward_s": stats["forward_s"],
                  "residual_names": sorted(strategy.omgs_state.memory.keys()),
                  "first_loss": model.losses[0], "last_loss": model.losses[-1]}
        print(json.dumps(report["total"]))
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
    strategy.omgs_state.close()
    # Lightning leaves the process group alive; exiting with gloo's worker threads still
    # holding work aborts a rank now and then (SIGABRT, "terminate called without an
    # active exception": 1 CI run in many), so end it here on every rank.
    if torch.distributed.is_initialized():
        # (Lightning's teardown unwrapped the DDP model; collect it before the group goes)
        del trainer
        gc.collect()
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
