"""When to change the global batch size B: a pure function of (B, observation, state).

- Shrink (by ``shrink_factor``) when the peak memory fraction reaches ``memory_high`` or an OOM
  happened. Shrinking ignores the cooldown: memory pressure is urgent. After an OOM, B never grows
  back above the size it was lowered to (``ceiling``).
- Grow (by ``grow_factor``) when mean utilisation is below ``grow_below_utilization`` and peak memory
  is at most ``memory_low``, once ``cooldown`` decisions have passed since the last change.
- With ``goodput`` (the default) a growth also has to pay: the predicted goodput (throughput × statistical
  efficiency from the gradient noise scale, :mod:`ivyplug.load.goodput`) at the grown B must exceed the
  current one by ``goodput_threshold``; without an estimate (one process, a strategy that never shows the
  combined gradient) B does not grow and the reason says why. A growth must also keep the statistical
  efficiency relative to the batch the fit started with at ``min_efficiency`` or more: goodput is about time,
  and a schedule tuned in epochs for that batch would otherwise end less accurate (at most 1/min_efficiency
  times the samples for the same progress).
- Between ``memory_low`` and ``memory_high`` nothing moves (hysteresis), and a change smaller than
  ``min_relative_change`` of B is not worth it (AdaptDL's 5% rule). Bounds are always respected.

The caller decides *when* to call ``decide``: the callbacks call it once per epoch boundary, so the
cooldown counts epochs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from ivyplug.load.goodput import GoodputEstimate, statistical_efficiency
from ivyplug.load.observation import LoadObservation


@dataclass(frozen=True)
class PolicyState:
    """What the policy remembers between decisions."""

    since_change: int = 1_000_000
    ceiling: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"since_change": self.since_change, "ceiling": self.ceiling}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PolicyState:
        return cls(since_change=int(data["since_change"]), ceiling=data.get("ceiling"))


@dataclass(frozen=True)
class Decision:
    """The outcome of one decision: the batch size to use next, why, and the state to carry."""

    batch_size: int
    changed: bool
    reason: str
    state: PolicyState


#: Default bounds of the global batch size B, shared by both ``IvyLoadBalancer`` twins: down to one sample per
#: replica (an OOM may need that much room), up to this many times the initial B.
DEFAULT_MAX_BATCH_FACTOR = 8


def default_batch_bounds(initial: int, replicas: int = 1) -> tuple[int, int]:
    """``(min, max)`` for B when the user gives neither: ``replicas`` and ``DEFAULT_MAX_BATCH_FACTOR`` × ``initial``."""
    low = max(1, replicas)
    return low, max(DEFAULT_MAX_BATCH_FACTOR * initial, low)


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _check_float(name: str, value: object, low: float, high: float, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    ok = (low < value if low_open else low <= value) and value <= high
    if not ok:
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must be in {bracket}{low}, {high}], got {value!r}")
    return float(value)


@dataclass(frozen=True)
class BatchSizePolicy:
    """Grow/shrink rules with hysteresis, cooldown and bounds; see the module docstring."""

    min_batch_size: int
    max_batch_size: int
    grow_factor: float = 2.0
    shrink_factor: float = 0.5
    grow_below_utilization: float = 70.0
    memory_low: float = 0.6
    memory_high: float = 0.9
    cooldown: int = 1
    min_relative_change: float = 0.05
    goodput: bool = True
    goodput_threshold: float = 0.05
    min_efficiency: float = 0.9

    def __post_init__(self) -> None:
        _check_int("min_batch_size", self.min_batch_size, 1)
        _check_int("max_batch_size", self.max_batch_size, 1)
        if self.max_batch_size < self.min_batch_size:
            raise ValueError(
                f"max_batch_size ({self.max_batch_size}) must be >= min_batch_size ({self.min_batch_size})"
            )
        _check_float("grow_factor", self.grow_factor, 1.0, 1e6, low_open=True)
        shrink = self.shrink_factor
        if isinstance(shrink, bool) or not isinstance(shrink, (int, float)) or not 0.0 < shrink < 1.0:
            raise ValueError(f"shrink_factor must be a number in (0, 1), got {shrink!r}")
        _check_float("grow_below_utilization", self.grow_below_utilization, 0.0, 100.0)
        _check_float("memory_low", self.memory_low, 0.0, 1.0)
        _check_float("memory_high", self.memory_high, 0.0, 1.0)
        if self.memory_low >= self.memory_high:
            raise ValueError(
                f"memory_low ({self.memory_low}) must be below memory_high ({self.memory_high}): "
                "the gap between them is the hysteresis band"
            )
        _check_int("cooldown", self.cooldown, 0)
        _check_float("min_relative_change", self.min_relative_change, 0.0, 1.0)
        if not isinstance(self.goodput, bool):
            raise ValueError(f"goodput must be True or False, got {self.goodput!r}")
        _check_float("goodput_threshold", self.goodput_threshold, 0.0, 10.0)
        _check_float("min_efficiency", self.min_efficiency, 0.0, 1.0)

    def clamp(self, batch_size: int, ceiling: int | None = None) -> int:
        upper = self.max_batch_size if ceiling is None else max(self.min_batch_size, min(self.max_batch_size, ceiling))
        return max(self.min_batch_size, min(upper, batch_size))

    def decide(
        self,
        batch_size: int,
        observation: LoadObservation,
        state: PolicyState | None = None,
        estimate: GoodputEstimate | None = None,
    ) -> Decision:
        """The batch size for the next epoch given what the last one looked like.

        ``estimate`` is what a growth is weighed with when ``goodput`` is on (``None``: no estimate, so no growth).
        """
        _check_int("batch_size", batch_size, 1)
        if not isinstance(observation, LoadObservation):
            raise ValueError(f"observation must be a LoadObservation, got {observation!r}")
        state = PolicyState() if state is None else state
        aged = replace(state, since_change=state.since_change + 1)
        mem = observation.memory_fraction
        util = observation.utilization

        if observation.oom_count > 0 or (mem is not None and mem >= self.memory_high):
            target = max(1, math.floor(batch_size * self.shrink_factor))
            new = min(batch_size, self.clamp(target, state.ceiling))  # a B below min_batch_size stays, never grows
            ceiling = new if observation.oom_count > 0 else state.ceiling
            why = f"out of memory ({observation.oom_count}x)" if observation.oom_count else f"memory {mem:.0%}"
            return self._outcome(batch_size, new, f"shrink: {why}", replace(aged, ceiling=ceiling))

        if aged.since_change <= self.cooldown:
            return Decision(batch_size, False, f"hold: cooldown ({aged.since_change}/{self.cooldown})", aged)
        if util is None or mem is None:
            return Decision(batch_size, False, "hold: utilisation or memory unknown", aged)
        if util < self.grow_below_utilization and mem <= self.memory_low:
            target = max(batch_size + 1, math.ceil(batch_size * self.grow_factor))
            new = max(batch_size, self.clamp(target, state.ceiling))  # a B above max_batch_size stays, never shrinks
            why = f"utilisation {util:.0f}%, memory {mem:.0%}"
            if self.goodput and new != batch_size:
                gain = None if estimate is None else estimate.gain(batch_size, new)
                if gain is None:
                    unknown = "no goodput estimate" if estimate is None else estimate.why_unknown()
                    return Decision(batch_size, False, f"hold: {why} but goodput unknown ({unknown})", aged)
                noise = estimate.noise_scale if estimate is not None else None
                why += f", goodput x{gain:.2f} at {new} (noise scale {noise:.0f})"
                if not gain >= 1.0 + self.goodput_threshold:  # NaN-safe: a NaN gain holds
                    return Decision(batch_size, False, f"hold: {why}, below x{1.0 + self.goodput_threshold:.2f}", aged)
                assert estimate is not None and noise is not None
                base = estimate.base_batch_size or batch_size
                efficiency = statistical_efficiency(noise, new, base)
                if not efficiency >= self.min_efficiency:
                    return Decision(
                        batch_size,
                        False,
                        f"hold: {why}, but efficiency {efficiency:.2f} relative to the starting batch {base} is "
                        f"below min_efficiency {self.min_efficiency:.2f}",
                        aged,
                    )
            return self._outcome(batch_size, new, f"grow: {why}", aged)
        return Decision(batch_size, False, f"hold: utilisation {util:.0f}%, memory {mem:.0%}", aged)

    def _outcome(self, old: int, new: int, reason: str, state: PolicyState) -> Decision:
        if new == old:
            return Decision(old, False, f"hold: {reason} but at the bound", state)
        if abs(new - old) < self.min_relative_change * old:
            return Decision(old, False, f"hold: {reason} but the change is below {self.min_relative_change:.0%}", state)
        return Decision(new, True, reason, replace(state, since_change=0))
