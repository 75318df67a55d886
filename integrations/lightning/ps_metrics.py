"""Per-worker PS metrics, gathered at epoch end and logged as ``ivy/rank{r}/<metric>``.

Lightning's loggers write from rank 0 only, so each worker's numbers (pushes, pulls, staleness,
bytes, time waiting on the PS, with local updates its current ``sync_every``) are all-gathered first; every
rank then logs the same values.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.callbacks import Callback


class PSMetricsLogger(Callback):
    """Installed by :class:`IvyPSStrategy`, before the user's callbacks; not meant to be added by users.

    It also pulls the global model at the end of training, before the user's callbacks' ``on_train_end``: one
    that sets the model's weights there (``StochasticWeightAveraging`` copies its average in) has the last word,
    as under DDP (the strategy's own ``on_train_end`` runs after every callback's)."""

    def __init__(self, strategy: Any) -> None:
        self._ps_strategy = strategy
        self.last: dict[str, float] = {}

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._ps_strategy.end_train_epoch()
        local = self._ps_strategy.ps_metrics()
        if not local:
            return
        names = sorted(local)
        values = torch.tensor([float(local[n]) for n in names], dtype=torch.float64)
        by_rank = self._ps_strategy.gather_by_rank(values)
        self.last = {}
        for rank, row in sorted(by_rank.items()):
            for i, name in enumerate(names):
                key = f"ivy/rank{rank}/{name}"
                value = float(row[i])
                self.last[key] = value
                pl_module.log(key, value, on_step=False, on_epoch=True, sync_dist=False, reduce_fx="max")

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._ps_strategy.pull_final_model()
