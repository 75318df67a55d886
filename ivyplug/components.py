"""The small frozen records that plugins return from their hooks.

A component is referenced lazily as ``"module:attr"`` so that listing components
never imports a framework; :meth:`Component.load` imports it on demand.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field
from typing import Any, ClassVar

#: What each framework needs importable, and the pip extra that brings it.
FRAMEWORK_REQUIREMENTS: dict[str, tuple[tuple[str, ...], str | None]] = {
    "torch": (("torch",), None),
    "lightning": (("torch", "lightning"), "lightning"),
    "keras": (("keras", "tensorflow"), "keras"),
}

KINDS: tuple[str, ...] = ("strategy", "optimizer", "callback", "probe")


@dataclass(frozen=True)
class Component:
    """A named, lazily imported thing a plugin contributes.

    ``name`` is the short name (``"lamb"``); the registry's key is :attr:`full_name`, which
    carries the framework (``"torch.lamb"``) so that torch and Keras twins can coexist.
    """

    name: str
    target: str
    framework: str | None = None
    description: str = ""
    requires: tuple[str, ...] = field(default=())
    extra: str | None = None
    kind: ClassVar[str] = ""

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(
                f"{type(self).__name__}.name must be a non-empty identifier-like string, got {self.name!r}"
            )
        if self.target.count(":") != 1 or not all(self.target.split(":")):
            raise ValueError(
                f"{type(self).__name__}.target must look like 'package.module:attribute', got {self.target!r}"
            )
        if self.framework is not None and self.framework not in FRAMEWORK_REQUIREMENTS:
            raise ValueError(
                f"{type(self).__name__}.framework must be one of {sorted(FRAMEWORK_REQUIREMENTS)} or None, "
                f"got {self.framework!r}"
            )

    @property
    def full_name(self) -> str:
        return f"{self.framework}.{self.name}" if self.framework else self.name

    @property
    def required_modules(self) -> tuple[str, ...]:
        base = FRAMEWORK_REQUIREMENTS[self.framework][0] if self.framework else ()
        return tuple(dict.fromkeys((*base, *self.requires)))

    @property
    def install_extra(self) -> str | None:
        if self.extra is not None:
            return self.extra
        return FRAMEWORK_REQUIREMENTS[self.framework][1] if self.framework else None

    def missing_modules(self) -> list[str]:
        """Required top-level modules that are not importable (checked without importing)."""
        return [m for m in self.required_modules if importlib.util.find_spec(m) is None]

    def load(self) -> Any:
        module_name, attr = self.target.split(":")
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
        return obj


@dataclass(frozen=True)
class Strategy(Component):
    """A training strategy (for example a Lightning ``Strategy`` subclass)."""

    kind: ClassVar[str] = "strategy"


@dataclass(frozen=True)
class Optimizer(Component):
    """An optimizer class (torch.optim or Keras)."""

    kind: ClassVar[str] = "optimizer"


@dataclass(frozen=True)
class Callback(Component):
    """A training-loop callback (Lightning or Keras)."""

    kind: ClassVar[str] = "callback"


@dataclass(frozen=True)
class Probe(Component):
    """A device-load probe (NVML, torch allocator, psutil, ...)."""

    kind: ClassVar[str] = "probe"


KIND_TYPES: dict[str, type[Component]] = {c.kind: c for c in (Strategy, Optimizer, Callback, Probe)}
