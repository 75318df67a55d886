"""AsyncLAMB: LAMB without a PS, local steps + delta averaging with one (in-process and 2 gloo workers)."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch

from ivyplug.optim import LAMB, AsyncLAMB
from ivyplug.ps import PSConfig
from tests.optim import async_scenarios
from tests.ps.harness import run_workers


def _mlp(seed: int) -> torch.nn.Module:
    return async_scenarios.mlp(seed)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def test_without_a_ps_it_is_lamb_bitwise() -> None:
    a, b = _mlp(0), _mlp(0)
    opt_a = AsyncLAMB(a.parameters(), lr=0.02, weight_decay=0.01, max_trust_ratio=5.0, sync_every=2)
    opt_b = LAMB(b.parameters(), lr=0.02, weight_decay=0.01, max_trust_ratio=5.0)
    _train(a, opt_a, 7)
    _train(b, opt_b, 7)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert opt_a.exchanges == 0 and not opt_a.attached


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sync_every": 0}, "sync_every must be an int >= 1"),
        ({"sync_every": True}, "sync_every must be an int >= 1"),
        ({"sync_every": 2.0}, "sync_every must be an int >= 1"),
        ({"merge_rate": 0.0}, "merge_rate must be None or a finite number > 0"),
        ({"merge_rate": math.nan}, "merge_rate must be None or a finite number > 0"),
        ({"merge_rate": -1}, "merge_rate must be None or a finite number > 0"),
        ({"lr": -1.0}, "lr"),
    ],
)
def test_bad_arguments_are_refused_by_name(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        AsyncLAMB(_mlp(0).parameters(), **kwargs)


def test_outer_optimizer_rates_and_attach_checks() -> None:
    opt = AsyncLAMB(_mlp(0).parameters())
    assert opt.outer_optimizer("sync", 4).param_groups[0]["lr"] == 1.0
    assert opt.outer_optimizer("async", 4).param_groups[0]["lr"] == 0.25
    assert opt.outer_optimizer("ssp", 2).param_groups[0]["lr"] == 0.5
    assert AsyncLAMB(_mlp(0).parameters(), merge_rate=0.3).outer_optimizer("async", 4).param_groups[0]["lr"] == 0.3
    with pytest.raises(ValueError, match="mode must be"):
        opt.outer_optimizer("bsp", 2)
    with pytest.raises(ValueError, match="num_workers"):
        opt.outer_optimizer("sync", 0)
    with pytest.raises(RuntimeError, match="needs a PS"):
        opt.exchange()


def test_one_worker_exchanges_every_h_steps_and_follows_lamb() -> None:
    """One worker, merge_rate 1: the global copy after each exchange is the local LAMB result (to rounding)."""
    model, ref = _mlp(0), _mlp(0)
    opt = AsyncLAMB(model.parameters(), lr=0.02, sync_every=3)
    client = opt.start_ps(PSConfig(mode="async"), list(model.named_parameters()))
    ref_opt = LAMB(ref.parameters(), lr=0.02)
    try:
        _train(model, opt, 7)
        _train(ref, ref_opt, 7)
        assert opt.exchanges == 2 and opt.local_steps == 1  # steps 3 and 6 exchanged
        opt.flush()
        assert opt.exchanges == 3 and opt.local_steps == 0
        opt.flush()  # nothing new: no exchange
        assert opt.exchanges == 3
        assert client.metrics()["pushes"] == 3
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
        # the servers hold what the worker holds
        client.sync()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    finally:
        client.close()


def test_copies_and_checkpoints_are_not_attached_and_keep_the_settings() -> None:
    model = _mlp(0)
    opt = AsyncLAMB(model.parameters(), lr=0.02, sync_every=5, merge_rate=0.5)
    client = opt.start_ps(PSConfig(mode="async"), list(model.named_parameters()))
    try:
        _train(model, opt, 5)
        dup = copy.deepcopy(opt)
        assert not dup.attached and dup.sync_every == 5 and dup.merge_rate == 0.5 and dup.exchanges == 1
        sd = opt.state_dict()
        fresh = AsyncLAMB(_mlp(1).parameters(), lr=0.02, sync_every=5, merge_rate=0.5)
        fresh.load_state_dict(sd)
        assert fresh.exchanges == 1 and not fresh.attached
        assert fresh.state_dict()["state"].keys() == sd["state"].keys()
    finally:
        client.close()


@pytest.fixture(scope="module")
def world2() -> list[dict[str, Any]]:
    return run_workers(async_scenarios.session, 2, timeout=180)


def test_sync_exchange_moves_the_global_copy_by_the_mean_delta(world2: list[dict[str, Any]]) -> None:
    r0, r1 = world2[0]["sync"], world2[1]["sync"]
    x0 = r0["x0"]
    assert torch.equal(r0["x0"], r1["x0"])  # both started from the servers' copy (rank 0's weights)
    deltas = [r["local"] - x0 for r in (r0, r1)]
    assert not torch.equal(deltas[0], deltas[1])  # different data: different local progress
    want = x0 + (deltas[0] + deltas[1]) / 2  # float64 reference
    for r in (r0, r1):
        torch.testing.assert_close(r["after"], want, rtol=0, atol=2e-6)
    # second exchange: rank 1's copy held a NaN, so the PS dropped its whole delta and it counted zero
    # local steps: the global copy moves by rank 0's delta alone (averaging in a zero would halve it)
    want2 = r0["local2"]
    for r in (r0, r1):
        assert torch.isfinite(r["after2"]).all()
        torch.testing.assert_close(r["after2"], want2, rtol=0, atol=2e-6)
    assert (r0["discarded"], r1["discarded"]) == (0, 1)
    assert r0["exchanges"] == r1["exchanges"] == 2


def test_async_merges_every_pushed_delta(world2: list[dict[str, Any]]) -> None:
    a0, a1 = world2[0]["async"], world2[1]["async"]
    assert a0["exchanges"] == a1["exchanges"] == 8
    want = a0["x0"] + 0.5 * (a0["pushed"] + a1["pushed"])  # merge_rate 1/2, no staleness scaling
    for a in (a0, a1):
        torch.testing.assert_close(a["final"], want, rtol=0, atol=1e-5)


def test_docstring_example_runs() -> None:
    import doctest

    from ivyplug.localsgd import async_lamb

    tests = [t for t in doctest.DocTestFinder().find(async_lamb.AsyncLAMB, "AsyncLAMB", globs={}) if t.examples]
    assert tests, "AsyncLAMB's docstring must hold a runnable example"
    runner = doctest.DocTestRunner()
    for test in tests:
        runner.run(test)
    assert runner.summarize(verbose=False).failed == 0
