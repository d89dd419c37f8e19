"""Build of the optional C pass (omgs_hook._native); everything else is in pyproject.toml.

``optional=True``: without a C compiler the install goes on and omgs_hook.topk uses its
NumPy/torch chunk loop instead (the same results, slower; docs/hot-path.md)."""

import sys

from setuptools import Extension, setup

# -O3 vectorises the pass's block loop; never -ffast-math: the sums must be IEEE float32
# additions, bit for bit those of torch.add
COMPILE_ARGS = [] if sys.platform == "win32" else ["-O3", "-std=c99"]

setup(
    ext_modules=[
        Extension("omgs_hook._native", sources=["src/omgs_hook/_native.c"],
                  extra_compile_args=COMPILE_ARGS, optional=True),
    ],
)
