"""ivyplug: parameter-server training, async-averaging LAMB and load-aware devices.

Importing this package is cheap and framework-free: torch, lightning, keras and
tensorflow are imported only by the modules that need them, and the plugin
registry is built on first use (``get_registry()``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'ivyplug' has no attribute {name!r}")
    import importlib

    module_name, attr = target.split(":")
    value = getattr(importlib.import_module(module_name), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
