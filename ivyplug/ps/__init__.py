"""Parameter server on torch.distributed (gloo point-to-point), framework-free apart from torch.

``from ivyplug.ps import PSConfig, PSClient`` — see docs/design.md for how a step flows. ``PSConfig``
(validation only) is importable without torch; everything else loads torch on first use.
"""

from __future__ import annotations

from ivyplug._lazy import LazyExports
from ivyplug.ps.config import MODES, STALENESS_SCALINGS, PSConfig

__all__ = [
    "MODES",
    "STALENESS_SCALINGS",
    "PSClient",
    "PSConfig",
    "PSProtocolError",
    "PSTimeoutError",
    "ShardPlan",
    "TensorSpec",
    "build_plan",
]

_LAZY = {
    "PSClient": "ivyplug.ps.client",
    "PSTimeoutError": "ivyplug.ps.transport",
    "PSProtocolError": "ivyplug.ps.transport",
    "ShardPlan": "ivyplug.ps.sharding",
    "TensorSpec": "ivyplug.ps.sharding",
    "build_plan": "ivyplug.ps.sharding",
}


_exports = LazyExports(__name__, globals(), _LAZY)

__getattr__ = _exports.load
__dir__ = _exports.names
