"""A shard's state lent to its replies (``ivyplug.ps.server.lent_state``): no copy per reply, never a torn one.

The buffer is checked alone, then on shards (a held reply keeps the values of its version while later
steps go on, checked against a float64 SGD reference; released replies let the state stay in place),
then in 2 real processes over gloo: a sync step's replies cost no copy, and the server keeps one reply per
worker and shard, not one per step.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

from ivyplug.ps import PSConfig
from ivyplug.ps.server.lent_state import LentState
from ivyplug.ps.server.mirror import OptimizerSpec
from ivyplug.ps.server.shard import Shard, load_state_bytes
from ivyplug.ps.sharding import TensorSpec, build_plan
from ivyplug.ps.wire.push import hyper_prefix
from tests.ps import lent_state_scenarios
from tests.ps.harness import run_workers
from tests.ps.introspection import held_buffers

pytestmark = pytest.mark.timeout(300)


def test_a_lent_buffer_is_left_unchanged_and_the_write_goes_to_a_copy() -> None:
    values = torch.randn(1000)
    state = LentState(values.clone())
    data, loan = state.lend()
    assert state.writable() is True  # lent: the state moves (one copy) before the write
    assert state.data.data_ptr() != data.data_ptr()
    torch.testing.assert_close(state.data, values, rtol=0, atol=0)
    state.data.mul_(2)
    torch.testing.assert_close(data, values, rtol=0, atol=0)  # the reader's view kept its version
    loan.release()
    loan.release()  # idempotent
    assert loan.released
    assert state.writable() is False and state.moves == 1


def test_released_or_dropped_loans_let_the_state_stay_in_place_and_buffers_are_reused() -> None:
    state = LentState(torch.zeros(64))
    ptr = state.data.data_ptr()
    for _ in range(5):
        _, loan = state.lend()
        loan.release()
        assert state.writable() is False
    _, dropped = state.lend()
    del dropped  # a reader that forgot to release: collected, released
    gc.collect()
    assert state.writable() is False and state.data.data_ptr() == ptr and state.moves == 0
    # one reply in flight at each write: the state alternates between two buffers, never more
    held = None
    for step in range(50):
        _, loan = state.lend()
        if held is not None:
            held.release()
        held = loan
        state.writable()
        state.data.add_(1)
        assert held_buffers(state) <= 2, step
    assert state.moves == 50
    torch.testing.assert_close(state.data, torch.full((64,), 50.0), rtol=0, atol=0)
    # k replies of k versions in flight: k + 1 buffers; all back: the next moves reuse them, none is added
    held.release()
    loans = []
    for _ in range(3):
        loans.append(state.lend()[1])
        state.writable()
    assert held_buffers(state) == 4
    for loan in loans:
        loan.release()
    before = held_buffers(state)
    ptrs = set()
    for _ in range(3):
        loans = [state.lend()[1]]
        state.writable()
        ptrs.add(state.data.data_ptr())
        loans[0].release()
    assert held_buffers(state) == 2  # the current one and one free spare; the other two were dropped
    assert before == 4 and len(ptrs) == 2  # the moves reused two buffers, allocated none


def test_a_state_must_be_one_flat_float32_tensor() -> None:
    with pytest.raises(ValueError, match="contiguous flat float32"):
        LentState(torch.zeros(3, 4))
    with pytest.raises(ValueError, match="contiguous flat float32"):
        LentState(torch.zeros(8, dtype=torch.float64))


def _shard(mode: str, lr: float = 0.1, momentum: float = 0.9) -> tuple[Shard, torch.Tensor, Any]:
    """One shard of a 2-worker job: two params (a matrix and a vector) and a float buffer, random values."""
    gen = torch.Generator().manual_seed(7)
    w, b = torch.nn.Parameter(torch.randn(5, 3, generator=gen)), torch.nn.Parameter(torch.randn(3, generator=gen))
    opt = torch.optim.SGD([w, b], lr=lr, momentum=momentum)
    spec = OptimizerSpec.from_optimizer(opt, [w, b])
    specs = [TensorSpec("w", (5, 3)), TensorSpec("b", (3,)), TensorSpec("m", (3,), kind="buffer")]
    plan = build_plan(specs, 1)
    init = torch.cat([w.detach().reshape(-1), b.detach(), torch.randn(3, generator=gen)])
    shard = Shard(0, plan, PSConfig(mode=mode, staleness_scaling="none"), 2, spec, init)
    hyper = torch.cat([hyper_prefix([True, True]), spec.encode(opt)])
    return shard, init, hyper


def _sgd_reference(
    init: torch.Tensor, grads: list[torch.Tensor], lr: float = 0.1, momentum: float = 0.9
) -> torch.Tensor:
    """Params after SGD with momentum over ``grads`` (float64), as torch.optim.SGD defines it."""
    p, buf = init[:18].double().clone(), None
    for g in grads:
        g = g[:18].double()
        buf = g.clone() if buf is None else momentum * buf + g
        p = p - lr * buf
    return p


def test_async_a_held_reply_keeps_its_version_while_later_pushes_step_a_copy() -> None:
    shard, init, hyper = _shard("async")
    gen = torch.Generator().manual_seed(11)
    g0, g1 = torch.randn(21, generator=gen), torch.randn(21, generator=gen)
    first = shard.push_pull(0, g0, hyper).result(1)  # held: worker 0 has not read it yet
    second = shard.push_pull(1, g1, hyper).result(1)
    assert first.snapshot.data_ptr() != second.snapshot.data_ptr()
    assert shard.flat.moves == 1
    want_first, want_second = _sgd_reference(init, [g0]), _sgd_reference(init, [g0, g1])
    torch.testing.assert_close(first.snapshot[:18].double(), want_first, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(second.snapshot[:18].double(), want_second, rtol=1e-6, atol=1e-6)
    # async buffers: the running mean over 2 workers of what each pushed
    mean_first = init[18:] + (g0[18:] - init[18:]) / 2
    torch.testing.assert_close(first.snapshot[18:], mean_first, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(second.snapshot[18:], mean_first + (g1[18:] - mean_first) / 2, rtol=1e-6, atol=1e-6)
    # the masters the optimizer steps are views of the current buffer
    assert shard.masters[0].data_ptr() == shard.flat.data.data_ptr()
    first.release()
    second.release()


def test_async_replies_released_before_the_next_push_cost_no_copy() -> None:
    shard, init, hyper = _shard("async")
    gen = torch.Generator().manual_seed(12)
    grads = [torch.randn(21, generator=gen) for _ in range(6)]
    ptr = shard.flat.data.data_ptr()
    for i, g in enumerate(grads):
        reply = shard.push_pull(i % 2, g, hyper).result(1)
        torch.testing.assert_close(reply.snapshot[:18].double(), _sgd_reference(init, grads[: i + 1]))
        reply.release()
    assert shard.flat.moves == 0 and shard.flat.data.data_ptr() == ptr and held_buffers(shard.flat) == 1


def test_sync_every_reply_of_a_step_shares_one_buffer_and_a_held_one_survives_the_next_step() -> None:
    shard, init, hyper = _shard("sync")
    gen = torch.Generator().manual_seed(13)
    g = [torch.randn(21, generator=gen) for _ in range(4)]
    a, b = shard.push_pull(0, g[0], hyper), shard.push_pull(1, g[1], hyper)
    ra, rb = a.result(1), b.result(1)
    assert ra.snapshot.data_ptr() == rb.snapshot.data_ptr()  # no copy per worker
    step1 = _sgd_reference(init, [(g[0] + g[1]) / 2])
    torch.testing.assert_close(ra.snapshot[:18].double(), step1, rtol=1e-6, atol=1e-6)
    ra.release()
    rb.release()
    a, b = shard.push_pull(0, g[2], hyper), shard.push_pull(1, g[3], hyper)
    ra, rb = a.result(1), b.result(1)
    assert shard.flat.moves == 0  # released before the step: stepped in place
    step2 = _sgd_reference(init, [(g[0] + g[1]) / 2, (g[2] + g[3]) / 2])
    torch.testing.assert_close(rb.snapshot[:18].double(), step2, rtol=1e-6, atol=1e-6)
    rb.release()  # worker 0 holds its reply of step 2 through step 3
    a, b = shard.push_pull(0, g[0], hyper), shard.push_pull(1, g[1], hyper)
    assert shard.flat.moves == 1
    torch.testing.assert_close(ra.snapshot[:18].double(), step2, rtol=1e-6, atol=1e-6)
    step3 = _sgd_reference(init, [(g[0] + g[1]) / 2, (g[2] + g[3]) / 2, (g[0] + g[1]) / 2])
    torch.testing.assert_close(b.result(1).snapshot[:18].double(), step3, rtol=1e-6, atol=1e-6)


def test_a_checkpoint_load_does_not_write_into_a_lent_state() -> None:
    shard, init, hyper = _shard("async")
    saved = shard.state()
    reply = shard.push_pull(0, torch.ones(21), hyper).result(1)
    before = reply.snapshot.clone()
    shard.load(load_state_bytes(saved))
    torch.testing.assert_close(reply.snapshot, before, rtol=0, atol=0)
    torch.testing.assert_close(shard.flat.data[:18], init[:18], rtol=0, atol=0)


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict[str, Any]]]:
    out = {mode: run_workers(lent_state_scenarios.fit, 2, mode, timeout=240) for mode in ("sync", "async")}
    # a bf16 reply is an encoded copy (its loan released at once); early pushes (PUSH_DATA) free the last reply
    out["sync_bf16"] = run_workers(lent_state_scenarios.fit, 2, "sync", {"wire_dtype": "bfloat16"}, timeout=240)
    out["sync_overlap"] = run_workers(lent_state_scenarios.fit, 2, "sync", {"overlap_backward": True}, timeout=240)
    return out


@pytest.mark.parametrize("case", ["sync", "sync_bf16", "sync_overlap"])
def test_sync_replies_over_gloo_cost_no_copy_of_the_state(runs: dict[str, list[dict[str, Any]]], case: str) -> None:
    for rank in (0, 1):
        r = runs[case][rank]
        assert r["moves"] == 0, r
        assert r["buffers"] == 1, r


def test_async_in_turns_a_reply_in_flight_makes_the_next_push_step_a_copy(
    runs: dict[str, list[dict[str, Any]]],
) -> None:
    """The control: rank 1's reply from shard 0 is still held (it has sent no request since) when rank 0
    pushes to its own shard, so each such step moves the state (and never holds more than a few buffers)."""
    assert runs["async"][0]["moves"] >= lent_state_scenarios.STEPS - 1
    assert runs["async"][0]["buffers"] <= 3


def test_the_server_keeps_one_reply_per_worker_and_shard_not_one_per_step(
    runs: dict[str, list[dict[str, Any]]],
) -> None:
    for mode in runs:
        for rank in (0, 1):
            kept = runs[mode][rank]["kept_replies"]
            assert kept and max(kept.values()) <= 1, (mode, rank, kept)


def test_both_ranks_end_with_the_same_finite_parameters(runs: dict[str, list[dict[str, Any]]]) -> None:
    """After ``sync()`` both ranks hold the same finite parameters."""
    for mode in ("sync", "async", "sync_overlap"):  # (a bf16 wire's pulls differ by its rounding from the local)
        a, b = runs[mode][0]["params"], runs[mode][1]["params"]
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
            assert bool(torch.isfinite(x).all())
