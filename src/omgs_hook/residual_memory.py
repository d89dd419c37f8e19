"""Error-feedback memory: the part of each gradient that top-k did not send yet.

Residuals are stored per *parameter*, keyed by the parameter's name (its name in
``module.named_parameters()``), never by ``bucket.index()``. A DDP bucket's residual is
therefore simply the residuals of the bucket's parameters. This makes the state
independent of how DDP happens to cut buckets:

* DDP rebuilds its buckets after the first iteration(s) (ready order; ``static_graph``
  one iteration later), and a restarted DDP starts again with one bucket;
* re-planning changes which buckets are merged into a group.

None of these can lose or misplace residual, because no residual is ever attached to a
bucket index or to a group.

Updates are *staged*: each group stages the new residuals of its parameters, and the
whole step is committed at once when every group of the step has been exchanged, or
dropped (the old residuals stay) when the step turned out non-finite or failed. A
skipped AMP step therefore leaves the residual exactly as it was.
"""

import threading

import torch


class ResidualMemory:
    """Per-parameter fp32 residuals with all-or-nothing step commits.

    Stored tensors are flat fp32 (they may be views into the buffer a group was
    assembled in - a zero-copy commit). ``get`` returns ``None`` for a parameter whose
    residual is zero because it was never set, so dense-only training allocates nothing.
    """

    def __init__(self):
        self._residuals = {}
        self._shapes = {}
        self._staged = {}
        self._lock = threading.Lock()

    # -- reading --------------------------------------------------------------
    def get(self, key):
        """The flat fp32 residual of parameter ``key``, or None when it is zero."""
        return self._residuals.get(key)

    def keys(self):
        return list(self._residuals)

    def __contains__(self, key):
        return key in self._residuals

    def __len__(self):
        return len(self._residuals)

    def note_shape(self, key, shape):
        """Remember a parameter's shape so ``state_dict`` can return shaped tensors."""
        self._shapes[key] = tuple(shape)

    def total_norm(self):
        """L2 norm over every stored residual (for monitoring)."""
        sq = 0.0
        for tensor in self._residuals.values():
            sq += float(tensor.double().pow(2).sum())
        return sq ** 0.5

    # -- staged updates (called from collective callbacks, any thread) ----------
    def stage(self, key, flat_residual):
        """Stage the new residual of ``key``; ``None`` stages "zero"."""
        with self._lock:
            self._staged[key] = flat_residual

    def commit_staged(self):
        """Make every staged residual current (end of a finite, successful step)."""
        with self._lock:
            for key, tensor in self._staged.items():
                if tensor is None:
                    self._residuals.pop(key, None)
                else:
                    self._residuals[key] = tensor
            self._staged = {}

    def discard_staged(self):
        """Drop staged updates: the residuals stay exactly as before the step."""
        with self._lock:
            self._staged = {}

    # -- persistence ------------------------------------------------------------
    def state_dict(self):
        """``{name: residual shaped like the parameter}`` (fp32 clones)."""
        out = {}
        for key, tensor in self._residuals.items():
            shape = self._shapes.get(key)
            t = tensor.detach().clone()
            out[key] = t.view(shape) if shape is not None else t
        return out

    def load_state_dict(self, residuals, expected_shapes=None):
        """Replace the residuals. ``expected_shapes`` ({name: shape}) validates names/shapes.

        Raises ValueError naming the first unknown parameter or mismatched shape, before
        anything is replaced.
        """
        if not isinstance(residuals, dict):
            raise ValueError("residuals must be a dict {parameter name: tensor}")
        for key, tensor in residuals.items():
            if not torch.is_tensor(tensor):
                raise ValueError(f"residual for {key!r} is not a tensor")
            if not tensor.is_floating_point():
                raise ValueError(f"residual for {key!r} has non-float dtype {tensor.dtype}")
            if expected_shapes is not None:
                if key not in expected_shapes:
                    raise ValueError(
                        f"residual for {key!r}: no such trainable parameter in the module"
                    )
                if tuple(tensor.shape) != tuple(expected_shapes[key]):
                    raise ValueError(
                        f"residual for {key!r} has shape {tuple(tensor.shape)}, "
                        f"the parameter has {tuple(expected_shapes[key])}"
                    )
        with self._lock:
            self._residuals = {}
            self._staged = {}
            for key, tensor in residuals.items():
                self._shapes[key] = tuple(tensor.shape)
                self._residuals[key] = tensor.detach().reshape(-1).to(torch.float32).clone()

    def move_to(self, device):
        """Move every residual to ``device`` (after loading a checkpoint saved elsewhere)."""
        with self._lock:
            for key, tensor in list(self._residuals.items()):
                if tensor.device != device:
                    self._residuals[key] = tensor.to(device)
