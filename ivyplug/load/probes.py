"""Build probe instances from the registry: every registered probe that can run here."""

from __future__ import annotations

import logging

from ivyplug.load.probe import Probe

log = logging.getLogger(__name__)

#: Probes worth polling by default: they need no arguments (``scripted`` needs a trace).
DEFAULT_PROBE_NAMES: tuple[str, ...] = ("nvml", "torch_allocator", "psutil")


def default_probes(names: tuple[str, ...] = DEFAULT_PROBE_NAMES) -> list[Probe]:
    """Instances of the named registered probes whose modules import, available or not."""
    from ivyplug.registry import ComponentUnavailableError, get_registry

    registry = get_registry()
    out: list[Probe] = []
    for name in names:
        try:
            cls = registry.get("probe", name)
        except ComponentUnavailableError as exc:
            log.debug("probe %s skipped: %s", name, exc)
            continue
        out.append(cls())
    return out


def available_probes(names: tuple[str, ...] = DEFAULT_PROBE_NAMES) -> list[Probe]:
    """The default probes that report themselves available on this machine."""
    return [p for p in default_probes(names) if p.available()]
