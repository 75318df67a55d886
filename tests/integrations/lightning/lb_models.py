"""Small digits models and data shared by the IvyLoadBalancer tests and the ddp job script."""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
import torch
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset


def digits_dataset(n: int = 512) -> TensorDataset:
    x, y = load_digits(return_X_y=True)
    xt = torch.tensor(x[:n] / 16.0, dtype=torch.float32)
    yt = torch.tensor(y[:n], dtype=torch.long)
    return TensorDataset(xt, yt, torch.arange(len(yt)))


class DigitsMLP(pl.LightningModule):
    """Records every batch it trains on; can fake OOMs above a size and sleep per sample on one rank."""

    def __init__(
        self,
        batch_size: int = 32,
        n: int = 512,
        optimizer: str = "adam",
        lr: float = 0.01,
        oom_above: int | None = None,
        sleep_per_sample: float = 0.0,
        slow_rank: int = 1,
        seed: int = 0,
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 10))
        self.batch_size = batch_size
        self.n = n
        self.optimizer_name = optimizer
        self.lr = lr
        self.oom_above = oom_above
        self.sleep_per_sample = sleep_per_sample
        self.slow_rank = slow_rank
        self.oom_rank = 0
        self.seen: list[tuple[int, int]] = []  # (epoch, sample index) pairs trained on
        self.batch_sizes: list[tuple[int, int]] = []  # (epoch, len(batch)) per training_step call
        self.dataset = digits_dataset(n)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=True)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, index = batch
        if self.oom_above is not None and len(x) > self.oom_above and self.global_rank == self.oom_rank:
            raise torch.OutOfMemoryError(f"fake: {len(x)} samples > {self.oom_above}")
        if self.sleep_per_sample and self.global_rank == self.slow_rank:
            time.sleep(self.sleep_per_sample * len(x))
        self.batch_sizes.append((self.current_epoch, len(x)))
        self.seen.extend((self.current_epoch, int(i)) for i in index)
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr)
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def trainer_kwargs(**overrides: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": 3,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "log_every_n_steps": 1,
    }
    kwargs.update(overrides)
    return kwargs
