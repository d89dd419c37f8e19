"""Round-to-round spread of each plan's step time in a ``pace.py timed`` run, raw and divided
by the pace (the largest, mean or least over ranks of each rank's forward over its median):
per-step median absolute deviation, and the coefficient of variation of the round medians.

    python spread.py timed_n2_a.json
"""
import json, sys
import numpy as np
d = json.load(open(sys.argv[1]))
R = np.array(d["rows"])  # ranks x plans x rounds x steps x 2
step = R[..., 0].max(0)
F = R[..., 1]
ref = np.median(F.reshape(F.shape[0], -1), axis=1)[:, None, None, None]
ratio = F / ref
for k, pace in {"raw": np.ones_like(step), "max": ratio.max(0), "mean": ratio.mean(0), "min": ratio.min(0)}.items():
    v = step / np.clip(pace, 1/1.3, 1.3)
    flat = v.reshape(v.shape[0], -1)
    mad = np.median(np.abs(flat - np.median(flat, 1)[:, None]), 1) / np.median(flat, 1)
    rm = np.median(v, axis=2); cv = np.std(rm, axis=1) / np.mean(rm, axis=1)
    print(f"{k:5s} per-step MAD% {np.round(100*mad,1)} round CV% {np.round(100*cv,1)} medians {np.round(1e3*np.median(flat,1),1)}")
