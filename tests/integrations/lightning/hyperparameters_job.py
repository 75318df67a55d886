"""One popen-launched 2-rank job running several scheduled fits in sequence (one launch: start-up paid once).

Each argument after the output folder names a fit ``mode/optimizer/schedule``: ``mode`` ``async`` or ``ssp``;
``optimizer`` ``sgd``, ``adamw`` or ``lamb`` (a recording subclass: the servers' mirror of it records the
hyperparameters of every step it takes); ``schedule`` ``zero_after_epoch_0`` (a ``LambdaLR`` per epoch) or
``one_cycle`` (``OneCycleLR`` per step). Each rank writes one JSON file per fit: its own optimizer's values at
each of its steps, the steps its process's server shards took, and the global model at each epoch's end.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from ivyplug.integrations.lightning import IvyPSStrategy
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.demos.boring_classes import RandomDataset
from torch.utils.data import DataLoader

from ivyplug.optim import LAMB

WORKERS = 2
EPOCHS = 3

#: per group: its weight decay (which tells the groups apart), its learning rate and the value a one-cycle
#: schedule cycles with it (momentum or beta1)
Values = list[tuple[float, float, float]]

#: this process's server-side record: (the recording optimizer's id, the values of the groups it holds)
SERVER_STEPS: list[tuple[int, Values]] = []


def _values(optimizer: torch.optim.Optimizer) -> Values:
    out = []
    for group in optimizer.param_groups:
        second = group["betas"][0] if "betas" in group else group.get("momentum", 0.0)
        out.append((float(group["weight_decay"]), float(group["lr"]), float(second)))
    return out


class _RecordsServerSteps:
    """Mixed into an optimizer class: each step records its hyperparameters (only servers step it here)."""

    param_groups: list[dict[str, Any]]

    def step(self, closure: Any = None) -> Any:
        SERVER_STEPS.append((id(self), _values(self)))  # type: ignore[arg-type]
        return super().step(closure)  # type: ignore[misc]


class RecordingSGD(_RecordsServerSteps, torch.optim.SGD):
    pass


class RecordingAdamW(_RecordsServerSteps, torch.optim.AdamW):
    pass


class RecordingLAMB(_RecordsServerSteps, LAMB):
    pass


OPTIMIZERS = {"sgd": RecordingSGD, "adamw": RecordingAdamW, "lamb": RecordingLAMB}


class ScheduledModel(LightningModule):
    """Lightning's BoringModel shape (32 -> 2), two param groups, a schedule; writes what each rank saw."""

    def __init__(self, optimizer: str, schedule: str) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(32, 2)
        self.worker_steps: list[tuple[int, Values]] = []  # (epoch, values)
        self.global_at_validation: list[list[float]] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.layer(batch).pow(2).mean()

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self.layer(batch).pow(2).mean())

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 64), batch_size=4, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 8), batch_size=8)

    def configure_optimizers(self) -> Any:
        cls = OPTIMIZERS[self.hparams.optimizer]
        groups = [
            {"params": [self.layer.weight], "weight_decay": 1e-4},
            {"params": [self.layer.bias], "weight_decay": 0.0},
        ]
        kwargs: dict[str, Any] = {"lr": 0.05, "momentum": 0.9} if cls is RecordingSGD else {"lr": 0.01}
        optimizer = cls(groups, **kwargs)
        if self.hparams.schedule == "zero_after_epoch_0":
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 1.0 if epoch == 0 else 0.0)
            return [optimizer], [scheduler]
        total = int(self.trainer.estimated_stepping_batches)
        one_cycle = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=kwargs["lr"], total_steps=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": one_cycle, "interval": "step"}}

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.worker_steps.append((self.current_epoch, _values(optimizer)))

    def on_validation_epoch_start(self) -> None:
        # each epoch's end (no sanity check): the strategy has just pulled the global model
        self.global_at_validation.append(torch.cat([p.detach().flatten() for p in self.parameters()]).tolist())


def run(spec: str) -> dict[str, Any]:
    mode, optimizer, schedule = spec.split("/")
    seed_everything(0)
    SERVER_STEPS.clear()
    strategy = IvyPSStrategy(
        mode=mode,  # type: ignore[arg-type]
        staleness=2 if mode == "ssp" else None,
        staleness_scaling="none",  # a shard's learning rate is then exactly its push's
        timeout=60,
        process_group_timeout=timedelta(seconds=60),
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=WORKERS,
        strategy=strategy,
        max_epochs=EPOCHS,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = ScheduledModel(optimizer, schedule)
    trainer.fit(model)
    return {
        "rank": trainer.global_rank,
        "worker_steps": model.worker_steps,
        "server_steps": list(SERVER_STEPS),
        "global_at_validation": model.global_at_validation,
    }


def main() -> None:
    out = Path(sys.argv[1])
    for i, spec in enumerate(sys.argv[2:]):
        result = run(spec)
        (out / f"fit{i}-rank{result['rank']}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
