"""Optimizer tests use tiny tensors: one intra-op thread avoids OpenMP spin-waits on a loaded 2-core machine."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_thread: None) -> None:
    """Every optimizer test runs on one thread (the ``one_thread`` fixture of tests/conftest.py)."""
