"""Measure the OMGS hook's cost models on this process group: ``omgs-profile`` as a script.

    torchrun --nproc_per_node=2 scripts/profile.py --out profile.json

The default sweep is adaptive: message and top-k sizes double until the next one would
not fit in its share of ``--time-budget`` (30 s of measuring by default); a sweep the
budget cut short says so and records where and why. On more than one node with more
than one rank per node (``--topology auto``, ``--ranks-per-node`` defaulting to torchrun's
``LOCAL_WORLD_SIZE``) it also measures the intra- and inter-node link classes of the
two-level exchange (``ranks_per_node``, ``intra``, ``inter`` in the profile). See ``omgs_hook.profile_run`` (or
``--help``) for what is measured and the options, and docs/calibration.md.
"""

import os
import sys

if __name__ != "__main__":
    # Any script in scripts/ puts this folder first on sys.path, so `import profile`
    # (cProfile does it, and torch imports cProfile) finds this file instead of the
    # standard library's module. Stand in for the real one.
    import importlib.util
    import sysconfig

    _spec = importlib.util.spec_from_file_location(
        "profile", os.path.join(sysconfig.get_paths()["stdlib"], "profile.py"))
    _stdlib_profile = importlib.util.module_from_spec(_spec)
    sys.modules[__name__] = _stdlib_profile
    _spec.loader.exec_module(_stdlib_profile)
else:
    # Run as a script: drop this folder from sys.path before importing anything else.
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]

    from omgs_hook.profile_run import main

    sys.exit(main())
