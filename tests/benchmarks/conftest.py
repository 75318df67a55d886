"""Benchmark smoke tests run benchmark code in-process; keep its process-wide settings from leaking."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _restore_torch_threads() -> Iterator[None]:
    """Benchmarks pin torch's thread count for their (normally fresh) process; later tests compare bits."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
