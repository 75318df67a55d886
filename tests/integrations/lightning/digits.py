"""Small digits models and data shared by the Lightning PS tests (importable by spawned workers)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def digits_tensors() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """sklearn's digits, scaled to [0, 1], split 1440 train / 357 validation (fixed split)."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    xt = torch.tensor(x, dtype=torch.float32) / 16.0
    yt = torch.tensor(y, dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(xt), generator=g)
    train, val = perm[:1440], perm[1440:]
    return xt[train], yt[train], xt[val], yt[val]


class DigitsMLP(pl.LightningModule):
    """An MLP on digits with configurable optimizer, scheduler and (for stragglers) a per-rank delay."""

    def __init__(
        self,
        hidden: int = 64,
        lr: float = 0.1,
        optimizer: str = "sgd",
        step_lr: bool = False,
        step_lr_size: int = 3,
        batch_size: int = 32,
        train_size: int | None = None,
        shuffle: bool = False,
        slow_rank: int | None = None,
        delay_s: float = 0.0,
        log_sync_dist: bool = False,
        batchnorm: bool = False,
        record_dir: str | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        layers: list[nn.Module] = [nn.Linear(64, hidden)]
        if batchnorm:
            layers.append(nn.BatchNorm1d(hidden))
        layers += [nn.ReLU(), nn.Linear(hidden, 10)]
        self.net = nn.Sequential(*layers)
        self.batches_seen = 0
        self.samples_seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch[0], batch[1]
        if self.hparams.slow_rank is not None and self.global_rank == self.hparams.slow_rank:
            time.sleep(self.hparams.delay_s)
        if len(batch) > 2:
            self.samples_seen.extend(batch[2].tolist())
        self.batches_seen += 1
        loss = nn.functional.cross_entropy(self(x), y)
        if self.hparams.log_sync_dist:
            self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        return loss

    def on_train_epoch_end(self) -> None:
        # each worker records what it trained on, so tests can count samples across workers
        if self.hparams.record_dir is not None:
            path = Path(self.hparams.record_dir) / f"rank{self.global_rank}_epoch{self.current_epoch}.json"
            path.write_text(json.dumps({"batches": self.batches_seen, "samples": self.samples_seen}))
        self.batches_seen = 0
        self.samples_seen = []

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch[0], batch[1]
        logits = self(x)
        acc = (logits.argmax(-1) == y).float().mean()
        self.log("val_acc", acc, sync_dist=True, prog_bar=True)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch[0], batch[1]
        self.log("test_acc", (self(x).argmax(-1) == y).float().mean(), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self) -> Any:
        if self.hparams.optimizer == "sgd":
            opt: torch.optim.Optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        elif self.hparams.optimizer == "lamb":
            from ivyplug.optim import LAMB

            opt = LAMB(self.parameters(), lr=self.hparams.lr)
        elif self.hparams.optimizer == "adamw":
            opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        else:
            raise ValueError(f"optimizer must be sgd, lamb or adamw, got {self.hparams.optimizer!r}")
        if self.hparams.step_lr:
            return {
                "optimizer": opt,
                "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=self.hparams.step_lr_size, gamma=0.5),
            }
        return opt

    def _train_data(self) -> TensorDataset:
        x, y, _, _ = digits_tensors()
        n = self.hparams.train_size or len(x)
        return TensorDataset(x[:n], y[:n], torch.arange(n))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self._train_data(), batch_size=self.hparams.batch_size, shuffle=self.hparams.shuffle)

    def val_dataloader(self) -> DataLoader:
        _, _, xv, yv = digits_tensors()
        return DataLoader(TensorDataset(xv, yv), batch_size=128)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        return self.val_dataloader()


class ManualOptMLP(DigitsMLP):
    """Manual optimization with one optimizer: ``opt.step()`` in ``training_step``."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        loss = nn.functional.cross_entropy(self(batch[0]), batch[1])
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()


class DigitsGAN(pl.LightningModule):
    """Lightning's GAN shape on the digits: a generator and a discriminator, one Adam each, manual optimization
    with ``toggle_optimizer``; the noise of a batch depends only on the epoch, the batch and the rank, so two
    strategies that see the same batches draw the same noise."""

    def __init__(self, batch_size: int = 32, train_size: int = 320, noise: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(noise, 64), nn.Sigmoid())
        self.discriminator = nn.Sequential(nn.Linear(64, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        real = batch[0]
        seed = 100_000 * self.current_epoch + 10 * batch_idx + self.global_rank
        z = torch.randn(len(real), self.hparams.noise, generator=torch.Generator().manual_seed(seed))
        ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
        bce = nn.functional.binary_cross_entropy_with_logits
        opt_g, opt_d = self.optimizers()

        self.toggle_optimizer(opt_d)
        d_loss = bce(self.discriminator(real), ones) + bce(self.discriminator(self.generator(z).detach()), zeros)
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        self.untoggle_optimizer(opt_d)

        self.toggle_optimizer(opt_g)
        g_loss = bce(self.discriminator(self.generator(z)), ones)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.untoggle_optimizer(opt_g)

    def configure_optimizers(self) -> Any:
        betas = (0.5, 0.999)
        return (
            torch.optim.Adam(self.generator.parameters(), lr=2e-3, betas=betas),
            torch.optim.Adam(self.discriminator.parameters(), lr=1e-3, betas=betas),
        )

    def train_dataloader(self) -> DataLoader:
        x, _, _, _ = digits_tensors()
        return DataLoader(TensorDataset(x[: self.hparams.train_size]), batch_size=self.hparams.batch_size)
