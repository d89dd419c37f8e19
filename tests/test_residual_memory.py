"""The hot path's pieces on their own: persistent group buffers, all-or-nothing commits,
and the scatter of averaged sparse entries straight into bucket buffers."""

import math
import pytest
import torch

from omgs_hook.group_exchange import _offset_in, _scatter_average
from omgs_hook.residual_memory import CURRENT, ResidualMemory, squared_norm

DEV = torch.device("cpu")


def _step(memory, keys, numels, grads, taken=None, commit=True):
    """One step of a group as the exchange does it: spare = grad + residual, zero the
    first entry (as if it was sent), stage, commit or discard."""
    buffers = memory.group_buffers(keys, numels, DEV)
    for i, key in enumerate(keys):
        o, n = buffers.offsets[i], numels[i]
        src = memory.residual_source(buffers, i, key)
        out = buffers.spare[o:o + n]
        if src is None:
            out.copy_(grads[key])
        else:
            torch.add(grads[key], buffers.current[o:o + n] if src is CURRENT else src, out=out)
    buffers.spare[0] = 0.0
    memory.stage_group(buffers, keys if taken is None else taken)
    if commit:
        memory.commit_staged()
    else:
        memory.discard_staged()
    return buffers


def test_buffers_persist_and_commit_swaps_without_copy():
    memory = ResidualMemory()
    keys, numels = ("a", "b"), (3, 2)
    grads = {"a": torch.tensor([1.0, 2.0, 3.0]), "b": torch.tensor([4.0, 5.0])}
    first = _step(memory, keys, numels, grads)
    a_storage = memory.get("a").untyped_storage().data_ptr()
    assert memory.residual_source(first, 0, "a") is CURRENT
    assert torch.equal(memory.get("a"), torch.tensor([0.0, 2.0, 3.0]))
    second = _step(memory, keys, numels, grads)
    assert second is first  # the same two buffers, step after step
    assert torch.equal(memory.get("a"), torch.tensor([0.0, 4.0, 6.0]))
    assert torch.equal(memory.get("b"), torch.tensor([8.0, 10.0]))
    # the residual moved to the other buffer: a swap, not a copy into the same one
    assert memory.get("a").untyped_storage().data_ptr() != a_storage


def test_discarded_step_leaves_residual_bit_identical():
    memory = ResidualMemory()
    keys, numels = ("a",), (4,)
    _step(memory, keys, numels, {"a": torch.tensor([1.0, 1.5, -2.0, 0.1])})
    before = memory.get("a").clone()
    _step(memory, keys, numels, {"a": torch.tensor([float("nan"), 7.0, 7.0, 7.0])}, commit=False)
    assert torch.equal(memory.get("a"), before)
    # and the next committed step starts from it
    _step(memory, keys, numels, {"a": torch.zeros(4)})
    assert torch.equal(memory.get("a")[1:], before[1:])


def test_plan_change_reads_old_residual_once_and_releases_old_buffers():
    memory = ResidualMemory()
    grads = {"a": torch.ones(2), "b": torch.full((3,), 2.0)}
    _step(memory, ("a",), (2,), grads)
    _step(memory, ("b",), (3,), grads)
    expected_a, expected_b = memory.get("a").clone(), memory.get("b").clone()
    merged = memory.group_buffers(("a", "b"), (2, 3), DEV)
    assert memory.residual_source(merged, 0, "a") is not CURRENT  # another group's slice
    memory.discard_staged()
    _step(memory, ("a", "b"), (2, 3), grads)
    assert torch.equal(memory.get("a")[1:], (expected_a + 1)[1:])
    assert torch.equal(memory.get("b"), expected_b + 2)
    assert set(memory._groups) == {("a", "b")}  # the old plan's buffers were released


