"""Held-out models and DDP modes through omgs_hook: no crash, ranks agree, losses finite.

Run from the repository root (2 gloo ranks; 4 for the two-level modes, 1 for ws1)::

    python docs/results/extra/heldout_sweep/run_sweep.py CASE[:MODE],...

MODE: default (register() with density only), layerwise / single (sparse, select="model"),
sparse (allow_dense=False), twolevel / twolevel_sparse (topology="hierarchical",
ranks_per_node=2), resume (state_dict -> torch.load(weights_only=True) -> a new DDP and
state at step 25), ws1 (one rank), nohook (DDP's own all-reduce). Cases: see
sweep_cases.make. Results of the 2026-12-01 run: results.txt. The bugs it found (zero-
element parameters, float64 layers, sparse-gradient embeddings) have tests in
tests/test_hook_ddp.py and tests/test_hook_validation.py.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "..", "tests"))
sys.path.insert(0, HERE)
from ddp_harness import run_ranks  # noqa: E402


def run_and_print(label, module, world, timeout, **kwargs):
    """Run ``module.run_case`` on ``world`` ranks; print rank 0's result (and traceback)."""
    try:
        first = run_ranks(module, "run_case", world_size=world, timeout=timeout, **kwargs)[0]
        tb = first.pop("tb", None)
        print(first, flush=True)
        if tb:
            print(tb)
    except Exception as exc:  # noqa: BLE001 - reported, the sweep goes on
        print(label, "HARNESS FAIL", str(exc)[-2000:], flush=True)


def main():
    for c in sys.argv[1].split(","):
        case, _, mode = c.partition(":")
        world = 4 if mode.startswith("twolevel") else (1 if mode == "ws1" else 2)
        run_and_print(c, "sweep_cases", world, 400, case=case,
                      mode=("default" if mode in ("", "ws1") else mode))


if __name__ == "__main__":
    main()
