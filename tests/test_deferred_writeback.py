"""A flat sparse group's write-back on the CPU runs on the hook's own (autograd) thread,
not on the collective's completion thread: at the next bucket for the groups whose
collective has completed, at the last bucket for the rest (``StepExchange.
write_back_completed``). These tests pin down when it runs, in which order, on which
thread, what it reports as the collective's time, and that an abandoned step still
discards its staged residuals."""

import threading
import time

import pytest
import torch

from ddp_harness import run_ranks
from test_exchange_options import FakeBucket


def _exchange_with_deferred_groups(count):
    """An exchange with ``count`` one-parameter buckets, each issued as a deferred group
    whose "collective" is a future the test completes; returns (exchange, futures,
    bucket futures, write-back log)."""
    from omgs_hook.group_exchange import GroupRecord, StepExchange
    from omgs_hook.residual_memory import ResidualMemory

    ex = StepExchange(memory=ResidualMemory(), selector=None, process_group=None,
                      world_size=1, density=0.5)
    collectives, bucket_futures, log = [], [], []
    for i in range(count):
        key = f"p{i}"
        bucket = FakeBucket([torch.ones(4)])
        bucket_futures.append(ex.add_bucket(bucket, [key], bucket.params))
        collective = torch.futures.Future()
        collectives.append(collective)
        record = GroupRecord((key,), False, 4, 2, 20, time.perf_counter())

        def finish(i=i):
            log.append((i, threading.get_ident()))

        ex._issue(lambda c=collective: c, finish, record, defer=True)
    return ex, collectives, bucket_futures, log


def test_a_deferred_write_back_runs_on_the_calling_thread_in_issue_order():
    ex, collectives, bucket_futures, log = _exchange_with_deferred_groups(3)
    assert ex.write_back_completed() == 0  # nothing has completed
    # the second collective completes first, on another thread: its write-back waits
    # for the first (issue order), and the completion thread runs none of it
    other = threading.Thread(target=lambda: collectives[1].set_result(None))
    other.start()
    other.join()
    assert ex.write_back_completed() == 0 and log == []
    collectives[0].set_result(None)
    assert ex.write_back_completed() == 2
    me = threading.get_ident()
    assert log == [(0, me), (1, me)]
    assert bucket_futures[0].done() and bucket_futures[1].done()
    assert not bucket_futures[2].done()
    # the last bucket: finish_issuing waits for the rest and completes the step
    threading.Timer(0.05, lambda: collectives[2].set_result(None)).start()
    ex.finish_issuing()
    assert log[-1] == (2, me)
    assert ex.finished and all(f.done() for f in bucket_futures)
    assert ex.waited_s > 0.0


def test_a_late_write_back_reports_the_collectives_completion_time():
    """``record.done`` (what ``measurements.comm_sums`` reads as the collective's end)
    is the completion time, not the moment the hook got round to it; the online refit
    gets the completion time too."""
    ex, collectives, _, _ = _exchange_with_deferred_groups(1)
    samples = []
    ex.on_comm_sample = lambda nbytes, seconds: samples.append((nbytes, seconds))
    issued = ex.records[0].issued
    collectives[0].set_result(None)
    completed = time.perf_counter()
    time.sleep(0.2)  # the hook is busy elsewhere (backward) before the next bucket
    ex.finish_issuing()
    record = ex.records[0]
    assert issued <= record.done < completed + 0.1
    (nbytes, seconds), = samples
    assert nbytes == 20 and seconds < completed - issued + 0.1


def test_a_failed_collective_reaches_the_bucket_futures():
    ex, collectives, bucket_futures, log = _exchange_with_deferred_groups(2)
    collectives[0].set_exception(RuntimeError("connection reset"))
    collectives[1].set_result(None)
    ex.finish_issuing()
    assert ex.finished and isinstance(ex.error, RuntimeError)
    with pytest.raises(RuntimeError, match="connection reset"):
        bucket_futures[0].wait()
    assert [i for i, _ in log] == [1]  # the other group is still written back


