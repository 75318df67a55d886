"""Affine step-time fits and min-max shares against independent float64 references (numpy/scipy, brute force)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from scipy.optimize import lsq_linear

from ivyplug.load import worker_shares
from ivyplug.load.share_model import (
    StepTimeModel,
    damped_shares,
    fit_all,
    fit_step_time,
    min_max_shares,
    next_shares,
    recent_distinct,
    round_shares,
    trust_bounds,
    water_level,
)


def _max_time(models: list[StepTimeModel], shares: list[int]) -> float:
    return max(m.intercept + m.slope * b for m, b in zip(models, shares, strict=True))


def _random_models(rng: np.random.Generator, n: int) -> list[StepTimeModel]:
    return [
        StepTimeModel(float(rng.uniform(0.0, 0.05)) * float(rng.integers(0, 2)), float(rng.uniform(1e-5, 1e-3)), True)
        for _ in range(n)
    ]


def test_fit_matches_numpy_least_squares_on_random_lines() -> None:
    rng = np.random.default_rng(5)
    for _ in range(300):
        a, c = rng.uniform(0.001, 0.1), rng.uniform(1e-5, 1e-3)
        b = rng.choice(np.arange(1, 1000), size=int(rng.integers(2, 6)), replace=False).astype(np.float64)
        t = a + c * b + rng.normal(0, 1e-4, size=b.size) * c * 100
        model = fit_step_time(list(zip(b.tolist(), t.tolist(), strict=True)), window=6)
        slope, intercept = np.polyfit(b, t, 1)
        if intercept >= 0 and slope >= 0.05 * t.mean() / b.mean():
            assert model.fitted
            assert model.intercept == pytest.approx(intercept, rel=1e-9, abs=1e-12)
            assert model.slope == pytest.approx(slope, rel=1e-9, abs=1e-15)


def test_constrained_fit_matches_scipy_bounded_least_squares() -> None:
    """Noise that tilts the line (a < 0 or c below the floor) gets the box-constrained optimum."""
    rng = np.random.default_rng(7)
    clamped = 0
    for _ in range(120):
        b = rng.choice(np.arange(1, 600), size=int(rng.integers(2, 5)), replace=False).astype(np.float64)
        t = rng.uniform(0.01, 0.2, size=b.size)  # unrelated to b: slopes of either sign, intercepts too
        points = list(zip(b.tolist(), t.tolist(), strict=True))
        model = fit_step_time(points, window=5, min_slope_fraction=0.05)
        c_min = 0.05 * t.mean() / b.mean()
        ref = lsq_linear(
            np.stack([np.ones_like(b), b], axis=1), t, bounds=([0.0, c_min], [np.inf, np.inf]), method="bvls"
        )
        sse = float(np.sum((t - model.intercept - model.slope * b) ** 2))
        assert sse <= float(np.sum((t - ref.x[0] - ref.x[1] * b) ** 2)) + 1e-12
        assert model.intercept >= 0.0 and model.slope >= c_min * (1 - 1e-12)
        clamped += int(model.intercept == 0.0 or model.slope == pytest.approx(c_min))
    assert clamped > 20  # the random data exercised the clamps


def test_fit_edge_cases() -> None:
    # one observation: the prior (a = f*t, the rest per sample); f = 0 is the proportional rule
    m = fit_step_time([(256.0, 0.5)])
    assert not m.fitted and m.intercept == 0.0 and m.slope == pytest.approx(0.5 / 256)
    m = fit_step_time([(200.0, 0.4)], prior_fraction=0.25)
    assert m.intercept == pytest.approx(0.1) and m.predict(200.0) == pytest.approx(0.4)
    # the same share twice is singular: the newest reading is the one observation
    m = fit_step_time([(256.0, 0.5), (256.0, 0.7)])
    assert not m.fitted and m.slope == pytest.approx(0.7 / 256)
    # a negative intercept (time grows faster than the share) clamps to a = 0, least squares through 0
    m = fit_step_time([(100.0, 0.05), (200.0, 0.2)])
    assert m.intercept == 0.0 and m.slope == pytest.approx((100 * 0.05 + 200 * 0.2) / (100**2 + 200**2))
    # a negative slope (more samples, less time: noise) clamps to the slope floor
    m = fit_step_time([(100.0, 0.3), (200.0, 0.2)], min_slope_fraction=0.05)
    assert m.slope == pytest.approx(0.05 * 0.25 / 150) and m.intercept == pytest.approx(0.25 - m.slope * 150)
    # the window keeps the newest reading of the last distinct shares
    assert recent_distinct([(1.0, 1.0), (2.0, 2.0), (1.0, 3.0), (3.0, 4.0)], 2) == [(1.0, 3.0), (3.0, 4.0)]
    with pytest.raises(ValueError, match="observations"):
        fit_step_time([])
    with pytest.raises(ValueError, match="seconds"):
        fit_step_time([(10.0, 0.0)])
    with pytest.raises(ValueError, match="window"):
        recent_distinct([(1.0, 1.0)], 0)
    with pytest.raises(ValueError, match="prior_fraction"):
        fit_step_time([(1.0, 1.0)], prior_fraction=1.0)


def test_single_observation_ranks_borrow_the_fitted_ranks_fixed_fraction() -> None:
    fitted_rank = [(100.0, 0.02 + 0.001 * 100), (200.0, 0.02 + 0.001 * 200)]  # a = 0.02: 1/11 of t at b = 200
    models = fit_all([fitted_rank, [(312.0, 0.6)]])
    assert models[0].fitted and models[0].intercept == pytest.approx(0.02)
    assert not models[1].fitted and models[1].intercept == pytest.approx(0.6 * 0.02 / 0.22)
    assert models[1].predict(312.0) == pytest.approx(0.6)
    assert all(not m.fitted and m.intercept == 0.0 for m in fit_all([[(1.0, 1.0)], [(2.0, 1.0)]]))


def test_min_max_shares_equal_brute_force_optimum() -> None:
    rng = np.random.default_rng(13)
    for _ in range(150):
        n = int(rng.integers(1, 4))
        batch = int(rng.integers(n, 20))
        models = _random_models(rng, n)
        shares = min_max_shares(batch, models)
        assert sum(shares) == batch and min(shares) >= 1
        best = min(
            _max_time(models, list(c)) for c in itertools.product(range(1, batch + 1), repeat=n) if sum(c) == batch
        )
        assert _max_time(models, shares) == pytest.approx(best, rel=1e-12, abs=1e-15)


def test_bounded_min_max_shares_equal_brute_force_optimum() -> None:
    rng = np.random.default_rng(19)
    tested = 0
    for _ in range(200):
        n = int(rng.integers(2, 4))
        batch = int(rng.integers(n, 20))
        models = _random_models(rng, n)
        bounds = []
        for _ in range(n):
            low = int(rng.integers(1, 5))
            bounds.append((low, low + int(rng.integers(0, 12))))
        feasible = [c for c in itertools.product(*(range(lo, hi + 1) for lo, hi in bounds)) if sum(c) == batch]
        if not feasible:
            with pytest.raises(ValueError, match="bounds"):
                min_max_shares(batch, models, bounds)
            continue
        tested += 1
        shares = min_max_shares(batch, models, bounds)
        assert sum(shares) == batch and all(lo <= s <= hi for s, (lo, hi) in zip(shares, bounds, strict=True))
        best = min(_max_time(models, list(c)) for c in feasible)
        assert _max_time(models, shares) == pytest.approx(best, rel=1e-12, abs=1e-15)
    assert tested > 50


def test_trust_bounds_limit_extrapolation() -> None:
    histories = [[(256.0, 0.2), (394.0, 0.25)], [(256.0, 0.6), (118.0, 0.55)]]
    assert trust_bounds(512, histories, 4, 2.0) == [(128, 788), (59, 512)]
    assert trust_bounds(8, [[(1.0, 1.0)], [(7.0, 1.0)]], 4, 2.0) == [(1, 2), (3, 14)]
    assert trust_bounds(100, [[(256.0, 1.0)], [(256.0, 1.0)]], 4, 2.0) is None  # B fell below the bounds
    # a two-point fit that claims a huge fixed cost on rank 1 moves its share at most to half its lowest
    step = next_shares(512, [394, 118], [256, 256], histories, 1.0)
    assert step.target == [453, 59]
    with pytest.raises(ValueError, match="factor"):
        trust_bounds(512, histories, 4, 1.0)


def test_min_max_shares_on_large_batches_against_a_greedy_reference() -> None:
    """Greedy (each next sample to the rank that stays fastest) is optimal for min-max with increasing costs."""
    rng = np.random.default_rng(17)
    for _ in range(40):
        n = int(rng.integers(2, 9))
        batch = int(rng.integers(n, 700))
        models = _random_models(rng, n)
        greedy = [1] * n
        for _ in range(batch - n):
            j = min(range(n), key=lambda i: models[i].intercept + models[i].slope * (greedy[i] + 1))
            greedy[j] += 1
        shares = min_max_shares(batch, models)
        assert sum(shares) == batch and min(shares) >= 1
        assert _max_time(models, shares) == pytest.approx(_max_time(models, greedy), rel=1e-12)
        level = water_level(batch, models)
        assert sum(level) == pytest.approx(batch, rel=1e-9)
        above = [m.predict(x) for m, x in zip(models, level, strict=True) if x > 1.0]
        assert max(above) - min(above) <= 1e-9 * max(above)


def test_share_edge_cases() -> None:
    same = [StepTimeModel(0.01, 1e-4, True)] * 4
    assert min_max_shares(512, same) == [128, 128, 128, 128]  # equal speeds -> equal shares
    assert min_max_shares(4, _random_models(np.random.default_rng(0), 4)) == [1, 1, 1, 1]  # B = workers
    assert min_max_shares(9, [StepTimeModel(0.0, 1.0, True)]) == [9]
    # a rank whose fixed cost alone exceeds the others' whole step keeps the floor of one sample
    assert min_max_shares(100, [StepTimeModel(0.0, 1e-3, True), StepTimeModel(1.0, 1e-3, True)]) == [99, 1]
    # with a = 0 everywhere the optimum is the proportional split (never worse than largest remainder)
    models = [StepTimeModel(0.0, 1 / v, False) for v in (3.0, 1.0, 0.5)]
    proportional = worker_shares(97, [3.0, 1.0, 0.5])
    assert _max_time(models, min_max_shares(97, models)) <= _max_time(models, proportional)
    assert round_shares(5, [0.2, 0.2, 4.6]) == [1, 1, 3]
    with pytest.raises(ValueError, match="at least the number of workers"):
        min_max_shares(2, same)
    with pytest.raises(ValueError, match=r"models\[1\]"):
        min_max_shares(10, [StepTimeModel(0.0, 1.0, True), StepTimeModel(0.0, 0.0, True)])


def test_damping_halves_on_reversal_and_regrows_when_consistent() -> None:
    shares, gain = damped_shares(512, [256, 256], [384, 128], None, 1.0)
    assert shares == [384, 128] and gain == 1.0  # the first move is a full one
    shares, gain = damped_shares(512, [384, 128], [300, 212], [256, 256], 1.0)
    assert gain == 0.5 and shares == [342, 170]  # overshoot: half way back
    shares, gain = damped_shares(512, [342, 170], [330, 182], [384, 128], 0.5)
    assert gain == 0.75 and shares == [333, 179]
    shares, gain = damped_shares(1024, [384, 128], [700, 324], None, 0.5)  # B changed: current rescaled to 768:256
    assert sum(shares) == 1024 and shares == [734, 290]
    assert damped_shares(2, [1, 1], [1, 1], [1, 1], 1.0) == ([1, 1], 1.0)
    with pytest.raises(ValueError, match="target"):
        damped_shares(10, [5, 5], [10, 0], None, 1.0)
    with pytest.raises(ValueError, match="gain"):
        damped_shares(10, [5, 5], [6, 4], None, 0.0)


def _simulate(truth: list[tuple[float, float]], epochs: int, batch: int = 512) -> list[list[int]]:
    shares = [batch // len(truth)] * len(truth)
    previous, gain = None, 1.0
    histories: list[list[tuple[float, float]]] = [[] for _ in truth]
    seen = [shares]
    for _ in range(epochs):
        for h, (a, c), b in zip(histories, truth, shares, strict=True):
            h.append((float(b), a + c * b))
        step = next_shares(batch, shares, previous, histories, gain)
        previous, shares, gain = shares, step.shares, step.gain
        seen.append(shares)
    return seen


def test_converges_to_the_optimum_when_fixed_costs_differ() -> None:
    """The issue's case: the slow rank's fixed cost is slowed too, so per-sample speed falls with its share."""
    truth = [(0.014, 8e-5), (0.014 + 6 * 0.004, 7 * 8e-5)]  # forward f = 4 ms + 80 us/sample, sleep 6 f on rank 1
    models = [StepTimeModel(a, c, True) for a, c in truth]
    best = min_max_shares(512, models)
    seen = _simulate(truth, 6)
    assert seen[1][1] == 128  # the proportional first guess would be lower: held at half the measured share
    assert seen[4] == best and seen[-1] == best  # the trust region halves the share per epoch, then the fit lands
    slow = [s[1] for s in seen]
    assert all(x >= y for x, y in itertools.pairwise(slow))  # monotone: no overshoot, no oscillation


def test_converges_for_three_ranks_and_holds_when_balanced() -> None:
    truth = [(0.01, 1e-4), (0.03, 2e-4), (0.005, 5e-4)]
    best = min_max_shares(600, [StepTimeModel(a, c, True) for a, c in truth])
    seen = _simulate(truth, 6, batch=600)
    assert seen[-1] == best and seen[-2] == best
    assert _simulate([(0.01, 1e-4)] * 2, 3) == [[256, 256]] * 4  # equal ranks: shares never move
