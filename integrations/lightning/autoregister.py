"""Make ``Trainer(strategy="ivy_ps")`` work in an interpreter that never imports ivyplug.

A ``.pth`` file that ivyplug installs into site-packages runs :func:`install` at interpreter
start. It only puts a small finder at the front of ``sys.meta_path``; when (and only when)
``lightning.pytorch.strategies`` is imported, the finder wraps that module's loader so the
ivyplug names are registered in its ``StrategyRegistry`` right after it executes. Nothing
else is imported at start-up. ``IVYPLUG_DISABLE_LIGHTNING_AUTOREGISTER=1`` switches it off.
The old package name ``pytorch_lightning`` has a separate registry and class tree that
``IvyPSStrategy`` does not belong to; there the names raise an error saying what to import.

This module must stay import-light: it imports only ``os`` and ``sys``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

DISABLE_ENV = "IVYPLUG_DISABLE_LIGHTNING_AUTOREGISTER"
TARGET_MODULE = "lightning.pytorch.strategies"
#: The old package name has its own registry and class tree: the names there explain what to import instead.
LEGACY_MODULE = "pytorch_lightning.strategies"
TARGETS = (TARGET_MODULE, LEGACY_MODULE)


def disabled() -> bool:
    return os.environ.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _register(module: Any) -> None:
    """Register into the freshly executed strategies module; never breaks the user's import."""
    try:
        from ivyplug.integrations.lightning import registration

        if module.__name__ == LEGACY_MODULE:
            registration.register_legacy_pointers(module.StrategyRegistry)
        else:
            registration.register_strategies(module.StrategyRegistry)
    except Exception as exc:  # a broken ivyplug must not make lightning unimportable
        import warnings

        warnings.warn(f"ivyplug: could not register Lightning strategies: {exc!r}", RuntimeWarning, stacklevel=2)


class _RegisteringLoader:
    """Wraps the real loader; after it executes the module, registers the strategies."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        # hand the module back to its real loader (inspect, importlib.resources and reload see no wrapper)
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        _register(module)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, resource readers, ...
        return getattr(self._loader, name)


class StrategyRegistryHook:
    """A meta-path finder that only ever reacts to ``lightning.pytorch.strategies``."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in TARGETS:
            return None
        for finder in sys.meta_path:
            if finder is self or isinstance(finder, StrategyRegistryHook):
                continue
            find_spec = getattr(finder, "find_spec", None)
            if find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _RegisteringLoader(spec.loader)
        return spec


def install() -> bool:
    """Install the hook once (or register at once if Lightning's strategies are already imported)."""
    if disabled():
        return False
    for name in TARGETS:
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "StrategyRegistry"):
            _register(module)
    if all(name in sys.modules for name in TARGETS):
        return True
    if not any(isinstance(f, StrategyRegistryHook) for f in sys.meta_path):
        sys.meta_path.insert(0, StrategyRegistryHook())
    return True
