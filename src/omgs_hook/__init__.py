"""omgs-hook: OMGS-SGD merged gradient sparsification as a PyTorch DDP communication hook.

Typical use (two lines added to a DDP script)::

    import omgs_hook
    state = omgs_hook.register(ddp_model, density=0.001)

or, in PyTorch's own style::

    from omgs_hook import OMGSState, omgs_hook
    ddp_model.register_comm_hook(OMGSState(density=0.001), omgs_hook)

The planner (``omgs_hook.cost_model``, ``omgs_hook.planner``) is pure Python and never
imports torch; the names that need torch are loaded lazily on first access.
"""

__version__ = "0.1.0"

# name -> module that defines it; imported on first attribute access so that
# `omgs-plan` and the planner stay free of the torch import cost.
_LAZY = {
    "OMGSState": "omgs_hook.hook",
    "omgs_hook": "omgs_hook.hook",
    "register": "omgs_hook.hook",
}

__all__ = ["OMGSState", "omgs_hook", "register", "__version__"]


def __getattr__(name):
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'omgs_hook' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value
