"""Lightning fits on the PS with unused layers and a non-finite gradient (2 spawned workers).

Unused parameters: ``ivy_ps_sync`` ends where DDP with ``find_unused_parameters=True`` ends (AdamW's weight
decay leaves a layer without gradient alone). Non-finite: one NaN gradient element on rank 1 at one step
leaves every parameter and BatchNorm buffer finite, and the drop is counted in ``ivy/rank1/nonfinite_skipped``.
"""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from ivyplug.integrations.lightning import IvyPSStrategy
from lightning.pytorch import seed_everything
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from .digits import digits_tensors
from .helpers import SpawnedDDP, max_abs_diff, params_of, quiet_trainer, reaped_children

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


class Branches(pl.LightningModule):
    """``used`` always runs; ``sometimes`` on rank 0 at even batches only; ``never`` is never called."""

    def __init__(self, optimizer: str = "adamw", nan_at: int | None = None, batchnorm: bool = False) -> None:
        super().__init__()
        self.optimizer_name = optimizer
        self.nan_at = nan_at
        self.used = nn.Sequential(nn.Linear(64, 32), *([nn.BatchNorm1d(32)] if batchnorm else []), nn.ReLU())
        self.head = nn.Linear(32, 10)
        self.sometimes = nn.Linear(64, 10)
        self.never = nn.Linear(64, 10)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self.head(self.used(x))
        if self.global_rank == 0 and batch_idx % 2 == 0:
            out = out + self.sometimes(x)
        return nn.functional.cross_entropy(out, y)

    def on_after_backward(self) -> None:
        if self.nan_at is not None and self.global_rank == 1 and self.trainer.global_step == self.nan_at:
            self.head.weight.grad[0, 0] = float("nan")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
        return torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.1)

    def train_dataloader(self) -> DataLoader:
        x, y, _, _ = digits_tensors()
        return DataLoader(TensorDataset(x[:384], y[:384]), batch_size=32)


def test_sync_unused_and_conditionally_used_layers_match_ddp_find_unused_parameters() -> None:
    seed_everything(0)
    init = Branches()
    fits = {}
    for name, strategy in (
        ("ps", IvyPSStrategy(mode="sync", start_method="spawn", timeout=60)),
        ("ddp", SpawnedDDP(find_unused_parameters=True, start_method="spawn")),
    ):
        model = copy.deepcopy(init)
        with reaped_children():
            quiet_trainer(strategy, devices=2, max_epochs=2).fit(model)
        fits[name] = params_of(model)
    start = params_of(init)
    assert max_abs_diff(fits["ps"], fits["ddp"]) <= 1e-5
    for key in ("never.weight", "never.bias"):
        torch.testing.assert_close(fits["ps"][key], start[key], rtol=0, atol=0)  # no weight decay step
    assert max_abs_diff({"w": fits["ps"]["sometimes.weight"]}, {"w": start["sometimes.weight"]}) > 1e-3


@pytest.mark.parametrize(("mode", "optimizer"), [("async", "sgd"), ("sync", "adamw")])
def test_one_nan_gradient_on_one_worker_never_reaches_the_global_model(mode: str, optimizer: str) -> None:
    seed_everything(0)
    model = Branches(optimizer=optimizer, nan_at=3, batchnorm=True)
    trainer = quiet_trainer(IvyPSStrategy(mode=mode, start_method="spawn", timeout=60), devices=2, max_epochs=2)
    with reaped_children():
        trainer.fit(model)
    for name, tensor in model.state_dict().items():
        assert bool(torch.isfinite(tensor.float()).all()), name
    assert float(trainer.callback_metrics["ivy/rank1/nonfinite_skipped"]) == 1.0
    assert float(trainer.callback_metrics["ivy/rank0/nonfinite_skipped"]) == 0.0


def test_nonfinite_raise_stops_the_fit_naming_rank_step_and_tensor() -> None:
    seed_everything(0)
    model = Branches(optimizer="sgd", nan_at=3)
    strategy = IvyPSStrategy(mode="sync", start_method="spawn", timeout=60, nonfinite="raise")
    with (
        reaped_children(),
        pytest.raises(Exception, match=r"rank 1, step 4: non-finite values in the gradient of 'head\.weight'"),
    ):
        quiet_trainer(strategy, devices=2, max_epochs=1).fit(model)


class ValidatedBranches(Branches):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.head(self.used(x)), y), sync_dist=True)

    def val_dataloader(self) -> DataLoader:
        _, _, x, y = digits_tensors()
        return DataLoader(TensorDataset(x[:64], y[:64]), batch_size=32)


def _flat(module: pl.LightningModule) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in module.state_dict().values()])


class SavedAtFitEnd(pl.Callback):
    """Each rank saves its model's flat values when validation starts (after the strategy's pull) and when the fit
    ends, with its checkpoint's state dict."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.validated: torch.Tensor | None = None

    def on_validation_epoch_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.validated = _flat(module)

    def on_fit_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        saved = trainer.strategy.lightning_module_state_dict()  # what a checkpoint holds
        out = {"model": _flat(module), "checkpoint": saved, "validated": self.validated}
        torch.save(out, f"{self.out}/rank{trainer.global_rank}.pt")


@pytest.mark.parametrize("wire_dtype", ["bfloat16", "int8"])
def test_a_rounded_wire_returns_and_saves_the_exact_global_model(tmp_path: Any, wire_dtype: str) -> None:
    """Steps' pulls travel rounded, but the pulls that stay (the fit's end, a checkpoint's) are fp32: both ranks
    end with the same model, equal to the checkpoint's, and most of its values are not bf16 numbers (a model
    pulled in bf16 holds only bf16 numbers in the tensors of the other rank's shard). The pull before validation,
    which keeps no model, travels as a step's: each rank validates its own shard exact, the other's rounded."""
    seed_everything(0)
    strategy = IvyPSStrategy(mode="sync", start_method="spawn", timeout=60, wire_dtype=wire_dtype)
    with reaped_children():
        quiet_trainer(strategy, devices=2, max_epochs=1, callbacks=[SavedAtFitEnd(str(tmp_path))]).fit(
            ValidatedBranches(optimizer="sgd")
        )
    saved = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    torch.testing.assert_close(saved[0]["model"], saved[1]["model"], rtol=0, atol=0)
    assert not torch.equal(saved[0]["validated"], saved[1]["validated"])
    for r in (0, 1):
        for name, value in saved[r]["checkpoint"].items():
            bf16_numbers = float((value.bfloat16().float() == value).float().mean())
            assert bf16_numbers < 0.5, (r, name, bf16_numbers)
