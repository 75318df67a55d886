"""Suite-wide settings: quiet TensorFlow logs, no third-party plugins leaking in from the environment."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
# TensorFlow's plain CPU allocator: the oneDNN one retries a failed allocation for 10 s before its OOM, and
# the OOM-recovery tests cause real allocator OOMs (the error and its recovery are the same with either)
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

#: Lightning's spawn launcher writes these into the test process; a later test's subprocesses would inherit
#: a stale MASTER_PORT (and hang when something else holds it).
_LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "PL_GLOBAL_SEED")


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread for the test: tiny tensors on a loaded 2-core machine avoid OpenMP spin-waits."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _destroy_default_group() -> None:
    """A one-device fit under ivyplug's strategies keeps the default process group for the process's next stage
    (destroyed at exit): a later test in this pytest worker would find it and take its world size for its own."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _restore_launch_variables() -> Iterator[None]:
    """Every test starts with a MASTER_PORT of this worker's own range (tests/ports.py) and ends with the launch
    variables it found: a fit that leaves MASTER_PORT unset has Lightning draw an ephemeral port, which the
    other pytest worker may take before rank 0 binds it."""
    from tests.ports import free_port

    saved = {k: os.environ.get(k) for k in _LAUNCH_VARIABLES}
    os.environ["MASTER_PORT"] = str(free_port())
    yield
    _destroy_default_group()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture
def emulated_hosts() -> Iterator[Any]:
    """A factory of emulated hosts (ivyplug.benchmarks.emulated_hosts): ``emulated_hosts(2, rate="100mbit")``.

    Skips the test where they cannot be made (not Linux, not root, a command missing); every host made is
    torn down at the end of the test, processes included, whatever the test's outcome.
    """
    from ivyplug.benchmarks.emulated_hosts import Hosts, remove_stale, unavailable

    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    remove_stale()
    made: list[Hosts] = []

    def make(n: int = 2, rate: str | None = None, hostname_maps_to: str | None = "address") -> Hosts:
        hosts = Hosts(n, rate=rate, hostname_maps_to=hostname_maps_to)
        made.append(hosts)
        return hosts.__enter__()

    try:
        yield make
    finally:
        for hosts in made:
            hosts.close()
