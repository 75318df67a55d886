"""Make ``Trainer(strategy="ivy_ps")`` work in an interpreter that never imports ivyplug.

A ``.pth`` file that ivyplug installs into site-packages runs :func:`install` at interpreter
start. It only puts a small finder at the front of ``sys.meta_path``; when (and only when)
``lightning.pytorch.strategies`` is imported, the finder wraps that module's loader so the
ivyplug names are registered in its ``StrategyRegistry`` right after it executes. Nothing
else is imported at start-up. ``IVYPLUG_DISABLE_LIGHTNING_AUTOREGISTER=1`` switches it off.
The old package name ``pytorch_lightning`` has a separate registry and class tree that
``IvyPSStrategy`` does not belong to; there the names raise an error saying what to import.

This module must stay import-light: it imports only ``os``, ``sys`` and ``post_import``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from ivyplug.integrations.post_import import PostImportFinder

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


class StrategyRegistryHook(PostImportFinder):
    """Registers the strategy names once ``lightning.pytorch.strategies`` (or the legacy module) executed."""

    def __init__(self) -> None:
        super().__init__(TARGETS, _register)


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
    StrategyRegistryHook.install()
    return True
