"""Gradient noise scale and goodput: the estimator against the closed form on synthetic gradients with known
noise (float64), its edge cases, and the policy gate (goodput off grows where goodput on holds)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ivyplug.load import BatchSizePolicy, LoadObservation
from ivyplug.load.goodput import (
    GoodputEstimate,
    NoiseScale,
    StepCost,
    goodput_gain,
    noise_components,
    predict_step_seconds,
    statistical_efficiency,
)

IDLE = LoadObservation(utilization=20.0, memory_fraction=0.3)


def _mean_sq(rng: np.random.Generator, g: np.ndarray, sigma: np.ndarray, batch: int, reps: int) -> np.ndarray:
    """|mean of `batch` per-sample gradients|², `reps` independent draws: per-sample gradient = g + sigma·N(0, I)."""
    noise = rng.standard_normal((reps, g.size)) * sigma / math.sqrt(batch)  # the mean of `batch` draws, exactly
    return ((g + noise) ** 2).sum(axis=1)


def test_components_match_the_closed_form_on_synthetic_gradients() -> None:
    rng = np.random.default_rng()  # fresh inputs every run: the tolerance must hold for any draw
    d = 200
    g = rng.standard_normal(d)
    sigma = rng.uniform(0.5, 3.0, d)
    true_grad_sq, true_trace = float((g**2).sum()), float((sigma**2).sum())
    b, big, reps = 16, 64, 40_000
    small_sq = _mean_sq(rng, g, sigma, b, reps)
    big_sq = _mean_sq(rng, g, sigma, big, reps)
    estimates = np.array([noise_components(s, b, x, big) for s, x in zip(small_sq, big_sq, strict=True)])
    grad_sq, trace = estimates.mean(axis=0)
    # the standard error of the mean over 40k draws is well below 1% here: unbiased estimates land within 2%
    assert math.isclose(grad_sq, true_grad_sq, rel_tol=0.02), (grad_sq, true_grad_sq)
    assert math.isclose(trace, true_trace, rel_tol=0.02), (trace, true_trace)
    # exact algebra on noise-free inputs (E|g_b|² = |G|² + tr/b), float64, tight
    exact = noise_components(true_grad_sq + true_trace / b, b, true_grad_sq + true_trace / big, big)
    assert exact[0] == pytest.approx(true_grad_sq, rel=1e-12) and exact[1] == pytest.approx(true_trace, rel=1e-12)


def test_ema_of_noisy_estimates_gives_the_noise_scale() -> None:
    rng = np.random.default_rng()
    d, b, big = 100, 8, 32
    g = rng.standard_normal(d) * 0.2
    sigma = np.full(d, 1.5)
    true_noise = float((sigma**2).sum() / (g**2).sum())
    scale = NoiseScale(smoothing=0.999)
    for s, x in zip(_mean_sq(rng, g, sigma, b, 20_000), _mean_sq(rng, g, sigma, big, 20_000), strict=True):
        scale.update(*noise_components(s, b, x, big))
    assert scale.value is not None and math.isclose(scale.value, true_noise, rel_tol=0.1), (scale.value, true_noise)
    assert NoiseScale.from_dict(scale.to_dict()) == scale


def test_edge_cases_equal_batches_zero_gradient_and_nan() -> None:
    with pytest.raises(ValueError, match=r"big_batch .* must be larger than small_batch"):
        noise_components(1.0, 32, 1.0, 32)
    with pytest.raises(ValueError, match="small_batch"):
        noise_components(1.0, 0, 1.0, 32)
    with pytest.raises(ValueError, match="big_batch"):
        noise_components(1.0, 8, 1.0, math.nan)
    assert noise_components(0.0, 8, 0.0, 16) == (0.0, 0.0)
    scale = NoiseScale()
    scale.update(0.0, 0.0)  # zero gradient: |G|² is 0, so B_noise is not defined
    assert scale.value is None and scale.updates == 1
    grad_sq, trace = noise_components(math.nan, 8, 1.0, 16)
    assert math.isnan(grad_sq) and math.isnan(trace)
    scale = NoiseScale(smoothing=0.0)
    scale.update(grad_sq, trace)  # a NaN step is skipped, not averaged in
    assert scale.skipped == 1 and scale.updates == 0 and scale.value is None
    scale.update(2.0, 10.0)
    scale.update(math.inf, 1.0)
    assert scale.value == pytest.approx(5.0) and scale.skipped == 2
    scale.update(-1.0, 10.0)  # a negative |G|² estimate (noise-dominated): not measurable, no division
    assert scale.value is None
    for bad in (1.0, -0.1, math.nan, True):
        with pytest.raises(ValueError, match="smoothing"):
            NoiseScale(smoothing=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="noise_scale"):
        statistical_efficiency(math.nan, 64, 32)


def test_efficiency_and_goodput() -> None:
    assert statistical_efficiency(100.0, 64, 32) == pytest.approx(132 / 164)
    assert statistical_efficiency(0.0, 64, 32) == pytest.approx(0.5)  # noise-free: double batch, half the value
    # step time fixed: throughput doubles, efficiency decides
    assert goodput_gain(100.0, 32, 64, 0.01, 0.01) == pytest.approx(2 * 132 / 164)
    # compute-bound: throughput unchanged, growth only loses
    assert goodput_gain(100.0, 32, 64, 0.01, 0.02) == pytest.approx(132 / 164)
    with pytest.raises(ValueError, match="new_seconds"):
        goodput_gain(1.0, 32, 64, 0.01, 0.0)


def test_step_time_prediction() -> None:
    one = [StepCost(64, 0.010, 0.004)]
    assert predict_step_seconds(one, 128) == pytest.approx(0.006 + 0.008)  # compute scales, the rest does not
    assert predict_step_seconds([], 128) is None
    two = [StepCost(64, 0.010, 0.004), StepCost(128, 0.012, 0.006)]
    assert predict_step_seconds(two, 256) == pytest.approx(0.016)  # affine fit: 0.008 + B/32000
    assert StepCost(64, 0.01, 0.5).predict(128) == pytest.approx(0.02)  # compute is capped at the wall time


def test_policy_grows_only_when_goodput_pays_and_goodput_off_grows_anyway() -> None:
    cost = (StepCost(64, 0.010, 0.002),)  # mostly fixed cost: throughput nearly doubles at 128
    on = BatchSizePolicy(8, 512, cooldown=0)
    off = BatchSizePolicy(8, 512, cooldown=0, goodput=False)
    noisy = GoodputEstimate(noise_scale=2000.0, costs=cost)  # B_noise >> B: larger batches are nearly free
    clean = GoodputEstimate(noise_scale=2.0, costs=cost)  # B_noise << B: doubling halves the value per sample
    d = on.decide(64, IDLE, None, noisy)
    assert d.changed and d.batch_size == 128 and "goodput x1." in d.reason
    d = on.decide(64, IDLE, None, clean)
    assert not d.changed and d.batch_size == 64 and "below x1.05" in d.reason
    assert off.decide(64, IDLE, None, clean).batch_size == 128  # the control: without the gate it grows
    d = on.decide(64, IDLE, None, GoodputEstimate(None, cost, unavailable="one process"))
    assert not d.changed and "goodput unknown (one process)" in d.reason
    assert not on.decide(64, IDLE).changed  # no estimate at all: no growth
    full = LoadObservation(utilization=20.0, memory_fraction=0.95)
    assert on.decide(64, full, None, None).batch_size == 32  # shrinking never waits for an estimate
    # goodput pays (x1.42) but a 2x batch costs 15% more samples than the starting one: the floor holds it
    middling = GoodputEstimate(noise_scale=300.0, costs=cost, base_batch_size=64)
    d = on.decide(64, IDLE, None, middling)
    assert not d.changed and "goodput x1.42" in d.reason and "below min_efficiency 0.90" in d.reason
    assert BatchSizePolicy(8, 512, cooldown=0, min_efficiency=0.0).decide(64, IDLE, None, middling).changed
    # the floor is relative to the batch the fit started with, not the current one
    later = GoodputEstimate(noise_scale=5000.0, costs=(StepCost(256, 0.010, 0.002),), base_batch_size=64)
    assert on.decide(256, IDLE, None, later).batch_size == 512  # (5000+64)/(5000+512) = 0.92
    assert not on.decide(256, IDLE, None, GoodputEstimate(3000.0, later.costs, base_batch_size=64)).changed
    with pytest.raises(ValueError, match="min_efficiency"):
        BatchSizePolicy(8, 512, min_efficiency=1.5)
    with pytest.raises(ValueError, match="goodput_threshold"):
        BatchSizePolicy(8, 512, goodput_threshold=-0.1)
    with pytest.raises(ValueError, match="goodput must be True or False"):
        BatchSizePolicy(8, 512, goodput="yes")  # type: ignore[arg-type]
