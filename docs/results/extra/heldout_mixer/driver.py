#!/usr/bin/env python
"""Driver: ../heldout_gru/driver.py (cluster, profile, interleaved rounds) pointed at this folder."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "heldout_gru"))
import driver as gru_driver  # noqa: E402

gru_driver.HERE = HERE
gru_driver.TRAIN = os.path.join(HERE, "train_heldout.py")
# RUN_PREFIX=rerun_ keeps a second run's raw files beside the first's (same profile)
_run = gru_driver.run
gru_driver.run = lambda cluster, argv, name, timeout: _run(
    cluster, argv, os.environ.get("RUN_PREFIX", "") + name, timeout)

if __name__ == "__main__":
    gru_driver.main()
