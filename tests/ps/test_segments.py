"""The fp32 wire cut into segments (``ivyplug.ps.wire.segments``): large tensors travel in place.

The cut itself is checked on plans; then 2 real processes over gloo fit a model with tensors on both sides
of the threshold, once cut and once with every payload as one message: the parameters and buffers must be
equal bit for bit. The control: sentinel NaNs in the push and reply buffers survive a step only where a
segment went from ``.grad`` and into the parameter without passing through them.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch

from ivyplug.ps.sharding import TensorSpec, build_plan
from ivyplug.ps.wire.segments import DIRECT_MIN, Segment, views, wire_segments
from tests.ps import segments_scenarios
from tests.ps.harness import run_workers

pytestmark = pytest.mark.timeout(300)


def _plan(specs: list[TensorSpec], **kw: Any) -> Any:
    return build_plan(specs, 1, **kw)


def _covers(segments: list[Segment], n: int) -> None:
    """The segments partition ``[0, n)`` in order, none empty."""
    assert segments[0].start == 0 and segments[-1].end == n
    for a, b in itertools.pairwise(segments):
        assert a.end == b.start
    assert all(s.numel > 0 for s in segments)


def test_small_tensors_travel_as_one_message() -> None:
    plan = _plan([TensorSpec("w", (100, 10)), TensorSpec("b", (10,)), TensorSpec("m", (10,), kind="buffer")])
    assert wire_segments(plan.pieces[0]) == [Segment(0, plan.shard_numel(0))]


def test_large_parameters_are_segments_of_their_own_between_runs_of_small_pieces() -> None:
    big = DIRECT_MIN
    specs = [
        TensorSpec("a", (10,)),
        TensorSpec("big1", (big,)),
        TensorSpec("big2", (2, big // 2)),
        TensorSpec("c", (3, 3)),
        TensorSpec("big3", (big + 1,)),
        TensorSpec("buf", (big,), kind="buffer"),  # buffers are never in place (they travel by value)
        TensorSpec("steps", (), kind="buffer", is_float=False),
    ]
    plan = _plan(specs, max_shard_bytes=None)
    pieces = plan.pieces[0]
    segments = wire_segments(pieces)
    _covers(segments, plan.shard_numel(0))
    direct = {pieces[s.piece].index for s in segments if s.piece is not None}
    assert direct == {1, 2, 4}
    for s in segments:
        if s.piece is not None:
            p = pieces[s.piece]
            assert (s.start, s.end) == (p.offset, p.offset + p.numel)
    # every run of small pieces between two large ones is one segment: [a], [c], [buf, steps]
    runs = [[pieces[i].index for i in range(len(pieces)) if s.start <= pieces[i].offset < s.end] for s in segments]
    assert [r for r, s in zip(runs, segments, strict=True) if s.piece is None] == [[0], [3], [5, 6]]


def test_just_below_the_threshold_is_packed() -> None:
    plan = _plan([TensorSpec("w", (DIRECT_MIN - 1,))])
    assert wire_segments(plan.pieces[0]) == [Segment(0, DIRECT_MIN - 1)]
    assert wire_segments([]) == []


def test_views_fill_the_flat_tensor() -> None:
    flat = torch.zeros(10)
    for i, v in enumerate(views(flat, [Segment(0, 3), Segment(3, 4, 0), Segment(4, 10)])):
        v.fill_(i + 1)
    torch.testing.assert_close(flat, torch.tensor([1.0, 1, 1, 2, 3, 3, 3, 3, 3, 3]))


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_workers(segments_scenarios.session, 2, timeout=280)


@pytest.mark.parametrize("case", ["sync", "async", "dedicated", "nan"])
def test_cut_and_whole_payloads_train_bit_for_bit_alike(runs: list[dict[str, Any]], case: str) -> None:
    for r in runs:
        cut, whole = r[case][True], r[case][False]
        # large tensors among the shards this worker reaches over the wire; with a dedicated server all of them:
        # hidden.weight, extra and wide.weight's first row block (1280 rows; its second, 768 rows, is packed)
        assert cut["direct"] == (3 if case == "dedicated" else cut["direct"]) >= 1
        assert whole["direct"] == 0
        for a, b in zip(cut["params"] + cut["buffers"], whole["params"] + whole["buffers"], strict=True):
            assert torch.equal(a, b)
            assert not a.is_floating_point() or bool(torch.isfinite(a).all())
        assert cut["pointers_kept"] and whole["pointers_kept"]  # received into the parameters themselves
        assert cut["version_bumped"] and whole["version_bumped"]
        assert cut["pushes"] == whole["pushes"] == segments_scenarios.STEPS


@pytest.mark.parametrize("case", ["sync", "async", "dedicated"])
def test_large_segments_bypass_the_buffers(runs: list[dict[str, Any]], case: str) -> None:
    """The control: where a segment went through the buffers, its sentinel NaN would have been overwritten
    (and a NaN sent from the push buffer would have been caught and dropped)."""
    for r in runs:
        cut = r[case][True]
        assert cut["placed"] == cut["direct"]
        assert cut["nonfinite_skipped"] == 0


def test_a_nan_in_a_gradient_sent_in_place_drops_the_whole_push(runs: list[dict[str, Any]]) -> None:
    assert [r["nan"][True]["nonfinite_skipped"] for r in runs] == [0, 1]
    assert [r["nan"][False]["nonfinite_skipped"] for r in runs] == [0, 1]
    nan_free = runs[0]["nan"][True]["params"]
    assert all(not math.isnan(float(p.abs().max())) for p in nan_free)
    # the dropped push changed the fit: it differs from the one without the NaN
    assert not all(torch.equal(a, b) for a, b in zip(nan_free, runs[0]["sync"][True]["params"], strict=True))


def test_many_segments_per_shard_do_not_wait_on_each_other(runs: list[dict[str, Any]]) -> None:
    for r in runs:
        cut, whole = r["many"][True], r["many"][False]
        assert min(cut["cuts"]) > 16 and whole["cuts"] == [0]
        for a, b in zip(cut["params"], whole["params"], strict=True):
            assert torch.equal(a, b)


def test_empty_pieces_make_no_empty_segment() -> None:
    """A message of no bytes is never sent, so no segment may be empty (its receive would take the next one)."""
    specs = [
        TensorSpec("big", (DIRECT_MIN,)),
        TensorSpec("nothing", (0, 4)),
        TensorSpec("big2", (DIRECT_MIN,)),
        TensorSpec("none", (0,), kind="buffer"),
    ]
    pieces = _plan(specs, max_shard_bytes=None).pieces[0]
    segments = wire_segments(pieces)
    assert [s.piece is not None for s in segments] == [True, True]
    _covers(segments, 2 * DIRECT_MIN)