def test_parked_parameter_keeps_its_residual_out_of_the_swapped_buffers():
    memory = ResidualMemory()
    keys, numels = ("a", "b"), (2, 2)
    _step(memory, keys, numels, {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([3.0, 4.0])})
    parked = memory.get("b").clone()
    # b unused this step: its slot is overwritten by the exchange, its residual must stay
    _step(memory, keys, numels, {"a": torch.tensor([1.0, 1.0]), "b": torch.tensor([9.0, 9.0])},
          taken=("a",))
    assert torch.equal(memory.get("b"), parked)
    _step(memory, keys, numels, {"a": torch.zeros(2), "b": torch.zeros(2)}, taken=("a",))
    assert torch.equal(memory.get("b"), parked)


def test_state_dict_round_trip_and_total_norm():
    memory = ResidualMemory()
    memory.note_layout("w", torch.empty(2, 2))
    _step(memory, ("w",), (4,), {"w": torch.tensor([1.0, 2.0, 2.0, 4.0])})
    sd = memory.state_dict()
    assert sd["w"].shape == (2, 2)
    other = ResidualMemory()
    other.load_state_dict(sd)
    assert torch.equal(other.get("w"), memory.get("w"))
    assert abs(memory.total_norm() - 24 ** 0.5) < 1e-12  # entry 0 was "sent"


def _snapshot(memory):
    return {k: memory.get(k).clone() for k in memory.keys()}


def _same(memory, snapshot):
    return set(memory.keys()) == set(snapshot) and all(
        torch.equal(memory.get(k), v) for k, v in snapshot.items())


def test_rewind_undoes_the_last_commit_bit_exactly_across_a_plan_change():
    memory = ResidualMemory()
    grads = {"a": torch.tensor([1.0, -2.0]), "b": torch.tensor([3.0, 0.5, 4.0])}
    _step(memory, ("a",), (2,), grads)
    _step(memory, ("b",), (3,), grads)
    before = _snapshot(memory)
    # a new plan merges both (new buffers, residuals read from the old groups' slices),
    # and a dense-like stage drops "b" to zero
    _step(memory, ("a", "b"), (2, 3), {"a": torch.full((2,), 5.0), "b": torch.full((3,), 7.0)})
    assert not _same(memory, before)
    assert memory.rewind_last_commit()
    assert _same(memory, before)
    assert not memory.rewind_last_commit()  # only once
    # the step after the rewind starts from the restored residuals, on the old plan
    _step(memory, ("a",), (2,), {"a": torch.zeros(2)})
    _step(memory, ("b",), (3,), {"b": torch.zeros(3)})
    assert torch.equal(memory.get("a")[1:], before["a"][1:])
    assert torch.equal(memory.get("b")[1:], before["b"][1:])


def test_rewind_restores_a_zeroed_residual_and_a_parked_one():
    memory = ResidualMemory()
    keys, numels = ("a", "b"), (2, 2)
    _step(memory, keys, numels, {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([3.0, 4.0])})
    before = _snapshot(memory)
    # b parked, a staged as "zero" (a dense group sent it all)
    buffers = _step(memory, keys, numels, {"a": torch.ones(2), "b": torch.ones(2)},
                    taken=("a",), commit=False)
    memory.group_buffers(keys, numels, DEV)
    memory.stage_group(buffers, ("a",))
    memory.stage("b", None)
    memory.commit_staged()
    assert memory.get("b") is None
    assert memory.rewind_last_commit()
    assert _same(memory, before)
    # the swap is undone too: the residuals are the group's current slices again (the
    # next step's fast path reads them in place and writes the other buffer)
    assert memory.residual_source(buffers, 0, "a") is CURRENT
    assert memory.residual_source(buffers, 1, "b") is CURRENT


def test_undo_state_dict_shows_the_rewound_residuals_and_changes_nothing():
    memory = ResidualMemory()
    keys, numels = ("a", "b"), (2, 3)
    _step(memory, keys, numels,
          {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([3.0, 4.0, 5.0])})
    before = _snapshot(memory)
    buffers = _step(memory, keys, numels, {"a": torch.ones(2), "b": torch.ones(3)})
    after = _snapshot(memory)
    undone = memory.undo_state_dict()
    assert set(undone) == set(before) and all(torch.equal(undone[k], before[k]) for k in before)
    assert _same(memory, after)  # the commit stands ...
    assert memory.residual_source(buffers, 0, "a") is CURRENT
    assert memory.rewind_last_commit()  # ... and can still be undone
    assert _same(memory, before)
    assert memory.undo_state_dict() is None


