"""Lazy public names of a package (PEP 562), so that importing the package loads none of its submodules'
frameworks (torch, Lightning, Keras) until one of those names is first used."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any


class LazyExports:
    """The names ``table`` maps to ``"module"`` (the same name there) or ``"module:attr"``, loaded on first use.

    A package serves them from its ``__getattr__`` and lists them from its ``__dir__``; a loaded name is stored
    in the package's ``namespace`` (its ``globals()``), so later lookups skip ``__getattr__``.
    """

    def __init__(self, package: str, namespace: dict[str, Any], table: Mapping[str, str]) -> None:
        self.package = package
        self.namespace = namespace
        self.table = dict(table)

    def load(self, name: str) -> Any:
        target = self.table.get(name)
        if target is None:
            raise AttributeError(f"module {self.package!r} has no attribute {name!r}")
        module_name, _, attr = target.partition(":")
        value = getattr(importlib.import_module(module_name), attr or name)
        self.namespace[name] = value
        return value

    def names(self) -> list[str]:
        return sorted(set(self.namespace) | set(self.table))
