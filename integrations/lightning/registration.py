"""Names under which ``IvyPSStrategy`` is offered to Lightning's ``StrategyRegistry``.

The registered objects are :class:`LazyStrategyFactory` instances: calling one imports the
strategy class and builds it with the name's defaults. Registering them therefore imports
nothing, which is what lets the post-import hook (:mod:`.autoregister`) register while
``lightning.pytorch`` is still being imported. This module imports only the standard library.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

STRATEGY_TARGET = "ivyplug.integrations.lightning.ps_strategy:IvyPSStrategy"
DEFAULT_SSP_STALENESS = 4


class LazyStrategyFactory:
    """A callable that builds ``IvyPSStrategy(**defaults, **overrides)``, importing it on first call."""

    def __init__(self, name: str, description: str, **defaults: Any) -> None:
        self.name = name
        self.description = description
        self.defaults = defaults

    def load_class(self) -> type:
        module_name, attr = STRATEGY_TARGET.split(":")
        cls: type = getattr(importlib.import_module(module_name), attr)
        return cls

    def __call__(self, **overrides: Any) -> Any:
        return self.load_class()(**{**self.defaults, **overrides})

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.defaults.items())
        return f"<ivyplug strategy {self.name!r}: IvyPSStrategy({args})>"


ivy_ps = LazyStrategyFactory(
    "ivy_ps", "ivyplug parameter server, asynchronous (each push applied on arrival)", mode="async"
)
ivy_ps_sync = LazyStrategyFactory(
    "ivy_ps_sync", "ivyplug parameter server, synchronous (every worker's gradient combined per step)", mode="sync"
)
ivy_ps_ssp = LazyStrategyFactory(
    "ivy_ps_ssp",
    f"ivyplug parameter server, stale-synchronous (at most {DEFAULT_SSP_STALENESS} steps ahead of the slowest)",
    mode="ssp",
    staleness=DEFAULT_SSP_STALENESS,
)

FACTORIES: tuple[LazyStrategyFactory, ...] = (ivy_ps, ivy_ps_sync, ivy_ps_ssp)
STRATEGY_NAMES: tuple[str, ...] = tuple(f.name for f in FACTORIES)


def _is_ours(entry: Any) -> bool:
    strategy = entry.get("strategy") if isinstance(entry, dict) else None
    if isinstance(strategy, LazyStrategyFactory):
        return True
    return getattr(strategy, "__module__", "") == STRATEGY_TARGET.split(":")[0]


def register_strategies(strategy_registry: Any) -> list[str]:
    """Register ``ivy_ps``, ``ivy_ps_sync`` and ``ivy_ps_ssp`` in a Lightning ``StrategyRegistry``.

    Idempotent: our own earlier entries are replaced. A name already taken by another package is
    left alone (with a warning), so installing ivyplug never silently changes someone else's strategy.
    Returns the names registered.
    """
    registered: list[str] = []
    for factory in FACTORIES:
        if factory.name in strategy_registry and not _is_ours(strategy_registry[factory.name]):
            warnings.warn(
                f"ivyplug: strategy name {factory.name!r} is already registered by another package; "
                "use ivyplug.integrations.lightning.IvyPSStrategy(...) explicitly",
                RuntimeWarning,
                stacklevel=2,
            )
            continue
        strategy_registry.register(factory.name, factory, description=factory.description, override=True)
        registered.append(factory.name)
    return registered


def register_with_lightning() -> list[str]:
    """Register the strategies with ``lightning.pytorch`` (imports it)."""
    from lightning.pytorch.strategies import StrategyRegistry

    return register_strategies(StrategyRegistry)


class LegacyPackagePointer:
    """Registered under the ivyplug names in ``pytorch_lightning``'s registry: explains what to use instead."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, **kwargs: Any) -> Any:
        raise ValueError(
            f"strategy {self.name!r} is an ivyplug strategy for the `lightning` package; the old "
            "`pytorch_lightning` package has a separate Trainer and class tree. Use "
            "`from lightning.pytorch import Trainer` (pip install lightning)."
        )


def register_legacy_pointers(strategy_registry: Any) -> list[str]:
    """Make the ivyplug names in ``pytorch_lightning``'s registry fail with a clear message, not a KeyError."""
    registered: list[str] = []
    for factory in FACTORIES:
        if factory.name in strategy_registry:
            continue
        strategy_registry.register(
            factory.name, LegacyPackagePointer(factory.name), description=f"{factory.description} (lightning only)"
        )
        registered.append(factory.name)
    return registered
