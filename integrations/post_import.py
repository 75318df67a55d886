"""Run a function right after a module is imported, without importing it (a meta-path finder).

The start-up hooks of the Lightning and Keras adapters register ivyplug's names when Lightning's strategies
or Keras are imported, in programs that never import ivyplug. A finder at the front of ``sys.meta_path``
reacts only to its target module names: it finds the real spec through the other finders and wraps the
spec's loader, which executes the module, hands it back to its real loader and calls the function.

This module must stay import-light: it imports only ``sys``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


class _CallingLoader:
    """Wraps a module's real loader; after it executes the module, calls ``after(module)``."""

    def __init__(self, loader: Any, after: Callable[[Any], None]) -> None:
        self._loader = loader
        self._after = after

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        # hand the module back to its real loader (inspect, importlib.resources and reload see no wrapper)
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._after(module)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, resource readers, ...
        return getattr(self._loader, name)


class PostImportFinder:
    """Calls ``after(module)`` once one of ``targets`` is executed; every other import passes untouched."""

    def __init__(self, targets: tuple[str, ...], after: Callable[[Any], None]) -> None:
        self.targets = targets
        self.after = after

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in self.targets:
            return None
        for finder in sys.meta_path:
            if isinstance(finder, PostImportFinder):
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
            spec.loader = _CallingLoader(spec.loader, self.after)
        return spec

    @classmethod
    def installed(cls) -> bool:
        """Whether a finder of this class is in ``sys.meta_path``."""
        return any(isinstance(f, cls) for f in sys.meta_path)

    @classmethod
    def install(cls) -> None:
        """Put one finder of this class at the front of ``sys.meta_path`` (once); ``cls()`` takes no argument."""
        if not cls.installed():
            sys.meta_path.insert(0, cls())  # type: ignore[call-arg]
