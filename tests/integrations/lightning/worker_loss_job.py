"""A popen-launched 2-rank fit in which rank 1 SIGKILLs itself mid-epoch; rank 0 must finish the fit.

``python worker_loss_job.py OUT MODE WHERE``: MODE ``async`` or ``ssp``; WHERE a number of dedicated servers
or the address of an ``ivyplug serve``. Rank 0 writes OUT/result.json: the epochs and steps it ran, its
validation accuracy, the lost ranks, the checkpoint it saved and whether that checkpoint loads; every rank
writes OUT/trained_rank{r}.json, the batches it trained in each epoch.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from ivyplug.integrations.lightning import IvyPSStrategy
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from tests.integrations.lightning.digits import DigitsMLP, digits_tensors

KILL_AT = 8  # rank 1's batch of epoch 0 at which it dies


class DieMidEpoch(pl.Callback):
    """Rank 1 dies at batch ``KILL_AT`` of epoch 0."""

    def on_train_batch_start(self, trainer: pl.Trainer, module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_rank == 1 and trainer.current_epoch == 0 and batch_idx == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)


class SlowRank0InEpoch0(pl.Callback):
    """Rank 0 is slow in epoch 0, so that the dispatch queue surely hands rank 1 the batches it dies at (a fast
    rank 0 on a loaded machine took all but 8 of the epoch's 45 once, and rank 1 lived)."""

    def on_train_batch_start(self, trainer: pl.Trainer, module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_rank == 0 and trainer.current_epoch == 0:
            time.sleep(0.05)


class TrainedBatches(pl.Callback):
    """Each rank writes the global batch indices it trained (and pushed) so far, per epoch, after every batch."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.trained: dict[int, list[int]] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        sampler = trainer.train_dataloader.batch_sampler  # type: ignore[union-attr]
        self.trained.setdefault(trainer.current_epoch, []).append(sampler.served[batch_idx])
        path = self.out / f"trained_rank{trainer.global_rank}.json"
        path.write_text(json.dumps({"epochs": self.trained, "batches": len(sampler)}))


class StartAccuracy(pl.Callback):
    """Validation accuracy of the model each fit starts from (after the strategy pulled the servers' copy)."""

    value = -1.0

    def on_train_start(self, trainer: pl.Trainer, module: Any) -> None:
        _, _, xv, yv = digits_tensors()
        with torch.no_grad():
            StartAccuracy.value = float((module(xv).argmax(-1) == yv).float().mean())


def main() -> None:
    out, mode, where = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    pl.seed_everything(0)
    placement = {"num_servers": int(where)} if where.isdigit() else {"servers": where}
    strategy = IvyPSStrategy(mode=mode, staleness=2 if mode == "ssp" else None, timeout=30, **placement)
    checkpoint = ModelCheckpoint(dirpath=out / "ckpt", save_top_k=-1, save_last=True)  # one per epoch
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=2,
        callbacks=[DieMidEpoch(), SlowRank0InEpoch0(), StartAccuracy(), TrainedBatches(out), checkpoint],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = DigitsMLP(lr=0.05)
    trainer.fit(model)
    if trainer.global_rank != 0:
        return
    loaded = torch.load(checkpoint.last_model_path, map_location="cpu", weights_only=False)
    again = DigitsMLP(lr=0.05)
    again.load_state_dict(loaded["state_dict"])
    same = all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values(), strict=True))
    result = {
        "epochs": trainer.current_epoch,
        "global_step": trainer.global_step,
        "val_acc": float(trainer.callback_metrics["val_acc"]),
        "lost": strategy._lost_ranks,
        "last": checkpoint.last_model_path,
        "checkpoint_epoch": loaded["epoch"],
        "checkpoint_matches_model": same,
        "start_acc": StartAccuracy.value,
    }
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
