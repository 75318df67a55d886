"""Pick the n least-loaded GPUs now: ``ivyplug.least_loaded(2)`` -> ``[3, 1]`` for ``Trainer(devices=...)``.

Ranking is a pure function of NVML-style readings (:func:`rank_devices`): devices below
``min_free_memory`` or above ``max_utilization`` are excluded, the rest are ordered by utilisation,
then by used memory fraction, then by index. Indices are CUDA-visible indices (see NvmlProbe).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from ivyplug.load.probe import Probe

_KEY = re.compile(r"^gpu(\d+)_(util|mem_used|mem_free|mem_total)$")
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "kib": 2**10, "mib": 2**20}
_UNITS.update({"gib": 2**30, "t": 1e12, "tb": 1e12, "tib": 2**40})


class NoDeviceAvailableError(RuntimeError):
    """Fewer devices qualify than were asked for (the message says why each one was excluded)."""


@dataclass(frozen=True)
class DeviceLoad:
    """One GPU's load as the ranking sees it."""

    index: int
    utilization: float | None
    mem_used: float | None
    mem_total: float | None
    mem_free: float | None

    @property
    def used_fraction(self) -> float:
        if self.mem_used is None or not self.mem_total:
            return 0.0
        return self.mem_used / self.mem_total


def parse_memory(value: int | float | str) -> float:
    """Bytes from a number or a string such as ``"4GiB"``, ``"500MB"``, ``"1.5 G"``."""
    if isinstance(value, bool):
        raise ValueError(f"min_free_memory must be bytes (int) or a string like '4GiB', got {value!r}")
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(f"min_free_memory must look like '4GiB', '500MB' or a byte count, got {value!r}")
        number = float(m.group(1)) * _UNITS[unit]
    else:
        raise ValueError(f"min_free_memory must be bytes (int) or a string like '4GiB', got {value!r}")
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"min_free_memory must be >= 0, got {value!r}")
    return number


def devices_from_readings(readings: Mapping[str, float]) -> list[DeviceLoad]:
    """Group flat ``gpu{i}_*`` readings into one record per device, sorted by index."""
    fields: dict[int, dict[str, float]] = {}
    for key, value in readings.items():
        m = _KEY.match(key)
        if m:
            fields.setdefault(int(m.group(1)), {})[m.group(2)] = float(value)
    out = []
    for index in sorted(fields):
        f = fields[index]
        free = f.get("mem_free")
        if free is None and "mem_total" in f and "mem_used" in f:
            free = f["mem_total"] - f["mem_used"]
        out.append(DeviceLoad(index, f.get("util"), f.get("mem_used"), f.get("mem_total"), free))
    return out


def rank_devices(
    devices: list[DeviceLoad], n: int, min_free_memory: float = 0.0, max_utilization: float = 100.0
) -> list[int]:
    """The ``n`` best device indices; raises NoDeviceAvailableError listing why others were excluded."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    if isinstance(max_utilization, bool) or not isinstance(max_utilization, (int, float)):
        raise ValueError(f"max_utilization must be a percentage in [0, 100], got {max_utilization!r}")
    if not 0.0 <= max_utilization <= 100.0:
        raise ValueError(f"max_utilization must be a percentage in [0, 100], got {max_utilization!r}")
    need = parse_memory(min_free_memory)
    eligible: list[DeviceLoad] = []
    excluded: list[str] = []
    for d in devices:
        if need > 0 and d.mem_free is None:
            excluded.append(f"gpu{d.index}: free memory unknown")
        elif d.mem_free is not None and d.mem_free < need:
            excluded.append(f"gpu{d.index}: {d.mem_free / 2**30:.2f} GiB free < {need / 2**30:.2f} GiB")
        elif d.utilization is not None and d.utilization > max_utilization:
            excluded.append(f"gpu{d.index}: {d.utilization:.0f}% busy > {max_utilization:.0f}%")
        else:
            eligible.append(d)
    if len(eligible) < n:
        why = "; ".join(excluded) if excluded else "no other devices"
        raise NoDeviceAvailableError(
            f"asked for {n} device(s) but only {len(eligible)} of {len(devices)} qualify "
            f"(min_free_memory={need:.0f} bytes, max_utilization={max_utilization}): {why}"
        )
    eligible.sort(key=lambda d: (d.utilization if d.utilization is not None else 0.0, d.used_fraction, d.index))
    return [d.index for d in eligible[:n]]


def least_loaded(
    n: int = 1,
    min_free_memory: int | float | str = 0,
    max_utilization: float = 100.0,
    probe: Probe | None = None,
) -> list[int]:
    """The ``n`` least-loaded CUDA-visible GPUs right now, best first (usable as ``Trainer(devices=...)``).

    ``probe`` defaults to :class:`~ivyplug.load.nvml_probe.NvmlProbe`; without NVML (no driver, no
    nvidia-ml-py) this raises NoDeviceAvailableError saying so.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    parse_memory(min_free_memory)
    owned = probe is None
    if probe is None:
        from ivyplug.load.nvml_probe import NvmlProbe

        probe = NvmlProbe()
    try:
        if not probe.available():
            reason = getattr(probe, "unavailable_reason", None) or "the probe reports itself unavailable"
            raise NoDeviceAvailableError(f"no GPU load information from probe {probe.name!r}: {reason}")
        devices = devices_from_readings(probe.read())
    finally:
        if owned:
            probe.close()
    if not devices:
        raise NoDeviceAvailableError(f"probe {probe.name!r} reported no GPUs (check CUDA_VISIBLE_DEVICES)")
    return rank_devices(devices, n, parse_memory(min_free_memory), max_utilization)
