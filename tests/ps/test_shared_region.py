"""Shared-memory payloads between a worker and a co-located server on one host (``ivyplug.ps.wire.shared_region``).

The region itself is checked in one process: what one mapping writes the other reads, and a server maps only
the file that was announced. Then 2 real processes over gloo fit a model (BatchNorm's buffers, an integer one
among them) with payloads in shared memory and again over gloo alone: parameters and buffers must be equal
bit for bit, in sync, async, SSP, with pushes from backward's hooks, clipped pushes and a NaN push. The
control: the shared fits did share (and the gloo ones did not), and where a region cannot be made or mapped
the pair falls back to gloo, with a warning where that is the worker's own failure.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from ivyplug.ps.config import PSConfig
from ivyplug.ps.wire import shared_region
from tests.ps import shared_memory_scenarios
from tests.ps.harness import run_workers

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        not os.access(shared_region.SHM_DIR, os.W_OK), reason=f"needs a writable {shared_region.SHM_DIR}"
    ),
]


@pytest.fixture
def region() -> Any:
    r = shared_region.create(1000)
    yield r
    r.unlink()


def test_what_one_mapping_writes_the_other_reads(region: shared_region.Region) -> None:
    other = shared_region.attach(region.path, 1000, region.nonce)
    values = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    region.tensor.copy_(values)
    torch.testing.assert_close(other, values, rtol=0, atol=0)
    other.fill_(-1.5)
    torch.testing.assert_close(region.tensor, torch.full((1000,), -1.5), rtol=0, atol=0)
    region.unlink()
    assert not os.path.exists(region.path)
    other[3] = 7.0  # both mappings outlive the file
    assert float(region.tensor[3]) == 7.0


def test_a_nonce_from_its_header_arguments_is_the_same_nonce(region: shared_region.Region) -> None:
    assert shared_region.nonce_bytes(*region.nonce_args) == region.nonce


def test_another_nonce_is_refused(region: shared_region.Region) -> None:
    with pytest.raises(ValueError, match="nonce differs"):
        shared_region.attach(region.path, 1000, bytes(16))


def test_another_size_is_refused(region: shared_region.Region) -> None:
    with pytest.raises(ValueError, match="holds 4016 bytes, expected 4020"):
        shared_region.attach(region.path, 1001, region.nonce)


@pytest.mark.parametrize("path", ["/etc/passwd", "/dev/shm/not-ours", "/dev/shm/../etc/ivyplug-ps-1-0123456789abcdef"])
def test_a_path_that_is_not_an_ivyplug_region_is_refused_before_it_is_opened(path: str) -> None:
    with pytest.raises(ValueError, match="is not an ivyplug shared-memory region"):
        shared_region.attach(path, 10, bytes(16))


def test_a_symlink_is_not_followed(region: shared_region.Region, tmp_path: Path) -> None:
    link = os.path.join(shared_region.SHM_DIR, f"ivyplug-ps-{os.getpid()}-{'0' * 16}")
    os.symlink(region.path, link)
    try:
        with pytest.raises(OSError):
            shared_region.attach(link, 1000, region.nonce)
    finally:
        os.unlink(link)


def test_shared_memory_is_a_checked_option() -> None:
    assert PSConfig().shared_memory is True
    with pytest.raises(ValueError, match=r"PSConfig\.shared_memory must be True or False, got 'yes'"):
        PSConfig(shared_memory="yes")  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_workers(shared_memory_scenarios.session, 2, timeout=280)


@pytest.mark.parametrize("case", list(shared_memory_scenarios.CASES))
def test_shared_memory_and_gloo_fits_are_equal_bit_for_bit(runs: list[dict[str, Any]], case: str) -> None:
    for r in runs:
        shm, gloo = r[case][True], r[case][False]
        assert (shm["shared"], gloo["shared"]) == (shm["wires"], 0) and shm["wires"] >= 1  # the control
        assert (shm["segments"], gloo["segments"]) == (0, gloo["wires"])
        assert shm["leftovers"] == [] and shm["warnings"] == []
        for a, b in zip(shm["params"] + shm["buffers"], gloo["params"] + gloo["buffers"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert shm["pushes"] == gloo["pushes"] == shared_memory_scenarios.STEPS
        assert re.fullmatch(
            r"shard \d+: a shared-memory push is one flat tensor of \d+ values, got a tensor of 3 values",
            shm["refused"],
        )
        # a push moves its bytes whichever way they travel
        assert shm["bytes_sent"] == pytest.approx(gloo["bytes_sent"], rel=0.05)


def test_a_nan_push_in_shared_memory_is_dropped_on_every_shard(runs: list[dict[str, Any]]) -> None:
    assert [r["nan"][True]["nonfinite_skipped"] for r in runs] == [0, 1]
    params = runs[0]["nan"][True]["params"]
    assert all(bool(torch.isfinite(p).all()) for p in params)
    # the dropped push changed the fit: it differs from the one without the NaN
    assert not all(torch.equal(a, b) for a, b in zip(params, runs[0]["sync"][True]["params"], strict=True))
    assert not math.isnan(float(params[0].abs().max()))


def test_a_region_the_server_cannot_map_leaves_the_pair_on_gloo(runs: list[dict[str, Any]]) -> None:
    for r in runs:
        got = r["not_mapped"]
        assert got["shared"] == 0 and got["segments"] == got["wires"] >= 1
        assert got["leftovers"] == [] and got["warnings"] == []  # another host is no reason to warn
        for a, b in zip(got["params"], r["sync"][True]["params"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_region_the_worker_cannot_make_warns_and_stays_on_gloo(runs: list[dict[str, Any]]) -> None:
    rank0, rank1 = (r["no_space"] for r in runs)
    assert rank0["shared"] == rank0["wires"] and rank0["warnings"] == []
    assert rank1["shared"] == 0 and rank1["segments"] == rank1["wires"]
    (warning,) = rank1["warnings"]
    assert "travel over gloo, not shared memory" in warning and "No space left on device" in warning
    for r in runs:
        for a, b in zip(r["no_space"]["params"], r["sync"][True]["params"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_an_ivyplug_serve_counts_shared_payloads_as_moved() -> None:
    """The serve's status line counts a push and its reply through a region as it would on gloo: the same
    bytes in and out with and without shared memory (the control: only the shared client shares)."""
    from ivyplug.ps import PSClient
    from ivyplug.ps.server.endpoints import WireEndpoint
    from ivyplug.ps.server.service import PSService

    svc = PSService(1, port=0, num_workers=1, timeout=30, status_every=None, log=lambda line: None)
    try:
        counts = {}
        for shared in (True, False):
            torch.manual_seed(0)
            model = torch.nn.Linear(40, 30)
            cfg = PSConfig(mode="async", servers=svc.address, timeout=30, shared_memory=shared)
            client = PSClient.start(
                cfg, list(model.named_parameters()), [], torch.optim.SGD(model.parameters(), lr=0.1)
            )
            try:
                client.pull_initial()
                svc.traffic.take()
                for _ in range(3):
                    model(torch.randn(4, 40)).sum().backward()
                    client.step(4)
                counts[shared] = svc.traffic.take()
                wires = [ep for ep in client.topo.endpoints.values() if isinstance(ep, WireEndpoint)]
                assert [ep.shared is not None for ep in wires] == [shared]
            finally:
                client.close()
        pushes, bytes_in, bytes_out = counts[True]
        assert counts[True] == counts[False] and pushes == 3
        assert bytes_in > 3 * 4 * (40 * 30 + 30) and bytes_out > 3 * 4 * (40 * 30 + 30)
    finally:
        svc.close()
