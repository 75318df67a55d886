"""Refuse, in the main process and before any worker starts, what an asynchronous PS run cannot do.

In ``async``/``ssp`` mode workers run different numbers of batches, so nothing may run a
collective on the default process group per batch: ranks meet only at epoch end. These
Trainer options do run one per batch (or at a batch-level time check), so they are refused
with an explanation instead of hanging until a collective times out.
"""

from __future__ import annotations

from typing import Any


def per_step_collective_problems(trainer: Any, model: Any = None) -> list[str]:
    """Human-readable reasons why ``trainer`` cannot run an async/ssp PS fit (empty when it can)."""
    from lightning.pytorch.callbacks import ModelCheckpoint, Timer
    from lightning.pytorch.callbacks.timer import Interval

    problems: list[str] = []
    if getattr(trainer, "_val_check_time_interval", None) is not None:
        problems.append("a time-based val_check_interval (validation must run at epoch end: use 1.0)")
    interval = getattr(trainer, "val_check_interval", 1.0)
    if isinstance(interval, bool) or not isinstance(interval, float) or interval != 1.0:
        problems.append(f"val_check_interval={interval!r} (validation must run once per epoch: use 1.0)")
    if getattr(trainer, "check_val_every_n_epoch", 1) is None:
        problems.append("check_val_every_n_epoch=None (batch-count validation; use an epoch interval)")
    for callback in getattr(trainer, "callbacks", []):
        if isinstance(callback, ModelCheckpoint):
            if getattr(callback, "_every_n_train_steps", 0):
                problems.append(
                    f"ModelCheckpoint(every_n_train_steps={callback._every_n_train_steps}) "
                    "(checkpoint per epoch instead: every_n_epochs)"
                )
            if getattr(callback, "_train_time_interval", None) is not None:
                problems.append("ModelCheckpoint(train_time_interval=...) (checkpoint per epoch instead)")
        if isinstance(callback, Timer) and getattr(callback, "_interval", None) == Interval.step:
            problems.append(
                "a Timer checked every step (Trainer(max_time=...) adds one): use Timer(duration, interval='epoch')"
            )
    fit_loop = getattr(trainer, "fit_loop", None)
    if getattr(trainer, "max_steps", -1) != -1 and (
        getattr(fit_loop, "min_steps", None) or getattr(fit_loop, "min_epochs", None)
    ):
        problems.append(
            "max_steps together with min_steps/min_epochs (the first worker to reach max_steps ends every "
            "worker's fit at that epoch's end, and a minimum would keep the others training without it)"
        )
    if getattr(getattr(trainer, "strategy", None), "_layer_sync", None) is not None:
        problems.append("sync_batchnorm=True (SyncBatchNorm all-reduces in every forward)")
    return problems
