"""One step's exchange: assembling groups from arrived buckets, sending them, and
completing DDP's per-bucket futures when every group covering a bucket is written back.

Threading model (measured on gloo, see docs/design.md):
* ``add_bucket`` / ``send_group`` / ``finish_issuing`` run on the autograd thread, in
  the hook, identically ordered on every rank - the only place collectives are issued.
* A group's completion - unpack, average, write back, stage residuals, complete
  futures - is local work only: it never issues a collective. A dense group's and a
  two-level group's run on a process-group worker thread when the collective
  completes (or inline, when it already had). A flat sparse group's on the CPU runs on
  the autograd thread instead (``write_back_completed``): at the next bucket for the
  groups whose collective has completed by then, and at the last bucket for the rest,
  waiting for them. Its callback on the worker thread only notes the completion time.
  On two cores, a write-back on gloo's thread took the interpreter lock and a core
  from backward at every small torch call (hand-offs of the lock cost more than the
  O(k) work itself: docs/hot-path.md).

Any exception - in a collective or in the local work - is routed to every bucket
future still pending, so ``backward()`` raises instead of hanging.
"""

import collections
import contextlib
import threading
import time
import warnings

import torch

from . import communicator, cost_model
from .cost_model import selected_k
from .residual_memory import CURRENT, squared_norm

_FP32 = torch.finfo(torch.float32)
_fp64_range_warned = False  # once per process: the check costs a pass per fp64 gradient


def _warn_if_fp64_outside_fp32(segments):
    """Warn (once) when a float64 gradient lies outside float32's range. The hook adds,
    selects and keeps residuals in fp32, so such a gradient was silently lost (all of
    it below ~1e-45, its precision below ~1e-38) or read as inf - a "NaN/Inf"
    step that plain DDP, all-reducing in fp64, does not have. CPU only (a host read)."""
    global _fp64_range_warned
    for _, _, grad in segments:
        if _fp64_range_warned or grad.dtype != torch.float64 or grad.device.type != "cpu":
            continue
        amax = float(grad.abs().max()) if grad.numel() else 0.0
        if _FP32.max < amax < float("inf") or 0.0 < amax < _FP32.tiny:
            _fp64_range_warned = True
            what = ("overflows to inf (the step is treated as non-finite)" if amax > 1 else
                    "loses its precision or is flushed to zero (error feedback loses it)")
            warnings.warn(
                f"omgs_hook: a float64 gradient's largest magnitude is {amax:.3g}, outside "
                f"float32's normal range ({_FP32.tiny:.3g} to {_FP32.max:.3g}); the hook "
                f"accumulates, selects and keeps residuals in float32, so this gradient "
                f"{what}. Scale the loss into float32's range, or use density=1.0 / plain "
                f"DDP for this model", RuntimeWarning, stacklevel=2)


class GroupRecord:
    """What was sent for one group (for stats and for tests' reference checks), and when:
    ``started`` (the hook began assembling it), ``issued`` (its collective was issued),
    ``done`` (written back) - host ``perf_counter`` seconds, for the measured timeline.
    A two-level group also has ``inter_issued`` and ``inter_done`` (its inter-node
    collective; set when the exchange times its stages) and ``model_bytes`` (its
    inter-node collective's and intra-node all-gather's bytes as the cost model prices
    them; :func:`~omgs_hook.measurements.two_level_comm_sums`)."""

    __slots__ = ("keys", "dense", "numel", "selected", "bytes", "started", "issued", "done",
                 "inter_bytes", "intra_bytes", "inter_issued", "inter_done", "model_bytes")

    def __init__(self, keys, dense, numel, selected, nbytes, started=None):
        self.keys = keys
        self.dense = dense
        self.numel = numel
        self.selected = selected
        self.bytes = nbytes
        self.started = started
        self.issued = None
        self.done = None
        self.inter_bytes = 0  # bytes this rank sends to ranks on other nodes / its own node
        self.intra_bytes = 0
        self.inter_issued = None
        self.inter_done = None
        self.model_bytes = None


