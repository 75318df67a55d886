"""Keras adapters: ``LAMB``, ``AsyncLAMB`` (+ ``AsyncLAMBExchange``), ``IvyLoadBalancer``, ``ElasticDataset``.

Lazy (PEP 562): importing this package, or its ``plugin`` module, imports neither Keras nor
TensorFlow; a name is imported from its module on first access.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Public name -> module that defines it. Adding an export is one line here.
_EXPORTS: dict[str, str] = {
    "LAMB": "ivyplug.integrations.keras.lamb",
    "AsyncLAMB": "ivyplug.integrations.keras.async_lamb",
    "AsyncLAMBExchange": "ivyplug.integrations.keras.async_lamb",
    "ElasticDataset": "ivyplug.integrations.keras.elastic",
    "IvyLoadBalancer": "ivyplug.integrations.keras.load_balancer",
    "apply_mwms_fixes": "ivyplug.integrations.keras.mwms_fixes",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
