"""Lightning adapters for ivyplug, imported lazily.

Importing this package (or its ``plugin`` module) imports no framework: each public name
below is loaded from its module on first attribute access (PEP 562). Adding a public
class is one line in ``_LAZY``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ivyplug._lazy import LazyExports

if TYPE_CHECKING:
    from ivyplug.integrations.lightning.load_balancer import IvyLoadBalancer as IvyLoadBalancer
    from ivyplug.integrations.lightning.ps_strategy import IvyPSStrategy as IvyPSStrategy

#: Public name -> module that defines it.
_LAZY: dict[str, str] = {
    "IvyPSStrategy": "ivyplug.integrations.lightning.ps_strategy",
    "IvyLoadBalancer": "ivyplug.integrations.lightning.load_balancer",
}

__all__ = sorted(_LAZY)


_exports = LazyExports(__name__, globals(), _LAZY)

__getattr__ = _exports.load
__dir__ = _exports.names
