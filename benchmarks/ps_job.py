"""One configuration of ``ivyplug bench ps``, run as its own process (Lightning's popen launcher re-runs it).

``python -m ivyplug.benchmarks.ps_job --strategy ivy_ps --slowdown 3 --epochs 4 --repeat 16 --out r.json``.
Rank 0 writes the train-epoch wall times (epoch start to the start of validation, so the wait for the
slowest worker at the epoch's end is included), the validation accuracy and the PS byte counters. The slow
worker is the documented delay injector: rank 1 sleeps (k-1) x 3 x its measured forward time every step (a device
k times slower at compute; forward + backward ~ 3 x forward), not (k-1) x the whole step.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from ivyplug.benchmarks.ps import OVERLAPPED, STRATEGIES
from ivyplug.integrations.lightning.launchers import destroy_default_group
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

HIDDEN = 1024


def digits(repeat: int) -> tuple[TensorDataset, TensorDataset]:
    """sklearn's digits: the 1440 training images repeated ``repeat`` times, 357 validation images."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    xt = torch.tensor(x, dtype=torch.float32) / 16.0
    yt = torch.tensor(y, dtype=torch.long)
    perm = torch.randperm(len(xt), generator=torch.Generator().manual_seed(0))
    train, val = perm[:1440], perm[1440:]
    return TensorDataset(xt[train].repeat(repeat, 1), yt[train].repeat(repeat)), TensorDataset(xt[val], yt[val])


def slow_down(rank: int, slowdown: float, forward_s: float) -> float:
    """On rank 1, sleep as a device ``slowdown`` times slower at compute would take longer (a step's compute
    is about 3 forwards: forward + backward); the seconds slept."""
    if rank != 1 or slowdown <= 1:
        return 0.0
    delay = (slowdown - 1) * 3 * forward_s
    time.sleep(delay)
    return delay


class BenchMLP(pl.LightningModule):
    """The compute-bound digits MLP 64-1024-1024-10; rank 1 simulates a device ``slowdown`` times slower."""

    def __init__(self, slowdown: float, lr: float) -> None:
        super().__init__()
        self.slowdown = slowdown
        self.lr = lr
        self.net = nn.Sequential(
            nn.Linear(64, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 10)
        )
        self.slept = 0.0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        start = time.perf_counter()
        logits = self.net(x)
        forward = time.perf_counter() - start
        self.slept += slow_down(self.global_rank, self.slowdown, forward)
        return nn.functional.cross_entropy(logits, y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_acc", (self.net(x).argmax(-1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class EpochClock(pl.Callback):
    """Train-epoch wall time on this rank (epoch start to the start of validation) and CPU time.

    CPU time (``time.process_time``: every thread of the worker process, so the PS server thread and gloo's
    threads too) is the load-robust number: on a shared machine wall time moves with foreign load, the CPU
    seconds a strategy needs per epoch hardly do. Summed over ranks at the end of fit.
    """

    def __init__(self) -> None:
        self.times: list[float] = []
        self.cpu: list[float] = []
        self.cpu_all_ranks: list[float] = []
        self._start = 0.0
        self._cpu_start = 0.0

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = time.perf_counter()
        self._cpu_start = time.process_time()

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "fit":
            self.times.append(time.perf_counter() - self._start)
            self.cpu.append(time.process_time() - self._cpu_start)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        mine = torch.tensor(self.cpu, dtype=torch.float64)
        gathered = pl_module.all_gather(mine)
        assert isinstance(gathered, torch.Tensor)
        self.cpu_all_ranks = gathered.reshape(trainer.world_size, -1).sum(0).tolist()


def _strategy(name: str) -> Any:
    """A registered strategy name, or (``OVERLAPPED``) an ``IvyPSStrategy`` with ``overlap_backward=True``."""
    if name not in OVERLAPPED:
        return name
    from ivyplug.integrations.lightning import IvyPSStrategy

    return IvyPSStrategy(mode="sync" if name.startswith("ivy_ps_sync") else "async", overlap_backward=True)


def quiet_trainer(**kwargs: Any) -> pl.Trainer:
    """A CPU ``Trainer`` that writes and prints nothing (no logger, checkpoint, progress bar, summary or sanity
    validation), so that a benchmark's clock measures training alone; ``kwargs`` add to or override that."""
    quiet: dict[str, Any] = {
        "accelerator": "cpu",
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }
    return pl.Trainer(**{**quiet, **kwargs})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", required=True, choices=[*STRATEGIES, *OVERLAPPED])
    parser.add_argument("--slowdown", type=float, default=1.0)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=16)
    parser.add_argument("--batch", type=int, default=256, help="per worker (ddp, sync) / per dispatched batch (async)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    torch.set_num_threads(1)  # two workers on two cores
    pl.seed_everything(0, verbose=False)
    train, val = digits(args.repeat)
    clock = EpochClock()
    model = BenchMLP(args.slowdown, args.lr)
    trainer = quiet_trainer(
        strategy=_strategy(args.strategy),
        devices=2,
        max_epochs=args.epochs,
        callbacks=[clock],
    )
    trainer.fit(model, DataLoader(train, batch_size=args.batch, shuffle=True), DataLoader(val, batch_size=512))
    try:
        if trainer.global_rank == 0:
            _write_result(args, trainer, model, clock, len(train))
    finally:
        destroy_default_group()  # Lightning's DDP leaves it to the interpreter's teardown (the PS strategies do not)


def _write_result(
    args: argparse.Namespace, trainer: pl.Trainer, model: BenchMLP, clock: EpochClock, train_samples: int
) -> None:
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    ps_bytes = sum(v for k, v in metrics.items() if k.startswith("ivy/") and k.endswith("bytes_sent"))
    params = sum(p.numel() for p in model.parameters())
    steps_per_rank = train_samples / (2 * args.batch)
    result = {
        "strategy": args.strategy,
        "slowdown": args.slowdown,
        "epochs": args.epochs,
        "repeat": args.repeat,
        "batch": args.batch,
        "train_samples": train_samples,
        "epoch_times": clock.times,
        "epoch_cpu_seconds": clock.cpu_all_ranks,  # CPU seconds of both worker processes per train epoch
        "val_acc": metrics.get("val_acc"),
        "params": params,
        # bytes every worker sent in one epoch: measured by the PS; for DDP the ring all-reduce of 2 ranks
        # sends one full gradient per rank per step (an analytic count, gloo does not report it)
        "bytes_sent_per_epoch": (ps_bytes / args.epochs if args.strategy != "ddp" else 2 * steps_per_rank * params * 4),
        "shards_sent_early": sum(v for k, v in metrics.items() if k.startswith("ivy/") and k.endswith("sent_early")),
        "bytes_measured": args.strategy != "ddp",
        "ps_pushes": {r: metrics[f"ivy/rank{r}/pushes"] for r in (0, 1) if f"ivy/rank{r}/pushes" in metrics},
    }
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
