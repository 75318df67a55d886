"""OOM recognition and micro-batch splitting (same samples, same order, nothing lost)."""

from __future__ import annotations

from collections import namedtuple

import numpy as np
import pytest

from ivyplug.load import OutOfMemoryRecoveryError, batch_length, is_oom_error, next_split, part_sizes, split_batch


def test_recognises_oom_errors() -> None:
    import torch

    assert is_oom_error(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert is_oom_error(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried... out of memory"))
    assert is_oom_error(MemoryError())

    class ResourceExhaustedError(Exception):
        pass

    assert is_oom_error(ResourceExhaustedError("OOM when allocating tensor"))
    assert not is_oom_error(RuntimeError("shape mismatch"))
    assert not is_oom_error(ValueError("out of memory"))


def test_split_keeps_every_sample_in_order() -> None:
    import torch

    Pair = namedtuple("Pair", "x y")
    x = torch.arange(30.0).reshape(10, 3)
    y = np.arange(10)
    batch = {"inputs": Pair(x, y), "mask": [torch.ones(10, 2)], "name": "digits", "scale": 2.0}
    assert batch_length(batch) == 10
    parts = split_batch(batch, 3)
    assert [batch_length(p) for p in parts] == [4, 3, 3]
    assert torch.equal(torch.cat([p["inputs"].x for p in parts]), x)
    assert np.array_equal(np.concatenate([p["inputs"].y for p in parts]), y)
    assert all(isinstance(p["inputs"], Pair) and p["name"] == "digits" and p["scale"] == 2.0 for p in parts)
    assert torch.equal(torch.cat([p["mask"][0] for p in parts]), batch["mask"][0])
    assert split_batch((x,), 1)[0][0] is not None


def test_split_errors_and_limits() -> None:
    import torch

    with pytest.raises(ValueError, match="disagree"):
        batch_length((torch.zeros(3), torch.zeros(4)))
    with pytest.raises(ValueError, match="no array"):
        split_batch({"a": 1}, 2)
    with pytest.raises(ValueError, match="non-empty parts"):
        split_batch(torch.zeros(3), 4)
    with pytest.raises(ValueError, match="parts"):
        part_sizes(3, 0)
    assert next_split(1, 64, 8) == 2 and next_split(4, 64, 8) == 8 and next_split(2, 3, 8) == 3
    with pytest.raises(OutOfMemoryRecoveryError, match="8 micro-batches"):
        next_split(8, 64, 8)
    with pytest.raises(OutOfMemoryRecoveryError):
        next_split(3, 3, 8)
