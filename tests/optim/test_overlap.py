"""Overlapped exchanges (``overlap=True``): pushes and pulls in the background while local steps go on.

One worker, ``outer="average"`` at rate 1: the servers' copy must end at the start plus the sum of every local
step's progress (float64 reference), each step pushed exactly once, with overlap on as with it off; buffers
likewise. A dropped (non-finite) delta, an error of the background thread and the refused settings are checked
too.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from ivyplug.optim import AsyncLAMB, LocalUpdates
from ivyplug.ps import PSClient, PSConfig
from ivyplug.ps.wire.transport import PSProtocolError, PSTimeoutError
from ivyplug.ps.worker.client import PSNonFiniteError

STEPS, H = 20, 3  # 6 exchanges during the steps, the 7th by flush() (2 steps left)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(6, 4)
        self.out = nn.Linear(4, 2)
        self.register_buffer("seen", torch.zeros(3))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))


def _opt(model: Net, overlap: bool, sync_every: int = H) -> LocalUpdates:
    # lr 1 SGD on .grad = −d moves each parameter by exactly d: the test chooses every step's progress
    return LocalUpdates(
        torch.optim.SGD(model.parameters(), lr=1.0), sync_every=sync_every, merge_rate=1.0, overlap=overlap
    )


def _params(model: nn.Module) -> list[np.ndarray]:
    return [p.detach().double().numpy().copy() for p in model.parameters()]


def _local_step(model: Net, opt: LocalUpdates, gen: torch.Generator, poison: bool = False) -> list[np.ndarray]:
    """One local step by a random d (its float64 value returned); the buffers count the step."""
    ds = [torch.randn(p.shape, generator=gen) * 0.01 for p in model.parameters()]
    if poison:
        ds[1].view(-1)[0] = math.nan
    for p, d in zip(model.parameters(), ds, strict=True):
        p.grad = -d
    with torch.no_grad():
        model.seen.add_(1.0)
        model.count.add_(1)
    before = _params(model)
    opt.step()
    opt.zero_grad()
    return (
        [d.double().numpy() for d in ds] if not poison else [a - b for a, b in zip(_params(model), before, strict=True)]
    )


def _run(model: Net, opt: LocalUpdates, client: PSClient, steps: int = STEPS) -> list[np.ndarray]:
    """``steps`` local steps, flush, sync; returns the float64 sum of their progress."""
    gen = torch.Generator().manual_seed(3)
    total = [np.zeros(p.shape) for p in model.parameters()]
    for _ in range(steps):
        for t, d in zip(total, _local_step(model, opt, gen), strict=True):
            t += d
    opt.flush()
    client.sync()
    opt.reset_snapshot()
    return total


def _check_global(
    model: Net, opt: LocalUpdates, client: PSClient, x0: list[np.ndarray], total: list[np.ndarray]
) -> None:
    for p, a, t in zip(model.parameters(), x0, total, strict=True):  # fp32 roundings of 20 steps and 7 merges
        np.testing.assert_allclose(p.detach().double().numpy(), a + t, rtol=0, atol=2e-6)
    for (name, mine), (_, theirs) in zip(model.named_parameters(), client.params, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0, msg=f"{name}: model != the servers' copy")
    torch.testing.assert_close(model.seen, torch.full((3,), float(STEPS)), rtol=0, atol=0)  # every step counted once
    assert int(model.count) == STEPS
    assert opt.exchanges == math.ceil(STEPS / H) and client.metrics()["pushes"] == opt.exchanges


@pytest.mark.parametrize("mode, overlap", [("async", False), ("async", True), ("sync", True)])
def test_every_local_step_is_pushed_exactly_once(mode: str, overlap: bool) -> None:
    model = Net()
    opt = _opt(model, overlap)
    client = opt.start_ps(PSConfig(mode=mode), list(model.named_parameters()), list(model.named_buffers()))
    try:
        assert (client.params[0][1] is model.lin.weight) is not overlap  # overlap: the client holds shadows
        x0 = _params(model)
        total = _run(model, opt, client)
        _check_global(model, opt, client, x0, total)
        assert not opt.delta.in_flight
    finally:
        client.close()


def test_the_background_exchange_never_writes_the_model_and_merges_one_exchange_late() -> None:
    model = Net()
    opt = _opt(model, overlap=True)
    client = opt.start_ps(PSConfig(mode="async"), list(model.named_parameters()), list(model.named_buffers()))
    try:
        gen = torch.Generator().manual_seed(1)
        x0 = _params(model)
        first = [np.zeros(p.shape) for p in model.parameters()]
        for _ in range(H):  # the H-th step starts the first exchange
            for f, d in zip(first, _local_step(model, opt, gen), strict=True):
                f += d
        job = opt.delta._inflight
        assert job is not None and job.thread is not None
        local = _params(model)
        job.thread.join(30)
        assert not job.thread.is_alive()
        for a, b in zip(_params(model), local, strict=True):  # pulled into the shadows only
            np.testing.assert_array_equal(a, b)
        g = [s.detach().double().numpy() for _, s in client.params]
        for gi, a, f in zip(g, x0, first, strict=True):  # the servers merged the first H steps
            np.testing.assert_allclose(gi, a + f, rtol=0, atol=1e-6)
        later = [np.zeros(p.shape) for p in model.parameters()]
        for _ in range(H):  # the next exchange point applies it: x ← g + (x − x_sent), snapshot ← g
            for t, d in zip(later, _local_step(model, opt, gen), strict=True):
                t += d
        for p, gi, t in zip(model.parameters(), g, later, strict=True):
            np.testing.assert_allclose(p.detach().double().numpy(), gi + t, rtol=0, atol=1e-6)
        for s, gi in zip(opt.delta.snapshot, g, strict=True):
            np.testing.assert_array_equal(s.double().numpy(), gi)
        assert opt.exchanges == 1 and opt.delta.in_flight
        opt.flush()
        assert opt.exchanges == 2 and not opt.delta.in_flight and opt.overlap_wait_s >= 0.0
    finally:
        client.close()


def test_a_non_finite_delta_is_dropped_whole_and_the_worker_restarts_from_the_global_copy() -> None:
    """H=2: steps 1-2 pushed (A); step 3 is NaN, so B (steps 3-4) is dropped when applied at step 6, together
    with steps 5-6 taken meanwhile; C (nothing since the restart) and D (steps 7-8) count."""
    model = Net()
    opt = _opt(model, overlap=True, sync_every=2)
    client = opt.start_ps(PSConfig(mode="async"), list(model.named_parameters()), list(model.named_buffers()))
    try:
        gen = torch.Generator().manual_seed(2)
        x0 = _params(model)
        kept = [np.zeros(p.shape) for p in model.parameters()]
        for step in range(1, 9):
            d = _local_step(model, opt, gen, poison=step == 3)
            if step in (1, 2, 7, 8):
                for k, di in zip(kept, d, strict=True):
                    k += di
            if step == 6:  # B was applied: dropped, the worker is at the global copy (A merged), C in flight
                assert opt.discarded_exchanges == 1
                for p, s in zip(model.parameters(), opt.delta.snapshot, strict=True):
                    torch.testing.assert_close(p.detach(), s, rtol=0, atol=0)
                    assert torch.isfinite(p).all()
        opt.flush()
        client.sync()
        opt.reset_snapshot()
        assert opt.discarded_exchanges == 1 and client.metrics()["nonfinite_skipped"] == 1
        for p, a, k in zip(model.parameters(), x0, kept, strict=True):
            assert torch.isfinite(p).all()
            np.testing.assert_allclose(p.detach().double().numpy(), a + k, rtol=0, atol=1e-6)
    finally:
        client.close()


def test_an_error_of_the_background_exchange_is_raised_by_the_next_exchange_point() -> None:
    model = Net()
    opt = _opt(model, overlap=True, sync_every=2)
    client = opt.start_ps(PSConfig(mode="async", nonfinite="raise"), list(model.named_parameters()))
    try:
        gen = torch.Generator().manual_seed(4)
        _local_step(model, opt, gen, poison=True)
        _local_step(model, opt, gen)  # starts the exchange, which raises on its thread
        job = opt.delta._inflight
        assert job is not None and job.thread is not None
        job.thread.join(30)
        before = _params(model)
        with pytest.raises(PSNonFiniteError, match="nonfinite='raise'"):  # the very next local step
            _local_step(model, opt, gen)
        assert not opt.delta.in_flight and opt.local_steps == 0
        for a, b in zip(_params(model), before, strict=True):  # raised before the inner step
            np.testing.assert_array_equal(a, b)
    finally:
        client.close()


@pytest.mark.timeout(120)
def test_through_an_ivyplug_serve_wire() -> None:
    """The exact-sum check against an ``ivyplug serve``; then the serve dies under an exchange in flight: the
    training thread gets the error at its next flush, within the timeout."""
    from tests.ps.service_harness import _kill, serve

    model = Net()
    opt = _opt(model, overlap=True)
    with serve("--shards", "1", "--workers", "1", "--token", "t0ken") as s:
        cfg = PSConfig(mode="async", servers=s.address, token="t0ken", timeout=8.0)
        client = opt.start_ps(cfg, list(model.named_parameters()), list(model.named_buffers()))
        try:
            x0 = _params(model)
            total = _run(model, opt, client)
            _check_global(model, opt, client, x0, total)
            _kill(s.proc)
            gen = torch.Generator().manual_seed(5)
            for _ in range(H):  # the exchange point starts a push to a dead service
                _local_step(model, opt, gen)
            start = time.monotonic()
            with pytest.raises((PSProtocolError, PSTimeoutError)):
                opt.flush()
            assert time.monotonic() - start < 2 * cfg.timeout + 5
        finally:
            opt.detach()
            start = time.monotonic()
            client.close()  # the servers are gone: no goodbye over the dead link, whose error would hide the first
            assert time.monotonic() - start < cfg.timeout


BAD: list[tuple[Callable[[], Any], str]] = [
    (lambda: LocalUpdates(torch.optim.SGD(Net().parameters(), lr=0.1), overlap=1), "overlap must be True or False"),
    (lambda: AsyncLAMB(Net().parameters(), overlap="yes"), "overlap must be True or False"),
    (lambda: _opt(Net(), overlap=True).outer_optimizer("ssp", 2), "overlap=True runs in mode='sync' or 'async'"),
]


@pytest.mark.parametrize("make, match", BAD)
def test_bad_settings_are_refused_by_name(make: Callable[[], Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()


def test_a_client_started_directly_over_ps_tensors_and_one_over_the_model_refused() -> None:
    model = Net()
    opt = _opt(model, overlap=True)
    params, buffers = opt.ps_tensors(list(model.named_parameters()), list(model.named_buffers()))
    client = PSClient.start(PSConfig(mode="async"), params, buffers, optimizer=opt.outer_optimizer("async", 1))
    try:
        assert [n for n, _ in client.params] == [n for n, _ in model.named_parameters()]
        assert opt.ps_tensors(model.named_parameters())[0][0][1] is params[0][1]  # one shadow per tensor
        client.pull_initial()
        opt.attach(client)
        x0 = _params(model)
        total = _run(model, opt, client)
        _check_global(model, opt, client, x0, total)
        other = _opt(Net(), overlap=True)
        other.outer_optimizer("async", 1)
        other.delta.outer = client.optimizer  # the right optimizer, but the client holds other tensors
        with pytest.raises(ValueError, match="ps_tensors"):
            other.attach(client)
    finally:
        client.close()


def test_bf16_error_feedback_is_kept_on_the_training_thread() -> None:
    """wire_dtype="bfloat16": the deltas are rounded with error feedback before the thread starts; the servers'
    copy ends at the start plus the true sum less the last carried error e, |e| <= half a bf16 unit."""
    model = Net()
    opt = _opt(model, overlap=True)
    cfg = PSConfig(mode="async", wire_dtype="bfloat16")
    client = opt.start_ps(cfg, list(model.named_parameters()), list(model.named_buffers()))
    try:
        x0 = _params(model)
        total = _run(model, opt, client)
        residual = opt.delta.residual
        assert residual is not None and any(bool(e.abs().max() > 0) for e in residual)
        for p, a, t, e in zip(model.parameters(), x0, total, residual, strict=True):
            # e is x_pulled − x_local left unsent: the servers' copy is the true one plus e
            np.testing.assert_allclose(p.detach().double().numpy() - e.double().numpy(), a + t, rtol=0, atol=2e-6)
            assert float(e.abs().max()) <= 2.0**-9 * 0.2  # half a bf16 unit of deltas below 0.2
    finally:
        client.close()


def test_copies_and_checkpoints_keep_the_setting() -> None:
    import copy
    import pickle

    opt = AsyncLAMB(Net().parameters(), overlap=True)
    assert copy.deepcopy(opt).overlap and pickle.loads(pickle.dumps(opt)).overlap
    assert opt.state_dict()[AsyncLAMB.state_key]["overlap"] is True
    assert "overlap=True" in repr(opt) and not AsyncLAMB(Net().parameters()).overlap


def test_ps_tensors_takes_generators_and_refreshes_the_shadows() -> None:
    model = Net()
    plain = _opt(model, overlap=False).ps_tensors(model.named_parameters(), model.named_buffers())
    assert [t for _, t in plain[0]] == list(model.parameters()) and len(plain[1]) == 2
    opt = _opt(model, overlap=True)
    first, _ = opt.ps_tensors(model.named_parameters())
    with torch.no_grad():
        model.lin.weight.add_(1.0)
    again, _ = opt.ps_tensors(model.named_parameters())
    assert again[0][1] is first[0][1] and torch.equal(again[0][1], model.lin.weight)
    assert again[0][1] is not model.lin.weight
