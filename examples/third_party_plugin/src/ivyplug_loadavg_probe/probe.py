"""The probe itself: cheap, framework-free, and honest about where it cannot run."""

from __future__ import annotations

import os


class LoadAverageProbe:
    """Reports ``os.getloadavg()[0] / cpu_count`` as the host's CPU load (0..1+)."""

    name = "loadavg"

    def available(self) -> bool:
        return hasattr(os, "getloadavg")

    def read(self) -> dict[str, float]:
        load1, _, _ = os.getloadavg()
        return {"cpu_load": load1 / (os.cpu_count() or 1)}

    def close(self) -> None:
        """Nothing to release: the probe holds no handle (the protocol asks every probe for ``close``)."""
