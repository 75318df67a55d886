"""``DeltaExchangingOptimizer``: the protocol through which an optimizer with local updates works with the PS.

``ivyplug.optim.LocalUpdates`` (any torch optimizer in a local-update wrapper) and so ``AsyncLAMB`` implement it;
the outer optimizer it returns is the one ``outer=`` chose (``ivyplug.localsgd.delta_exchange.OuterRule``).

Such an optimizer steps on the worker and exchanges its progress with the servers itself, every few
steps. A training loop (the Lightning strategy, a Keras callback) needs only these calls: start the PS with
the optimizer the servers run instead (the *outer* one), attach the client, at every meeting point
(validation, checkpoint, end of fit) flush the local progress before a sync and re-snapshot after, and at each
epoch's end let the optimizer re-choose its period (``sync_every="auto"``), which it reports as a metric.

Optional, outside the protocol: an optimizer that exchanges in the background (``ivyplug.optim.LocalUpdates``
with ``overlap=True``) offers ``ps_tensors(params, buffers)``, the tensors to start the client over (its
shadow copies), and ``detach()``, which waits for an exchange in flight before the client closes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from ivyplug.ps.worker.client import PSClient


@runtime_checkable
class DeltaExchangingOptimizer(Protocol):
    def outer_optimizer(self, mode: str, num_workers: int) -> Any:
        """The optimizer the servers mirror (pass it to ``PSClient.start``)."""

    def attach(self, client: PSClient) -> None:
        """Exchange through ``client`` from now on; the current values are the pulled global copy."""

    def flush(self) -> None:
        """Push the progress made since the last exchange (before a sync)."""

    def reset_snapshot(self) -> None:
        """Measure the next delta from the current values (after a sync or a load)."""

    @property
    def sync_every(self) -> int:
        """Local steps between two exchanges, now."""

    def retune_sync_every(self) -> int:
        """At an epoch's end: choose ``sync_every`` again where it is chosen from measured times; returns it."""
