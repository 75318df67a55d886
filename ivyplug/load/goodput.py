"""Goodput = throughput × statistical efficiency: whether a larger global batch trains faster, not just busier.

A larger batch raises throughput (samples per second) but each sample then buys less progress. McCandlish
et al. (2018, "An Empirical Model of Large-Batch Training") measure how much less with the gradient noise
scale B_noise = tr(Σ)/|G|² (Σ: the per-sample gradient covariance, G: the true gradient): training with batch
M needs about (1 + B_noise/M) times the steps of the noise-free limit, so relative to a batch M0 the progress
per sample is ``(B_noise + M0) / (B_noise + M)`` (the statistical efficiency AdaptDL/Pollux use).

Neither tr(Σ) nor |G|² is observed directly. Data-parallel training sees the gradient at two batch sizes
in every step: each worker's local gradient ``g_small`` at its batch b and the combined gradient ``g_big``
at B = the sum of the batches. Since E|g_b|² = |G|² + tr(Σ)/b, the two give unbiased estimates

    |G|² ≈ (B·|g_big|² − b·|g_small|²) / (B − b),        tr(Σ) ≈ (|g_small|² − |g_big|²) / (1/b − 1/B).

Both are noisy (the |G|² estimate can be negative), so :class:`NoiseScale` smooths each with an exponential
moving average and divides only then. Everything here is scalars: the callbacks hand in a few per step or
per epoch, nothing here imports a framework.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def _check_batch(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite batch size, got {value!r}")
    return float(value)


def noise_components(small_sq: float, small_batch: float, big_sq: float, big_batch: float) -> tuple[float, float]:
    """``(|G|², tr(Σ))`` estimated from one gradient at ``small_batch`` and one at ``big_batch``.

    ``small_sq`` / ``big_sq`` are the squared norms of the mean gradients over ``small_batch`` and
    ``big_batch`` samples. ``big_batch`` must exceed ``small_batch`` (equal sizes carry no information about
    the noise); a non-finite norm gives ``(nan, nan)`` so the caller can skip that step.
    """
    b = _check_batch("small_batch", small_batch)
    big = _check_batch("big_batch", big_batch)
    if big <= b:
        raise ValueError(
            f"big_batch ({big_batch}) must be larger than small_batch ({small_batch}): the noise scale is "
            "estimated from the difference between the gradient norms at two batch sizes"
        )
    if not (math.isfinite(small_sq) and math.isfinite(big_sq)):
        return math.nan, math.nan
    grad_sq = (big * big_sq - b * small_sq) / (big - b)
    trace = (small_sq - big_sq) / (1.0 / b - 1.0 / big)
    return grad_sq, trace


def statistical_efficiency(noise_scale: float, batch_size: float, base_batch_size: float) -> float:
    """Progress per sample at ``batch_size`` relative to ``base_batch_size``: (B_noise + M0) / (B_noise + M)."""
    m = _check_batch("batch_size", batch_size)
    m0 = _check_batch("base_batch_size", base_batch_size)
    if not math.isfinite(noise_scale) or noise_scale < 0:
        raise ValueError(f"noise_scale must be a finite number >= 0, got {noise_scale!r}")
    return (noise_scale + m0) / (noise_scale + m)


@dataclass
class NoiseScale:
    """Exponential moving averages of |G|² and tr(Σ), and their ratio B_noise.

    ``smoothing`` is the weight of the past at each update (0: the latest estimate only). The averages are
    bias-corrected (as Adam's moments are), so the first update is not pulled towards zero. Non-finite
    estimates are counted in ``skipped`` and leave the averages alone.
    """

    smoothing: float = 0.9
    grad_sq: float = 0.0
    trace: float = 0.0
    weight: float = 0.0  # 1 - smoothing**updates: the bias correction
    updates: int = 0
    skipped: int = 0

    def __post_init__(self) -> None:
        s = self.smoothing
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0.0 <= s < 1.0:
            raise ValueError(f"smoothing (the noise-scale EMA weight of the past) must be in [0, 1), got {s!r}")

    def update(self, grad_sq: float, trace: float) -> None:
        """Fold in one pair of estimates (from :func:`noise_components`, or a mean of several)."""
        if not (math.isfinite(grad_sq) and math.isfinite(trace)):
            self.skipped += 1
            return
        s = self.smoothing
        self.grad_sq = s * self.grad_sq + (1.0 - s) * grad_sq
        self.trace = s * self.trace + (1.0 - s) * trace
        self.weight = s * self.weight + (1.0 - s)
        self.updates += 1

    @property
    def value(self) -> float | None:
        """B_noise, or ``None`` while it is not measurable (no update yet, or |G|² not above zero)."""
        if self.updates == 0 or self.grad_sq <= 0.0:
            return None
        return max(self.trace, 0.0) / self.grad_sq  # the bias corrections cancel in the ratio

    def to_dict(self) -> dict[str, float | int]:
        return {
            "smoothing": self.smoothing,
            "grad_sq": self.grad_sq,
            "trace": self.trace,
            "weight": self.weight,
            "updates": self.updates,
            "skipped": self.skipped,
        }

    @classmethod
    def from_dict(cls, data: dict[str, float | int]) -> NoiseScale:
        return cls(
            smoothing=float(data["smoothing"]),
            grad_sq=float(data["grad_sq"]),
            trace=float(data["trace"]),
            weight=float(data["weight"]),
            updates=int(data["updates"]),
            skipped=int(data.get("skipped", 0)),
        )


@dataclass(frozen=True)
class StepCost:
    """Seconds per step at global batch ``batch_size``: ``fixed`` (data, sync, optimizer) + ``scaled`` (compute).

    Predicting a batch never tried assumes the compute part grows in proportion to the batch and the rest does
    not: compute has a fixed part too, so this under-predicts the throughput gain (growth must pay more).
    """

    batch_size: int
    seconds: float  # wall seconds per step
    compute: float  # of which: the part that is taken to scale with the batch

    def predict(self, batch_size: int) -> float:
        scaled = min(max(self.compute, 0.0), self.seconds)
        return (self.seconds - scaled) + scaled * batch_size / self.batch_size


def predict_step_seconds(costs: Sequence[StepCost], batch_size: int) -> float | None:
    """Seconds per step at ``batch_size``: an affine fit over the batch sizes measured, else :meth:`StepCost.predict`.

    With two or more distinct measured batch sizes, t(B) = a + c·B is fitted by least squares (a, c >= 0);
    with one, the latest measurement's split into fixed and scaled parts is used. ``None`` without measurements.
    """
    usable = [c for c in costs if c.seconds > 0 and math.isfinite(c.seconds) and math.isfinite(c.compute)]
    if not usable:
        return None
    sizes = {c.batch_size for c in usable}
    if len(sizes) < 2:
        return usable[-1].predict(batch_size)
    n = len(usable)
    mean_b = sum(c.batch_size for c in usable) / n
    mean_t = sum(c.seconds for c in usable) / n
    var = sum((c.batch_size - mean_b) ** 2 for c in usable)
    slope = max(sum((c.batch_size - mean_b) * (c.seconds - mean_t) for c in usable) / var, 0.0)
    intercept = mean_t - slope * mean_b
    if intercept < 0:  # through the origin instead: time proportional to the batch
        intercept, slope = 0.0, sum(c.seconds * c.batch_size for c in usable) / sum(c.batch_size**2 for c in usable)
    return intercept + slope * batch_size


def goodput_gain(noise_scale: float, old_batch: int, new_batch: int, old_seconds: float, new_seconds: float) -> float:
    """Predicted goodput at ``new_batch`` over goodput at ``old_batch`` (1.0: no change).

    Throughput ratio (new_batch / new_seconds) / (old_batch / old_seconds) times the statistical efficiency of
    ``new_batch`` relative to ``old_batch``.
    """
    for name, value in (("old_seconds", old_seconds), ("new_seconds", new_seconds)):
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be a positive finite number of seconds per step, got {value!r}")
    throughput = (new_batch / new_seconds) / (old_batch / old_seconds)
    return throughput * statistical_efficiency(noise_scale, new_batch, old_batch)


@dataclass(frozen=True)
class GoodputEstimate:
    """What the batch-size policy needs to weigh a growth: B_noise and measured step costs, or why not."""

    noise_scale: float | None
    costs: tuple[StepCost, ...] = ()
    unavailable: str | None = None  # why there is no estimate (shown in the decision's reason)
    base_batch_size: int | None = None  # the batch the fit started with (``min_efficiency`` is relative to it)

    def gain(self, old_batch: int, new_batch: int) -> float | None:
        """Predicted goodput ratio of ``new_batch`` over ``old_batch``, ``None`` when it cannot be predicted."""
        if self.unavailable is not None or self.noise_scale is None:
            return None
        old_s = predict_step_seconds(self.costs, old_batch)
        new_s = predict_step_seconds(self.costs, new_batch)
        if old_s is None or new_s is None or old_s <= 0 or new_s <= 0:
            return None
        return goodput_gain(self.noise_scale, old_batch, new_batch, old_s, new_s)

    def why_unknown(self) -> str:
        if self.unavailable is not None:
            return self.unavailable
        if self.noise_scale is None:
            return "the gradient noise scale is not measurable yet (no estimate, or |G|² not above zero)"
        return "no step time measured yet"
