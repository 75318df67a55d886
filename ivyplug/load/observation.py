"""Turn raw probe readings into the two numbers the batch-size policy needs.

``utilization`` (percent) prefers the training device's GPU (``gpu{i}_util``) and falls back to host
CPU (``cpu_util``); ``memory_fraction`` (0..1) prefers NVML's GPU memory, then the torch allocator's
peak over the device total, then host memory. Over a window, utilisation is the mean and memory the
peak: a batch size must fit the worst moment, but throughput is about the typical one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ivyplug.load.sampler import Stat


@dataclass(frozen=True)
class LoadObservation:
    """What one rank saw over one decision window (an epoch)."""

    utilization: float | None = None
    memory_fraction: float | None = None
    oom_count: int = 0

    def __post_init__(self) -> None:
        if self.utilization is not None and not 0.0 <= self.utilization <= 100.0 + 1e-9:
            raise ValueError(f"utilization must be a percentage in [0, 100] or None, got {self.utilization!r}")
        if self.memory_fraction is not None and not 0.0 <= self.memory_fraction <= 1.0 + 1e-9:
            raise ValueError(f"memory_fraction must be in [0, 1] or None, got {self.memory_fraction!r}")
        if self.oom_count < 0:
            raise ValueError(f"oom_count must be >= 0, got {self.oom_count!r}")


def _ratio(used: float | None, total: float | None) -> float | None:
    if used is None or total is None or total <= 0:
        return None
    return min(max(used / total, 0.0), 1.0)


def observation_from_readings(
    readings: Mapping[str, float], device_index: int | None = None, oom_count: int = 0
) -> LoadObservation:
    """One snapshot of readings -> observation for the device ``device_index`` (None: CPU training)."""
    stats = {k: Stat(v, v, v, v, 1) for k, v in readings.items()}
    return observation_from_summary(stats, device_index, oom_count)


def observation_from_summary(
    stats: Mapping[str, Stat], device_index: int | None = None, oom_count: int = 0
) -> LoadObservation:
    """Window statistics (``Sampler.summary()``) -> observation: mean utilisation, peak memory."""

    def mean(key: str) -> float | None:
        s = stats.get(key)
        return None if s is None else s.mean

    def peak(key: str) -> float | None:
        s = stats.get(key)
        return None if s is None else s.max

    util: float | None = None
    mem: float | None = None
    if device_index is not None:
        util = mean(f"gpu{device_index}_util")
        mem = _ratio(peak(f"gpu{device_index}_mem_used"), peak(f"gpu{device_index}_mem_total"))
        if mem is None:
            mem = _ratio(peak(f"cuda{device_index}_peak"), peak(f"cuda{device_index}_total"))
    if util is None:
        util = mean("cpu_util")
    if mem is None:
        mem = _ratio(peak("mem_used"), peak("mem_total"))
    if util is not None:
        util = min(max(util, 0.0), 100.0)
    return LoadObservation(utilization=util, memory_fraction=mem, oom_count=oom_count)


def combine_observations(observations: list[LoadObservation]) -> LoadObservation:
    """All ranks share one global batch: the busiest memory and the mean utilisation decide."""
    if not observations:
        raise ValueError("observations must not be empty")
    utils = [o.utilization for o in observations if o.utilization is not None]
    mems = [o.memory_fraction for o in observations if o.memory_fraction is not None]
    return LoadObservation(
        utilization=sum(utils) / len(utils) if utils else None,
        memory_fraction=max(mems) if mems else None,
        oom_count=sum(o.oom_count for o in observations),
    )
