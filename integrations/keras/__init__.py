"""Keras adapters: ``LAMB``, ``AsyncLAMB`` (+ ``AsyncLAMBExchange``), ``IvyLoadBalancer``, ``ElasticDataset``.

Importing this package registers ``ivyplug>LAMB`` and ``ivyplug>AsyncLAMB`` with Keras's serialization
(compile configs and saved ``.keras`` models name them), at once if Keras is imported, otherwise as soon
as it is (:mod:`.autoregister`). It stays lazy (PEP 562): importing it, or its ``plugin`` module, imports
neither Keras nor TensorFlow, and a name is imported from its module on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ivyplug.integrations.keras import autoregister as _autoregister

from ivyplug._lazy import LazyExports

if TYPE_CHECKING:
    from ivyplug.integrations.keras.async_lamb import AsyncLAMB as AsyncLAMB
    from ivyplug.integrations.keras.async_lamb import AsyncLAMBExchange as AsyncLAMBExchange
    from ivyplug.integrations.keras.elastic import ElasticDataset as ElasticDataset
    from ivyplug.integrations.keras.lamb import LAMB as LAMB
    from ivyplug.integrations.keras.load_balancer import IvyLoadBalancer as IvyLoadBalancer
    from ivyplug.integrations.keras.mwms_fixes import apply_mwms_fixes as apply_mwms_fixes

#: Public name -> module that defines it. Adding an export is one line here.
_EXPORTS: dict[str, str] = {
    "LAMB": "ivyplug.integrations.keras.lamb",
    "AsyncLAMB": "ivyplug.integrations.keras.async_lamb",
    "AsyncLAMBExchange": "ivyplug.integrations.keras.async_lamb",
    "ElasticDataset": "ivyplug.integrations.keras.elastic",
    "IvyLoadBalancer": "ivyplug.integrations.keras.load_balancer",
    "apply_mwms_fixes": "ivyplug.integrations.keras.mwms_fixes",
}

__all__ = sorted(_EXPORTS)

# The user asked for ivyplug's Keras side: its classes must resolve by name, whatever the start-up
# hook's switch says (that switch only concerns programs that never import ivyplug).
_autoregister.register_on_import()


_exports = LazyExports(__name__, globals(), _EXPORTS)

__getattr__ = _exports.load
__dir__ = _exports.names
