"""The CUDA paths of the PS worker: pinned host buffers, one device-to-host copy per shard and step, CUDA
workers with CPU servers. Skipped where no CUDA device exists (the staged path itself is tested on the CPU in
test_layout.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.ps import cuda_scenarios
from tests.ps.harness import run_workers

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_cuda_tensors_are_staged_through_one_pinned_buffer_per_shard() -> None:
    out = cuda_scenarios.staged_layout()
    assert out["device"] == "cuda"
    assert out["pinned_push"] and out["pinned_reply"]
    assert out["pack_equal"] and out["unpack_equal"]


@pytest.fixture(scope="module")
def fits() -> list[dict[str, Any]]:
    return run_workers(cuda_scenarios.session, 2, timeout=280)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_cuda_workers_with_cpu_servers_train_as_per_piece_copies_do(fits: list[dict[str, Any]], mode: str) -> None:
    for r in fits:
        staged, per_piece = r[mode]["staged"], r[mode]["per_piece"]
        assert staged["device"] == "cuda:0"
        for a, b in zip(staged["params"], per_piece["params"], strict=True):
            assert torch.equal(a, b)
            assert bool(torch.isfinite(a).all())
        assert staged["pinned"]


def test_cuda_workers_train_as_cpu_workers(fits: list[dict[str, Any]]) -> None:
    for r in fits:
        for a, b in zip(r["sync"]["staged"]["params"], r["sync"]["cpu"]["params"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
