"""One configuration of ``ivyplug bench balance``, run as its own process (Lightning's ddp launcher re-runs it).

``python -m ivyplug.benchmarks.balance_job --strategy ddp --balancer 1 --slowdown 3 --epochs 4 --repeat 16
--out result.json``. Rank 0 writes the epoch wall times, the callback's hook time, the per-epoch shares and the
validation accuracy. The slow worker is the documented delay injector: rank 1 sleeps (k-1) x 3 x its measured
forward time every step (a device k times slower at compute; forward + backward ~ 3 x forward), so a smaller
share also means a shorter sleep.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from ivyplug.benchmarks.ps_job import quiet_trainer, slow_down
from ivyplug.integrations.lightning import IvyLoadBalancer
from ivyplug.integrations.lightning.launchers import destroy_default_group
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

from ivyplug.load import PsutilProbe

BATCH_PER_WORKER = 256
HIDDEN = 1024


def digits_split(repeat: int) -> tuple[TensorDataset, torch.Tensor, torch.Tensor]:
    """Training set (first 1497 digits, repeated) and the 300 held-out digits."""
    x, y = load_digits(return_X_y=True)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    xt = torch.tensor(x / 16.0, dtype=torch.float32)[perm]
    yt = torch.tensor(y)[perm]
    train = TensorDataset(xt[:1497].repeat(repeat, 1), yt[:1497].repeat(repeat))
    return train, xt[1497:], yt[1497:]


class SlowableMLP(pl.LightningModule):
    """The digits MLP 64-1024-1024-10; rank 1 is ``slowdown`` times slower at compute."""

    def __init__(self, train: TensorDataset, slowdown: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(64, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(),
            torch.nn.Linear(HIDDEN, 10),
        )  # fmt: skip
        self.train_set = train
        self.slowdown = slowdown

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=BATCH_PER_WORKER, shuffle=True)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        start = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        slow_down(self.global_rank, self.slowdown, time.perf_counter() - start)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class EpochTimer(pl.Callback):
    """Wall time of every training epoch (ranks run in lockstep: rank 0's times are the job's)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = time.perf_counter()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.times.append(time.perf_counter() - self._start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=("single", "ddp", "ivy_ps_sync"), required=True)
    parser.add_argument("--balancer", type=int, choices=(0, 1), required=True)
    parser.add_argument("--slowdown", type=float, default=1.0)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=16)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    train, x_val, y_val = digits_split(args.repeat)
    model = SlowableMLP(train, args.slowdown)
    timer = EpochTimer()
    callbacks: list[pl.Callback] = [timer]
    balancer = None
    if args.balancer:
        # batch-size policy pinned: only the shares move, so epoch times compare
        balancer = IvyLoadBalancer(probes=[PsutilProbe(per_cpu=False)], adapt_batch_size=False)
        callbacks.append(balancer)
    if args.strategy == "ivy_ps_sync":
        from ivyplug.integrations.lightning import IvyPSStrategy

        strategy: Any = IvyPSStrategy(mode="sync", timeout=300)
    else:
        strategy = "ddp" if args.strategy == "ddp" else "auto"
    trainer = quiet_trainer(
        devices=1 if args.strategy == "single" else 2,
        strategy=strategy,
        max_epochs=args.epochs,
        callbacks=callbacks,
        limit_val_batches=0,
    )
    trainer.fit(model)
    if trainer.global_rank == 0:
        model.eval()
        with torch.no_grad():
            accuracy = float((model.net(x_val).argmax(1) == y_val).float().mean())
        result = {
            "strategy": args.strategy,
            "balancer": bool(args.balancer),
            "slowdown": args.slowdown,
            "epoch_times": timer.times,
            "val_acc": accuracy,
            "hook_seconds": balancer.hook_seconds if balancer else 0.0,
            "hook_breakdown": dict(balancer.hook_breakdown) if balancer else {},
            "steps": balancer.steps if balancer else None,
            "shares": [h["next_shares"] for h in balancer.history] if balancer else [],
            "target_shares": [h["target_shares"] for h in balancer.history] if balancer else [],
            "step_models": [h["step_models"] for h in balancer.history] if balancer else [],
            "loadavg": os.getloadavg(),
        }
        args.out.write_text(json.dumps(result))
    destroy_default_group()


if __name__ == "__main__":
    main()
