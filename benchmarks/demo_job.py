"""One worker of ``ivyplug demo``: trains every run of the demo one after the other, as rank LOCAL_RANK of 2.

``LOCAL_RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 python -m ivyplug.benchmarks.demo_job
--runs ddp,ivy_ps_async --ports 29510,29511 --slowdown 3 --epochs 6 --repeat 3 --out DIR``, started once per
rank by ``ivyplug demo`` (Lightning then launches nothing itself, as under torchrun). Both workers import
Lightning once for all runs: on a loaded 2-core machine an import costs tens of seconds. Each run gets a fresh
process group on its own port. The slow worker is that of ``ivyplug bench ps`` (:mod:`ivyplug.benchmarks.ps_job`):
the documented delay injector (rank 1 sleeps (k-1) x 3 x its measured forward time every step), on its digits
MLP (64-1024-1024-10), here at batch 128 per worker. Every run trains the same model from the same weights with
the same optimizer and learning-rate schedule (AdamW, lr 2e-3, cosine over the epochs, ``CosineAnnealingLR``
stepped per epoch): only the strategy and the callbacks change (:data:`RUNS`). AdamW rather than LAMB: async
LAMB at lr 1e-2 to 5e-2 swung by several points from epoch to epoch here, so no single LAMB setting served all
three runs. The digits are split 1024 for training (repeated ``--repeat`` times) and 773 for validation, so one
validation sample is 0.13 points of accuracy.

Why these settings: async's final accuracy differs from run to run, because the order in which pushes arrive
depends on timing and acts like a fresh data order (and its stale pushes, the slow worker's about 2 updates old,
set it back most in the first epoch, at the full learning rate). Where the last epoch still trains at a sizeable
rate, that order decides where the model ends: with 6 epochs of 4096 samples at batch 256 per worker (48 DDP
steps, the last epoch at 15% of the peak rate) async ended 1.2 points below to 0.7 above DDP, which had not
converged. Batch 128 per worker (twice the steps for the same samples), 6 shorter epochs (the last at 7% of the
peak) and lr 2e-3 let every run settle near its plateau, where the order moves the final accuracy by tenths of a
point. ``--lr``, ``--hidden`` and ``--batch`` change them for an experiment.

Rank 0 prints one progress line per validated epoch (prefixed :data:`PROGRESS_PREFIX`, for the parent to
show) and writes the validation accuracy against wall time since ``on_fit_start``, the train-epoch times,
and, with the balancer, its per-epoch shares; every rank writes the samples it trained and the delay injected.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from ivyplug.benchmarks.ps_job import BenchMLP, EpochClock, quiet_trainer
from ivyplug.integrations.lightning.launchers import destroy_default_group
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

#: Lines of rank 0's stdout that start with this are progress for the user; the rest is the job's log.
PROGRESS_PREFIX = "@@demo "
BATCH_PER_WORKER = 128
VAL_BATCH = 1024
HIDDEN = 1024
TRAIN_DIGITS = 1024
LR = 2e-3  # AdamW's, in every run


@dataclass(frozen=True)
class RunSpec:
    """What one demo run trains with."""

    name: str
    label: str
    strategy: str  # "ddp", "ivy_ps_sync" or "ivy_ps_async"
    balancer: bool
    note: str


#: The demo's runs, in the order they run and are shown. Same model, data, slow worker and batch per step.
# fmt: off
RUNS: dict[str, RunSpec] = {spec.name: spec for spec in (
    RunSpec(name="ddp", label="ddp", strategy="ddp", balancer=False,
            note="the baseline: every step waits for the slow worker's gradient"),
    RunSpec(name="ivy_ps_sync_lb", label="ivy_ps sync + IvyLoadBalancer", strategy="ivy_ps_sync", balancer=True,
            note="synchronous like DDP; the balancer moves samples of the global batch to the fast worker each epoch"),
    RunSpec(name="ivy_ps_async", label="ivy_ps async", strategy="ivy_ps_async", balancer=False,
            note="no IvyLoadBalancer: under async the PS hands each worker its next batch when it asks, so the fast "
                 "worker already trains more batches and there are no per-rank shares to rebalance (the balancer "
                 "would only monitor)"),
)}
# fmt: on


def digits(repeat: int) -> tuple[TensorDataset, TensorDataset]:
    """sklearn's digits: 1024 training images repeated ``repeat`` times, the other 773 for validation."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    xt = torch.tensor(x, dtype=torch.float32) / 16.0
    yt = torch.tensor(y, dtype=torch.long)
    perm = torch.randperm(len(xt), generator=torch.Generator().manual_seed(0))
    train, val = perm[:TRAIN_DIGITS], perm[TRAIN_DIGITS:]
    return TensorDataset(xt[train].repeat(repeat, 1), yt[train].repeat(repeat)), TensorDataset(xt[val], yt[val])


class DemoMLP(BenchMLP):
    """``ivyplug bench ps``'s MLP and slow worker; AdamW with a cosine schedule in every run."""

    def __init__(self, slowdown: float, epochs: int, lr: float = LR, hidden: int = HIDDEN) -> None:
        super().__init__(slowdown, lr)
        torch.manual_seed(0)  # the same initial weights in every run
        self.net = nn.Sequential(
            nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10)
        )
        self.epochs = epochs

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr)
        return [optimizer], [torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.epochs)]