def test_nothing_to_rewind_after_a_discard_a_forget_or_a_load():
    memory = ResidualMemory()
    _step(memory, ("a",), (2,), {"a": torch.tensor([1.0, 2.0])})
    memory.forget_last_commit()
    assert not memory.rewind_last_commit()
    _step(memory, ("a",), (2,), {"a": torch.tensor([1.0, 2.0])})
    _step(memory, ("a",), (2,), {"a": torch.tensor([9.0, 9.0])}, commit=False)
    assert not memory.rewind_last_commit()  # the discarded step left nothing to undo
    _step(memory, ("a",), (2,), {"a": torch.tensor([1.0, 2.0])})
    memory.load_state_dict({"a": torch.zeros(2)})
    assert not memory.rewind_last_commit()
    assert torch.equal(memory.get("a"), torch.zeros(2))


def test_rewind_of_a_shard_store_swaps_it_back():
    memory = ResidualMemory()
    store = memory.shard_store(("a", "b"), (3, 3), 0, 3, 6, DEV)
    store.spare.copy_(torch.tensor([1.0, 2.0, 3.0]))
    memory.stage_shard(store)
    memory.commit_staged()
    before = memory.state_dict()
    store.spare.copy_(torch.tensor([-4.0, 5.0, 6.0]))
    memory.stage_shard(store)
    memory.commit_staged()
    assert torch.equal(memory.state_dict()["a"], torch.tensor([-4.0, 5.0, 6.0]))
    assert memory.rewind_last_commit()
    after = memory.state_dict()
    assert set(after) == set(before) and all(torch.equal(after[k], before[k]) for k in before)


def _reference_average(indices, values, scale, numel):
    out = torch.zeros(numel, dtype=torch.float64)
    out.index_add_(0, indices, values.double())
    return out * scale


def test_scatter_average_one_run_and_several_runs_match_reference():
    torch.manual_seed(0)
    numel, world = 50, 3
    indices = torch.cat([torch.randperm(numel)[:7].sort().values for _ in range(world)])
    values = torch.randn(indices.numel())
    expected = _reference_average(indices, values, 1 / world, numel)
    one = torch.full((numel,), 9.0)
    _scatter_average([(0, numel, one)], indices, values, 1 / world, numel)
    assert torch.allclose(one.double(), expected, atol=1e-6)
    # three runs in two bucket buffers, in group order
    buf0, buf1 = torch.full((30,), 9.0), torch.full((40,), 9.0)
    runs = [(0, 20, buf0[5:25]), (20, 10, buf1[0:10]), (30, 20, buf1[15:35])]
    _scatter_average(runs, indices, values, 1 / world, numel, rows=world)
    got = torch.cat([buf0[5:25], buf1[0:10], buf1[15:35]])
    assert torch.allclose(got.double(), expected, atol=1e-6)
    assert torch.equal(buf0[:5], torch.full((5,), 9.0))  # outside the runs: untouched
    assert torch.equal(buf1[10:15], torch.full((5,), 9.0))


@pytest.mark.parametrize("seed", range(6))
def test_scatter_average_in_run_order_equals_the_masked_path_bit_for_bit(seed):
    """Several runs and payloads: the run-ordered write-back (O(k)) gives exactly what
    masking every entry for every run gives - each element receives its entries in
    payload order either way - including clamped duplicate indices (the two-level
    exchange's padding), empty runs and zero-length stretches."""
    gen = torch.Generator().manual_seed(seed)
    world = 1 + seed
    numel = 4000 + 37 * seed
    edges = [0] + sorted(set(torch.randint(1, numel, (3 + 2 * seed,), generator=gen).tolist())) + [numel]
    k = [1, 50, 400, 4000, 999, 3][seed]
    indices = torch.cat([torch.randperm(numel, generator=gen)[:k].sort().values for _ in range(world)])
    if seed % 2:
        indices = indices.clamp(max=numel - 3)
    values = torch.randn(indices.numel(), generator=gen)
    results = []
    for rows in (world, 0):  # rows=0: not known ascending, the masked path
        buffer = torch.full((numel + 10,), 9.0)
        runs = [(a, b - a, buffer[a + 5:b + 5]) for a, b in zip(edges, edges[1:])]
        _scatter_average(runs, indices, values, 1 / world, numel, rows=rows)
        results.append(buffer)
    assert torch.equal(results[0].view(torch.int32), results[1].view(torch.int32))
    expected = _reference_average(indices, values, 1 / world, numel)
    assert torch.allclose(results[0][5:numel + 5].double(), expected, atol=1e-6)
    assert torch.equal(results[0][:5], torch.full((5,), 9.0))


