"""The probe protocol: anything that can say how loaded the machine is, as a flat dict of floats.

Flat readings (``{"gpu0_util": 37.0, "cpu_util": 12.5}``) keep probes independent of each other:
the sampler merges them, metrics are logged as ``ivy/<key>``, and decision code reads the keys it
knows. A probe that cannot work here (no driver, no library) says so through ``available()`` and
returns ``{}`` from ``read()`` instead of raising.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

Readings = dict[str, float]


@runtime_checkable
class Probe(Protocol):
    """What the sampler, ``least_loaded`` and ``ivyplug devices`` need from a load probe."""

    name: str

    def available(self) -> bool:
        """Whether this probe can produce readings on this machine (cheap after the first call)."""
        ...

    def read(self) -> Readings:
        """One snapshot of flat readings; ``{}`` when unavailable. Must be thread-safe for one caller."""
        ...

    def close(self) -> None:
        """Release whatever the probe holds (library handles); reading afterwards may re-open it."""
        ...


def merge_readings(parts: Mapping[str, Mapping[str, float]]) -> Readings:
    """Merge per-probe readings; on a key clash the later probe wins (order of ``parts``)."""
    merged: Readings = {}
    for values in parts.values():
        merged.update(values)
    return merged
