"""Error-feedback memory: the part of each gradient that top-k did not send yet.

Residuals are stored per *parameter*, keyed by the parameter's name (its name in
``module.named_parameters()``), never by ``bucket.index()``. A DDP bucket's residual is
therefore simply the residuals of the bucket's parameters. This makes the state
independent of how DDP happens to cut buckets:

* DDP rebuilds its buckets after the first iteration(s) (ready order; ``static_graph``
  one iteration later), and a restarted DDP starts again with one bucket;
* re-planning (or a measured-plan trial) changes which buckets are merged into a group.

None of these can lose or misplace residual, because no residual is ever attached to a
bucket index or to a group.

Persistent group buffers (the hot path)
---------------------------------------
Each group the hook sends owns two persistent fp32 buffers of the group's size
(:class:`GroupBuffers`): ``current``, whose slices *are* the stored residuals of the
group's parameters, and ``spare``, into which the step writes ``gradient + residual``
and from which the sent entries are zeroed - so after the step ``spare`` holds the new
residual. Committing the step swaps the two (O(1): no copy), discarding it leaves
``current`` untouched, bit for bit (a skipped AMP step). Nothing group-sized is
allocated per step. When the plan changes, a parameter's residual may still be a slice
of another group's buffer: the new group reads it from there once (one copy) and from
then on owns it.

Invariant: a stored residual that is a slice of some group's buffers is always a slice
of that group's ``current`` buffer, so writing into ``spare`` never overwrites a stored
residual. The commit keeps it: every parameter of a committed group either points into
the new ``current`` or (a parameter parked this step, see ``group_exchange``) is copied
out of the group's buffers first.

Updates are *staged*: each group stages its new residuals, and the whole step is
committed at once when every group of the step has been exchanged, or dropped (the old
residuals stay) when the step turned out non-finite or failed.
"""

import threading

import torch

# residual_source's answer for "the residual is this group's own slice of ``current``"
CURRENT = object()


class GroupBuffers:
    """Two persistent fp32 buffers for one group (``keys`` with ``numels`` elements each).

    ``current`` holds the committed residuals (``views(current)[i]`` is key i's residual
    when the memory says so), ``spare`` is where a step assembles ``gradient + residual``.
    """

    __slots__ = ("keys", "numels", "offsets", "numel", "_buffers", "_views", "_current", "ages")

    def __init__(self, keys, numels, device):
        self.keys = tuple(keys)
        self.numels = tuple(int(n) for n in numels)
        offsets, total = [], 0
        for n in self.numels:
            offsets.append(total)
            total += n
        self.offsets = tuple(offsets)
        self.numel = total
        self._buffers = [torch.empty(total, dtype=torch.float32, device=device) for _ in range(2)]
        self._views = [
            tuple(buf[o:o + n] for o, n in zip(self.offsets, self.numels)) for buf in self._buffers
        ]
        self._current = 0
        self.ages = None  # int32 steps since each element was sent (track_staleness only)

    @property
    def device(self):
        return self._buffers[0].device

    @property
    def current(self):
        return self._buffers[self._current]

    @property
    def spare(self):
        return self._buffers[1 - self._current]

    def current_views(self):
        return self._views[self._current]

    def spare_views(self):
        return self._views[1 - self._current]

    def owns(self, tensor):
        """True when ``tensor`` shares storage with either buffer."""
        ptr = tensor.untyped_storage().data_ptr()
        return any(ptr == buf.untyped_storage().data_ptr() for buf in self._buffers)

    def in_spare(self, tensor):
        return tensor.untyped_storage().data_ptr() == self.spare.untyped_storage().data_ptr()

    def swap(self):
        self._current = 1 - self._current