class StepExchange:
    """Bookkeeping for one backward pass (one call of the hook per bucket).

    Args:
        memory: the ResidualMemory (staged updates, committed at the end of the step).
        selector: the top-k selector (``select(x, k) -> (values, indices)``).
        process_group: where collectives go; ``world_size`` its size.
        density: fraction of each sparse group's elements to send.
        on_finished: called once, from whichever thread completes the step, with this
            object, after the residual commit and before the last futures complete.
        on_comm_sample: optional ``(nbytes, seconds)`` callback for online refitting.
        raise_on_nonfinite: fail the step (``backward()`` raises FloatingPointError)
            instead of marking it non-finite when any rank's gradient has NaN/Inf.
    """

    def __init__(self, memory, selector, process_group, world_size, density,
                 on_finished=None, on_comm_sample=None, raise_on_nonfinite=False,
                 clip_per_sqrt_element=None, measure_health=False, track_staleness=False,
                 topology=None, subgroups=None, time_stages=False):
        self.memory = memory
        # two-level groups: time the inter-node collective too (measured_comm, on the
        # host clock), for measurements.two_level_comm_sums
        self.time_stages = time_stages
        # omgs_hook.topology.Topology (None: flat, one rank per node assumed) and, for the
        # two-level exchange, its Subgroups
        self.topology = topology
        self.subgroups = subgroups
        # two-level groups in flight, in send order: [generator, work handle it waits on,
        # group index, collectives issued so far] (omgs_hook.hierarchical)
        self._pipelines = []
        # resume a two-level group only once its collective completed (CPU: a hook call
        # never waits for the network); set with the first two-level group
        self.poll_stages = False
        self.selector = selector
        self.process_group = process_group
        self.world_size = world_size
        self.density = density
        self.on_finished = on_finished
        self.on_comm_sample = on_comm_sample
        self.raise_on_nonfinite = raise_on_nonfinite
        # DGC's local gradient clipping, per group: a group of D elements has its local
        # gradient scaled to an L2 norm of at most clip_per_sqrt_element * sqrt(D)
        self.clip_per_sqrt_element = clip_per_sqrt_element
        # error-feedback health this step: per group (||local gradient||^2, ||residual||^2)
        # as 0-d tensors (read lazily, so no host sync on the hot path)
        self.measure_health = measure_health
        self.health = []
        # per sparse group: (keys, int32 ages) - steps since each element was last sent
        self.track_staleness = track_staleness
        self.staleness = []

        self.layout = []  # per bucket: tuple of parameter keys, in bucket order
        self.arrival_wall = []  # per bucket: perf_counter() when the hook received it
        self.arrived = {}  # key -> (bucket index, flat gradient view)
        self.sent = set()  # keys already assigned to an issued group
        # Parameters without a .grad at hook time were unused by this rank's forward
        # (find_unused_parameters, or a join()'s shadow step), as are those add_bucket's
        # ``used`` shows unused with a zero gradient. If no rank used them, DDP discards
        # whatever the hook writes for them, so their residual must neither be sent nor
        # reset: it is parked.
        self.parked = set()
        self.stale = set()  # keys sent with a gradient no backward of this step computed
        self.records = []
        self.nonfinite = False
        self.error = None
        self.finished = False
        self.finish_wall = None
        # host seconds spent in top-k selection and in the hook body this step (on CUDA
        # these are launch times: the kernels run asynchronously)
        self.topk_s = 0.0
        self.hook_s = 0.0
        # per sparse group: (elements, assembling + NaN-check seconds, packing + issuing
        # seconds) - the hook's own cost besides top-k (measurements.GroupOverheadMeter)
        self.overhead_samples = []
        # per sparse group: (elements, seconds) of its top-k as training runs it (fused
        # with the gradient + residual pass on the host) - the profile times a bare
        # select on a warm tensor (measurements.TopkTimeMeter)
        self.topk_samples = []
        # per sparse group: (elements, seconds) of the receive side - unpacking, the
        # scatter-add, averaging, writing back - once the collective completed
        self.writeback_samples = []
        # per send window (open_window / close_window, flat exchange on the host):
        # (sparse groups sent in it, seconds of it no timer above covered)
        self.window_samples = []

        self._futures = []  # per bucket
        self._buffers = []
        # per bucket (CUDA): events recorded after each write-back into it (see _complete)
        self._written = []
        # (CUDA) the write-backs' closures - the gathered tensors they read on a callback
        # stream - kept until the exchange is dropped, after DDP has waited for them
        self._retained = []
        self._remaining = []  # per bucket: parameters not written back yet
        self._completed = set()
        self._issued = 0
        self._done = 0
        self._all_issued = False
        self._lock = threading.Lock()
        self._last_comm_done = None
        # flat sparse groups (CPU) whose write-back runs on the autograd thread, in issue
        # order: [future, finish, record, issue time, completion time or None, group]
        self._deferred = collections.deque()
        self.waited_s = 0.0  # seconds write_back_completed waited for collectives

    # -- arrival ------------------------------------------------------------------
    def add_bucket(self, bucket, keys, params, used=None):
        """Register bucket ``bucket`` (DDP GradBucket): its ``params`` have ``keys``.

        ``used``: the keys whose gradient this rank's backward computed since the last
        synchronised step, where that is tracked (``OMGSState.track_local_use``, which
        ``register`` calls): a parameter outside it whose gradient is all zeros - left
        unused under ``find_unused_parameters``, or a joined rank's shadow step - is
        parked too, as one without a ``.grad`` is."""
        index = len(self.layout)
        self.arrival_wall.append(time.perf_counter())
        grads = bucket.gradients()
        buffer = bucket.buffer()
        if buffer.layout != torch.strided or len(grads) != len(keys):
            # sparse gradients (e.g. an embedding with sparse=True): DDP hands them over
            # as a sparse buffer without per-parameter views
            raise RuntimeError(
                f"omgs_hook: bucket {bucket.index()} (parameters {list(keys)[:5]}) holds "
                f"{buffer.layout} gradients; the hook needs dense gradients (construct "
                "embeddings with sparse=False)"
            )
        self.layout.append(tuple(keys))
        for key, grad, param in zip(keys, grads, params):
            self.arrived[key] = (index, grad.view(-1), _offset_in(grad, buffer))
            not_computed = used is not None and key not in used
            if param.grad is None or not param.requires_grad or (
                    not_computed and not bool(grad.any())):
                # unused here: no .grad (zero_grad(set_to_none=True)), or a .grad that
                # zero_grad(set_to_none=False) left at zero. The zero test is the guard:
                # a gradient that holds anything is sent as any other - except that of a
                # parameter frozen since DDP was built, which no backward computes: its
                # .grad is a stale one DDP hands over again every step (and drops the
                # result of); sent, it was added to the residual each step and spent
                self.parked.add(key)
            elif not_computed:
                # not computed since the last synchronised step, yet a .grad that holds
                # something: the gradient an earlier synchronised step of an accumulation
                # wrote back. Sent like any other; where no rank used the parameter, DDP
                # drops the result and the hook undoes its residual update (its
                # "stale" keys, OMGSState._undo_discarded)
                self.stale.add(key)
        future = _bucket_future(buffer.device)
        with self._lock:
            self._futures.append(future)
            self._buffers.append(buffer)
            self._written.append([])
            self._remaining.append(len(keys))
        return future

    def whole_bucket(self, keys):
        """The bucket index when ``keys`` are exactly one bucket, in its order; else None."""
        index = self.arrived[keys[0]][0]
        return index if tuple(keys) == self.layout[index] else None

    # -- sending ------------------------------------------------------------------
    def send_group(self, keys, dense):
        """Assemble the group ``keys`` (all arrived) and issue its collective."""
        keys = tuple(keys)
        self.sent.update(keys)
        numel = sum(self.arrived[key][1].numel() for key in keys)
        if not dense and numel > cost_model.MAX_SPARSE_GROUP_NUMEL:
            if len(keys) == 1:
                raise ValueError(
                    f"parameter {keys[0]!r} has {numel} elements, more than one sparse "
                    f"group can index ({cost_model.MAX_SPARSE_GROUP_NUMEL}: int32 indices)"
                )
            # beyond the int32 index range (a plan made on DDP's first, coarser buckets;
            # planned groups are cut at bucket boundaries already): cut it at parameter
            # boundaries, each piece as large as fits
            numels = [self.arrived[k][1].numel() for k in keys]
            for piece in cost_model.index_range_pieces(numels):
                self.send_group([keys[i] for i in piece], dense=False)
            return
        if numel == 0:
            # zero-element parameters only: nothing to send, on any rank (the layout and
            # the plan are the same everywhere)
            self._keys_done(keys, group_finished=False)
            return
        if self.subgroups is not None:
            if not dense:
                self._send_hierarchical(keys, numel)
            else:
                # the dense path sends ordinary residuals: turn shard residuals into them
                self.memory.migrate_overlapping(keys)
                self._send_hierarchical_dense(keys, numel)
            return
        # a flat step after a two-level one (the trial of a topology="auto" run switches
        # exchanges): shard residuals become the per-parameter residuals this path sends
        self.memory.migrate_overlapping(keys)
        bucket_index = self.whole_bucket(keys) if dense else None
        if bucket_index is not None and self._buffers[bucket_index].element_size() < 4:
            # a bf16/fp16 bucket is summed in fp32 on every rank (never in place): a rank
            # with a residual must send an fp32 sum so that the average is rounded once,
            # and every rank must send the same dtype
            bucket_index = None
        if bucket_index is not None and self.clip_per_sqrt_element is None and all(
                key in self.parked or self.memory.get(key) is None for key in keys):
            self._send_dense_inplace(keys, numel, bucket_index)
        elif dense:
            self._send_dense(keys, numel, bucket_index)
        else:
            self._send_sparse(keys, numel)

    def _segments(self, keys):
        """The group's gradients as maximal runs that are contiguous both in the group's
        order and in one bucket's buffer: ``[(group offset, length, gradient slice)]``.
        One whole bucket is one run, so per-run work is per bucket, not per parameter."""
        runs = []  # [group offset, length, bucket index, offset in its buffer or None, key]
        offset = 0
        for key in keys:
            index, grad, at = self.arrived[key]
            n = grad.numel()
            if n == 0:  # a zero-element parameter: nothing to add, select or write
                continue
            last = runs[-1] if runs else None
            if (last is not None and at is not None and last[3] is not None
                    and last[2] == index and last[3] + last[1] == at):
                last[1] += n
            else:
                runs.append([offset, n, index, at, key])
            offset += n
        segments = [(g_off, n, self.arrived[key][1] if at is None
                     else self._buffers[index][at:at + n])
                    for g_off, n, index, at, key in runs]
        if self.measure_health and not _fp64_range_warned:  # every HEALTH_EVERY steps
            _warn_if_fp64_outside_fp32(segments)
        return segments

    def _sources(self, keys):
        """The group's buffers, each key's residual source (``CURRENT``, None or a
        tensor) and the gradient segments."""
        device = self.arrived[keys[0]][1].device
        numels = [self.arrived[key][1].numel() for key in keys]
        buffers = self.memory.group_buffers(keys, numels, device)
        sources = [None if key in self.parked else self.memory.residual_source(buffers, i, key)
                   for i, key in enumerate(keys)]
        return buffers, sources, self._segments(keys)

    def _fusable(self, buffers, sources):
        """For the steady state - the residual is the group's own ``current`` buffer (or
        zero everywhere), no clipping - the residual tensor (or None) the selector may
        add in its own pass; else False."""
        if self.clip_per_sqrt_element is not None:
            return False
        if all(src is CURRENT for src in sources):
            return buffers.current
        if all(src is None for src in sources):
            return None
        return False

    def _accumulate(self, keys, numel, prepared=None):
        """``spare = gradient + residual`` in the group's persistent buffer (fp32), one op
        per contiguous run where the residual is the group's own (the gradient first
        scaled by the local clipping factor, when clipping is on); returns the buffers
        and the gradient segments."""
        buffers, sources, segments = prepared or self._sources(keys)
        spare, current = buffers.spare, buffers.current
        numels = buffers.numels
        factor, grad_sq = self._clip_factor(segments, numel)

        def put(out, grad, residual):
            if factor is None:
                if residual is None:
                    out.copy_(grad)
                else:
                    torch.add(grad, residual, out=out)
            elif residual is None:
                torch.mul(grad, factor, out=out)
            else:
                torch.addcmul(residual, grad, factor, out=out)

        if all(src is CURRENT for src in sources):
            for g_off, n, grad in segments:
                put(spare[g_off:g_off + n], grad, current[g_off:g_off + n])
        elif all(src is None for src in sources):
            for g_off, n, grad in segments:
                put(spare[g_off:g_off + n], grad, None)
        else:  # mixed (after a plan change, a load, or parked parameters): per parameter
            for i, key in enumerate(keys):
                o, n = buffers.offsets[i], numels[i]
                src = sources[i]
                residual = None if src is None else (current[o:o + n] if src is CURRENT else src)
                put(spare[o:o + n], self.arrived[key][1], residual)
        if self.measure_health:
            self.health.append([sent_gradient_sq(segments, grad_sq, factor), None])
        return buffers, segments

    def _clip_factor(self, segments, numel):
        """(min(1, threshold / ||local gradient||) as a 0-d tensor, ||gradient||^2), or
        (None, None) when clipping is off. NaN/inf gradients give a NaN factor, so the
        non-finite check still sees them."""
        if self.clip_per_sqrt_element is None:
            return None, None
        grad_sq = _sum_of_squares(segments)
        threshold = self.clip_per_sqrt_element * numel ** 0.5
        # in fp64, rounded once to the fp32 the gradient is scaled with
        factor = (threshold / grad_sq.sqrt().clamp_min(1e-30)).clamp(max=1.0).float()
        return factor, grad_sq

    def _send_dense_inplace(self, keys, numel, bucket_index):
        # No residual and exactly one bucket: average the bucket buffer in place, like
        # DDP's default hook (divide first so fp16 sums do not overflow).
        started = time.perf_counter()
        buffer = self._buffers[bucket_index]
        if self.measure_health:  # nothing stays behind: the residual is zero
            self.health.append([_sum_of_squares([(0, buffer.numel(), buffer)]),
                                buffer.new_zeros((), dtype=torch.float32)])
        buffer.div_(self.world_size)
        self._allreduce_bucket(keys, numel, buffer, started)

    def _allreduce_bucket(self, keys, numel, buffer, started):
        """Issue the dense group ``keys``, exactly one bucket, as the all-reduce of that
        bucket's ``buffer`` (each rank's share already in it): the average lands in DDP's
        own buffer, with no write-back."""
        record = GroupRecord(keys, True, numel, numel, numel * buffer.element_size(), started)
        self._issue(lambda: communicator.allreduce_async(buffer, self.process_group),
                    lambda: self._finish_dense(keys, buffer, segments=None), record)

    def _send_dense(self, keys, numel, bucket_index=None):
        started = time.perf_counter()
        with _range("assemble", len(self.records)):
            buffers, segments = self._accumulate(keys, numel)
        acc = buffers.spare
        if self.measure_health:
            self.health[-1][1] = acc.new_zeros(())  # everything is sent
        if self.track_staleness:
            self.memory.group_ages(buffers).zero_()
        # divided before the sum, as the in-place path does: which of the two a rank takes
        # depends on its own residuals (a two-level shard, a parked parameter), and the
        # ranks' contributions must add up to the average either way
        acc.div_(self.world_size)
        if bucket_index is not None:
            # exactly one fp32 or fp64 bucket: another rank may send it in place (it has
            # no residual here), so this rank must send the same tensor - the bucket
            # buffer, in its dtype; an fp32 copy of an fp64 bucket would be a collective
            # of another size, which gloo aborts on and NCCL mis-reduces
            for g_off, n, grad in segments:
                grad.copy_(acc[g_off:g_off + n])
            self._allreduce_bucket(keys, numel, self._buffers[bucket_index], started)
            return
        record = GroupRecord(keys, True, numel, numel, 4 * numel, started)
        self._issue(lambda: communicator.allreduce_async(acc, self.process_group),
                    lambda: self._finish_dense(keys, acc, segments=segments), record)

    def _send_sparse(self, keys, numel):
        group = len(self.records)
        started = time.perf_counter()
        k = selected_k(numel, self.density)  # the planner's own k, bit for bit
        prepared = self._sources(keys)
        buffers, _, segments = prepared
        acc = buffers.spare
        residual = self._fusable(buffers, prepared[1])
        # Every selector ranks NaN above all numbers and inf above every finite value, so
        # a non-finite entry of acc is always among the selected ones: checking the k
        # values is the non-finite check (no pass over acc, no host sync). The flag
        # travels in the payload; every rank then treats the step as non-finite and the
        # staged residual (acc) is discarded, so acc may be modified regardless.
        fused = residual is not False
        # the fused CPU pass zeroes each gradient chunk while it is in cache, so the
        # write-back need not; on a GPU the write-back overwrites the runs anyway
        cleared = fused and acc.device.type == "cpu"
        if not fused:
            with _range("assemble", group):
                self._accumulate(keys, numel, prepared)
            selecting = time.perf_counter()
            with _range("select", group):
                values, indices = self.selector.select(acc, k)
        else:  # the selector adds gradient and residual in its own pass (fused on CPU)
            if self.measure_health:  # before the pass: it zeroes the gradient
                self.health.append([_sum_of_squares(segments), None])
            selecting = started
            with _range("assemble_select", group):
                values, indices = self.selector.accumulate_select(
                    segments, residual, acc, k, clear_runs=cleared,
                    hint_key=(keys[0], keys[-1], numel))
        selected = time.perf_counter()
        with _range("pack", group):
            status = torch.logical_not(torch.isfinite(values)).any()
            payload = communicator.pack_sparse(values, indices, nonfinite=status)
            acc.index_fill_(0, indices, 0.0)  # what was sent leaves the residual
        if self.measure_health:
            self.health[-1][1] = squared_norm(acc)
        if self.track_staleness:
            ages = self.memory.group_ages(buffers)
            ages.add_(1)
            ages.index_fill_(0, indices, 0)
            self.staleness.append((keys, ages))
        record = GroupRecord(keys, False, numel, k, communicator.payload_bytes(k), started)
        gathered = []

        def start():
            future, out = communicator.allgather_async(payload, self.process_group)
            gathered.append(out)
            return future

        self._issue(start,
                    lambda: self._finish_sparse(keys, buffers, segments, gathered[0], k, numel,
                                                cleared),
                    record, defer=acc.device.type == "cpu")
        self.topk_s += selected - selecting
        self.topk_samples.append((numel, selected - selecting))
        # the rest of the group's work on this thread, for the cost model
        self.overhead_samples.append((numel, selecting - started, time.perf_counter() - selected))

    def _register(self, record):
        """Count the group as issued (the step cannot finish before it is done)."""
        self._byte_counts(record)
        with self._lock:
            group = self._issued
            self._issued += 1
            self.records.append(record)
        return group

    def _byte_counts(self, record):
        """The record's inter- and intra-node bytes by the flat algorithm's own count:
        an all-gather delivers this rank's payload to every other rank; an all-reduce is
        counted as a reduce-scatter plus an all-gather, ``2 * bytes * (W - 1) / W``,
        spread evenly over the other ranks. Ranks per node unknown: every other rank
        counts as another node's."""
        if record.inter_bytes or record.intra_bytes:
            return  # counted by its sender (the two-level exchange)
        world = self.world_size
        local = self.topology.ranks_per_node if self.topology is not None else 1
        if record.dense:
            share = 2.0 * record.bytes / world if world > 1 else 0.0
            record.inter_bytes = int(round(share * (world - local)))
            record.intra_bytes = int(round(share * (local - 1)))
        else:
            record.inter_bytes = record.bytes * (world - local)
            record.intra_bytes = record.bytes * (local - 1)

    # -- the two-level exchange (omgs_hook.hierarchical) -------------------------------
    def _send_hierarchical(self, keys, numel):
        from . import hierarchical

        lo, size = hierarchical.shard_bounds(numel, self.topology.ranks_per_node,
                                             self.topology.local_rank)
        k = selected_k(size, self.density)
        record = GroupRecord(keys, False, numel, k * self.topology.ranks_per_node,
                             communicator.payload_bytes(k), time.perf_counter())
        record.inter_bytes, record.intra_bytes = hierarchical.byte_counts(numel, k, self.topology)
        entry = communicator.VALUE_BYTES + communicator.INDEX_BYTES
        record.model_bytes = (k * entry, self.topology.nodes * k * entry)
        group = self._register(record)
        self._start_pipeline(hierarchical.sparse_group(self, keys, numel, record), keys, group)

    def _send_hierarchical_dense(self, keys, numel):
        from . import hierarchical

        _, size = hierarchical.shard_bounds(numel, self.topology.ranks_per_node,
                                            self.topology.local_rank)
        # bytes: the fp32 shard this rank all-reduces between nodes
        record = GroupRecord(keys, True, numel, numel, 4 * size, time.perf_counter())
        record.inter_bytes, record.intra_bytes = hierarchical.dense_byte_counts(
            numel, self.topology)
        record.model_bytes = (4 * size, 4 * size)
        group = self._register(record)
        self._start_pipeline(hierarchical.dense_group(self, keys, numel, record), keys, group)

    def _start_pipeline(self, stages, keys, group):
        """Issue a two-level group's first collective (the intra-node reduce-scatter, in
        send order on every rank) and keep the group in flight."""
        # (the same on every rank: one device type, one backend)
        self.poll_stages = (self.arrived[keys[0]][1].device.type == "cpu"
                            and self.subgroups.intra_gather is not None)
        entry = [stages, None, group, 0]
        self._pipelines.append(entry)
        if self._step_pipeline(entry):
            self._pipelines.remove(entry)

    def _step_pipeline(self, entry):
        """Wait for the entry's pending collective (if any) and run its next stage, which
        issues the group's next collective; returns True when the generator is finished."""
        stages, work, group, _ = entry
        try:
            if work is not None:
                work.wait()
            with _range("hierarchical", group):
                entry[1] = next(stages)
            entry[3] += 1
            return False
        except StopIteration:
            return True
        except BaseException as exc:  # noqa: BLE001 - every two-level group in flight fails
            pending, self._pipelines = self._pipelines, []
            for _ in pending:
                self._fail(exc, group_finished=True)
            raise

    def advance(self, wait_first=False):
        """At a hook call: move the two-level groups in flight on, in send order.

        Stage ``s`` of every group uses one communicator (omgs_hook.hierarchical), so a
        group may issue its next collective only after the group before it has issued
        that many: each communicator then gets its collectives in group order on every
        rank, whichever stages each rank's hook calls happen to run. With
        ``poll_stages`` (CPU) a group moves on only when its collective has completed -
        the hook never waits for the network, except for the first group when
        ``wait_first`` (the drain). (Stage 1 is an all-to-all there, which reports its
        completion; gloo's reduce-scatter does not: ``communicator.start_shard_sum``.)
        Without it every group moves one stage on (CUDA: the wait only orders streams).
        Returns whether any group moved on."""
        moved = False
        kept = []
        ahead = None  # collectives issued by the group before, still in flight
        for index, entry in enumerate(list(self._pipelines)):
            work, issued = entry[1], entry[3]
            allowed = ahead is None or ahead > issued
            ready = (not self.poll_stages or work is None or work.is_completed()
                     or (wait_first and index == 0))
            if allowed and ready:
                moved = True
                if self._step_pipeline(entry):
                    continue  # finished: its last collective is issued
            kept.append(entry)
            ahead = entry[3]
        self._pipelines = kept
        return moved

    def drain(self):
        """At the last bucket: run every two-level group to its last collective (waiting
        for the first group in flight whenever no other one can move on)."""
        while self._pipelines:
            if not self.advance():
                self.advance(wait_first=True)

    def _issue(self, start_collective, finish, record, defer=False):
        """Issue the group's collective (``start_collective() -> future``) and arrange for
        ``finish`` (the write-back) to run when it completes: on the completion thread,
        or with ``defer`` on this (the autograd) thread, in :meth:`write_back_completed`.
        A profiler range ``omgs/collective[gN]`` spans issue to completion."""
        self._issue_registered(start_collective, finish, record, self._register(record),
                               defer=defer)

    def _issue_registered(self, start_collective, finish, record, group=None, defer=False):
        """``_issue`` for a record already counted by ``_register``."""
        if group is None:
            group = self.records.index(record)
        issue_wall = record.issued = time.perf_counter()
        with _range("collective", group) as span:
            future = start_collective()
            if span is not None:  # the range ends when the collective completes
                span._call_end_callbacks_on_future(future)

        if defer:
            entry = [future, finish, record, issue_wall, None, group]

            def completed(fut):  # the worker thread: the time only, no torch work
                entry[4] = time.perf_counter()

            self._deferred.append(entry)
            future.add_done_callback(completed)
            return

        def on_done(fut):
            self._complete(fut, finish, record, issue_wall, group)

        future.add_done_callback(on_done)

    def _complete(self, future, finish, record, issue_wall, group, completed_at=None):
        """The group's collective is complete: write it back and count it done (any
        exception is routed to the futures). ``completed_at``: when the collective
        completed, for a write-back run later than that (deferred); ``record.done`` is
        then that time: the deferred write-back runs on the autograd thread, which the
        cost model prices on the compute stream, so the measured collective times
        (``measurements.comm_sums``) end at the completion."""
        begin = time.perf_counter()
        samples = len(self.writeback_samples)
        try:
            future.value()  # raises if the collective failed
            if (not record.dense and self.on_comm_sample is not None
                    and self.subgroups is None):  # (two-level: three collectives)
                self._comm_sample(record.bytes, issue_wall, completed_at)
            with _range("write_back", group):
                finish()
            # CUDA: the write-back ran on the callback's stream (a CUDA future runs its
            # callbacks on a stream from a pool, not on the compute stream)
            written = _writes_done_event(self._buffers[0].device if self._buffers else None)
            if written is not None:
                self._retained.append(finish)
            record.done = time.perf_counter() if completed_at is None else completed_at
        except BaseException as exc:  # noqa: BLE001 - routed to the futures
            self._fail(exc, group_finished=True)
            if not isinstance(exc, Exception):
                raise  # (KeyboardInterrupt, SystemExit: the script's, not the futures')
            return
        self._keys_done(record.keys, group_finished=True, written=written)
        if completed_at is not None and len(self.writeback_samples) > samples:
            # a deferred write-back: all of it is this thread's time, the bucket futures'
            # callbacks (DDP's) and this bookkeeping included - the compute-stream work
            # the model prices as ``w`` (the finish timed only its own part)
            numel = self.writeback_samples[-1][0]
            self.writeback_samples[-1] = (numel, time.perf_counter() - begin)

    def open_window(self):
        """A mark at the start of a send window, for :meth:`close_window`."""
        return (time.perf_counter(), len(self.records), len(self.overhead_samples),
                len(self.writeback_samples), self.topk_s)

    def close_window(self, mark):
        """Note the send window since ``mark`` (``window_samples``): the sparse groups it
        sent and its seconds beyond the timed work of this thread in it - the groups'
        top-k and ``h`` samples, the deferred write-backs' ``w`` samples
        (:func:`~omgs_hook.measurements.untimed_per_group_s`). A window that sent a
        dense group is left out: a dense send has no timer."""
        now = time.perf_counter()
        opened, records, overheads, writebacks, topk_s = mark
        with self._lock:
            new = self.records[records:]
        if any(record.dense for record in new):
            return
        timed = (self.topk_s - topk_s
                 + sum(e + f for _, e, f in self.overhead_samples[overheads:])
                 + sum(seconds for _, seconds in self.writeback_samples[writebacks:]))
        self.window_samples.append((len(new), max(0.0, now - opened - timed)))

    def write_back_completed(self, wait=False):
        """On the autograd thread: write back the deferred groups, in issue order, whose
        collective has completed - all of them with ``wait`` (at the last bucket: it waits
        for each, as DDP would for the bucket futures). Returns how many it wrote back."""
        count = 0
        deferred = self._deferred
        while deferred:
            entry = deferred[0]
            future, finish, record, issue_wall, _, group = entry
            if not future.done():
                if not wait:
                    break
                waiting = time.perf_counter()
                try:
                    future.wait()  # (releases the interpreter lock)
                except Exception:  # noqa: BLE001 - _complete routes it to the futures
                    pass
                self.waited_s += time.perf_counter() - waiting
            deferred.popleft()
            # the completion time its callback noted (done() can turn True before the
            # callback has run: then now)
            completed_at = entry[4] if entry[4] is not None else time.perf_counter()
            self._complete(future, finish, record, issue_wall, group, completed_at)
            count += 1
        return count

    def _comm_sample(self, nbytes, issue_wall, now=None):
        now = time.perf_counter() if now is None else now
        with self._lock:
            start = issue_wall if self._last_comm_done is None else max(issue_wall, self._last_comm_done)
            self._last_comm_done = now
        if now > start:  # a clock that did not advance gives no information
            self.on_comm_sample(nbytes, now - start)

    # -- completion (a collective callback thread, or the autograd thread) ------------
    def _mark_nonfinite(self):
        if self.raise_on_nonfinite:
            raise FloatingPointError("omgs_hook: a rank's gradient holds NaN/Inf (nonfinite='raise')")
        self.nonfinite = True

    def _finish_dense(self, keys, summed, segments):
        # ``summed``: the sum of every rank's share, each divided by the world size first
        if not bool(torch.isfinite(summed.sum())) and not bool(torch.isfinite(summed).all()):
            self._mark_nonfinite()
        if segments is not None:  # the average, into the bucket buffers
            for g_off, n, grad in segments:
                grad.copy_(summed[g_off:g_off + n])
        for key in keys:
            if key not in self.parked and self.memory.get(key) is not None:
                self.memory.stage(key, None)  # the residual went out with the dense sum

    def _finish_sparse(self, keys, buffers, segments, gathered, k, numel, cleared=False):
        started = time.perf_counter()
        values, indices, nonfinite_any = communicator.unpack_gathered(gathered, self.world_size, k)
        if nonfinite_any:
            # Every rank fills the group with NaN so an AMP GradScaler skips the step;
            # the step's residual updates are discarded at commit time.
            self._mark_nonfinite()
            for _, _, grad in segments:
                grad.fill_(float("nan"))
        else:
            _scatter_average(segments, indices.reshape(-1), values.reshape(-1),
                             1.0 / self.world_size, numel, rows=self.world_size,
                             cleared=cleared)
        self.memory.stage_group(buffers, [key for key in keys if key not in self.parked])
        if not nonfinite_any:
            self.writeback_samples.append((numel, time.perf_counter() - started))

    def _keys_done(self, keys, group_finished, written=None):
        """``keys`` are written back (by an issued group when ``group_finished``); the
        buckets they complete get their futures. ``written``: on CUDA, an event recorded
        after that write-back. A bucket's future is set on the current stream once it
        waits for every write-back into the bucket - groups complete on different
        streams - so that DDP, waiting for the future, waits for all of them."""
        ready = []
        with self._lock:
            touched = set()
            for key in keys:
                index = self.arrived[key][0]
                if written is not None and index not in touched:
                    touched.add(index)
                    self._written[index].append(written)
                self._remaining[index] -= 1
                if self._remaining[index] == 0 and index not in self._completed:
                    self._completed.add(index)
                    ready.append((index, list(self._written[index])))
            if group_finished:
                self._done += 1
            finished = self._maybe_finish_locked()
        if finished:
            self._after_finish()
        for index, events in ready:
            if events:
                _wait_for_events(self._buffers[index].device, events)
            self._futures[index].set_result(self._buffers[index])

    def _fail(self, exc, group_finished):
        if not isinstance(exc, Exception):
            # a Ctrl-C or sys.exit() in a signal handler while the hook ran: a torch future
            # takes an Exception only (set_exception raised AssertionError, which replaced
            # the KeyboardInterrupt the script catches); the caller re-raises the original
            exc = RuntimeError(f"omgs_hook: the backward pass was interrupted "
                               f"({type(exc).__name__})")
        pending = []
        with self._lock:
            if self.error is None:
                self.error = exc
            for index, future in enumerate(self._futures):
                if index not in self._completed:
                    self._completed.add(index)
                    pending.append(future)
            if group_finished:
                self._done += 1
            else:
                self._all_issued = True  # the hook gave up: nothing more will be issued
            finished = self._maybe_finish_locked()
        if finished:
            self._after_finish()
        for future in pending:
            future.set_exception(exc)

    def fail_all(self, exc):
        """Route ``exc`` to every pending bucket future (the hook itself raised, or the
        backward pass was abandoned). Deferred write-backs will not run: they count as
        done, so the step finishes (its staged residuals discarded) once the groups
        completing on other threads are."""
        with self._lock:
            self._done += len(self._deferred)
            self._deferred.clear()
        self._fail(exc, group_finished=False)

    # -- end of step ------------------------------------------------------------------
    def finish_issuing(self):
        """Called after the last bucket's groups were issued, on the autograd thread:
        writes back every deferred group, waiting for their collectives."""
        self.write_back_completed(wait=True)
        with self._lock:
            self._all_issued = True
            finished = self._maybe_finish_locked()
        if finished:
            self._after_finish()

    def _maybe_finish_locked(self):
        if self.finished or not self._all_issued or self._done < self._issued:
            return False
        self.finished = True
        if self.error is None and not self.nonfinite:
            self.memory.commit_staged()
        else:
            self.memory.discard_staged()
        self.finish_wall = time.perf_counter()
        return True

    def _after_finish(self):
        if self.on_finished is not None:
            self.on_finished(self)


