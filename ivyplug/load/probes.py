"""Build probe instances from the registry: every registered probe that can run here."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ivyplug.load.probe import Probe

log = logging.getLogger(__name__)

#: Probes worth polling by default: they need no arguments. Both ``IvyLoadBalancer`` twins poll these when
#: given no ``probes``: ivyplug's own, by full name, whatever other plugins offer under the same names.
DEFAULT_PROBE_NAMES: tuple[str, ...] = ("nvml", "torch.torch_allocator", "psutil")

#: The config name of a :class:`~ivyplug.load.scripted_probe.ScriptedProbe` (read by :func:`make_probe`).
SCRIPTED = "scripted"


def default_probes(names: tuple[str, ...] = DEFAULT_PROBE_NAMES) -> list[Probe]:
    """Instances of the named registered probes whose modules import, available or not."""
    from ivyplug.registry import ComponentUnavailableError, get_registry

    registry = get_registry()
    out: list[Probe] = []
    for name in names:
        try:
            cls = registry.get("probe", name, builtin=True)
        except ComponentUnavailableError as exc:
            log.debug("probe %s skipped: %s", name, exc)
            continue
        out.append(cls())
    return out


def available_probes(names: tuple[str, ...] = DEFAULT_PROBE_NAMES) -> list[Probe]:
    """The default probes that report themselves available on this machine."""
    return [p for p in default_probes(names) if p.available()]


def make_probe(spec: str | Mapping[str, Any] | Probe) -> Probe:
    """A probe from a registry name, a ``{"name": ..., **kwargs}`` dict or a probe object (returned as is).

    Names and dicts let a load balancer's probes live in a config file (LightningCLI YAML, Keras ``get_config``).
    ``{"name": "scripted", "trace": [...]}`` is a :class:`ScriptedProbe` (what :func:`probe_config` writes for
    one): a tool for tests and demos, so it is not a registered component that ``ivyplug list`` would offer.
    """
    if isinstance(spec, Probe):
        return spec
    from ivyplug.registry import get_registry

    if isinstance(spec, Mapping) and spec.get("name") == SCRIPTED:
        from ivyplug.load.scripted_probe import ScriptedProbe

        return ScriptedProbe(**{k: v for k, v in spec.items() if k != "name"})

    if isinstance(spec, str):
        return get_registry().get("probe", spec)()
    if isinstance(spec, Mapping) and isinstance(spec.get("name"), str):
        kwargs = {k: v for k, v in spec.items() if k != "name"}
        return get_registry().get("probe", spec["name"])(**kwargs)
    raise ValueError(f"probes must hold probe names, {{'name': ..., **kwargs}} dicts or Probe objects, got {spec!r}")


def probe_config(spec: str | Mapping[str, Any] | Probe) -> str | dict[str, Any]:
    """A probe spec as a config value (a name or a ``{"name": ..., **kwargs}`` dict), the inverse of make_probe."""
    from ivyplug.load.scripted_probe import ScriptedProbe

    if isinstance(spec, str):
        return spec
    if isinstance(spec, Mapping):
        return dict(spec)
    if isinstance(spec, ScriptedProbe) and spec.clock is None:
        return {"name": SCRIPTED, "trace": spec.trace, "loop": spec.loop}
    raise ValueError(
        f"probe {spec!r} cannot be written to a config: pass probes by name or as {{'name': ..., **kwargs}} dicts"
    )
