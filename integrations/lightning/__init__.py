"""Lightning adapters for ivyplug, imported lazily.

Importing this package (or its ``plugin`` module) imports no framework: each public name
below is loaded from its module on first attribute access (PEP 562). Adding a public
class is one line in ``_LAZY``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ivyplug.integrations.lightning.load_balancer import IvyLoadBalancer as IvyLoadBalancer
    from ivyplug.integrations.lightning.ps_strategy import IvyPSStrategy as IvyPSStrategy

#: Public name -> module that defines it.
_LAZY: dict[str, str] = {
    "IvyPSStrategy": "ivyplug.integrations.lightning.ps_strategy",
    "IvyLoadBalancer": "ivyplug.integrations.lightning.load_balancer",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
