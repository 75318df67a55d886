"""ivyplug's torch optimizers: :class:`LAMB`, :class:`LocalUpdates` (any optimizer + deltas merged through the PS
by an outer optimizer), :class:`AsyncLAMB` (LAMB in that wrapper), :class:`DelayedNesterov` (an outer optimizer),
the functional form :func:`lamb`, and :func:`lamb_param_groups`.

``LocalUpdates``, ``AsyncLAMB`` and ``DelayedNesterov`` live in :mod:`ivyplug.localsgd` (above this package and
:mod:`ivyplug.ps`); they stay importable from here under their old names.

Attributes load lazily (PEP 562), so that the registry can import :mod:`ivyplug.optim.plugin` without torch,
and so that this package never imports :mod:`ivyplug.localsgd` (which imports it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ivyplug._lazy import LazyExports

if TYPE_CHECKING:
    from ivyplug.localsgd.async_lamb import AsyncLAMB
    from ivyplug.localsgd.local_updates import LocalUpdates
    from ivyplug.localsgd.outer import DelayedNesterov
    from ivyplug.optim.functional import lamb
    from ivyplug.optim.groups import lamb_param_groups
    from ivyplug.optim.optimizer import LAMB

__all__ = ["LAMB", "AsyncLAMB", "DelayedNesterov", "LocalUpdates", "lamb", "lamb_param_groups"]

_LAZY: dict[str, str] = {
    "LAMB": "ivyplug.optim.optimizer:LAMB",
    "AsyncLAMB": "ivyplug.localsgd.async_lamb:AsyncLAMB",
    "DelayedNesterov": "ivyplug.localsgd.outer:DelayedNesterov",
    "LocalUpdates": "ivyplug.localsgd.local_updates:LocalUpdates",
    "lamb": "ivyplug.optim.functional:lamb",
    "lamb_param_groups": "ivyplug.optim.groups:lamb_param_groups",
}


_exports = LazyExports(__name__, globals(), _LAZY)

__getattr__ = _exports.load
__dir__ = _exports.names
