"""Delta averaging through the PS: push x_local − x_pulled, let the servers merge it, continue from the pull.

The merge runs on the existing PS machinery: the servers mirror an *outer* optimizer, plain SGD with
``lr = merge_rate``, and the worker pushes the pseudo-gradient x_pulled − x_local (= −Δ), so the servers
apply ``x ← x + merge_rate · Δ``. Every PS rule then holds unchanged: sync mode combines the workers' deltas
weighted by their local step counts before one merge; async/ssp merge each delta on arrival, with the
outer rate divided by τ for a delta made τ ≥ 2 merges after its pull (``staleness_scaling="inverse"``: the
merge rate already averages over the other workers' deltas of a round, see ``shard.staleness_factor``);
buffers follow the PS buffer rule at every exchange; a non-finite delta follows the PS's ``nonfinite``
policy like any push.

``merge_rate=None`` picks 1.0 in sync mode (the global copy moves by the mean delta) and 1/num_workers in
async/ssp (once every worker pushed, the global copy moved by the mean of their deltas). A delta with a
NaN/Inf is dropped whole by the PS (``nonfinite="skip"``, counted in ``discarded``; in sync mode it counts
zero local steps) or stops training (``"raise"``); either way nothing non-finite reaches the servers, and
after a drop the worker restarts from the global copy. Used by ``ivyplug.optim.AsyncLAMB`` and the Keras
``AsyncLAMB``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from ivyplug.ps.client import PSClient


def check_merge_rate(value: object) -> float | None:
    """``None`` or a finite number > 0 (ValueError naming ``merge_rate`` otherwise)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"merge_rate must be None or a finite number > 0, got {value!r}")
    return float(value)


def check_sync_every(value: object) -> int:
    """An int >= 1 (ValueError naming ``sync_every`` otherwise)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"sync_every must be an int >= 1 (local steps between exchanges), got {value!r}")
    return value


class DeltaExchange:
    """Measures a worker's progress since its last pull and exchanges it through a :class:`PSClient`."""

    def __init__(self, params: Sequence[Tensor], merge_rate: float | None = None) -> None:
        self.params = list(params)
        self.merge_rate = check_merge_rate(merge_rate)
        self.outer: torch.optim.SGD | None = None
        self.client: PSClient | None = None
        self.snapshot: list[Tensor] = []
        self.exchanges = 0
        self.discarded = 0

    def outer_optimizer(self, mode: str, num_workers: int) -> torch.optim.SGD:
        """The optimizer the servers mirror (pass it as ``optimizer=`` to ``PSClient.start``)."""
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")
        if mode not in ("sync", "async", "ssp"):
            raise ValueError(f"mode must be 'sync', 'async' or 'ssp', got {mode!r}")
        rate = self.merge_rate
        if rate is None:
            rate = 1.0 if mode == "sync" else 1.0 / num_workers
        self.outer = torch.optim.SGD(self.params, lr=rate)
        return self.outer

    def attach(self, client: PSClient) -> None:
        """Exchange through ``client``; the current values are the pulled global copy."""
        if self.outer is None or client.optimizer is not self.outer:
            raise ValueError("attach() needs a PSClient started with optimizer=outer_optimizer(mode, num_workers)")
        self.client = client
        self.reset_snapshot()

    def reset_snapshot(self) -> None:
        """Take the current values as the global copy the next delta is measured from."""
        self.snapshot = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def exchange(self, local_steps: int) -> None:
        """Push −Δ weighted by ``local_steps`` (sync mode), pull the global copy into the params, re-snapshot."""
        client = self.client
        if client is None:
            raise RuntimeError("exchange() needs a PS: start a PSClient with outer_optimizer() and attach() it")
        saved = [p.grad for p in self.params]
        pseudo = [s - p.detach() for s, p in zip(self.snapshot, self.params, strict=True)]
        skipped = client.metrics()["nonfinite_skipped"]
        try:
            for p, g in zip(self.params, pseudo, strict=True):
                p.grad = g
            client.step(max(1, int(local_steps)), delta=True)  # the PS checks the whole push (nonfinite policy)
            if client.metrics()["nonfinite_skipped"] > skipped:
                self.discarded += 1
        finally:
            for p, old in zip(self.params, saved, strict=True):
                p.grad = old
        self.exchanges += 1
        self.reset_snapshot()