def test_an_abandoned_step_drops_its_deferred_write_backs_and_finishes():
    ex, collectives, bucket_futures, log = _exchange_with_deferred_groups(2)
    collectives[0].set_result(None)
    ex.fail_all(RuntimeError("backward pass abandoned"))
    assert ex.finished and log == []
    assert ex.write_back_completed(wait=True) == 0
    with pytest.raises(RuntimeError, match="abandoned"):
        bucket_futures[1].wait()


def abandon_worker(rank, world_size):
    """One committed step, then a step abandoned after its sparse group was sent: the
    residual must stay the committed one, bit for bit."""
    from omgs_hook.group_exchange import StepExchange
    from omgs_hook.residual_memory import ResidualMemory
    from omgs_hook.topk import get_selector

    memory, selector = ResidualMemory(), get_selector("sampled")
    keys = ("w", "b")

    def step(grads, abandon):
        ex = StepExchange(memory, selector, None, world_size, 0.01)
        bucket = FakeBucket(grads)
        ex.add_bucket(bucket, keys, bucket.params)
        ex.send_group(keys, dense=False)
        if abandon:
            ex.fail_all(RuntimeError("backward pass abandoned"))
        else:
            ex.finish_issuing()
        return ex

    gen = torch.Generator().manual_seed(rank)
    step([torch.randn(3000, generator=gen), torch.randn(40, generator=gen)], abandon=False)
    committed = {k: v.clone() for k, v in memory.state_dict().items()}
    ex = step([torch.randn(3000, generator=gen), torch.randn(40, generator=gen)], abandon=True)
    after = memory.state_dict()
    return {"finished": ex.finished, "deferred": len(ex._deferred),
            "same": sorted(after) == sorted(committed)
            and all(torch.equal(after[k], committed[k]) for k in committed)}


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_an_abandoned_step_leaves_the_committed_residual_on_every_rank():
    for result in run_ranks("test_deferred_writeback", "abandon_worker", world_size=2,
                            timeout=100):
        assert result == {"finished": True, "deferred": 0, "same": True}


def thread_worker(rank, world_size):
    """A DDP step with several sparse groups: every write-back runs on the thread that
    called backward (the CPU autograd engine runs the hook there)."""
    import omgs_hook
    from omgs_hook import group_exchange

    threads = []
    original = group_exchange.StepExchange._finish_sparse

    def finish_sparse(self, *args, **kwargs):
        threads.append(threading.get_ident())
        return original(self, *args, **kwargs)

    group_exchange.StepExchange._finish_sparse = finish_sparse
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0)
    state = omgs_hook.register(ddp, density=0.05, strategy="layerwise", allow_dense=False,
                               select="model", warmup_steps=2)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(rank))
    for _ in range(6):  # (DDP's buckets are rebuilt after the first step)
        opt.zero_grad()
        ddp(x).square().sum().backward()
        opt.step()
    return {"groups": len(state.plan.groups), "write_backs": len(threads),
            "other_threads": sum(t != threading.get_ident() for t in threads)}


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_ddp_write_backs_run_on_the_backward_thread():
    for result in run_ranks("test_deferred_writeback", "thread_worker", world_size=2,
                            timeout=100):
        assert result["groups"] >= 4
        assert result["write_backs"] >= result["groups"]  # a sparse step at least
        assert result["other_threads"] == 0


def test_a_deferred_write_back_is_not_counted_in_the_collectives_time():
    """The deferred write-back runs on the autograd thread, which the cost model prices
    on the compute stream (the top-k line): the collective's measured end is its
    completion, however long the write-back itself takes."""
    from omgs_hook import measurements

    ex, collectives, _, _ = _exchange_with_deferred_groups(1)
    record = ex.records[0]
    ex._deferred[0][1] = lambda: time.sleep(0.2)  # a slow write-back
    collectives[0].set_result(None)
    completed = time.perf_counter()
    ex.finish_issuing()
    assert time.perf_counter() - completed >= 0.2
    assert record.done < completed + 0.1
    sparse_s = measurements.comm_sums([record])[0]
    assert sparse_s < completed + 0.1 - record.issued


