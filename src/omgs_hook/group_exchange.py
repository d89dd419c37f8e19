"""One step's exchange: assembling groups from arrived buckets, sending them, and
completing DDP's per-bucket futures when every group covering a bucket is written back.

Threading model (measured on gloo, see docs/design.md):
* ``add_bucket`` / ``send_group`` / ``finish_issuing`` run on the autograd thread, in
  the hook, identically ordered on every rank - the only place collectives are issued.
* ``_on_group_done`` runs on a process-group worker thread (or inline, when the
  collective already finished). It does local work only: unpack, average, write back,
  stage residuals, complete futures. It never issues a collective and never waits.

Any exception - in a collective or in the local work - is routed to every bucket
future still pending, so ``backward()`` raises instead of hanging.
"""

import threading
import time

import torch

from . import communicator
from .cost_model import selected_k


class GroupRecord:
    """What was sent for one group (for stats and for tests' reference checks)."""

    __slots__ = ("keys", "dense", "numel", "selected", "bytes")

    def __init__(self, keys, dense, numel, selected, nbytes):
        self.keys = keys
        self.dense = dense
        self.numel = numel
        self.selected = selected
        self.bytes = nbytes


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
                 on_finished=None, on_comm_sample=None, raise_on_nonfinite=False):
        self.memory = memory
        self.selector = selector
        self.process_group = process_group
        self.world_size = world_size
        self.density = density
        self.on_finished = on_finished
        self.on_comm_sample = on_comm_sample
        self.raise_on_nonfinite = raise_on_nonfinite

        self.layout = []  # per bucket: tuple of parameter keys, in bucket order
        self.arrived = {}  # key -> (bucket index, flat gradient view)
        self.sent = set()  # keys already assigned to an issued group
        # Parameters without a .grad at hook time were unused by this rank's forward
        # (find_unused_parameters). If no rank used them, DDP discards whatever the hook
        # writes for them, so their residual must neither be sent nor reset: it is parked.
        self.parked = set()
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
        # per sparse group: (elements, seconds) of the receive side - unpacking, the
        # scatter-add, averaging, writing back - on the collective's completion thread
        self.writeback_samples = []

        self._futures = []  # per bucket
        self._buffers = []
        self._remaining = []  # per bucket: parameters not written back yet
        self._completed = set()
        self._issued = 0
        self._done = 0
        self._all_issued = False
        self._lock = threading.Lock()
        self._last_comm_done = None

    # -- arrival ------------------------------------------------------------------
    def add_bucket(self, bucket, keys, params):
        """Register bucket ``bucket`` (DDP GradBucket): its ``params`` have ``keys``."""
        index = len(self.layout)
        grads = bucket.gradients()
        self.layout.append(tuple(keys))
        for key, grad, param in zip(keys, grads, params):
            self.arrived[key] = (index, grad.view(-1))
            if param.grad is None:
                self.parked.add(key)
        future = torch.futures.Future()
        with self._lock:
            self._futures.append(future)
            self._buffers.append(bucket.buffer())
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
        residuals = [None if key in self.parked else self.memory.get(key) for key in keys]
        numel = sum(self.arrived[key][1].numel() for key in keys)
        bucket_index = self.whole_bucket(keys) if dense else None
        if bucket_index is not None and all(r is None for r in residuals):
            self._send_dense_inplace(keys, numel, bucket_index)
        elif dense:
            self._send_dense(keys, residuals, numel)
        else:
            self._send_sparse(keys, residuals, numel)

    def _assemble(self, keys, residuals, numel):
        """acc = concatenated gradients + residuals, fp32, in the group's key order."""
        device = self.arrived[keys[0]][1].device
        acc = torch.empty(numel, dtype=torch.float32, device=device)
        offset = 0
        for key, residual in zip(keys, residuals):
            grad = self.arrived[key][1]
            n = grad.numel()
            if residual is None:
                acc[offset:offset + n].copy_(grad)
            else:
                torch.add(grad, residual, out=acc[offset:offset + n])
            offset += n
        return acc

    def _send_dense_inplace(self, keys, numel, bucket_index):
        # No residual and exactly one bucket: average the bucket buffer in place, like
        # DDP's default hook (divide first so fp16 sums do not overflow).
        buffer = self._buffers[bucket_index]
        buffer.div_(self.world_size)
        record = GroupRecord(keys, True, numel, numel, numel * buffer.element_size())
        self._issue(communicator.allreduce_async(buffer, self.process_group),
                    lambda: self._finish_dense(keys, buffer, record, scale=None), record)

    def _send_dense(self, keys, residuals, numel):
        acc = self._assemble(keys, residuals, numel)
        record = GroupRecord(keys, True, numel, numel, 4 * numel)
        self._issue(communicator.allreduce_async(acc, self.process_group),
                    lambda: self._finish_dense(keys, acc, record, scale=1.0 / self.world_size),
                    record)

    def _send_sparse(self, keys, residuals, numel):
        if numel > communicator.MAX_INDEX:
            raise ValueError(
                f"a group of {numel} elements exceeds the int32 index range; use a plan "
                "with smaller groups (e.g. strategy='threshold:...')"
            )
        started = time.perf_counter()
        acc = self._assemble(keys, residuals, numel)
        k = selected_k(numel, self.density)  # the planner's own k, bit for bit
        # A non-finite input must not reach the residual nor the selector: flag it and
        # send a harmless payload; every rank then treats the step as non-finite.
        nonfinite = not bool(torch.isfinite(acc.sum()))
        if nonfinite and bool(torch.isfinite(acc).all()):
            nonfinite = False  # the sum overflowed, the entries are finite
        selecting = time.perf_counter()
        if nonfinite:
            values = torch.zeros(k, dtype=torch.float32, device=acc.device)
            indices = torch.arange(k, device=acc.device)
        else:
            values, indices = self.selector.select(acc, k)
        selected = time.perf_counter()
        payload = communicator.pack_sparse(values, indices, nonfinite=nonfinite)
        if not nonfinite:
            acc[indices] = 0.0  # what was sent leaves the residual; acc is now the residual
        record = GroupRecord(keys, False, numel, k, communicator.payload_bytes(k))
        future, gathered = communicator.allgather_async(payload, self.process_group)
        self._issue((future, gathered),
                    lambda: self._finish_sparse(keys, acc, gathered, k, numel, record), record)
        if not nonfinite:
            self.topk_s += selected - selecting
            # the rest of the group's work on this thread, for the cost model
            self.overhead_samples.append(
                (numel, selecting - started, time.perf_counter() - selected))

    def _issue(self, future_or_pair, finish, record):
        future = future_or_pair[0] if isinstance(future_or_pair, tuple) else future_or_pair
        with self._lock:
            self._issued += 1
            self.records.append(record)
        issue_wall = time.perf_counter()

        def on_done(fut):
            try:
                fut.value()  # raises if the collective failed
                if not record.dense and self.on_comm_sample is not None:
                    self._comm_sample(record.bytes, issue_wall)
                finish()
            except BaseException as exc:  # noqa: BLE001 - routed to the futures
                self._fail(exc, group_finished=True)
                return
            self._group_done(record.keys)

        future.add_done_callback(on_done)

    def _comm_sample(self, nbytes, issue_wall):
        now = time.perf_counter()
        with self._lock:
            start = issue_wall if self._last_comm_done is None else max(issue_wall, self._last_comm_done)
            self._last_comm_done = now
        if now > start:  # a clock that did not advance gives no information
            self.on_comm_sample(nbytes, now - start)

    # -- completion (collective callback threads) -----------------------------------
    def _write_back(self, keys, result):
        offset = 0
        for key in keys:
            grad = self.arrived[key][1]
            n = grad.numel()
            grad.copy_(result[offset:offset + n])
            offset += n

    def _mark_nonfinite(self):
        if self.raise_on_nonfinite:
            raise FloatingPointError("omgs_hook: a rank's gradient holds NaN/Inf (nonfinite='raise')")
        self.nonfinite = True

    def _finish_dense(self, keys, summed, record, scale):
        if not bool(torch.isfinite(summed.sum())) and not bool(torch.isfinite(summed).all()):
            self._mark_nonfinite()
        if scale is not None:
            summed.mul_(scale)
            self._write_back(keys, summed)
        for key in keys:
            if key not in self.parked and self.memory.get(key) is not None:
                self.memory.stage(key, None)  # the residual went out with the dense sum

    def _finish_sparse(self, keys, acc, gathered, k, numel, record):
        started = time.perf_counter()
        values, indices, nonfinite_any = communicator.unpack_gathered(gathered, self.world_size, k)
        if nonfinite_any:
            # Every rank fills the group with NaN so an AMP GradScaler skips the step;
            # the step's residual updates are discarded at commit time.
            self._mark_nonfinite()
            result = torch.full((numel,), float("nan"), dtype=torch.float32, device=acc.device)
        else:
            result = torch.zeros(numel, dtype=torch.float32, device=acc.device)
            result.index_add_(0, indices.reshape(-1), values.reshape(-1))
            result.div_(self.world_size)
        self._write_back(keys, result)
        offset = 0
        for key in keys:
            n = self.arrived[key][1].numel()
            if key not in self.parked:
                self.memory.stage(key, acc[offset:offset + n])
            offset += n
        if not nonfinite_any:
            self.writeback_samples.append((numel, time.perf_counter() - started))

    def _group_done(self, keys):
        ready = []
        with self._lock:
            for key in keys:
                index = self.arrived[key][0]
                self._remaining[index] -= 1
                if self._remaining[index] == 0 and index not in self._completed:
                    self._completed.add(index)
                    ready.append(index)
            self._done += 1
            finished = self._maybe_finish_locked()
        if finished:
            self._after_finish()
        for index in ready:
            self._futures[index].set_result(self._buffers[index])

    def _fail(self, exc, group_finished):
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
        """Route ``exc`` to every pending bucket future (the hook itself raised)."""
        self._fail(exc, group_finished=False)

    # -- end of step ------------------------------------------------------------------
    def finish_issuing(self):
        """Called after the last bucket's groups were issued."""
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