def test_scatter_average_payloads_out_of_order_take_the_masked_path():
    numel, world = 40, 2
    indices = torch.tensor([5, 1, 30, 2, 3, 39])  # payload 0 is not ascending
    values = torch.arange(1.0, 7.0)
    buffer = torch.full((numel,), 9.0)
    runs = [(0, 20, buffer[:20]), (20, 20, buffer[20:])]
    _scatter_average(runs, indices, values, 0.5, numel, rows=world)
    assert torch.allclose(buffer.double(), _reference_average(indices, values, 0.5, numel))


def test_scatter_average_low_precision_sums_in_fp32():
    numel = 8
    indices = torch.tensor([1, 1, 1, 1])
    values = torch.tensor([1.0, 1e-3, 1e-3, 1e-3])
    grad = torch.zeros(numel, dtype=torch.bfloat16)
    _scatter_average([(0, numel, grad)], indices, values, 0.25, numel)
    expected = torch.tensor((1.0 + 3e-3) / 4).to(torch.bfloat16)
    assert grad[1] == expected and int((grad != 0).sum()) == 1


def test_offset_in_bucket_buffer():
    buffer = torch.zeros(10)
    assert _offset_in(buffer[3:7], buffer) == 3
    assert _offset_in(torch.zeros(4), buffer) is None  # another storage
    assert _offset_in(buffer[::2], buffer) is None  # not contiguous


def test_total_norm_does_not_depend_on_the_order_residuals_were_stored_in():
    # squares 1e16, 1, 1: added in storage order, (1e16 + 1) + 1 loses both ones and
    # (1 + 1) + 1e16 keeps them, so a plain running sum differs between a run and its
    # resume (a state dict lists the residuals in another order)
    big, small = torch.tensor([1e8]), torch.tensor([1.0])
    first, second = ResidualMemory(), ResidualMemory()
    first.load_state_dict({"a": big, "b": small, "c": small.clone()})
    second.load_state_dict({"b": small, "c": small.clone(), "a": big})
    assert first.total_norm() == second.total_norm() == math.sqrt(1e16 + 2)