def _bucket_future(device):
    """A bucket's future for DDP. On CUDA it names the device, so that ``set_result``
    records an event on the current stream and DDP's ``wait()`` makes its stream wait
    for it (a future without devices records none: DDP would read the bucket while
    the write-back kernels may still run on another stream)."""
    if device.type == "cuda":
        return torch.futures.Future(devices=[device])
    return torch.futures.Future()


def _writes_done_event(device):
    """On CUDA, an event recorded on the current stream (after a write-back); else None."""
    if device is None or device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def _wait_for_events(device, events):
    """Make the current stream of ``device`` wait for ``events`` (no host wait)."""
    stream = torch.cuda.current_stream(device)
    for event in events:
        stream.wait_event(event)


def _range(stage, group):
    """A ``torch.profiler`` range ``omgs/<stage>[g<group>]`` (group = send order in the
    step); a no-op context when no profiler is running, so the hot path pays nothing."""
    if not torch.autograd._profiler_enabled():
        return contextlib.nullcontext()
    return torch.profiler.record_function(f"omgs/{stage}[g{group}]")


def sent_gradient_sq(segments, grad_sq=None, factor=None):
    """The health figure's ``||local gradient||^2`` of a group: of the gradient as it
    enters the exchange, so after ``local_clip_norm``'s ``factor`` where it clips (every
    exchange path measures the same thing). ``grad_sq``: the unclipped figure where the
    clipping already computed it. In fp64 (the factor squared in fp32 goes subnormal
    below 1e-19)."""
    if grad_sq is None:
        grad_sq = _sum_of_squares(segments)
    if factor is not None:
        grad_sq = grad_sq * factor.double().square()
    return grad_sq


