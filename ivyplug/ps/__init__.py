"""Parameter server on torch.distributed (gloo point-to-point), framework-free apart from torch.

``from ivyplug.ps import PSConfig, PSClient, PSOptimizer`` — see docs/design.md for how a step flows. ``PSConfig``
(validation only) is importable without torch; everything else loads torch on first use.

Three subpackages, each importing only those after it: ``worker`` (``PSClient`` and how it reaches the
shards), ``server`` (shards, the server loop, ``ivyplug serve``), ``wire`` (messages, channels, codecs);
``config`` and ``sharding`` (the shard plan) sit below all three.
"""

from __future__ import annotations

from ivyplug._lazy import LazyExports
from ivyplug.ps.config import MODES, STALENESS_SCALINGS, PSConfig

__all__ = [
    "MODES",
    "STALENESS_SCALINGS",
    "PSClient",
    "PSConfig",
    "PSOptimizer",
    "PSProtocolError",
    "PSTimeoutError",
    "ShardPlan",
    "TensorSpec",
    "build_plan",
]

_LAZY = {
    "PSClient": "ivyplug.ps.worker.client",
    "PSOptimizer": "ivyplug.ps.worker.optimizer",
    "PSTimeoutError": "ivyplug.ps.wire.transport",
    "PSProtocolError": "ivyplug.ps.wire.transport",
    "ShardPlan": "ivyplug.ps.sharding",
    "TensorSpec": "ivyplug.ps.sharding",
    "build_plan": "ivyplug.ps.sharding",
}


_exports = LazyExports(__name__, globals(), _LAZY)

__getattr__ = _exports.load
__dir__ = _exports.names
