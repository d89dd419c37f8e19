"""The sparse wire format: ``pack_sparse`` and ``unpack_gathered`` against a reference
written with NumPy - the exact bytes, NaN payloads, signed zeros and the largest int32
index included, and the status word every rank reads."""

import numpy as np
import pytest
import torch

from omgs_hook import communicator as c

SPECIAL = [0.0, -0.0, 1e-45, -3.4e38, float("inf"), float("-inf"), 1.5]


def _values(k, seed):
    values = torch.randn(k, generator=torch.Generator().manual_seed(seed))
    values[: len(SPECIAL)] = torch.tensor(SPECIAL)
    values.view(torch.int32)[len(SPECIAL)] = 0x7FC01234  # a quiet NaN with a payload
    return values


def _indices(k, seed):
    indices = torch.randperm(1 << 20, generator=torch.Generator().manual_seed(seed))[:k]
    indices[0], indices[1] = 0, c.MAX_INDEX
    return indices.sort().values


def _reference_payload(values, indices, flag):
    """float32 words: the values' bits, the indices as int32 bits, then 1.0 or 0.0."""
    k = len(values)
    words = np.empty(2 * k + 1, dtype=np.uint32)
    words[:k] = values.numpy().view(np.uint32)
    words[k:2 * k] = indices.numpy().astype(np.int32).view(np.uint32)
    words[2 * k] = np.float32(1.0 if flag else 0.0).view(np.uint32)
    return words


@pytest.mark.parametrize("flag", [False, True, torch.tensor(False), torch.tensor(True)])
def test_a_payload_holds_the_exact_bytes_of_values_indices_and_status(flag):
    values, indices = _values(40, 1), _indices(40, 2)
    payload = c.pack_sparse(values, indices, nonfinite=flag)
    assert payload.dtype == torch.float32 and payload.numel() == c.payload_numel(40)
    assert c.payload_bytes(40) == 4 * payload.numel()
    expected = _reference_payload(values, indices, bool(flag))
    assert np.array_equal(payload.numpy().view(np.uint32), expected)


def test_unpacking_returns_what_every_rank_packed():
    world, k = 3, 25
    sent = [(_values(k, r), _indices(k, 10 + r), r == 1) for r in range(world)]
    gathered = torch.cat([c.pack_sparse(v, i, nonfinite=f) for v, i, f in sent])
    values, indices, nonfinite_any = c.unpack_gathered(gathered, world, k)
    assert nonfinite_any is True
    assert values.shape == (world, k) and indices.shape == (world, k)
    assert indices.dtype == torch.int64
    for r, (v, i, _) in enumerate(sent):
        assert torch.equal(values[r].contiguous().view(torch.int32), v.view(torch.int32))
        assert torch.equal(indices[r], i)
    clean = torch.cat([c.pack_sparse(v, i) for v, i, _ in sent])
    assert c.unpack_gathered(clean, world, k)[2] is False


def test_other_value_dtypes_travel_as_float32():
    values, indices = torch.tensor([1.5, -2.25, 65504.0]), torch.tensor([3, 7, 9])
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        payload = c.pack_sparse(values.to(dtype), indices)
        assert torch.equal(payload[:3], values.to(dtype).float())
        assert torch.equal(payload[3:6].view(torch.int32).long(), indices)


def test_mismatched_lengths_are_refused():
    with pytest.raises(ValueError, match="3 values but 2 indices"):
        c.pack_sparse(torch.zeros(3), torch.zeros(2, dtype=torch.int64))