class ResidualMemory:
    """Per-parameter fp32 residuals with all-or-nothing step commits.

    Stored tensors are flat fp32; most are slices of a group's persistent ``current``
    buffer (:class:`GroupBuffers`). ``get`` returns ``None`` for a parameter whose
    residual is zero because it was never set, so dense-only training allocates nothing.
    """

    def __init__(self):
        self._residuals = {}
        self._shapes = {}
        self._staged = {}  # key -> flat tensor or None ("zero")
        self._staged_groups = []  # GroupBuffers to swap at commit, with the keys they take
        self._groups = {}  # keys tuple -> GroupBuffers
        self._ages = {}  # key -> int32 ages of its elements (a slice of a group's ``ages``)
        self._used = set()  # keys tuples whose buffers this step used
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

    # -- group buffers (the hook's thread) --------------------------------------
    def group_buffers(self, keys, numels, device):
        """The persistent buffers of group ``keys`` (created on first use).

        A residual of the group's own keys that lives in the returned ``spare`` buffer
        (impossible while the invariant of the module docstring holds) is copied out
        first, so the caller may overwrite ``spare`` freely.
        """
        keys = tuple(keys)
        with self._lock:
            buffers = self._groups.get(keys)
            if buffers is None or buffers.device != device or buffers.numels != tuple(numels):
                buffers = GroupBuffers(keys, numels, device)
                self._groups[keys] = buffers
            self._used.add(keys)
            for key in keys:  # defensive: never overwrite a residual this group reads
                tensor = self._residuals.get(key)
                if tensor is not None and buffers.in_spare(tensor):
                    self._residuals[key] = tensor.clone()
        return buffers

    def group_ages(self, buffers):
        """The group's int32 staleness counters (steps since each element was last sent),
        created on first use from the parameters' counters in their previous groups."""
        if buffers.ages is None:
            ages = torch.zeros(buffers.numel, dtype=torch.int32, device=buffers.device)
            with self._lock:
                for key, o, n in zip(buffers.keys, buffers.offsets, buffers.numels):
                    old = self._ages.get(key)
                    if old is not None:
                        ages[o:o + n].copy_(old)
                    self._ages[key] = ages[o:o + n]
            buffers.ages = ages
        return buffers.ages

    def ages(self):
        """``{key: int32 ages}`` of every parameter with staleness counters."""
        return dict(self._ages)

    def residual_source(self, buffers, index, key):
        """Where key ``index`` of ``buffers``' group reads its residual from this step:
        :data:`CURRENT` (its slice of ``buffers.current``: the fast path), ``None`` (zero),
        or the stored tensor itself (a slice of another group's buffer, or loaded)."""
        stored = self._residuals.get(key)
        if stored is None:
            return None
        if stored is buffers.current_views()[index]:
            return CURRENT
        return stored

    # -- staged updates (called from collective callbacks, any thread) ----------
    def stage(self, key, flat_residual):
        """Stage the new residual of ``key``; ``None`` stages "zero"."""
        with self._lock:
            self._staged[key] = flat_residual

    def stage_group(self, buffers, keys):
        """Stage "``buffers.spare`` is the new residual of ``keys``" (a subset of the
        group's keys; the others - parked this step - keep their residual)."""
        with self._lock:
            self._staged_groups.append((buffers, frozenset(keys)))

    def commit_staged(self):
        """Make every staged residual current (end of a finite, successful step)."""
        with self._lock:
            for buffers, taken in self._staged_groups:
                for key in buffers.keys:
                    if key in taken:
                        continue
                    stored = self._residuals.get(key)
                    if stored is not None and buffers.owns(stored):
                        # a parked parameter keeps its residual, out of the group's buffers
                        self._residuals[key] = stored.clone()
                buffers.swap()
                for key, view in zip(buffers.keys, buffers.current_views()):
                    if key in taken:
                        self._residuals[key] = view
            for key, tensor in self._staged.items():
                if tensor is None:
                    self._residuals.pop(key, None)
                else:
                    self._residuals[key] = tensor
            # buffers of groups this step did not use belong to an old plan: release them
            # (residuals still pointing into them keep their storage alive until re-read)
            for keys in [k for k in self._groups if k not in self._used]:
                del self._groups[keys]
            self._clear_step_locked()

    def discard_staged(self):
        """Drop staged updates: the residuals stay exactly as before the step."""
        with self._lock:
            self._clear_step_locked()

    def _clear_step_locked(self):
        self._staged = {}
        self._staged_groups = []
        self._used = set()

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
            self._groups = {}
            self._clear_step_locked()
            for key, tensor in residuals.items():
                self._shapes[key] = tuple(tensor.shape)
                self._residuals[key] = tensor.detach().reshape(-1).to(torch.float32).clone()

    def move_to(self, device):
        """Move every residual to ``device`` (after loading a checkpoint saved elsewhere)."""
        with self._lock:
            for key, tensor in list(self._residuals.items()):
                if tensor.device != device:
                    self._residuals[key] = tensor.to(device)