def test_a_deferred_write_back_sample_covers_the_bucket_futures_callbacks():
    """The receive side ``w`` of a deferred group is all the autograd thread spends on
    it: the write-back's own sample grows to cover the bucket future's callbacks (what
    DDP runs when a bucket is done), which delay backward just as much."""
    ex, collectives, bucket_futures, _ = _exchange_with_deferred_groups(1)
    ex._deferred[0][1] = lambda: ex.writeback_samples.append((4, 0.0))  # as _finish_sparse
    bucket_futures[0].then(lambda fut: time.sleep(0.1))
    collectives[0].set_result(None)
    ex.finish_issuing()
    (numel, seconds), = ex.writeback_samples
    assert numel == 4 and seconds >= 0.1


def test_a_cuda_bucket_future_waits_for_every_write_back_into_the_bucket(monkeypatch):
    """On CUDA a group's write-back runs in its collective future's callback, on a stream
    from a pool (a different one per callback), not on the compute stream. The bucket
    future handed to DDP must carry the device (so that set_result records an event
    DDP's wait() synchronises with) and be set only after the current stream waited for
    the write-backs of every group that wrote into the bucket. Simulated on the CPU:
    the three CUDA calls are replaced by ones that log."""
    from omgs_hook import group_exchange
    from omgs_hook.group_exchange import GroupRecord, StepExchange
    from omgs_hook.residual_memory import ResidualMemory

    log = []
    tokens = iter(range(100))

    class LoggingFuture(torch.futures.Future):
        def set_result(self, result):
            log.append(("set_result",))
            super().set_result(result)

    monkeypatch.setattr(group_exchange, "_bucket_future", lambda device: LoggingFuture())
    monkeypatch.setattr(group_exchange, "_writes_done_event",
                        lambda device: ("event", next(tokens)))
    monkeypatch.setattr(group_exchange, "_wait_for_events",
                        lambda device, events: log.append(("wait", sorted(e[1] for e in events))))
    ex = StepExchange(memory=ResidualMemory(), selector=None, process_group=None,
                      world_size=1, density=0.5)
    bucket = FakeBucket([torch.ones(4), torch.ones(3)])  # one bucket, two groups
    bucket_future = ex.add_bucket(bucket, ["a", "b"], bucket.params)
    collectives = []
    for key in ("a", "b"):
        collective = torch.futures.Future()
        collectives.append(collective)
        record = GroupRecord((key,), False, 4, 2, 20, time.perf_counter())
        ex._issue(lambda c=collective: c, lambda: None, record)
    ex.finish_issuing()
    collectives[0].set_result(None)
    assert log == [] and not bucket_future.done()  # group "b" not written back yet
    collectives[1].set_result(None)
    assert log == [("wait", [0, 1]), ("set_result",)]
    assert bucket_future.done() and ex.finished and ex.error is None
    assert len(ex._retained) == 2  # the write-backs' tensors outlive their callbacks


def test_a_send_window_notes_its_groups_and_the_seconds_no_timer_covered():
    from omgs_hook.group_exchange import GroupRecord, StepExchange
    from omgs_hook.residual_memory import ResidualMemory

    ex = StepExchange(memory=ResidualMemory(), selector=None, process_group=None,
                      world_size=1, density=0.5)
    for key in ("p0", "p1"):
        bucket = FakeBucket([torch.ones(4)])
        ex.add_bucket(bucket, [key], bucket.params)
    mark = ex.open_window()  # a window that sends nothing
    ex.close_window(mark)
    # one sparse group: 0.06 s of timed work (top-k, h's two parts), 0.04 s of untimed
    mark = ex.open_window()
    time.sleep(0.04)
    started = time.perf_counter()
    time.sleep(0.06)
    ex.topk_s += 0.02
    ex.overhead_samples.append((4, 0.01, 0.03))
    ex._issue(torch.futures.Future, lambda: None,
              GroupRecord(("p0",), False, 4, 2, 20, started), defer=True)
    ex.close_window(mark)
    # a window that sends a dense group: no timer covers a dense send, so it is left out
    mark = ex.open_window()
    ex._issue(torch.futures.Future, lambda: None,
              GroupRecord(("p1",), True, 4, 4, 16, time.perf_counter()))
    ex.close_window(mark)
    (empty_groups, empty_s), (groups, untimed_s) = ex.window_samples
    assert empty_groups == 0 and 0.0 <= empty_s < 0.01
    assert groups == 1 and 0.04 <= untimed_s < 0.04 + 0.5, untimed_s
