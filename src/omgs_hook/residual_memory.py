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

Rewinding the last commit
-------------------------
A committed step can be undone once, until the next step starts
(:meth:`ResidualMemory.rewind_last_commit`): the hook does it when the step's gradient
was cleared without an optimizer step (a GAN's discriminator gradients from the
generator's step), as plain DDP drops such a gradient. The commit keeps what it
replaced: the residual mapping, and the buffers it swapped, whose old ``current`` is
the new ``spare`` and stays intact until the next step writes into it. Everything a
step changes before its commit (migrations, adoptions into a shard) only changes how
the same residual mass is stored, so the mapping as it was at the commit is a correct
pre-step state. (Staleness counters are not rewound.)

Shard stores (the two-level exchange, :mod:`omgs_hook.hierarchical`)
--------------------------------------------------------------------
A group sent by the two-level exchange keeps its residual only for the shard of the
group this rank owns (:class:`ShardStore`, ``S = ceil(D / ranks_per_node)`` elements,
double-buffered like :class:`GroupBuffers`), so error-feedback memory per rank drops by
the number of ranks per node. A store belongs to exactly one tuple of keys and one shard;
when a group with other keys (a new plan, a dense group) touches any of its keys, the
store is first *migrated*: turned into ordinary per-parameter residuals (zeros outside
the shard), which the next group then consumes. ``state_dict`` expands stores the same
way, so saved residuals are always full-shaped per parameter. The flat exchange
migrates the stores of a group's keys before it sends the group (a ``topology="auto"``
run whose trial switches from the two-level to the flat exchange), so a flat group
always finds its whole residual among the per-parameter ones.

