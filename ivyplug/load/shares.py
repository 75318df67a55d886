"""Per-worker shares of a global batch under heterogeneous speed (LB-BSP).

Worker i gets b_i ≈ B·v_i/Σv_j samples for measured speeds v_i (samples per second of its own
compute), so every worker finishes its part of a synchronous step at about the same time. Shares
are integers that sum to exactly B (largest-remainder rounding) and none is empty. In synchronous
training each worker's gradient is then weighted by b_i/B so the update is the full-batch mean.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def _check_batch(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def worker_shares(batch_size: int, speeds: Sequence[float]) -> list[int]:
    """Integer shares of ``batch_size`` proportional to ``speeds``, summing to it, each >= 1."""
    _check_batch("batch_size", batch_size)
    if len(speeds) == 0:
        raise ValueError("speeds must hold one positive number per worker, got an empty sequence")
    values: list[float] = []
    for i, v in enumerate(speeds):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"speeds[{i}] must be a finite number > 0, got {v!r}")
        values.append(float(v))
    n = len(values)
    if batch_size < n:
        raise ValueError(f"batch_size ({batch_size}) must be at least the number of workers ({n}): none may be empty")
    total = sum(values)
    ideal = [batch_size * v / total for v in values]
    shares = [math.floor(x) for x in ideal]
    order = sorted(range(n), key=lambda i: (-(ideal[i] - shares[i]), i))
    for i in order[: batch_size - sum(shares)]:
        shares[i] += 1
    # none empty: take one sample at a time from the largest share
    for i in range(n):
        while shares[i] < 1:
            donor = max(range(n), key=lambda j: (shares[j], -j))
            shares[donor] -= 1
            shares[i] += 1
    return shares


def measured_speeds(samples: Sequence[float], seconds: Sequence[float], floor: float = 1e-9) -> list[float]:
    """Samples per second of compute per worker; ``seconds`` below ``floor`` count as ``floor``."""
    if len(samples) != len(seconds) or not samples:
        raise ValueError(f"samples and seconds must be equally long and non-empty, got {len(samples)}, {len(seconds)}")
    out = []
    for i, (n, t) in enumerate(zip(samples, seconds, strict=True)):
        if not (math.isfinite(n) and n > 0):
            raise ValueError(f"samples[{i}] must be > 0, got {n!r}")
        if not (math.isfinite(t) and t >= 0):
            raise ValueError(f"seconds[{i}] must be >= 0, got {t!r}")
        out.append(n / max(t, floor))
    return out


def smooth_speeds(previous: Sequence[float] | None, current: Sequence[float], keep: float) -> list[float]:
    """Exponential smoothing of speeds: ``keep`` of the previous estimate, ``1 - keep`` of the new."""
    if not 0.0 <= keep < 1.0:
        raise ValueError(f"keep must be in [0, 1), got {keep!r}")
    if previous is None or len(previous) != len(current):
        return list(current)
    return [keep * p + (1.0 - keep) * c for p, c in zip(previous, current, strict=True)]


def gradient_weights(shares: Sequence[int]) -> list[float]:
    """b_i / B per worker: the factor each worker's mean gradient gets before a SUM all-reduce."""
    total = sum(shares)
    if total <= 0 or any(s < 1 for s in shares):
        raise ValueError(f"shares must all be >= 1, got {list(shares)}")
    return [s / total for s in shares]
