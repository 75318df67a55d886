"""ivyplug: parameter-server training, async-averaging LAMB and load-aware devices.

Importing this package is cheap and framework-free: torch, lightning, keras and
tensorflow are imported only by the modules that need them, and the plugin
registry is built on first use (``get_registry()``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ivyplug._lazy import LazyExports
from ivyplug._version import __version__

if TYPE_CHECKING:
    from ivyplug.registry import Registry

__all__ = ["__version__", "get_registry"]

# Attributes served lazily: name -> "module:attr". Subsystems add their public helpers here
# so that ``import ivyplug`` never pays for them.
_LAZY: dict[str, str] = {
    "hookimpl": "ivyplug.hookspecs:hookimpl",
    "least_loaded": "ivyplug.load.device_choice:least_loaded",
}


def get_registry() -> Registry:
    """Return the process-wide plugin registry, building it on first call."""
    from ivyplug.registry import get_registry as _get

    return _get()


_exports = LazyExports(__name__, globals(), _LAZY)

__getattr__ = _exports.load
__dir__ = _exports.names
