"""Configurations of ``ivyplug bench averaging`` (and ``bench hosts``) run in sequence in one job.

``python -m ivyplug.benchmarks.averaging_job --setting digits --slowdown 3 --epochs 4 --configs ddp ivy_ps
avg/16/nesterov/bfloat16 --out r.json``: 2 ranks on this machine (start-up paid once). With ``--nodes 2`` it is
one node of a two-node job, started by ``torchrun --nnodes 2`` on each (emulated) host, one rank per host;
``--link DEV`` then also records the bytes that crossed the interface ``DEV`` during each fit (the kernel's
own counters, read on rank 0's host).

A config is ``ddp`` (DDP), ``ivy_ps[/wire][/overlap_backward][/dedicated]`` (the PS in async mode on pushed
gradients; co-located servers, or with ``/dedicated`` one server process on rank 0's host; ``/overlap_backward``:
pushes from backward's hooks), ``ivy_ps_sync[/wire][/overlap_backward][/dedicated]`` (sync mode) or
``avg/H/outer/wire[/overlap]`` (the optimizer in ``LocalUpdates`` with ``sync_every=H``, where ``H`` may be
``auto``, async mode, merged by the outer optimizer ``outer``; ``outer@lr@momentum`` sets its ``outer_lr`` and
``outer_momentum``; ``/overlap`` exchanges in the background). ``--optimizer`` is AdamW (default) or ``lamb``
(ivyplug's LAMB), the same in every config. Settings: ``digits`` is the compute-bound MLP 64-1024-1024-10 of ``bench
ps`` at batch 256 on the training set repeated 32x (90 steps per worker and epoch); ``wide`` is 64-2048-2048-10 at
batch 16 on the training set (45 steps per worker and epoch), where communication is a larger share of a step. The
slow worker is ``bench ps``'s delay injector (rank 1 sleeps (k-1) x 3 x its measured forward time every step). Rank
0 writes, per config: train-epoch wall times, the wall time and validation accuracy at the end of every epoch's
validation, and the bytes the workers moved."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from ivyplug.benchmarks.averaging import OPTIMIZERS, WIRES
from ivyplug.benchmarks.ps_job import EpochClock, digits, quiet_trainer, slow_down
from ivyplug.integrations.lightning.launchers import destroy_default_group
from torch import nn
from torch.utils.data import DataLoader

from ivyplug.localsgd.sync_period import SyncEvery

#: setting -> (hidden width, per-worker batch, training-set repeats)
SETTINGS: dict[str, tuple[int, int, int]] = {"digits": (1024, 256, 32), "wide": (2048, 16, 1)}
LR = 1e-3
LAMB_LR = 1e-2


class AveragingMLP(pl.LightningModule):
    """64-H-H-10 with AdamW (wrapped in LocalUpdates for ``avg`` configs); rank 1 is ``slowdown`` times slower."""

    def __init__(
        self,
        hidden: int,
        slowdown: float,
        sync_every: SyncEvery | None,
        outer: str,
        overlap: bool = False,
        optimizer: str = "adamw",
    ) -> None:
        super().__init__()
        self.slowdown, self.sync_every, self.overlap, self.optimizer = slowdown, sync_every, overlap, optimizer
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
        inner: torch.optim.Optimizer
        if self.optimizer == "lamb":
            from ivyplug.optim import LAMB

            inner = LAMB(self.parameters(), lr=LAMB_LR)
        else:
            inner = torch.optim.AdamW(self.parameters(), lr=LR)
        if self.sync_every is None:
            return inner
        from ivyplug.optim import LocalUpdates

        return LocalUpdates(
            inner, sync_every=self.sync_every, outer=self.outer, overlap=self.overlap, **self.outer_kwargs
        )


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


def _link_bytes(link: str | None) -> int:
    """Bytes sent plus received over interface ``link`` so far (0 without one)."""
    if link is None:
        return 0
    stats = Path("/sys/class/net") / link / "statistics"
    return sum(int((stats / name).read_text()) for name in ("tx_bytes", "rx_bytes"))


def _config(
    kind: str,
    mode: str | None = None,
    wire: str = "float32",
    sync_every: SyncEvery | None = None,
    outer: str = "-",
    overlap: bool = False,
    servers: int = 0,
    overlap_backward: bool = False,
) -> dict[str, Any]:
    """A parsed config: its parts, the unnamed ones at their defaults."""
    return {
        "kind": kind, "mode": mode, "wire": wire, "sync_every": sync_every, "outer": outer, "overlap": overlap,
        "servers": servers, "overlap_backward": overlap_backward,
    }  # fmt: skip


def parse_config(config: str) -> dict[str, Any]:
    """The parts of a config name (ValueError naming the forms otherwise)."""
    parts = config.split("/")
    kind = parts[0]
    if kind == "ddp" and len(parts) == 1:
        return _config(kind)
    dedicated = parts[-1] == "dedicated"
    rest = parts[1 : len(parts) - dedicated]
    early = bool(rest) and rest[-1] == "overlap_backward"
    rest = rest[: len(rest) - early]
    if kind in ("ivy_ps", "ivy_ps_sync") and len(rest) <= 1 and (not rest or rest[0] in WIRES):
        mode = "sync" if kind == "ivy_ps_sync" else "async"
        wire = rest[0] if rest else "float32"
        return _config(kind, mode, wire, servers=int(dedicated), overlap_backward=early)
    if kind == "avg" and len(parts) in (4, 5) and (len(parts) == 4 or parts[4] == "overlap"):
        h: SyncEvery = "auto" if parts[1] == "auto" else int(parts[1])
        return _config(kind, "async", parts[3], h, parts[2], overlap=len(parts) == 5)
    raise ValueError(
        f"unknown config {config!r}: ddp, ivy_ps[/wire][/overlap_backward][/dedicated], "
        "ivy_ps_sync[/wire][/overlap_backward][/dedicated] or "
        "avg/H/outer/wire[/overlap]"
    )


def run_config(
    config: str,
    setting: str,
    slowdown: float,
    epochs: int,
    nodes: int = 1,
    seed: int = 0,
    link: str | None = None,
    optimizer: str = "adamw",
) -> dict[str, Any] | None:
    """One fit; rank 0's result (None on the other rank)."""
    from ivyplug.integrations.lightning import IvyPSStrategy

    hidden, batch, repeat = SETTINGS[setting]
    c = parse_config(config)
    strategy: Any = "ddp"
    if c["mode"] is not None:
        strategy = IvyPSStrategy(
            mode=c["mode"],
            wire_dtype=c["wire"],
            timeout=300,
            num_servers=c["servers"],
            overlap_backward=c["overlap_backward"],
        )
    pl.seed_everything(seed, verbose=False)
    train, val = digits(repeat)
    clock, acc = EpochClock(), AccuracyClock()
    model = AveragingMLP(hidden, slowdown, c["sync_every"], c["outer"], c["overlap"], optimizer)
    trainer = quiet_trainer(
        strategy=strategy,
        devices=2 if nodes == 1 else 1,
        num_nodes=nodes,
        max_epochs=epochs,
        callbacks=[clock, acc],
    )
    link_before = _link_bytes(link)
    trainer.fit(model, DataLoader(train, batch_size=batch, shuffle=True), DataLoader(val, batch_size=512))
    link_moved = _link_bytes(link) - link_before
    if trainer.global_rank != 0:
        return None
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    params = sum(p.numel() for p in model.parameters())
    steps_per_rank = len(train) / (2 * batch)
    samples = epochs * len(train)
    if c["kind"] == "ddp":
        # gloo's ring all-reduce of 2 ranks: each rank sends and receives one full fp32 gradient per step
        # (an analytic count: gloo does not report its bytes)
        moved = epochs * steps_per_rank * 2 * (2 * params * 4)
    else:  # measured by the PS clients, cumulative over the fit (epoch-end pulls for validation included)
        moved = sum(
            v for k, v in metrics.items() if k.startswith("ivy/") and k.endswith(("bytes_sent", "bytes_received"))
        )
    periods = {k.split("/")[1]: v for k, v in metrics.items() if k.startswith("ivy/") and k.endswith("/sync_every")}
    return {
        "config": config,
        "kind": c["kind"],
        "mode": c["mode"],
        "sync_every": c["sync_every"],
        "sync_every_chosen": periods,
        "outer": c["outer"],
        "wire": c["wire"],
        "overlap": c["overlap"],
        "servers": c["servers"],
        "optimizer": optimizer,
        "setting": setting,
        "slowdown": slowdown,
        "seed": seed,
        "nodes": nodes,
        "epochs": epochs,
        "batch": batch,
        "params": params,
        "train_samples": len(train),
        "epoch_times": clock.times,
        "accuracy_points": acc.points,
        "val_acc": metrics.get("val_acc"),
        "bytes_moved": moved,
        "bytes_measured": c["kind"] != "ddp",
        "bytes_per_sample": moved / samples,
        "link_bytes": link_moved if link is not None else None,
        # every rank's PS counters (pushes, staleness, bytes, waits), as the workers logged them
        "ps_metrics": {k: v for k, v in metrics.items() if k.startswith("ivy/")},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--setting", choices=sorted(SETTINGS), default="digits")
    parser.add_argument("--slowdown", type=float, default=1.0)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=None, help="training-set repeats (default: the setting's)")
    parser.add_argument("--configs", nargs="+", required=True)
    parser.add_argument("--nodes", type=int, choices=(1, 2), default=1, help="2: one node of a torchrun job")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--link", default=None, help="interface whose byte counters are read around each fit")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
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
            result = run_config(
                config, args.setting, args.slowdown, args.epochs, args.nodes, args.seed, args.link, args.optimizer
            )
            if result is not None:
                results.append(result)
    finally:
        destroy_default_group()  # Lightning's DDP leaves it to the interpreter's teardown
    if results:
        args.out.write_text(json.dumps({"runs": results}, indent=2))


if __name__ == "__main__":
    main()