Element order: the parameter's memory order
-------------------------------------------
DDP lays a gradient into its bucket in the *parameter's* memory order: its reducer views
a bucket slice with the parameter's own strides whenever the parameter is dense and
non-overlapping (a ``channels_last`` convolution weight), and
``GradBucket.gradients()`` then shows that slice with contiguous strides. Everything the
hook does is elementwise on that flat slice, so a stored residual is in the same memory
order. Only the edges translate: :meth:`ResidualMemory.state_dict` returns each residual
in the parameter's logical order (shaped like it, contiguous), and
:meth:`ResidualMemory.load_state_dict` takes that form back, so a checkpoint means the
same thing whatever memory format the model it is loaded into has
(:meth:`ResidualMemory.note_layout`).
"""

import math
import threading

import torch

# residual_source's answer for "the residual is this group's own slice of ``current``"
CURRENT = object()


def bucket_view_strides(param):
    """The strides of ``param``'s slice of a DDP bucket when they are not contiguous,
    else None. DDP's reducer views a parameter's bucket slice with the parameter's own
    strides when the parameter is dense and non-overlapping (e.g. ``channels_last``),
    and contiguously otherwise; the flat slice is then in that memory order."""
    if param.is_contiguous():
        return None
    dims = sorted((stride, size) for size, stride in zip(param.shape, param.stride())
                  if size != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:  # overlapping or with gaps: DDP falls back to contiguous
            return None
        expected *= size
    return tuple(param.stride())


def _memory_to_logical(flat, shape, strides):
    """A flat residual in memory order -> shaped like the parameter, contiguous."""
    return flat.as_strided(shape, strides).contiguous()


def _logical_to_memory(tensor, shape, strides):
    """A residual in logical order (any shape of the right numel) -> flat, memory order."""
    flat = torch.empty(tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    flat.as_strided(shape, strides).copy_(tensor.reshape(shape))
    return flat


def _concatenation(numels):
    """``(numels, offsets, total)`` of tensors of ``numels`` elements laid end to end."""
    numels = tuple(int(n) for n in numels)
    offsets, total = [], 0
    for n in numels:
        offsets.append(total)
        total += n
    return numels, tuple(offsets), total


def check_residuals(residuals, expected_shapes=None, where="residuals"):
    """Raise ValueError naming the first entry of ``residuals`` ({name: tensor}) that is
    not a float tensor, or (with ``expected_shapes``, {name: shape}) names no parameter or
    has another shape. ``where``: the state dict's key that holds ``residuals`` (named in
    the hint of how to drop an entry)."""
    if not isinstance(residuals, dict):
        raise ValueError(f"{where} must be a dict {{parameter name: tensor}}")
    # (the state dict's key named where it is not the residuals themselves)
    prefix = "" if where == "residuals" else f"{where}: "
    for key, tensor in residuals.items():
        if not torch.is_tensor(tensor):
            raise ValueError(f"{prefix}residual for {key!r} is not a tensor")
        if not tensor.is_floating_point():
            raise ValueError(f"{prefix}residual for {key!r} has non-float dtype {tensor.dtype}")
        if expected_shapes is not None:
            if key not in expected_shapes:
                raise ValueError(
                    f"residual for {key!r}: no such trainable parameter in the module (a "
                    "parameter renamed, removed or frozen since the checkpoint; to go on "
                    "without its unsent error feedback, delete it from the state dict "
                    f"first: sd[{where!r}].pop({key!r}))"
                )
            if tuple(tensor.shape) != tuple(expected_shapes[key]):
                raise ValueError(
                    f"{prefix}residual for {key!r} has shape {tuple(tensor.shape)}, "
                    f"the parameter has {tuple(expected_shapes[key])}"
                )


def _swap_all(groups, shards):
    """Swap the double buffers of ``groups`` and ``shards`` (a commit, or its undo)."""
    for buffers in list(groups) + list(shards):
        buffers.swap()


# elements per row of squared_norm's partial norms
_NORM_ROW = 256


def squared_norm(tensor):
    """``||tensor||^2`` as a 0-d float64 tensor, in one read and without a copy of the
    tensor: fp32 norms of rows of 256 elements, squared and summed in fp64. At 12M
    normal values: 2.2 ms and a relative error of 2e-8, against 28 ms and 6e-8 for
    ``square().sum()`` (which allocates a tensor of the same size) and 1e-3 for one fp32
    ``vector_norm`` over the whole tensor; at most 1e-6 in the tests, with values
    spanning 8 orders of magnitude. fp64 tensors are normed in fp64. Deterministic for
    a given tensor.

    An fp32 row norm sums its squares in fp32, which overflows from about 1.8e19 in one
    element although every value and the norm itself are finite: on the CPU such a sum
    (inf) is computed again in fp64, so that a huge but finite gradient is not read as
    an infinite norm - ``local_clip_norm``'s factor was ``threshold / inf = 0`` there,
    which dropped the gradient instead of clipping it. Likewise a sum so small that
    fp32 squares may have underflowed (a tensor of all zeros included) is computed
    again in fp64. (A host read of one number,
    free on the CPU; on CUDA it would synchronise, so the fp32 sum stands there.)"""
    flat = tensor.detach().reshape(-1)
    if flat.dtype == torch.float64:
        return torch.linalg.vector_norm(flat).square()
    whole = flat.numel() // _NORM_ROW * _NORM_ROW
    total = torch.zeros((), dtype=torch.float64, device=flat.device)
    if whole:
        rows = torch.linalg.vector_norm(flat[:whole].view(-1, _NORM_ROW), dim=1,
                                        dtype=torch.float32)
        total = total + rows.double().square().sum()
    if whole < flat.numel():
        total = total + torch.linalg.vector_norm(flat[whole:], dtype=torch.float64).square()
    if flat.device.type == "cpu":
        value = float(total)
        # overflowed in fp32, or an inf in the tensor (then this is inf again); or so
        # small that squares below fp32's normal range (elements under about 1e-19)
        # may have been flushed to 0 or lost their precision in the fp32 row sums - a
        # gradient of 1e-25 values read about 700x too small (elements squared under
        # 2**-126 lose at most numel * 2**-126, under 1e-8 of numel * 2**-100)
        if math.isinf(value) or value < flat.numel() * 2.0 ** -100:
            total = torch.linalg.vector_norm(flat, dtype=torch.float64).square()
    return total


class _DoubleBuffer:
    """Two fp32 buffers (``self._buffers``), one holding the committed residuals
    (``current``), the other written by a step (``spare``); committing is a swap."""

    __slots__ = ()  # the subclasses keep their own __slots__ (no per-instance dict)

    @property
    def device(self):
        return self._buffers[0].device

    @property
    def current(self):
        return self._buffers[self._current]

    @property
    def spare(self):
        return self._buffers[1 - self._current]

    def swap(self):
        self._current = 1 - self._current


class GroupBuffers(_DoubleBuffer):
    """Two persistent fp32 buffers for one group (``keys`` with ``numels`` elements each).

    ``current`` holds the committed residuals (``views(current)[i]`` is key i's residual
    when the memory says so), ``spare`` is where a step assembles ``gradient + residual``.
    """

    __slots__ = ("keys", "numels", "offsets", "numel", "_buffers", "_views", "_current", "ages")

    def __init__(self, keys, numels, device):
        self.keys = tuple(keys)
        self.numels, self.offsets, self.numel = _concatenation(numels)
        self._buffers = [torch.empty(self.numel, dtype=torch.float32, device=device) for _ in range(2)]
        self._views = [
            tuple(buf[o:o + n] for o, n in zip(self.offsets, self.numels)) for buf in self._buffers
        ]
        self._current = 0
        self.ages = None  # int32 steps since each element was sent (track_staleness only)

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


class _ShardWorkBuffers:
    """The two ``padded``-element fp32 working buffers of a two-level group, made on
    first need and kept between steps (the subclass has ``padded``, ``device`` and the
    slots ``_staging`` and ``_receive``)."""

    __slots__ = ()

    def staging_buffer(self):
        """The local gradient, zero-padded to ``ranks_per_node * size`` (stage 1's input)."""
        if self._staging is None:
            self._staging = torch.zeros(self.padded, dtype=torch.float32, device=self.device)
        return self._staging

    def receive_buffer(self):
        """The L copies of this rank's shard (communicator.start_shard_sum on the CPU)."""
        if self._receive is None:
            self._receive = torch.empty(self.padded, dtype=torch.float32, device=self.device)
        return self._receive


class ShardStore(_ShardWorkBuffers, _DoubleBuffer):
    """The residual of one two-level group's shard: elements ``[lo, lo + size)`` of the
    group's flattened range (``numel`` real elements; the shard may run past ``numel``:
    padding, always zero), plus the step's working buffers."""

    __slots__ = ("keys", "numels", "offsets", "numel", "lo", "size", "_buffers", "_current",
                 "padded", "_staging", "_receive", "shard_sum")

    def __init__(self, keys, numels, lo, size, padded, device):
        self.keys = tuple(keys)
        self.numels, self.offsets, self.numel = _concatenation(numels)
        self.lo, self.size = int(lo), int(size)
        self._buffers = [torch.zeros(size, dtype=torch.float32, device=device) for _ in range(2)]
        self._current = 0
        # the local gradient, padded to ranks_per_node * size (reduce-scatter input; made
        # on first need: a single fp32 bucket run of that length is reduce-scattered in
        # place), and the reduce-scatter's output - per step, kept to avoid reallocation
        self.padded = int(padded)
        self._staging = None
        self._receive = None
        self.shard_sum = torch.empty(size, dtype=torch.float32, device=device)




    def matches(self, numels, lo, size, device):
        return (self.numels == tuple(int(n) for n in numels) and self.lo == lo
                and self.size == size and self.device == device)

    def key_ranges(self):
        """Per key overlapping the shard: ``(key, start in the key, start in the shard,
        length)``."""
        out = []
        hi = min(self.lo + self.size, self.numel)
        for key, o, n in zip(self.keys, self.offsets, self.numels):
            a, b = max(o, self.lo), min(o + n, hi)
            if a < b:
                out.append((key, a - o, a - self.lo, b - a))
        return out

    def to(self, device):
        self._buffers = [b.to(device) for b in self._buffers]
        if self._staging is not None:
            self._staging = self._staging.to(device)
        self._receive = None
        self.shard_sum = self.shard_sum.to(device)


class DenseShardBuffers(_ShardWorkBuffers):
    """Working buffers of one two-level *dense* group (no residual lives here): the fp32
    reduce-scatter input, zero-padded to ``ranks_per_node * size`` (made on first need,
    it is also the all-gather's output), and the rank's shard, ``size`` fp32 elements
    (the reduce-scatter's output, all-reduced between nodes in place)."""

    __slots__ = ("padded", "shard", "_staging", "_receive")

    def __init__(self, padded, size, device):
        self.padded = int(padded)
        self.shard = torch.empty(size, dtype=torch.float32, device=device)
        self._staging = None
        self._receive = None

    @property
    def device(self):
        return self.shard.device



class ResidualMemory:
    """Per-parameter fp32 residuals with all-or-nothing step commits.

    Stored tensors are flat fp32; most are slices of a group's persistent ``current``
    buffer (:class:`GroupBuffers`). ``get`` returns ``None`` for a parameter whose
    residual is zero because it was never set, so dense-only training allocates nothing.
    """

    def __init__(self):
        self._residuals = {}
        self._shapes = {}
        # key -> strides of its bucket slice, for parameters not laid out contiguously
        # (see "Element order"); a key is in _laid_out once its layout is known
        self._strides = {}
        self._laid_out = set()
        # keys whose stored residual is still in logical order (loaded before the
        # parameter's layout was known)
        self._logical = set()
        self._staged = {}  # key -> flat tensor or None ("zero")
        self._staged_groups = []  # GroupBuffers to swap at commit, with the keys they take
        self._groups = {}  # keys tuple -> GroupBuffers
        self._ages = {}  # key -> int32 ages of its elements (a slice of a group's ``ages``)
        self._used = set()  # keys tuples whose buffers this step used
        self._shards = {}  # keys tuple -> ShardStore (two-level groups)
        self._shard_of = {}  # key -> keys tuple of the ShardStore holding it
        self._staged_shards = []  # ShardStores to swap at commit
        self._dense = {}  # keys tuple -> DenseShardBuffers (two-level dense groups)
        self._dense_used = set()  # keys tuples whose DenseShardBuffers this step used
        self._undo = None  # what the last commit replaced (rewind_last_commit)
        # reentrant: a signal handler that saves (state_dict) may run on the thread
        # that holds it (a commit on the autograd thread)
        self._lock = threading.RLock()

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

    def note_layout(self, key, param):
        """Remember parameter ``key``'s shape and the memory order of its bucket slice
        (once per key; later calls cost a set lookup). A residual loaded before the
        layout was known is put into memory order here, before any step reads it."""
        if key in self._laid_out:
            return
        with self._lock:
            self._laid_out.add(key)
            shape = tuple(param.shape)
            self._shapes[key] = shape
            strides = bucket_view_strides(param)
            if strides is not None:
                self._strides[key] = strides
            if key in self._logical:
                self._logical.discard(key)
                loaded = self._residuals.get(key)
                if strides is not None and loaded is not None:
                    self._residuals[key] = _logical_to_memory(loaded, shape, strides)

    def unplaced(self):
        """{key: shape} of the residuals loaded before their parameter was seen in a
        bucket (:meth:`note_layout` places them)."""
        with self._lock:
            return {key: self._shapes[key] for key in self._logical}

    def total_norm(self):
        """L2 norm over every stored residual (for monitoring). The per-tensor sums are
        added exactly (``math.fsum``): the result does not depend on the order the
        residuals were stored in, which differs between a run and its resume. Each
        tensor's is :func:`squared_norm` (one read, no copy: ``double().pow(2).sum()``
        took 96 ms at 12M elements, this 2.2 ms)."""
        parts = [float(squared_norm(tensor)) for tensor in self._residuals.values()]
        parts += [float(squared_norm(store.current)) for store in self._shards.values()]
        return math.fsum(parts) ** 0.5

    # -- shard stores (the two-level exchange; the hook's thread) ----------------
    def shard_store(self, keys, numels, lo, size, padded, device):
        """The :class:`ShardStore` of two-level group ``keys`` owning ``[lo, lo + size)``
        (created on first use; stores overlapping ``keys`` otherwise are migrated first)."""
        keys = tuple(keys)
        self.migrate_overlapping(keys, keep=keys)
        with self._lock:
            store = self._shards.get(keys)
            if store is not None and not store.matches(numels, lo, size, device):
                self._migrate_locked(store)
                store = None
            if store is None:
                store = ShardStore(keys, numels, lo, size, padded, device)
                self._shards[keys] = store
                for key in keys:
                    self._shard_of[key] = keys
        return store

    def migrate_overlapping(self, keys, keep=None):
        """Turn every shard store holding one of ``keys`` (except the store of ``keep``)
        into per-parameter residuals: the mass stays, only its representation changes.
        (The flat exchange calls it for every group: without stores it returns at once.)"""
        if not self._shard_of:  # only the hook's thread adds stores
            return
        with self._lock:
            for owner in {self._shard_of[k] for k in keys if k in self._shard_of}:
                if owner != keep:
                    self._migrate_locked(self._shards[owner])

    def _migrate_locked(self, store):
        current = store.current
        for key, k_start, s_start, n in store.key_ranges():
            full = self._residuals.get(key)
            if full is None:
                full = torch.zeros(store.numels[store.keys.index(key)], dtype=torch.float32,
                                   device=store.device)
            else:
                full = full.clone()
            full[k_start:k_start + n] += current[s_start:s_start + n]
            self._residuals[key] = full
        del self._shards[store.keys]
        for key in store.keys:
            if self._shard_of.get(key) == store.keys:
                del self._shard_of[key]

    def adopt_into_shard(self, store, keys):
        """Move the per-parameter residuals of ``keys`` (all in ``store``'s group) into the
        store when each is zero outside the shard (a checkpoint of the same topology and
        plan: keeps resume bit-exact). Returns the keys that could not be moved."""
        left = []
        with self._lock:
            ranges = {key: (k_start, s_start, n) for key, k_start, s_start, n in store.key_ranges()}
            current = store.current
            for key in keys:
                tensor = self._residuals.get(key)
                if tensor is None:
                    continue
                if key not in ranges:
                    if bool((tensor != 0).any()):
                        left.append(key)
                    else:
                        del self._residuals[key]
                    continue
                k_start, s_start, n = ranges[key]
                outside = torch.cat([tensor[:k_start], tensor[k_start + n:]])
                if bool((outside != 0).any()):
                    left.append(key)
                    continue
                current[s_start:s_start + n] += tensor[k_start:k_start + n]
                del self._residuals[key]
        return left

    def dense_shard_buffers(self, keys, padded, size, device):
        """The :class:`DenseShardBuffers` of two-level dense group ``keys`` (created on
        first use; released at a commit of a step that did not use them)."""
        keys = tuple(keys)
        with self._lock:
            buffers = self._dense.get(keys)
            if (buffers is None or buffers.padded != padded or buffers.shard.numel() != size
                    or buffers.device != device):
                buffers = DenseShardBuffers(padded, size, device)
                self._dense[keys] = buffers
            self._dense_used.add(keys)
        return buffers

    def stage_shard(self, store):
        """Stage "``store.spare`` is the new shard residual" (from a collective callback)."""
        with self._lock:
            self._staged_shards.append(store)

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
            self._undo = (dict(self._residuals), [b for b, _ in self._staged_groups],
                          list(self._staged_shards), dict(self._groups), dict(self._dense))
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
            for store in self._staged_shards:
                store.swap()
            for key, tensor in self._staged.items():
                if tensor is None:
                    self._residuals.pop(key, None)
                else:
                    self._residuals[key] = tensor
            # buffers of groups this step did not use belong to an old plan: release them
            # (residuals still pointing into them keep their storage alive until re-read)
            for keys in [k for k in self._groups if k not in self._used]:
                del self._groups[keys]
            for keys in [k for k in self._dense if k not in self._dense_used]:
                del self._dense[keys]
            self._clear_step_locked()

    def discard_staged(self):
        """Drop staged updates: the residuals stay exactly as before the step."""
        with self._lock:
            self._undo = None
            self._clear_step_locked()

    def rewind_last_commit(self):
        """Undo the last :meth:`commit_staged`: every residual as it was before that step,
        bit for bit. Only until the next step writes into the buffers (call it before the
        next step begins) and only once. Returns False when there is nothing to undo
        (nothing committed since the last rewind, discard or load)."""
        with self._lock:
            if self._undo is None:
                return False
            residuals, groups_swapped, shards_swapped, groups, dense = self._undo
            self._undo = None
            _swap_all(groups_swapped, shards_swapped)
            self._residuals = residuals
            self._groups = groups
            self._dense = dense
            return True

    def rewind_keys(self, keys):
        """Undo the last :meth:`commit_staged` for ``keys`` only: each gets the residual
        it had before that step (a copy: the buffer half it was in is the next step's to
        write), the others keep the step's. Returns False, changing nothing, when there
        is nothing to undo or the step swapped two-level shard or dense-shard buffers
        (their residuals mix parameters). Either way the last commit is final after."""
        with self._lock:
            done = self._restore_keys_locked(keys)
            self._undo = None
            return done

    def restore_keys(self, keys):
        """:meth:`rewind_keys`, but the last commit stays undoable: a later
        :meth:`rewind_last_commit` still puts every residual back as before that step
        (``keys`` included: their copies are dropped then)."""
        with self._lock:
            return self._restore_keys_locked(keys)

    def _restore_keys_locked(self, keys):
        if self._undo is None:
            return False
        residuals, groups_swapped, shards_swapped, groups, dense = self._undo
        if shards_swapped or self._dense:
            return False
        for key in keys:
            old = residuals.get(key)
            if old is None:
                self._residuals.pop(key, None)
            else:
                self._residuals[key] = old.clone()
        return True

    def undo_state_dict(self):
        """:meth:`state_dict` as it would be after :meth:`rewind_last_commit`, leaving
        everything as it is (the rewind stays possible); None with nothing to undo.
        Read from the commit's record, changing nothing: rewinding, copying and redoing
        the commit let the training thread - whose next forward forgets the record and
        whose backward writes into the spare halves - run on a swapped memory, and the
        training changed (tests/test_concurrent_state_dict.py)."""
        with self._lock:  # (held while copying: the spare halves are the next step's)
            if self._undo is None:
                return None
            residuals, _, shards_swapped, _, _ = self._undo
            return self._state_dict_of(residuals, shards_swapped)

    def scale_(self, factor):
        """Multiply every stored residual by ``factor`` (a GradScaler changed the loss
        scale: the residuals are kept in the units of the gradients the hook is given).
        Call it between steps, before the next one stages anything: what the last
        commit replaced is released (no rewind of it is possible any more)."""
        factor = float(factor)
        with self._lock:
            self._undo = None
            for tensor in self._residuals.values():
                tensor.mul_(factor)
            for store in self._shards.values():
                store.current.mul_(factor)

    def forget_last_commit(self):
        """The last commit is final (its gradient was applied): release what it replaced."""
        with self._lock:
            self._undo = None

    def _clear_step_locked(self):
        self._staged = {}
        self._staged_groups = []
        self._staged_shards = []
        self._used = set()
        self._dense_used = set()

    # -- persistence ------------------------------------------------------------
    def state_dict(self):
        """``{name: residual shaped like the parameter}`` (fp32 clones)."""
        with self._lock:  # (a commit on another thread rebinds residuals, swaps buffers)
            return self._state_dict_of(self._residuals)

    def _state_dict_of(self, residuals, swapped_shards=()):
        """:meth:`state_dict` of ``residuals``, reading the shard stores in
        ``swapped_shards`` from their other half (as they were before the last commit)."""
        swapped = {id(store) for store in swapped_shards}
        out = {}
        for key, tensor in residuals.items():
            out[key] = tensor.detach().clone()
        for store in self._shards.values():  # full-shaped, zeros outside the shard
            current = store.spare if id(store) in swapped else store.current
            for key, n in zip(store.keys, store.numels):
                if key not in out:  # every key of the group, so every rank saves the same keys
                    out[key] = torch.zeros(n, dtype=torch.float32, device=store.device)
            for key, k_start, s_start, n in store.key_ranges():
                out[key][k_start:k_start + n] += current[s_start:s_start + n]
        for key, t in out.items():
            shape = self._shapes.get(key)
            strides = self._strides.get(key)
            if strides is not None and key not in self._logical:
                out[key] = _memory_to_logical(t, shape, strides)
            elif shape is not None:
                out[key] = t.view(shape)
        return out

    def load_state_dict(self, residuals, expected_shapes=None):
        """Replace the residuals. ``expected_shapes`` ({name: shape}) validates names/shapes.

        Raises ValueError naming the first unknown parameter or mismatched shape, before
        anything is replaced.
        """
        check_residuals(residuals, expected_shapes)
        for key, tensor in residuals.items():
            shape = self._shapes.get(key) if key in self._laid_out else None
            if shape is not None and tensor.numel() != math.prod(shape):
                raise ValueError(
                    f"residual for {key!r} has shape {tuple(tensor.shape)}, "
                    f"the parameter has {shape}"
                )
        with self._lock:
            self._undo = None
            self._residuals = {}
            self._groups = {}
            self._shards = {}
            self._shard_of = {}
            self._dense = {}
            self._clear_step_locked()
            self._logical = set()
            for key, tensor in residuals.items():
                shape = tuple(tensor.shape)
                flat = tensor.detach().reshape(-1).to(torch.float32).clone()
                if key not in self._laid_out:  # put into memory order by note_layout
                    self._shapes[key] = shape
                    self._logical.add(key)
                elif key in self._strides:
                    flat = _logical_to_memory(flat, self._shapes[key], self._strides[key])
                self._residuals[key] = flat

    def move_to(self, device):
        """Move every residual to ``device`` (after loading a checkpoint saved elsewhere)."""
        with self._lock:
            self._undo = None
            for key, tensor in list(self._residuals.items()):
                if tensor.device != device:
                    self._residuals[key] = tensor.to(device)
            for store in self._shards.values():
                if store.device != device:
                    store.to(device)
