"""A Lightning fit under ``torchrun --max-restarts 1`` against an ``ivyplug serve``; rank 1 dies in attempt 0.

``python torchrun_restart_job.py OUT ADDRESS``. torchrun restarts both ranks; attempt 1 starts its fit again
and, joining the live servers, starts from their state. Every rank writes OUT/rank{r}_attempt{a}.json: the
validation accuracy of the model its fit starts from, the final one and the epochs run.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from ivyplug.integrations.lightning import IvyPSStrategy

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from tests.integrations.lightning.digits import DigitsMLP, digits_tensors

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class Record(pl.Callback):
    """Writes where the fit starts (after the strategy pulled the servers' copy); rank 1 dies in attempt 0,
    when its epoch 1 starts."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.start = -1.0

    def _write(self, trainer: pl.Trainer, **extra: Any) -> None:
        path = self.out / f"rank{trainer.global_rank}_attempt{ATTEMPT}.json"
        path.write_text(json.dumps({"start_acc": self.start, **extra}))

    def on_train_start(self, trainer: pl.Trainer, module: Any) -> None:
        _, _, xv, yv = digits_tensors()
        with torch.no_grad():
            self.start = float((module(xv).argmax(-1) == yv).float().mean())
        self._write(trainer)

    def on_train_epoch_start(self, trainer: pl.Trainer, module: Any) -> None:
        # At the start of epoch 1, not at a batch of it: under async the batch queue hands a late worker
        # whatever the other left, possibly nothing, so a kill at its n-th batch may never happen.
        if ATTEMPT == 0 and trainer.global_rank == 1 and trainer.current_epoch == 1:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_fit_end(self, trainer: pl.Trainer, module: Any) -> None:
        self._write(trainer, val_acc=float(trainer.callback_metrics["val_acc"]), epochs=trainer.current_epoch)


def main() -> None:
    out, address = Path(sys.argv[1]), sys.argv[2]
    pl.seed_everything(0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=IvyPSStrategy(mode="async", timeout=30, servers=address),
        max_epochs=2,
        callbacks=[Record(out)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(DigitsMLP(lr=0.05))


if __name__ == "__main__":
    main()