def _sum_of_squares(segments):
    """Sum of squares of the gradient runs, in fp64, as a 0-d tensor (no host sync on
    CUDA). Each run's is :func:`~omgs_hook.residual_memory.squared_norm` (summed in
    fp64): one fp32 ``vector_norm`` over a run of 12M elements was off by 1e-3. Kept in
    fp64: a squared norm above 3.4e38 (a norm above 1.8e19) is inf in fp32."""
    return torch.stack([squared_norm(grad) for _, _, grad in segments]).sum()


def _offset_in(grad, buffer):
    """Element offset of ``grad`` inside the flat bucket ``buffer``, or None when it is not
    a plain contiguous slice of it (then the gradient is handled on its own)."""
    if (grad.dtype != buffer.dtype or not grad.is_contiguous()
            or grad.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr()):
        return None
    delta = grad.data_ptr() - buffer.data_ptr()
    size = grad.element_size()
    if delta < 0 or delta % size:
        return None
    at = delta // size
    return at if at + grad.numel() <= buffer.numel() else None


def _scatter_average(segments, indices, values, scale, numel, rows=1, per_payload=None,
                     cleared=False):
    """Write ``scale * (sum of every rank's sparse entries)`` into the group's gradients.

    ``indices``/``values``: ``rows`` payloads of equal length, one after the other (the
    ranks in order); each payload's indices are ascending, as every selector returns them.

    fp32 gradients in one run: zero the run, then ``index_add_`` the pre-scaled entries
    straight into the bucket buffer (O(k) besides the zeroing). Several runs (a group of
    several buckets) on the CPU: the entries are put in run order once
    (:func:`_run_major_order`, O(rows * k)), then each run zeroes its own slice and
    ``index_add_``-s into it - O(k) in all, where masking every entry for every run was
    O(k * runs) (12M elements in 40 runs: 18 ms against ~1 ms). Each element still
    receives its entries in payload order, so the sums are the same, bit for bit. Payloads
    not ascending: each run takes the entries that fall into it, masked. Other gradient
    dtypes: the sum is formed in an fp32 temporary, then cast once (summing world_size
    contributions in fp16/bf16 would round at every add).

    On a GPU (``per_payload``, default: the tensors are not on the CPU) see
    :func:`_scatter_average_per_payload`. ``cleared``: the fp32 runs are zero already (the
    fused pass zeroed them as it read them), so they are not zeroed again.
    """
    if per_payload is None:
        per_payload = indices.device.type != "cpu"
    if per_payload and rows >= 1 and indices.numel() % rows == 0:
        _scatter_average_per_payload(segments, indices, values, scale, numel, rows, cleared)
        return
    if all(grad.dtype == torch.float32 for _, _, grad in segments):
        if len(segments) == 1:
            grad = segments[0][2]
            if not cleared:
                grad.zero_()
            grad.index_add_(0, indices, values, alpha=scale)
            return
        ordered = _run_major_order(segments, indices, values, rows)
        if ordered is not None:
            run_indices, run_values, bounds = ordered
            for (g_off, _, grad), lo, hi in zip(segments, bounds, bounds[1:]):
                if not cleared:
                    grad.zero_()
                if hi > lo:
                    grad.index_add_(0, run_indices[lo:hi] - g_off, run_values[lo:hi], alpha=scale)
            return
        for g_off, n, grad in segments:
            inside = (indices >= g_off) & (indices < g_off + n)
            local = (indices - g_off).clamp_(0, n - 1)
            if not cleared:
                grad.zero_()
            grad.index_add_(0, local, torch.where(inside, values, values.new_zeros(())),
                            alpha=scale)
        return
    result = torch.zeros(numel, dtype=torch.float32, device=values.device)
    result.index_add_(0, indices, values, alpha=scale)
    for g_off, n, grad in segments:
        grad.copy_(result[g_off:g_off + n])


