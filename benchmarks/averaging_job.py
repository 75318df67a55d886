"""Configurations of ``ivyplug bench averaging`` run in sequence in one 2-rank job (start-up paid once).

``python -m ivyplug.benchmarks.averaging_job --setting digits --slowdown 3 --epochs 4 --configs ddp ivy_ps
avg/16/nesterov/bfloat16 --out r.json``. A config is ``ddp`` (DDP, AdamW), ``ivy_ps[/wire]`` (the PS in async
mode running AdamW on pushed gradients) or ``avg/H/outer/wire`` (AdamW in ``LocalUpdates`` with
``sync_every=H``, async mode, merged by the outer optimizer ``outer``; ``outer@lr@momentum`` sets its
``outer_lr`` and ``outer_momentum``). Settings: ``digits`` is the
compute-bound MLP 64-1024-1024-10 of ``bench ps`` at batch 256 on the training set repeated 32x (90 steps per
worker and epoch); ``wide`` is 64-2048-2048-10 at batch 16 on the training set (45 steps per worker and epoch),
where communication is a larger share of a step. The slow worker is ``bench ps``'s delay injector (rank 1
sleeps (k-1) x 3 x its measured forward time every step). Rank 0 writes, per config: train-epoch wall times,
the wall time and validation accuracy at the end of every epoch's validation, and the bytes the workers moved.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from ivyplug.benchmarks.ps_job import EpochClock, digits, slow_down
from ivyplug.integrations.lightning.launchers import destroy_default_group
from torch import nn
from torch.utils.data import DataLoader

#: setting -> (hidden width, per-worker batch, training-set repeats)
SETTINGS: dict[str, tuple[int, int, int]] = {"digits": (1024, 256, 32), "wide": (2048, 16, 1)}
LR = 1e-3


class AveragingMLP(pl.LightningModule):
    """64-H-H-10 with AdamW (wrapped in LocalUpdates for ``avg`` configs); rank 1 is ``slowdown`` times slower."""

    def __init__(self, hidden: int, slowdown: float, sync_every: int | None, outer: str) -> None:
        super().__init__()
        self.slowdown, self.sync_every = slowdown, sync_every
        name, *values = outer.split("@")  # outer[@outer_lr[@outer_momentum]]
        self.outer = name
        keys = ("outer_lr", "outer_momentum")[: len(values)]
        self.outer_kwargs: dict[str, Any] = {k: float(v) for k, v in zip(keys, values, strict=True)}
        self.net = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.net.append(nn.Linear(hidden, 10))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        start = time.perf_counter()
        logits = self.net(x)
        forward = time.perf_counter() - start
        slow_down(self.global_rank, self.slowdown, forward)
        return nn.functional.cross_entropy(logits, y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_acc", (self.net(x).argmax(-1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        inner = torch.optim.AdamW(self.parameters(), lr=LR)
        if self.sync_every is None:
            return inner
        from ivyplug.optim import LocalUpdates

        return LocalUpdates(inner, sync_every=self.sync_every, outer=self.outer, **self.outer_kwargs)


class AccuracyClock(pl.Callback):
    """Wall time since the fit started and the validation accuracy, at the end of each validation."""

    def __init__(self) -> None:
        self.points: list[tuple[float, float]] = []
        self._start = 0.0

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = time.perf_counter()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "fit" and "val_acc" in trainer.callback_metrics:
            self.points.append((time.perf_counter() - self._start, float(trainer.callback_metrics["val_acc"])))


def run_config(config: str, setting: str, slowdown: float, epochs: int) -> dict[str, Any] | None:
    """One fit; rank 0's result (None on the other rank)."""
    from ivyplug.integrations.lightning import IvyPSStrategy

    hidden, batch, repeat = SETTINGS[setting]
    parts = config.split("/")
    sync_every: int | None = None
    outer, wire = "-", "float32"
    strategy: Any
    if parts[0] == "ddp":
        strategy = "ddp"
    elif parts[0] == "ivy_ps":
        wire = parts[1] if len(parts) > 1 else "float32"
        strategy = IvyPSStrategy(mode="async", wire_dtype=wire, timeout=300)
    elif parts[0] == "avg":
        sync_every, outer, wire = int(parts[1]), parts[2], parts[3]
        strategy = IvyPSStrategy(mode="async", wire_dtype=wire, timeout=300)
    else:
        raise ValueError(f"unknown config {config!r}: ddp, ivy_ps[/wire] or avg/H/outer/wire")
    pl.seed_everything(0, verbose=False)
    train, val = digits(repeat)
    clock, acc = EpochClock(), AccuracyClock()
    model = AveragingMLP(hidden, slowdown, sync_every, outer)
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[clock, acc],
    )
    trainer.fit(model, DataLoader(train, batch_size=batch, shuffle=True), DataLoader(val, batch_size=512))
    if trainer.global_rank != 0:
        return None
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    params = sum(p.numel() for p in model.parameters())
    steps_per_rank = len(train) / (2 * batch)
    samples = epochs * len(train)
    if parts[0] == "ddp":
        # gloo's ring all-reduce of 2 ranks: each rank sends and receives one full fp32 gradient per step
        # (an analytic count: gloo does not report its bytes)
        moved = epochs * steps_per_rank * 2 * (2 * params * 4)
    else:  # measured by the PS clients, cumulative over the fit (epoch-end pulls for validation included)
        moved = sum(
            v for k, v in metrics.items() if k.startswith("ivy/") and k.endswith(("bytes_sent", "bytes_received"))
        )
    return {
        "config": config,
        "kind": parts[0],
        "sync_every": sync_every,
        "outer": outer,
        "wire": wire,
        "setting": setting,
        "slowdown": slowdown,
        "epochs": epochs,
        "batch": batch,
        "params": params,
        "train_samples": len(train),
        "epoch_times": clock.times,
        "accuracy_points": acc.points,
        "val_acc": metrics.get("val_acc"),
        "bytes_moved": moved,
        "bytes_measured": parts[0] != "ddp",
        "bytes_per_sample": moved / samples,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--setting", choices=sorted(SETTINGS), default="digits")
    parser.add_argument("--slowdown", type=float, default=1.0)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=None, help="training-set repeats (default: the setting's)")
    parser.add_argument("--configs", nargs="+", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.repeat is not None:
        hidden, batch, _ = SETTINGS[args.setting]
        SETTINGS[args.setting] = (hidden, batch, args.repeat)
    torch.set_num_threads(1)  # two workers on two cores
    # Subnormal floats cost x86 cores 10-100x per operation: a model that grows confident (large logits)
    # underflows softmax probabilities and their gradients to subnormals, and its steps slow down several-fold
    # for reasons of the CPU, not of the method (an aggressive outer step got there within 4 epochs). Every
    # config runs with subnormals flushed to zero, as GPUs and tuned CPU training run.
    torch.set_flush_denormal(True)
    results = []
    try:
        for config in args.configs:
            result = run_config(config, args.setting, args.slowdown, args.epochs)
            if result is not None:
                results.append(result)
    finally:
        destroy_default_group()  # Lightning's DDP leaves it to the interpreter's teardown
    if results:
        args.out.write_text(json.dumps({"runs": results}, indent=2))


if __name__ == "__main__":
    main()
