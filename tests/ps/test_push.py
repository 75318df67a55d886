"""The push checks that run on every step: the non-finite scan and the squared norm, against plain references."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from ivyplug.ps.wire.codecs import BF16_OVERFLOW
from ivyplug.ps.wire.push import nonfinite_in, nonfinite_in_parts, squared_norm


def _reference(data: torch.Tensor, ranges: list[tuple[int, int]], below: float | None) -> int | None:
    for a, b in ranges:
        part = data[a:b].double()
        ok = torch.isfinite(part) if below is None else part.abs() < below
        if b > a and not bool(ok.all()):
            return a
    return None


@pytest.mark.parametrize("below", [None, BF16_OVERFLOW])
def test_nonfinite_scan_matches_the_elementwise_check(below: float | None) -> None:
    gen = torch.Generator().manual_seed(7)
    specials = [math.nan, math.inf, -math.inf, 3.0e38, -3.0e38, BF16_OVERFLOW, -BF16_OVERFLOW, 1e-45]
    for trial in range(200):
        n = int(torch.randint(1, 3000, (1,), generator=gen))
        data = torch.randn(n, generator=gen) * 10.0 ** float(torch.randint(-3, 4, (1,), generator=gen))
        cuts = sorted(int(c) for c in torch.randint(0, n + 1, (4,), generator=gen))
        ranges = [(cuts[0], cuts[1]), (cuts[1], cuts[1]), (cuts[2], cuts[3])]
        for _ in range(int(torch.randint(0, 3, (1,), generator=gen))):
            data[int(torch.randint(0, n, (1,), generator=gen))] = specials[trial % len(specials)]
        assert nonfinite_in(data, ranges, below) == _reference(data, ranges, below), trial


@pytest.mark.parametrize("below", [None, BF16_OVERFLOW])
def test_the_scan_of_a_payload_in_parts_finds_what_the_whole_scan_finds(below: float | None) -> None:
    """A push cut into segments (segments.py): ranges that straddle parts, parts outside every range."""
    gen = torch.Generator().manual_seed(11)
    specials = [math.nan, math.inf, -math.inf, 3.0e38, BF16_OVERFLOW]
    for trial in range(300):
        n = int(torch.randint(2, 2000, (1,), generator=gen))
        data = torch.randn(n, generator=gen)
        cuts = sorted(int(c) for c in torch.randint(0, n + 1, (4,), generator=gen))
        ranges = [(cuts[0], cuts[1]), (cuts[2], cuts[3])]
        for _ in range(int(torch.randint(0, 3, (1,), generator=gen))):
            data[int(torch.randint(0, n, (1,), generator=gen))] = specials[trial % len(specials)]
        bounds = sorted({0, n, *(int(c) for c in torch.randint(1, n, (3,), generator=gen))})
        parts = [data[a:b] for a, b in itertools.pairwise(bounds)]
        whole = _reference(data, ranges, below)
        got = nonfinite_in_parts(parts, bounds[:-1], ranges, below)
        if whole is None:
            assert got is None, trial
        else:  # an offset inside the first range that holds one
            assert got is not None, trial
            end = next(b for a, b in ranges if a == whole)
            assert whole <= got < end, trial


def test_finite_values_whose_sum_overflows_are_finite() -> None:
    """The fast path's sum overflows to Inf here; the exact look must clear it (no false refusal)."""
    data = torch.full((1000,), 3.0e38)
    assert not math.isfinite(float(data.sum()))
    assert nonfinite_in(data, [(0, 1000)]) is None
    data[999] = math.nan
    assert nonfinite_in(data, [(0, 10), (10, 1000)]) == 10
    assert nonfinite_in(data, [(0, 10)]) is None  # outside the ranges: not looked at


def test_squared_norm_matches_float64() -> None:
    gen = torch.Generator().manual_seed(3)
    for n in (0, 1, 5, (1 << 14) - 1, 1 << 14, (1 << 14) + 3, 700_001):
        x = torch.randn(n, generator=gen) * 3 + 1
        want = float(x.double().square().sum())
        got = squared_norm(x)
        assert got == pytest.approx(want, rel=5e-7, abs=0.0), n
    assert math.isnan(squared_norm(torch.tensor([1.0, math.nan])))
