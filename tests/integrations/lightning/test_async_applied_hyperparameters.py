"""async/ssp: the hyperparameters the servers apply to a push are the ones its worker had at that step.

Read back from the servers themselves: the model's optimizer is a recording subclass, so each co-located
server shard's mirror of it (built from the same class) records the hyperparameters of every step it takes.
Each worker records the values of its own optimizer at each of its steps. With staleness scaling off, the
steps a shard applied are exactly the workers' steps, value for value; an epoch schedule that sets the
learning rate to 0 from epoch 1 on leaves the global model where epoch 0 left it, although every push of the
later epochs is applied.
"""

from __future__ import annotations

import json
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from ivyplug.integrations.lightning import IvyPSStrategy
from lightning.pytorch import LightningModule, seed_everything
from lightning.pytorch.demos.boring_classes import RandomDataset
from torch.utils.data import DataLoader

from ivyplug.optim import LAMB

from .helpers import quiet_trainer, reaped_children

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

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

    def __init__(self, optimizer: str, schedule: str, record_dir: str) -> None:
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

    def teardown(self, stage: str) -> None:
        record = {
            "worker_steps": self.worker_steps,
            "server_steps": SERVER_STEPS,
            "global_at_validation": self.global_at_validation,
        }
        Path(self.hparams.record_dir, f"rank{self.global_rank}.json").write_text(json.dumps(record))


def _fit(tmp_path: Path, mode: str, optimizer: str, schedule: str) -> tuple[list[Any], list[list[Any]], list[Any]]:
    """Fit on 2 spawned workers; returns every worker step, each server shard's steps, rank 0's global models."""
    seed_everything(0)
    record = tmp_path / "record"
    record.mkdir()
    strategy = IvyPSStrategy(
        mode=mode,  # type: ignore[arg-type]
        staleness=2 if mode == "ssp" else None,
        staleness_scaling="none",  # a shard's learning rate is then exactly its push's
        start_method="spawn",
        timeout=60,
        process_group_timeout=timedelta(seconds=60),
    )
    with reaped_children():
        trainer = quiet_trainer(strategy, devices=WORKERS, max_epochs=EPOCHS, default_root_dir=str(tmp_path))
        trainer.fit(ScheduledModel(optimizer, schedule, str(record)))
    ranks = [json.loads((record / f"rank{r}.json").read_text()) for r in range(WORKERS)]
    worker_steps = [step for rank in ranks for step in rank["worker_steps"]]
    shards: dict[tuple[int, int], list[Any]] = {}
    for r, rank in enumerate(ranks):
        for opt_id, values in rank["server_steps"]:
            shards.setdefault((r, opt_id), []).append(values)
    return worker_steps, list(shards.values()), ranks[0]["global_at_validation"]


def _check_applied(applied: list[Values], worker_steps: list[Values]) -> None:
    """A shard's steps are the workers' steps, value for value, over the groups the shard holds."""
    held = {group[0] for values in applied for group in values}
    assert held, "a shard recorded steps without groups"
    expected = [[group for group in values if group[0] in held] for values in worker_steps]
    assert Counter(json.dumps(v) for v in applied) == Counter(json.dumps(v) for v in expected)


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_an_epoch_schedule_that_zeroes_the_lr_stops_the_global_model(mode: str, tmp_path: Path) -> None:
    worker_steps, shards, global_models = _fit(tmp_path, mode, "sgd", "zero_after_epoch_0")

    assert len(global_models) == EPOCHS
    later = [values for epoch, values in worker_steps if epoch > 0]
    assert later, "no worker stepped after epoch 0"
    assert all(lr == 0.0 for values in later for _, lr, _ in values), "a worker pushed a non-zero lr after epoch 0"
    assert shards, "no server shard recorded a step"
    for applied in shards:  # every push of every epoch applied, each with its worker's learning rate
        _check_applied(applied, [values for _, values in worker_steps])
    first = torch.tensor(global_models[0], dtype=torch.float64)
    for epoch, model in enumerate(global_models[1:], start=1):
        torch.testing.assert_close(
            torch.tensor(model, dtype=torch.float64), first, rtol=0, atol=0, msg=f"moved in epoch {epoch}"
        )


@pytest.mark.parametrize(("optimizer", "mode"), [("sgd", "async"), ("adamw", "ssp"), ("lamb", "async")])
def test_a_step_schedule_s_values_are_the_ones_the_servers_apply(optimizer: str, mode: str, tmp_path: Path) -> None:
    worker_steps, shards, _ = _fit(tmp_path, mode, optimizer, "one_cycle")

    values = [v for _, v in worker_steps]
    lrs = {lr for v in values for _, lr, _ in v}
    assert len(lrs) > len(values) // 2, "the one-cycle schedule did not move the workers' learning rate"
    assert len({second for v in values for _, _, second in v}) > 1, "momentum/beta1 was not cycled"
    assert shards, "no server shard recorded a step"
    for applied in shards:
        assert len(applied) == len(values)
        _check_applied(applied, values)
