"""Local SGD through the parameter server: optimizers that step locally and merge deltas on the servers.

:class:`LocalUpdates` (any torch optimizer in a local-update wrapper), :class:`AsyncLAMB` (LAMB in that
wrapper), :class:`DelayedNesterov` (an outer optimizer the servers run), and the protocol a training loop
drives them through, :class:`DeltaExchangingOptimizer`. Built on :mod:`ivyplug.ps` and :mod:`ivyplug.optim`,
neither of which imports it (``ivyplug.optim`` re-exports the optimizers lazily under their old names).

Attributes load lazily (PEP 562): importing this package does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ivyplug.localsgd.async_lamb import AsyncLAMB
    from ivyplug.localsgd.local_updates import LocalUpdates
    from ivyplug.localsgd.optimizer_protocol import DeltaExchangingOptimizer
    from ivyplug.localsgd.outer import DelayedNesterov

__all__ = ["AsyncLAMB", "DelayedNesterov", "DeltaExchangingOptimizer", "LocalUpdates"]

_LAZY: dict[str, str] = {
    "AsyncLAMB": "ivyplug.localsgd.async_lamb:AsyncLAMB",
    "DelayedNesterov": "ivyplug.localsgd.outer:DelayedNesterov",
    "DeltaExchangingOptimizer": "ivyplug.localsgd.optimizer_protocol:DeltaExchangingOptimizer",
    "LocalUpdates": "ivyplug.localsgd.local_updates:LocalUpdates",
}


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'ivyplug.localsgd' has no attribute {name!r}")
    module_name, attr = target.split(":")
    value = getattr(importlib.import_module(module_name), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
