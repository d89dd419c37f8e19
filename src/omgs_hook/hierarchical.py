"""The two-level (hierarchical) exchange of one sparse group (``topology="hierarchical"``).

With N nodes of L ranks (rank ``r`` = local rank ``r % L`` of node ``r // L``), a sparse
group of D elements is split into L contiguous shards of ``S = ceil(D / L)`` elements
(the last one padded with zeros to S: gloo's reduce-scatter and all-gather need equal
sizes). Local rank ``l`` owns shard ``l`` and keeps that shard's residual only. Per step:

1. **intra-node reduce-scatter** of the local gradients (dense fp32, over the node's L
   ranks): local rank l gets the node's sum of shard l;
2. the owner adds the shard's residual and selects the ``k = max(1, ceil(density * S))``
   entries of largest magnitude (the same density as a flat group: the node sends
   ``L * k ~ density * D`` entries);
3. **inter-node packed all-gather** of ``(values, indices, status)`` among the N ranks
   with the same local rank, one per node (the only traffic that crosses nodes);
   the shard's new residual is the accumulator minus what was sent;
4. **intra-node all-gather** of those N payloads (still sparse), so every rank holds all
   ``L * N`` payloads; then every rank scatter-adds them (shard offsets added),
   divides by the world size and writes the result back into DDP's bucket buffers.

The residual is added *after* the reduce-scatter, by the shard's owner: that is what
makes the per-rank error-feedback memory S instead of D, and it releases residual at the
node level (the top-k of the node's summed accumulator). Residuals that are not in this
group's shard store (a checkpoint, a plan change that moved shard boundaries) are added
*before* the reduce-scatter by whichever rank holds them - the sums are the same, so no
residual is lost or counted twice; only the rounding order differs from the fast path.
The other direction (a flat step after a two-level one: the measured selection of a
``topology="auto"`` run compares both exchanges) migrates the shard stores of the flat
group's parameters into per-parameter residuals first (zeros outside the shard), which
the flat sparse and dense paths then send: summed over ranks, the same mass.

Stages 1-3 each need the previous collective's result, and collectives may only be
issued from the hook's own thread (a collective inside a future callback deadlocks gloo).
The exchange is therefore a generator: it issues a collective and yields its work
handle; :class:`~omgs_hook.group_exchange.StepExchange` resumes the generator at a later
hook call (a later bucket's arrival) or, at the last bucket, in a drain loop. On the CPU
(gloo) a hook call resumes a group waiting for its inter-node collective only once that
has completed, and never waits for it: backward goes on while the all-gather crosses the
slow link (waiting for it at the next bucket, as the exchange first did, put the whole
inter-node transfer on backward's critical path: 160-180 ms of a 380 ms step at
5 Mbit/s). Stage 1 on the CPU is an all-to-all of the shards and a local sum
(``communicator.start_shard_sum``): gloo's reduce-scatter never reports completion, and
is slower. Which stages run at which hook call then depends on timing and differs
between ranks, so each stage has a communicator of its own - stage 1 the intra-node
group, stage 2 the inter-node group, stage 3 a second intra-node group
(``Subgroups.intra_gather``) - and a group issues its stage only after the group sent
before it has issued the same stage: every communicator sees its collectives in group
order on every rank. On CUDA the wait only orders the streams, so a hook call moves
every group one stage on, as before (stage 3 on the first intra-node group). Only the
last stage's completion runs in a future callback (local work: unpack, scatter-add,
write back, stage the residual).

Dense groups (warm-up, ``density=1``, the plan's dense groups) take the two-level dense
path (:func:`dense_group`), driven the same way: an intra-node reduce-scatter of the
group's fp32 gradient plus its residual (shards as above), an inter-node all-reduce of
the rank's shard among the N ranks with its local rank, division by the world size, and
an intra-node all-gather of the reduced shards, written back into DDP's bucket buffers.
It keeps the flat dense path's guarantees: shard stores of its parameters are first
migrated into ordinary residuals, which it sends (except those of parameters this rank
did not use, which stay), and it leaves no residual; a non-finite sum marks the step
non-finite (every rank holds the same sums); a single fp32 bucket of exactly ``L * S``
elements without residual or clipping is reduced where it lies, anything else (other
layouts, bf16/fp16 gradients) in an fp32 buffer, cast once on the write-back.

Byte counts, per rank and group (the algorithm's own count, ``stats()["last"]``):
sparse ``inter_node_bytes = (N - 1) * payload(k)``; ``intra_node_bytes = (L - 1) * 4 * S``
(reduce-scatter) ``+ (L - 1) * N * payload(k)`` (all-gather), ``payload(k) = 4 * (2k + 1)``;
dense ``inter_node_bytes = 2 * 4 S * (N - 1) / N`` (the all-reduce, counted as a
reduce-scatter plus an all-gather) and ``intra_node_bytes = 2 * (L - 1) * 4 * S``.
"""

