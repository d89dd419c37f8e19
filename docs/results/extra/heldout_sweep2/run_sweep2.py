"""Held-out usage patterns through omgs_hook: no crash or hang, ranks agree, losses finite.

Run from the repository root::

    python docs/results/extra/heldout_sweep2/run_sweep2.py CASE[:MODE][@WORLD],...

MODE: default, sparse (allow_dense=False), layerwise, keep (on_unapplied="keep"), twolevel
(2 x 2, sparse), nohook (DDP's own all-reduce). Cases (sweep2_cases.run_case):
eval_rank0 (rank 0 alone evaluates the DDP model under no_grad every 10 steps),
eval_rank0_grad (the same without no_grad), join_uneven (the last rank runs 37 fewer steps, the others in between, so a rank joins during the first trial
inside DDP's Join), two_models (two DDP models with a state each, GAN-like),
frozen_midway (a layer frozen at step 20, find_unused_parameters), siamese (two
forwards per backward, static_graph), zero_opt (ZeroRedundancyOptimizer). A case name ending in _cap0 builds DDP with bucket_cap_mb=0. Results:
results.txt beside this file.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "..", "tests"))
sys.path.insert(0, os.path.join(HERE, "..", "heldout_sweep"))
sys.path.insert(0, HERE)
from run_sweep import run_and_print  # noqa: E402


def main():
    for c in sys.argv[1].split(","):
        c, _, world = c.partition("@")
        case, _, mode = c.partition(":")
        run_and_print(c, "sweep2_cases", int(world or 2), 120, case=case, mode=mode or "default")


if __name__ == "__main__":
    main()