def _scatter_average_per_payload(segments, indices, values, scale, numel, rows,
                                 cleared=False):
    """The GPU write-back: one ``index_add_`` per payload into one group-sized fp32 sum
    (or straight into a single fp32 run), then one fused copy into every run.

    * Deterministic, and the same on every rank: a CUDA ``index_add_`` adds with atomics,
      so entries of several ranks meeting at one index would be summed in whatever order
      the atomics land - and the ranks' averaged gradients could differ in their last
      bits. Within one payload the indices are distinct (top-k), so no two atomic adds
      meet, and every element receives its entries in payload order: bit for bit the sum
      of the CPU path.
    * A fixed number of kernel launches per group, whatever its number of runs
      (parameters, with ``bucket_cap_mb=0``): a zero fill, ``rows`` ``index_add_``, one
      ``_foreach_copy_``.
    """
    per = indices.numel() // rows
    single = len(segments) == 1 and segments[0][2].dtype == torch.float32
    target = (segments[0][2] if single
              else torch.empty(numel, dtype=torch.float32, device=values.device))
    if not (single and cleared):
        target.zero_()
    for r in range(rows):
        target.index_add_(0, indices[r * per:(r + 1) * per], values[r * per:(r + 1) * per],
                          alpha=scale)
    if single:
        return
    grads = [grad for _, _, grad in segments]
    sums = [target[g_off:g_off + n] for g_off, n, _ in segments]
    if all(grad.dtype == torch.float32 for grad in grads):
        torch._foreach_copy_(grads, sums)
    else:
        for grad, part in zip(grads, sums):
            grad.copy_(part)


