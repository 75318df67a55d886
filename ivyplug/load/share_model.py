"""Per-rank step-time model t_i(b) = a_i + c_i·b and the integer shares that minimise the slowest rank's time.

Why affine and not proportional: a rank's step is not only per-sample work. Framework overhead, the
optimizer step, communication and (for an injected or real slow device) the fixed part of every kernel
launch cost the same whatever the share. A per-sample speed v_i = b_i/t_i(b_i) then *falls* as the share
shrinks, and a rule b_i ∝ v_i moves the share further each epoch: it overshoots and oscillates. Fitting
a_i (seconds per step) and c_i (seconds per sample) from the rank's own (share, step time) pairs at
several shares removes that bias.

- :func:`fit_step_time` is least squares over the last ``window`` distinct shares, constrained to
  a_i ≥ 0 and c_i ≥ ``min_slope_fraction``·t̄/b̄ (a rank whose time does not grow with its share is
  noise, not physics; a negative intercept is the same). With a single distinct share the intercept is
  not identifiable: the prior is a_i = f·t(b) with f the intercept fraction ``prior_fraction``. The caller
  passes the median fraction of the ranks that *do* have a fit (ranks of one job share the framework and
  the model, so their fixed fraction is alike); with none, f = 0, which is exactly the proportional
  LB-BSP rule, the right first guess when nothing is known about the fixed cost.
- :func:`min_max_shares` solves min over integer shares (each ≥ 1, Σ = B) of max_i a_i + c_i·b_i:
  the continuous water level T with Σ max(1, (T − a_i)/c_i) = B, largest-remainder rounding, then
  single-sample moves from the slowest rank while the receiver ends below the donor's time. That stop
  rule is exact: if the slowest rank i (time M) cannot give a sample to any j with a_j + c_j(b_j+1) < M,
  any allocation with a smaller maximum would have to lower b_i and so raise some b_j past b_j + 1.
- :func:`trust_bounds` keeps each rank's target within a factor (2) of the shares it was measured at: a
  line through two noisy points may claim a large fixed cost and send a share to 1 in one epoch; with the
  bound, such a move takes several measured epochs, each of which corrects the fit. The min-max solution
  stays exact inside the bounds (the fix-up argument holds with donors above their lower and receivers
  below their upper bound).
- :func:`damped_shares` moves from the current shares towards the target. A full step is taken while
  the direction of the move holds; when the target reverses the previous move (an overshoot), the step
  gain halves (at most half way, then a quarter, ...) and grows back by 1.5× per consistent epoch. The
  first move, from equal shares, is a full one: that is what proportional LB-BSP does and the
  benchmark's epoch 2 depends on it; the affine fit then corrects it from two measured points.

Everything here is a pure function of its inputs (rank 0 decides, the decision is broadcast).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

#: Observations of one rank: (samples per step, compute seconds per step) of one epoch each, oldest first.
Observation = tuple[float, float]


@dataclass(frozen=True)
class StepTimeModel:
    """t(b) = intercept + slope·b seconds per step for a share of b samples."""

    intercept: float
    slope: float
    fitted: bool  # True: from >= 2 distinct shares; False: the one-observation prior

    def predict(self, share: float) -> float:
        return self.intercept + self.slope * share


def fixed_fraction(model: StepTimeModel, share: float) -> float:
    """Share of the predicted step time at ``share`` that does not depend on the share: a/(a + c·b)."""
    total = model.predict(share)
    return model.intercept / total if total > 0 else 0.0


def _check_observations(observations: Sequence[Observation]) -> list[Observation]:
    if len(observations) == 0:
        raise ValueError("observations must hold at least one (share, seconds) pair")
    out = []
    for k, pair in enumerate(observations):
        if len(pair) != 2:
            raise ValueError(f"observations[{k}] must be a (share, seconds) pair, got {pair!r}")
        b, t = float(pair[0]), float(pair[1])
        if not (math.isfinite(b) and b > 0):
            raise ValueError(f"observations[{k}] share must be a finite number > 0, got {pair[0]!r}")
        if not (math.isfinite(t) and t > 0):
            raise ValueError(f"observations[{k}] seconds must be a finite number > 0, got {pair[1]!r}")
        out.append((b, t))
    return out


def recent_distinct(observations: Sequence[Observation], window: int) -> list[Observation]:
    """The newest observation of each of the last ``window`` distinct shares, oldest first.

    Only the newest time per share is kept: the load on a rank drifts, and an old reading at a share
    that has been measured again since would pull the fit towards a past state.
    """
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an int >= 1, got {window!r}")
    seen: set[float] = set()
    picked: list[Observation] = []
    for b, t in reversed(_check_observations(observations)):
        if b in seen:
            continue
        seen.add(b)
        picked.append((b, t))
        if len(picked) == window:
            break
    return picked[::-1]


def _line_fit(points: Sequence[Observation]) -> tuple[float, float]:
    n = len(points)
    mb = sum(b for b, _ in points) / n
    mt = sum(t for _, t in points) / n
    sbb = sum((b - mb) ** 2 for b, _ in points)
    sbt = sum((b - mb) * (t - mt) for b, t in points)
    slope = sbt / sbb
    return mt - slope * mb, slope


def _sse(points: Sequence[Observation], a: float, c: float) -> float:
    return sum((t - a - c * b) ** 2 for b, t in points)


def fit_step_time(
    observations: Sequence[Observation],
    *,
    window: int = 4,
    prior_fraction: float = 0.0,
    min_slope_fraction: float = 0.05,
) -> StepTimeModel:
    """Least-squares t(b) = a + c·b over the last ``window`` distinct shares (see the module docstring)."""
    if not (isinstance(prior_fraction, (int, float)) and 0.0 <= prior_fraction < 1.0):
        raise ValueError(f"prior_fraction must be in [0, 1), got {prior_fraction!r}")
    if not (isinstance(min_slope_fraction, (int, float)) and 0.0 < min_slope_fraction <= 1.0):
        raise ValueError(f"min_slope_fraction must be in (0, 1], got {min_slope_fraction!r}")
    points = recent_distinct(observations, window)
    if len(points) == 1:
        b, t = points[0]
        return StepTimeModel(intercept=prior_fraction * t, slope=(1.0 - prior_fraction) * t / b, fitted=False)
    mean_b = sum(b for b, _ in points) / len(points)
    mean_t = sum(t for _, t in points) / len(points)
    c_min = min_slope_fraction * mean_t / mean_b
    a, c = _line_fit(points)
    if a >= 0.0 and c >= c_min:
        return StepTimeModel(intercept=a, slope=c, fitted=True)
    # convex QP on the box a >= 0, c >= c_min: the optimum lies on an edge; each edge is a 1-D clamp
    candidates = []
    c_edge = max(c_min, sum(b * t for b, t in points) / sum(b * b for b, _ in points))  # a = 0
    candidates.append((0.0, c_edge))
    a_edge = max(0.0, mean_t - c_min * mean_b)  # c = c_min
    candidates.append((a_edge, c_min))
    a, c = min(candidates, key=lambda ac: (_sse(points, *ac), -ac[1]))
    return StepTimeModel(intercept=a, slope=c, fitted=True)


def fit_all(
    histories: Sequence[Sequence[Observation]],
    *,
    window: int = 4,
    min_slope_fraction: float = 0.05,
) -> list[StepTimeModel]:
    """One model per rank; ranks with a single distinct share get the median fixed fraction of the fitted ranks."""
    fitted = [
        fit_step_time(h, window=window, min_slope_fraction=min_slope_fraction)
        if len(recent_distinct(h, window)) > 1
        else None
        for h in histories
    ]
    pairs = list(zip(fitted, histories, strict=True))
    fractions = [fixed_fraction(m, recent_distinct(h, 1)[0][0]) for m, h in pairs if m is not None]
    prior = min(statistics.median(fractions), 0.95) if fractions else 0.0
    return [m if m is not None else fit_step_time(h, window=window, prior_fraction=prior) for m, h in pairs]


def _check_models(batch_size: int, models: Sequence[StepTimeModel]) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if len(models) == 0:
        raise ValueError("models must hold one StepTimeModel per worker, got an empty sequence")
    if batch_size < len(models):
        raise ValueError(
            f"batch_size ({batch_size}) must be at least the number of workers ({len(models)}): none may be empty"
        )
    for i, m in enumerate(models):
        if not (math.isfinite(m.intercept) and m.intercept >= 0 and math.isfinite(m.slope) and m.slope > 0):
            raise ValueError(f"models[{i}] needs intercept >= 0 and slope > 0 (finite), got {m!r}")


Bounds = Sequence[tuple[int, int]]


def _check_bounds(batch_size: int, n: int, bounds: Bounds | None) -> list[tuple[int, int]]:
    if bounds is None:
        return [(1, batch_size)] * n
    if len(bounds) != n:
        raise ValueError(f"bounds must hold one (low, high) pair per worker ({n}), got {len(bounds)}")
    out = []
    for i, (low, high) in enumerate(bounds):
        if not (isinstance(low, int) and isinstance(high, int) and 1 <= low <= high):
            raise ValueError(f"bounds[{i}] must be integers 1 <= low <= high, got {(low, high)!r}")
        out.append((low, min(high, batch_size)))
    if sum(lo for lo, _ in out) > batch_size or sum(hi for _, hi in out) < batch_size:
        raise ValueError(f"bounds {out} admit no shares summing to batch_size={batch_size}")
    return out


def water_level(batch_size: int, models: Sequence[StepTimeModel], bounds: Bounds | None = None) -> list[float]:
    """Continuous shares x_i in [low_i, high_i] (default [1, B]) with Σ x_i = B and equal predicted time for
    every rank not held at a bound."""
    _check_models(batch_size, models)
    box = _check_bounds(batch_size, len(models), bounds)

    def shares_at(level: float) -> list[float]:
        return [min(hi, max(lo, (level - m.intercept) / m.slope)) for m, (lo, hi) in zip(models, box, strict=True)]

    lo = min(m.predict(b[0]) for m, b in zip(models, box, strict=True))
    hi = max(m.predict(b[1]) for m, b in zip(models, box, strict=True))
    for _ in range(200):  # the total is continuous and non-decreasing in the level: bisection to machine precision
        mid = 0.5 * (lo + hi)
        if sum(shares_at(mid)) < batch_size:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-15 * max(1.0, hi):
            break
    return shares_at(hi)


def round_shares(batch_size: int, ideal: Sequence[float], bounds: Bounds | None = None) -> list[int]:
    """Largest-remainder rounding of ``ideal`` (Σ ≈ B) to integers in the bounds (default >= 1) summing to B."""
    n = len(ideal)
    if n == 0 or batch_size < n:
        raise ValueError(f"batch_size ({batch_size}) must be at least the number of workers ({n}), which must be >= 1")
    box = _check_bounds(batch_size, n, bounds)
    shares = [min(hi, max(lo, math.floor(x))) for x, (lo, hi) in zip(ideal, box, strict=True)]
    while sum(shares) > batch_size:  # floors lifted to a bound can overshoot B: take from the most over-served
        donor = max((j for j in range(n) if shares[j] > box[j][0]), key=lambda j: (shares[j] - ideal[j], -j))
        shares[donor] -= 1
    while sum(shares) < batch_size:
        receiver = max((j for j in range(n) if shares[j] < box[j][1]), key=lambda j: (ideal[j] - shares[j], -j))
        shares[receiver] += 1
    return shares


def min_max_shares(batch_size: int, models: Sequence[StepTimeModel], bounds: Bounds | None = None) -> list[int]:
    """Integer shares (each in its bounds, default >= 1, summing to B) minimising the largest predicted step time."""
    box = _check_bounds(batch_size, len(models), bounds)
    ideal = water_level(batch_size, models, box)
    n = len(models)
    shares = round_shares(batch_size, ideal, box)
    # local fix-up: move single samples off the slowest rank while the receiver ends faster than the donor was
    for _ in range(batch_size * n + n):
        times = [m.predict(s) for m, s in zip(models, shares, strict=True)]
        slow = max(range(n), key=lambda i: (times[i], -i))
        if shares[slow] <= box[slow][0]:
            break
        after = [
            models[j].predict(shares[j] + 1) if j != slow and shares[j] < box[j][1] else math.inf for j in range(n)
        ]
        best = min(range(n), key=lambda j: (after[j], j))
        if not after[best] < times[slow]:
            break
        shares[slow] -= 1
        shares[best] += 1
    return shares


def trust_bounds(
    batch_size: int, histories: Sequence[Sequence[Observation]], window: int, factor: float
) -> list[tuple[int, int]] | None:
    """Per rank [min measured share / factor, max measured share · factor]: how far a fit may be extrapolated.

    A line through two noisy points can put a large intercept on a rank and send its share to 1 (or to
    all of B) in one epoch; bounding the extrapolation makes such a jump take several measured epochs.
    None when the bounds cannot hold B (the global batch changed a lot): then the fit alone decides.
    """
    if not factor > 1.0:
        raise ValueError(f"factor must be > 1, got {factor!r}")
    box = []
    for h in histories:
        shares = [b for b, _ in recent_distinct(h, window)]
        box.append((max(1, math.floor(min(shares) / factor)), max(1, math.ceil(max(shares) * factor))))
    if sum(lo for lo, _ in box) > batch_size or sum(min(hi, batch_size) for _, hi in box) < batch_size:
        return None
    return box


def damped_shares(
    batch_size: int,
    current: Sequence[int],
    target: Sequence[int],
    previous: Sequence[int] | None,
    gain: float,
    *,
    min_gain: float = 0.125,
) -> tuple[list[int], float]:
    """Step from ``current`` towards ``target``; returns the new shares and the gain for the next call.

    ``previous`` are the shares before ``current`` (None: no move yet). A move that reverses the last
    one halves the gain; a consistent one grows it by 1.5 (at most 1). The new shares are rounded with
    largest remainders so they sum to ``batch_size`` and stay >= 1.
    """
    n = len(current)
    if len(target) != n or n == 0:
        raise ValueError(f"current and target must be equally long and non-empty, got {n} and {len(target)}")
    if sum(target) != batch_size or min(target) < 1:
        raise ValueError(f"target must be >= 1 each and sum to batch_size={batch_size}, got {list(target)}")
    if not (isinstance(gain, (int, float)) and 0.0 < gain <= 1.0):
        raise ValueError(f"gain must be in (0, 1], got {gain!r}")
    if not 0.0 < min_gain <= 1.0:
        raise ValueError(f"min_gain must be in (0, 1], got {min_gain!r}")
    # the current shares may sum to another B (the batch-size policy changed it): rescale them first
    base = [s * batch_size / sum(current) for s in current]
    step = [t - b for t, b in zip(target, base, strict=True)]
    if previous is not None and len(previous) == n and sum(previous) > 0:
        last = [c - p * sum(current) / sum(previous) for c, p in zip(current, previous, strict=True)]
        dot = sum(s * m for s, m in zip(step, last, strict=True))
        if dot < 0:
            gain = max(min_gain, gain / 2)
        elif dot > 0:
            gain = min(1.0, gain * 1.5)
    ideal = [b + gain * s for b, s in zip(base, step, strict=True)]
    return round_shares(batch_size, ideal), gain


@dataclass(frozen=True)
class ShareDecision:
    """The shares for the next epoch, the damping gain to carry, and the models behind them."""

    shares: list[int]
    target: list[int]
    gain: float
    models: list[StepTimeModel]


def next_shares(
    batch_size: int,
    current: Sequence[int],
    previous: Sequence[int] | None,
    histories: Sequence[Sequence[Observation]],
    gain: float = 1.0,
    *,
    window: int = 4,
    trust: float = 2.0,
) -> ShareDecision:
    """Fit every rank's step time, solve the min-max shares for ``batch_size``, and take a damped step.

    ``histories[i]`` are rank i's (samples per step, compute seconds per step), one pair per epoch, oldest first.
    """
    if len(histories) != len(current):
        raise ValueError(f"histories must hold one list per worker ({len(current)}), got {len(histories)}")
    models = fit_all(histories, window=window)
    target = min_max_shares(batch_size, models, trust_bounds(batch_size, histories, window, trust))
    shares, gain = damped_shares(batch_size, current, target, previous, gain)
    return ShareDecision(shares=shares, target=target, gain=gain, models=models)
