"""Register ivyplug's Keras classes with Keras's serialization as soon as Keras is imported.

Keras resolves ``"ivyplug>LAMB"`` (a compile config, or a saved ``.keras`` model) through its global
custom-object table, which only holds classes whose decorator has run. Two ways fill it, both through
:func:`register_on_import`:

* ``import ivyplug.integrations.keras`` (registers now if Keras is imported, else when it is);
* a ``.pth`` file that ivyplug installs into site-packages calls :func:`install` at interpreter start,
  so ``keras.models.load_model("m.keras")`` works in a program that never imports ivyplug.
  ``IVYPLUG_DISABLE_KERAS_AUTOREGISTER=1`` switches that start-up hook off.

Until Keras is imported only a small finder sits at the front of ``sys.meta_path``; when (and only when)
the ``keras`` package is imported, it wraps that module's loader and registers right after it executes.
This module must stay import-light: it imports only ``os``, ``sys`` and ``post_import``.
"""

from __future__ import annotations

import os
import sys

from ivyplug.integrations.post_import import PostImportFinder

DISABLE_ENV = "IVYPLUG_DISABLE_KERAS_AUTOREGISTER"
TARGET_MODULE = "keras"
PACKAGE = "ivyplug"
#: What Keras's serialization knows the classes as (their modules import Keras, NumPy and ivyplug's
#: framework-free PS config only: registering loads no torch).
REGISTERED_NAMES = (f"{PACKAGE}>LAMB", f"{PACKAGE}>AsyncLAMB")
#: Where the registered classes live (module, class).
CLASSES = (
    ("ivyplug.integrations.keras.lamb", "LAMB"),
    ("ivyplug.integrations.keras.async_lamb", "AsyncLAMB"),
)

#: Keras was first imported by one of those modules, above its class: registration waits for it.
_deferred = False


def disabled() -> bool:
    """Whether the start-up hook is switched off (the explicit package import ignores the switch)."""
    return os.environ.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def register_serializables() -> list[str]:
    """Import the classes and (re-)enter them in Keras's custom-object table; returns the registered names.

    Idempotent: Keras's decorator only sets two dict entries, so a class registered twice stays one entry.
    """
    import keras
    from ivyplug.integrations.keras.async_lamb import AsyncLAMB
    from ivyplug.integrations.keras.lamb import LAMB

    return [
        keras.saving.get_registered_name(keras.saving.register_keras_serializable(package=PACKAGE)(cls))
        for cls in (LAMB, AsyncLAMB)
    ]


def _classes_ready() -> bool:
    """False while ``lamb.py`` or ``async_lamb.py`` runs above its class definition (it imported Keras)."""
    return all(
        module is None or hasattr(module, attr) for module, attr in ((sys.modules.get(m), a) for m, a in CLASSES)
    )


def finish_deferred() -> None:
    """Called at the end of the class modules: run a registration that had to wait for their classes."""
    global _deferred
    if _deferred and _classes_ready():
        _deferred = False
        _register()


def _register() -> None:
    """Register after Keras executed; a broken ivyplug must never make Keras unimportable."""
    global _deferred
    if not _classes_ready():  # `from ivyplug.integrations.keras import LAMB` before Keras was imported
        _deferred = True
        return
    try:
        register_serializables()
    except Exception as exc:
        import warnings

        warnings.warn(f"ivyplug: could not register its Keras classes: {exc!r}", RuntimeWarning, stacklevel=2)


class KerasImportHook(PostImportFinder):
    """Registers the classes once the ``keras`` package executed."""

    def __init__(self) -> None:
        super().__init__((TARGET_MODULE,), lambda module: _register())


def hook_installed() -> bool:
    """Whether the finder is in ``sys.meta_path`` (from the start-up hook or an earlier import)."""
    return KerasImportHook.installed()


def register_on_import() -> None:
    """Register now if Keras is imported, otherwise as soon as it is (installs the finder once)."""
    module = sys.modules.get(TARGET_MODULE)
    if module is not None:
        if not getattr(getattr(module, "__spec__", None), "_initializing", False):
            _register()
        return  # Keras is mid-import: registering now would fail; our finder, if loading it, registers after
    KerasImportHook.install()


def install() -> bool:
    """The start-up hook's entry point: :func:`register_on_import` unless switched off."""
    if disabled():
        return False
    register_on_import()
    return True