import time

import torch
import torch.distributed as dist

from . import communicator
from .cost_model import selected_k
from .group_exchange import _scatter_average, _sum_of_squares, sent_gradient_sq
from .residual_memory import squared_norm


def shard_bounds(numel, ranks_per_node, local_rank):
    """``(lo, size)``: local rank ``local_rank``'s shard of a group of ``numel`` elements
    (``size = ceil(numel / L)`` for every shard; the last may run past ``numel``)."""
    size = -(-numel // ranks_per_node)
    return local_rank * size, size


def byte_counts(numel, k, topo):
    """``(inter_node_bytes, intra_node_bytes)`` one rank sends for a two-level sparse group."""
    L, N = topo.ranks_per_node, topo.nodes
    _, size = shard_bounds(numel, L, topo.local_rank)
    payload = communicator.payload_bytes(k)
    return (N - 1) * payload, (L - 1) * 4 * size + (L - 1) * N * payload


def dense_byte_counts(numel, topo):
    """``(inter_node_bytes, intra_node_bytes)`` one rank sends for a two-level dense group:
    the inter-node all-reduce of its fp32 shard counted as a reduce-scatter plus an
    all-gather, ``2 * 4 S (N - 1) / N``; the intra-node reduce-scatter and all-gather,
    ``(L - 1) * 4 S`` each."""
    L, N = topo.ranks_per_node, topo.nodes
    _, size = shard_bounds(numel, L, topo.local_rank)
    inter = int(round(2.0 * 4 * size * (N - 1) / N))
    return inter, 2 * (L - 1) * 4 * size


def dense_group(ex, keys, numel, record):
    """The two-level dense exchange of group ``keys`` (module docstring), a generator
    driven like :func:`sparse_group`. The caller has migrated the shard stores of
    ``keys`` into per-parameter residuals. Residual handling is the flat dense path's
    (``StepExchange._send_dense`` / ``_finish_dense``): gradient (clipped, when clipping
    is on) plus the residual of every parameter this rank used goes out, those residuals
    are staged to zero, a parked parameter's residual stays as it is."""
    topo, groups = ex.topology, ex.subgroups
    L = topo.ranks_per_node
    _, size = shard_bounds(numel, L, topo.local_rank)
    memory = ex.memory
    device = ex.arrived[keys[0]][1].device
    scratch = memory.dense_shard_buffers(keys, L * size, size, device)
    shard = scratch.shard
    sent = [key for key in keys if key not in ex.parked and memory.get(key) is not None]
    bucket_index = ex.whole_bucket(keys)
    buffer = ex._buffers[bucket_index] if bucket_index is not None else None
    if (buffer is not None and not sent and ex.clip_per_sqrt_element is None
            and buffer.dtype == torch.float32 and buffer.is_contiguous()
            and buffer.numel() == L * size):
        # one fp32 bucket, nothing to add, no padding: reduce it where it lies (it is
        # overwritten by the last all-gather, after the reduce-scatter has read it)
        segments = None
        source = buffer
        if ex.measure_health:  # nothing stays behind: the residual is zero
            ex.health.append([_sum_of_squares([(0, buffer.numel(), buffer)]),
                              buffer.new_zeros((), dtype=torch.float32)])
    else:
        segments = ex._segments(keys)
        factor, grad_sq = ex._clip_factor(segments, numel)
        source = _stage(scratch.staging_buffer(), segments, factor)  # padding stays zero
        offset, offsets = 0, {}
        for key in keys:
            offsets[key] = offset
            offset += ex.arrived[key][1].numel()
        for key in sent:
            o = offsets[key]
            source[o:o + ex.arrived[key][1].numel()] += memory.get(key)
        if ex.measure_health:
            ex.health.append([sent_gradient_sq(segments, grad_sq, factor),
                              source.new_zeros(())])  # everything is sent
    work, complete = communicator.start_shard_sum(shard, source, groups.intra,
                                                  scratch.receive_buffer())
    yield work

    # -- stage 2: the all-reduce of the node sums of this shard between nodes
    if complete is not None:
        complete()
    inter_issued = time.perf_counter()
    work = dist.all_reduce(shard, group=groups.inter, async_op=True)
    _time_inter(ex, work, record, inter_issued)
    yield work

    # -- stage 3: the average, the intra-node all-gather; the write-back in its callback
    _inter_waited(ex, record)
    shard.div_(ex.world_size)

    def start():
        work = communicator.all_gather_flat(source, shard, group=_last_stage_group(ex),
                                            async_op=True)
        return work.get_future()

    def finish():
        _finish_dense(ex, keys, source, segments, sent)

    ex._issue_registered(start, finish, record)


def _finish_dense(ex, keys, averaged, segments, sent):
    """The flat dense path's completion on the gathered average (``L * S`` elements, the
    padding zero): the non-finite check, the write-back (a cast when the gradient is not
    fp32; nothing to do when the bucket was reduced in place), the residuals that went
    out staged to zero."""
    if not bool(torch.isfinite(averaged.sum())) and not bool(torch.isfinite(averaged).all()):
        ex._mark_nonfinite()
    if segments is not None:
        for g_off, n, grad in segments:
            grad.copy_(averaged[g_off:g_off + n])
    for key in sent:
        ex.memory.stage(key, None)  # the residual went out with the dense sum


def sparse_group(ex, keys, numel, record):
    """The two-level exchange of sparse group ``keys`` (see the module docstring); a
    generator driven by ``ex`` (a StepExchange): yields the work handle of each of the
    first two collectives, then issues the last one through ``ex._issue_registered``."""
    topo, groups = ex.topology, ex.subgroups
    L, N = topo.ranks_per_node, topo.nodes
    started = record.started
    lo, size = shard_bounds(numel, L, topo.local_rank)
    k = selected_k(size, ex.density)
    memory = ex.memory
    device = ex.arrived[keys[0]][1].device
    numels = [ex.arrived[key][1].numel() for key in keys]
    store = memory.shard_store(keys, numels, lo, size, L * size, device)
    # per-parameter residuals (a checkpoint, a migrated store): into the store when they
    # lie in this rank's shard, else added before the reduce-scatter (and dropped on commit)
    active = [key for key in keys if key not in ex.parked]
    foreign = [key for key in active if memory.get(key) is not None]
    if foreign:
        foreign = memory.adopt_into_shard(store, foreign)
    segments = ex._segments(keys)
    factor, grad_sq = ex._clip_factor(segments, numel)
    if ex.measure_health:
        # (after clipping, as the flat exchange measures it)
        ex.health.append([sent_gradient_sq(segments, grad_sq, factor), None])
    if (factor is None and not foreign and len(segments) == 1 and numel == L * size
            and segments[0][2].dtype == torch.float32 and segments[0][2].is_contiguous()):
        # one fp32 run of the bucket buffer, no padding: reduce-scatter it where it lies
        # (it is read before the write-back, which waits for the last collective)
        source = segments[0][2]
    else:
        source = _stage(store.staging_buffer(), segments, factor)
        offsets = {key: o for key, o in zip(store.keys, store.offsets)}
        for key in foreign:
            o = offsets[key]
            source[o:o + ex.arrived[key][1].numel()] += memory.get(key)
    shard_sum = store.shard_sum
    work, complete = communicator.start_shard_sum(shard_sum, source, groups.intra,
                                                  store.receive_buffer())
    assembled = time.perf_counter()
    yield work

    # -- stage 2: the owner's accumulator, top-k, the inter-node all-gather
    resumed = time.perf_counter()
    if complete is not None:
        complete()
    current, acc = store.current, store.spare
    parked = [(s_start, n) for key, _, s_start, n in store.key_ranges() if key in ex.parked]
    torch.add(shard_sum, current, out=acc)
    for s_start, n in parked:  # a parameter this rank did not use: its residual stays out
        acc[s_start:s_start + n].copy_(shard_sum[s_start:s_start + n])
    selecting = time.perf_counter()
    values, indices = ex.selector.select(acc, k)
    selected = time.perf_counter()
    status = torch.logical_not(torch.isfinite(values)).any()
    payload = communicator.pack_sparse(values, indices, nonfinite=status)
    acc.index_fill_(0, indices, 0.0)  # what was sent leaves the residual
    for s_start, n in parked:  # ... and the parked residual is kept on top of what is left
        acc[s_start:s_start + n] += current[s_start:s_start + n]
    if ex.measure_health:
        ex.health[-1][1] = squared_norm(acc)
    gathered = payload.new_empty(N * payload.numel())
    inter_issued = time.perf_counter()
    work = communicator.all_gather_flat(gathered, payload, group=groups.inter, async_op=True)
    _time_inter(ex, work, record, inter_issued)
    ex.topk_s += selected - selecting
    ex.topk_samples.append((acc.numel(), selected - selecting))  # the shard's top-k
    ex.overhead_samples.append((numel, (assembled - started) + (selecting - resumed),
                                time.perf_counter() - selected))
    yield work

    # -- stage 3: the intra-node all-gather of the N payloads; the write-back in its callback
    _inter_waited(ex, record)
    everything = []

    def start():
        out = gathered.new_empty(L * gathered.numel())
        everything.append(out)
        work = communicator.all_gather_flat(out, gathered, group=_last_stage_group(ex),
                                            async_op=True)
        return work.get_future()

    def finish():
        _finish(ex, keys, store, segments, everything[0], k, numel, size, foreign)

    ex._issue_registered(start, finish, record)


def _finish(ex, keys, store, segments, gathered, k, numel, size, foreign):
    """Unpack the ``L * N`` payloads (local-rank major, node minor), scatter-add them at
    their shard's offset, average over the world size, write back, stage the residual."""
    started = time.perf_counter()
    topo = ex.topology
    rows = topo.ranks_per_node * topo.nodes
    values, indices, nonfinite_any = communicator.unpack_gathered(gathered, rows, k)
    if nonfinite_any:
        ex._mark_nonfinite()
        for _, _, grad in segments:
            grad.fill_(float("nan"))
    else:
        # row j came from local rank j // N: its indices are relative to that shard
        shard = torch.arange(rows, device=indices.device).div_(topo.nodes, rounding_mode="floor")
        indices = indices + (shard * size).unsqueeze(1)
        # padding entries (past the group's end) carry value 0: clamp them onto a real one
        indices = indices.clamp_(max=numel - 1).reshape(-1)
        _scatter_average(segments, indices, values.reshape(-1), 1.0 / ex.world_size, numel,
                         rows=rows)
    ex.memory.stage_shard(store)
    for key in foreign:
        ex.memory.stage(key, None)  # added before the reduce-scatter: now in the shard sums
    if not nonfinite_any:
        ex.writeback_samples.append((numel, time.perf_counter() - started))


def _last_stage_group(ex):
    """The communicator of stage 3: a group's own when stages run as their collectives
    complete (``ex.poll_stages``, module docstring), else the intra-node group."""
    # (poll_stages is only set where the subgroups have intra_gather)
    return ex.subgroups.intra_gather if ex.poll_stages else ex.subgroups.intra


def _time_inter(ex, work, record, issued):
    """With ``ex.time_stages``: note when the group's inter-node collective was issued
    and, from its future's callback, when it completed (``measured_comm``)."""
    if not ex.time_stages:
        return
    record.inter_issued = issued

    def completed(_):
        if record.inter_done is None:
            record.inter_done = time.perf_counter()

    work.get_future().add_done_callback(completed)


def _inter_waited(ex, record):
    """The inter-node collective was waited for: if its callback has not noted its
    completion yet, now is when it is known to be complete."""
    if ex.time_stages and record.inter_done is None:
        record.inter_done = time.perf_counter()


def _stage(buffer, segments, factor):
    """Copy the group's gradient runs (scaled by the clip ``factor`` when set) into
    ``buffer`` at their group offsets; returns ``buffer``."""
    for g_off, n, grad in segments:
        out = buffer[g_off:g_off + n]
        if factor is None:
            out.copy_(grad)
        else:
            torch.mul(grad, factor, out=out)
    return buffer
