"""Pushes that overlap backward (``PSConfig.overlap_backward``), in 2 real processes over gloo.

Every fit runs twice, with and without overlap: the parameters must be identical (the same pushes reach
the servers), while the counters show the mechanism at work: shards sent from the gradient hooks
(``shards_sent_early``), and shards packed again at the step because their data changed after backward
(``shards_sent_again``). The cases: plain sync; a gradient edited in place or replaced after backward;
gradient accumulation with and without ``hold_pushes``; a NaN that backward itself produces in the last
shard to complete (the early-sent shards must be dropped too); the bf16 wire; a dedicated server; async
and ssp in a fixed push order; async clipping (which scales every gradient at the step). Overlap that only
repeats itself (every early send changed before its step, twice in a row) is switched off with one warning.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ivyplug.ps.worker.early_push import WASTED_STEPS
from tests.ps import early_push_scenarios
from tests.ps.harness import run_workers

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_workers(early_push_scenarios.session, 2, timeout=280)


CASES = [
    "sync",
    "edited",
    "replaced",
    "data_replaced",
    "unfrozen",
    "accumulated",
    "accumulated_unheld",
    "nan",
    "bf16",
    "dedicated",
    "async",
]
CASES += ["ssp", "async_clipped"]


@pytest.mark.parametrize("case", CASES)
def test_overlap_pushes_exactly_what_the_step_would(runs: list[dict[str, Any]], case: str) -> None:
    for rank in (0, 1):
        on, off = runs[rank][case][True], runs[rank][case][False]
        for a, b in zip(on["params"], off["params"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
            assert bool(torch.isfinite(a).all())
        assert off["shards_sent_early"] == off["shards_sent_again"] == 0  # the control: nothing early
        assert on["bytes_sent"] >= off["bytes_sent"]


def test_overlap_sends_every_shard_from_backward_when_nothing_changes(runs: list[dict[str, Any]]) -> None:
    for rank in (0, 1):
        for case in ("sync", "bf16", "dedicated", "async", "accumulated"):
            on = runs[rank][case][True]
            steps = early_push_scenarios.STEPS
            assert on["shards_sent_early"] == steps * on["shards"], (case, on)
            assert on["shards_sent_again"] == 0, (case, on)
        # the same bytes as without overlap: each shard's data crossed the wire once
        sync = runs[rank]["sync"]
        header_bytes = 128 * early_push_scenarios.STEPS * sync[True]["shards"]
        assert sync[True]["bytes_sent"] - sync[False]["bytes_sent"] <= header_bytes


def test_data_changed_after_backward_is_sent_again(runs: list[dict[str, Any]]) -> None:
    for rank in (0, 1):
        for case in ("edited", "replaced", "data_replaced", "ssp"):
            on = runs[rank][case][True]
            assert on["shards_sent_again"] >= early_push_scenarios.STEPS, (case, on)  # the edited layer's shard
        # the edit matters (so equal results above are not the edit being lost on both sides)
        edited, plain = runs[rank]["edited"][True]["params"], runs[rank]["sync"][True]["params"]
        assert any(not torch.equal(a, b) for a, b in zip(edited, plain, strict=True))
        # a second backward without hold_pushes changes every early-sent shard: after WASTED_STEPS such steps
        # the client warns once, naming why, and pushes at the step from then on
        unheld = runs[rank]["accumulated_unheld"][True]
        assert unheld["shards_sent_again"] == WASTED_STEPS * unheld["shards"], unheld
        assert unheld["shards_sent_early"] == 0
        assert len(unheld["warnings"]) == 1 and "hold_pushes" in unheld["warnings"][0], unheld["warnings"]
        # an edit of one shard's gradient wastes that shard's early send only: the overlap stays on
        assert runs[rank]["edited"][True]["warnings"] == []
        assert runs[rank]["edited"][True]["shards_sent_early"] > 0
        # async clipping rescales every push at the step: sent early once (the first step), then not armed
        clipped = runs[rank]["async_clipped"][True]
        assert clipped["shards_sent_early"] == 0 and clipped["shards_sent_again"] == clipped["shards"], clipped
        assert clipped["warnings"] == []


def test_a_parameter_unfrozen_later_gets_its_hook(runs: list[dict[str, Any]]) -> None:
    """Frozen when the client started, unfrozen at step 1 after that step's arm: that step's shards went out
    without its gradient and are sent again; from the next arm it is hooked, and every shard goes early again
    (no warning: one wasted step is not two)."""
    steps = early_push_scenarios.STEPS
    for rank in (0, 1):
        on = runs[rank]["unfrozen"][True]
        again = on["shards_sent_again"]
        assert 1 <= again <= on["shards"], on  # step 1 only: the shards holding the unfrozen layer
        assert on["shards_sent_early"] == steps * on["shards"] - again, on
        assert on["warnings"] == [], on["warnings"]
        frozen = runs[rank]["sync"][True]["params"][0]  # the control: the first layer did train
        assert not torch.equal(on["params"][0], frozen)


def test_a_nan_from_backward_drops_the_shards_already_sent(runs: list[dict[str, Any]]) -> None:
    assert runs[1]["nan"][True]["nonfinite_skipped"] == 1
    assert runs[0]["nan"][True]["nonfinite_skipped"] == 0
    # the NaN shard completed last: the others had gone early, with finite data, and were dropped too
    assert runs[1]["nan"][True]["shards_sent_early"] == early_push_scenarios.STEPS * runs[1]["nan"][True]["shards"]


@pytest.mark.parametrize(("overlap", "hooked"), [(None, False), (True, True), (False, False)])
def test_overlap_is_opt_in(overlap: bool | None, hooked: bool) -> None:
    """Off by default (it measured slower with CPU workers); ``True`` hooks every parameter."""
    from ivyplug.ps import PSClient, PSConfig

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = PSConfig(mode="sync") if overlap is None else PSConfig(mode="sync", overlap_backward=overlap)
    client = PSClient.start(cfg, list(model.named_parameters()), [], opt)
    try:
        client.pull_initial()
        assert (client.early is not None) is hooked
        model(torch.ones(3, 4)).sum().backward()
        client.step(3)
        assert client.metrics()["shards_sent_early"] == (1.0 if hooked else 0.0)
    finally:
        client.close()