@pytest.mark.parametrize("numel", [0, 1, 255, 256, 257, 4096, 3 * 256 + 5, 1_000_003])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_squared_norm_is_the_sum_of_squares_to_within_1e_6(numel, dtype):
    """``squared_norm`` (rows of 256 in fp32, summed in fp64; the tail in fp64) against
    the fp64 sum of squares: any length (empty, shorter than a row, a partial last row),
    any float dtype, a non-contiguous view, and entries of very different scales; the
    same tensor gives the same bits every time."""
    gen = torch.Generator().manual_seed(numel)
    values = torch.randn(numel, generator=gen, dtype=torch.float64)
    values *= torch.exp(torch.randn(numel, generator=gen, dtype=torch.float64) * 3)
    tensor = values.to(dtype)
    exact = float(tensor.double().pow(2).sum())
    rel = 1e-12 if dtype == torch.float64 else 1e-6  # fp32 row norms, scales of e^+-9
    got = squared_norm(tensor)
    assert got.dtype == torch.float64 and got.dim() == 0
    assert float(got) == pytest.approx(exact, rel=rel, abs=1e-300)
    assert torch.equal(squared_norm(tensor), got)
    strided = torch.stack([tensor, tensor], dim=1)[:, 0]  # every other element
    assert not strided.is_contiguous() or numel <= 1
    assert float(squared_norm(strided)) == pytest.approx(exact, rel=rel, abs=1e-300)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scatter_average_per_payload_equals_the_cpu_paths_bit_for_bit(seed, dtype):
    """The GPU write-back (one index_add_ per payload, so CUDA's atomics never meet at an
    index, then one fused copy into every run), run here on the CPU: the same sums, bit
    for bit, as the run-ordered path - one run or many, fp32 or bf16 gradients, and the
    two-level exchange's padding (zero values clamped onto the last element)."""
    gen = torch.Generator().manual_seed(100 + seed)
    world = 2 + seed
    numel = 3000 + 41 * seed
    k = [1, 60, 700, 3000][seed]
    indices = torch.cat([torch.randperm(numel, generator=gen)[:k].sort().values
                         for _ in range(world)])
    values = torch.randn(indices.numel(), generator=gen)
    if seed % 2:  # padding: the last payload's tail points past the end, with value 0
        tail = indices.numel() - min(k, 5)
        values[tail:] = 0.0
        indices[tail:] = numel - 1
        indices = indices.clamp(max=numel - 1)
    edges = [0] + sorted(set(torch.randint(1, numel, (2 + 3 * seed,), generator=gen).tolist())) + [numel]
    for layout in ("one run", "runs"):
        results = []
        for per_payload in (False, True):
            buffer = torch.full((numel + 10,), 9.0, dtype=dtype)
            pairs = [(0, numel)] if layout == "one run" else list(zip(edges, edges[1:]))
            runs = [(a, b - a, buffer[a + 5:b + 5]) for a, b in pairs]
            _scatter_average(runs, indices, values, 1 / world, numel, rows=world,
                             per_payload=per_payload)
            results.append(buffer)
        assert torch.equal(results[0].view(torch.int16), results[1].view(torch.int16)), layout
        assert torch.equal(results[1][:5], torch.full((5,), 9.0, dtype=dtype))
        expected = _reference_average(indices, values, 1 / world, numel)
        assert torch.allclose(results[1][5:numel + 5].double(), expected.to(dtype).double(),
                              atol=1e-6 if dtype == torch.float32 else 1e-2)


def test_squared_norm_of_huge_finite_values_is_finite():
    """fp32 row norms overflow from about 1.8e19 per element; the norm of such a tensor
    is still finite (its square too, in fp64) and must not read as inf. An inf in the
    tensor still gives inf, a NaN NaN."""
    values = torch.full((1000,), 3e20)
    expected = 1000 * 3e20 ** 2
    assert math.isclose(float(squared_norm(values)), expected, rel_tol=1e-6)
    values[7] = float("inf")
    assert math.isinf(float(squared_norm(values)))
    values[7] = float("nan")
    assert math.isnan(float(squared_norm(values)))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("scale", [1e-25, 1e-30, 1e-40])
def test_squared_norm_of_tiny_values_does_not_underflow(scale):
    """The other end of the huge-values case: fp32 row norms square each element in
    fp32, and below about 1e-19 per element those squares are subnormal or flush to 0.
    A gradient of such tiny (but normal, or subnormal) fp32 values must still have its
    norm to fp64 precision - stats()["error_feedback"] reported 1.6e-31 for a gradient
    of norm 6.6e-31, and local_clip_norm's factor is computed from this norm."""
    gen = torch.Generator().manual_seed(0)
    values = (torch.randn(100_000, generator=gen, dtype=torch.float64) * scale).float()
    exact = float(values.double().pow(2).sum())
    assert exact > 0
    assert float(squared_norm(values)) == pytest.approx(exact, rel=1e-6, abs=0)
    # every square flushes to zero in fp32: the row norms alone give exactly 0
    flat = torch.full((1024,), scale, dtype=torch.float32)
    assert float(squared_norm(flat)) == pytest.approx(float(flat.double().pow(2).sum()), rel=1e-6, abs=0)
    assert float(squared_norm(torch.zeros(1024))) == 0.0
