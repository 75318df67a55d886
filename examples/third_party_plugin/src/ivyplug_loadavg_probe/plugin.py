"""The plugin module named by the ``ivyplug`` entry point: one hook implementation."""

from __future__ import annotations

from collections.abc import Iterator

from ivyplug.components import Probe
from ivyplug.hookspecs import hookimpl


@hookimpl
def ivyplug_probes() -> Iterator[Probe]:
    yield Probe(
        "loadavg",
        "ivyplug_loadavg_probe.probe:LoadAverageProbe",
        description="OS 1-minute load average per CPU",
    )