def _run_major_order(segments, indices, values, rows):
    """The entries grouped by run (in the segments' order) and, within a run, in their
    original order: ``(indices, values, bounds)`` with run ``i``'s entries at
    ``bounds[i]:bounds[i + 1]``. Because each of the ``rows`` payloads is ascending, a
    run's entries in one payload are one slice of it (found for every run and payload by
    one ``searchsorted``), and the permutation is built from the slices without sorting.
    None on CUDA (the bounds would need a host read) or when a payload is not ascending."""
    total = indices.numel()
    if indices.device.type != "cpu" or rows < 1 or total % rows:
        return None
    grid = indices.view(rows, total // rows)
    if grid.shape[1] > 1 and not bool((grid[:, 1:] >= grid[:, :-1]).all()):
        return None
    edges = torch.tensor([edge for g_off, n, _ in segments for edge in (g_off, g_off + n)],
                         dtype=indices.dtype)
    cuts = torch.searchsorted(grid, edges.expand(rows, -1).contiguous())  # rows x 2R
    lengths = (cuts[:, 1::2] - cuts[:, 0::2]).t().reshape(-1)  # run-major, then payload
    starts = (cuts[:, 0::2] + torch.arange(rows).unsqueeze(1) * grid.shape[1]).t().reshape(-1)
    counts = lengths.view(len(segments), rows).sum(dim=1)
    kept = int(counts.sum())
    shift = torch.repeat_interleave(starts - (torch.cumsum(lengths, 0) - lengths), lengths,
                                    output_size=kept)
    order = shift + torch.arange(kept)
    bounds = [0] + torch.cumsum(counts, 0).tolist()
    return indices[order], values[order], bounds