class AccuracyClock(pl.Callback):
    """Rank 0: validation accuracy after each epoch against wall seconds since ``on_fit_start``, printed as it goes."""

    def __init__(self, label: str, epochs: int) -> None:
        self.label = label
        self.epochs = epochs
        self.points: list[tuple[float, float]] = []
        self.fit_seconds = 0.0
        self.samples = 0  # trained by this rank
        self._t0 = 0.0

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._t0 = time.perf_counter()
        if trainer.global_rank == 0:
            print(f"{PROGRESS_PREFIX}[{self.label}] workers connected, training {self.epochs} epochs", flush=True)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.samples += len(batch[1])

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        elapsed = time.perf_counter() - self._t0
        accuracy = float(trainer.callback_metrics["val_acc"])
        self.points.append((elapsed, accuracy))
        if trainer.global_rank == 0:
            print(
                f"{PROGRESS_PREFIX}[{self.label}] epoch {trainer.current_epoch + 1}/{self.epochs}  "
                f"t={elapsed:6.1f}s  val_acc={accuracy:.4f}",
                flush=True,
            )

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.fit_seconds = time.perf_counter() - self._t0


def build_strategy(name: str) -> Any:
    """The Trainer's strategy for a run: Lightning's ``ddp`` or ivyplug's PS in sync or async mode."""
    if name == "ddp":
        return "ddp"
    from ivyplug.integrations.lightning import IvyPSStrategy

    return IvyPSStrategy(mode="sync" if name == "ivy_ps_sync" else "async", timeout=300.0)


def fit_one(spec: RunSpec, args: argparse.Namespace) -> dict[str, Any] | None:
    """Train one run on this worker; rank 0 returns its results (other ranks: None)."""
    pl.seed_everything(0, verbose=False)  # same initial weights and data order in every run
    train, val = digits(args.repeat)
    model = DemoMLP(args.slowdown, args.epochs, args.lr, args.hidden)
    clock = AccuracyClock(spec.label, args.epochs)
    epochs = EpochClock()
    callbacks: list[pl.Callback] = [clock, epochs]
    balancer = None
    if spec.balancer:
        from ivyplug.integrations.lightning import IvyLoadBalancer

        from ivyplug.load import PsutilProbe

        # batch-size policy pinned (the global batch of the other runs): only the per-worker shares move
        balancer = IvyLoadBalancer(probes=[PsutilProbe(per_cpu=False)], adapt_batch_size=False)
        callbacks.append(balancer)
    trainer = quiet_trainer(
        strategy=build_strategy(spec.strategy),
        devices=2,
        max_epochs=args.epochs,
        callbacks=callbacks,
    )
    trainer.fit(
        model,
        DataLoader(train, batch_size=args.batch, shuffle=True),
        DataLoader(val, batch_size=VAL_BATCH),
    )
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    destroy_default_group()  # the next run starts a fresh group on its own port
    # every rank reports its own work through a file: a collective would need the ranks to meet once more
    worker = {"samples": clock.samples, "injected_sleep_s": model.slept}
    (args.out / f"{spec.name}.rank{trainer.global_rank}.json").write_text(json.dumps(worker))
    if trainer.global_rank != 0:
        return None
    return {
        "run": spec.name,
        "label": spec.label,
        "strategy": spec.strategy,
        "optimizer": "adamw",
        "lr": args.lr,
        "schedule": f"cosine over {args.epochs} epochs",
        "balancer": spec.balancer,
        "note": spec.note,
        "slowdown": args.slowdown,
        "epochs": args.epochs,
        "repeat": args.repeat,
        "batch_per_worker": args.batch,
        "hidden": args.hidden,
        "train_samples": len(train),
        "val_samples": len(val),
        "fit_seconds": clock.fit_seconds,
        "curve": clock.points,
        "epoch_times": epochs.times,
        "val_acc": clock.points[-1][1] if clock.points else None,
        "shares": [h["next_shares"] for h in balancer.history] if balancer else None,
        "share_targets": [h["target_shares"] for h in balancer.history] if balancer else None,
        "step_models": [h["step_models"] for h in balancer.history] if balancer else None,
        "ivy_metrics": {k: v for k, v in sorted(metrics.items()) if k.startswith("ivy/")},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", required=True, help=f"comma-separated, from {sorted(RUNS)}")
    parser.add_argument("--ports", required=True, help="comma-separated: one free MASTER_PORT per run")
    parser.add_argument("--slowdown", type=float, default=3.0, help="rank 1 is this many times slower at compute")
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--repeat", type=int, required=True, help="the 1024 training digits repeated this often")
    parser.add_argument("--out", type=Path, required=True, help="folder: rank 0 writes <run>.json there")
    parser.add_argument("--lr", type=float, default=LR, help=f"AdamW's learning rate in every run (default {LR:g})")
    parser.add_argument("--hidden", type=int, default=HIDDEN, help=f"width of the two hidden layers ({HIDDEN})")
    parser.add_argument("--batch", type=int, default=BATCH_PER_WORKER, help=f"per worker ({BATCH_PER_WORKER})")
    args = parser.parse_args()
    names = args.runs.split(",")
    ports = [int(p) for p in args.ports.split(",")]
    unknown = [n for n in names if n not in RUNS]
    if unknown or len(ports) != len(names):
        parser.error(f"--runs must name runs from {sorted(RUNS)} (got {unknown}) with one port each in --ports")
    if "LOCAL_RANK" not in os.environ:
        parser.error("start one process per worker with LOCAL_RANK, WORLD_SIZE=2, MASTER_ADDR set (ivyplug demo does)")
    torch.set_num_threads(1)  # two workers on two cores
    for name, port in zip(names, ports, strict=True):
        os.environ["MASTER_PORT"] = str(port)
        result = fit_one(RUNS[name], args)
        if result is not None:
            (args.out / f"{name}.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
