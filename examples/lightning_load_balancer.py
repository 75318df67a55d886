"""IvyLoadBalancer in Lightning: the global batch size follows device load, shares follow rank speed.

A scripted load trace (one entry per epoch) stands in for real probes so the run is reproducible:
idle devices make the batch grow, memory pressure makes it shrink, and the learning rate follows
(square-root rule for Adam). Your dataloader code does not change: the callback rebuilds the loader
at each epoch boundary. With ``--devices 2`` the run uses ``ddp`` on 2 CPU processes and rank 1 is
made 3x slower at compute: its share of each global batch falls until both ranks take equally long.

    python examples/lightning_load_balancer.py                 # 6 epochs, 1 process
    python examples/lightning_load_balancer.py --devices 2     # ddp, with a slow rank
    python examples/lightning_load_balancer.py --quick         # 3 epochs on 512 samples, for CI smoke tests

With real hardware, drop ``probes=`` to poll NVML, the torch allocator and psutil instead of the trace.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from ivyplug.integrations.lightning import IvyLoadBalancer
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, Subset, TensorDataset

from ivyplug.load import ScriptedProbe

GIB = 2**30
#: Per-epoch host load: idle (grow), idle again (cooldown), in the band (hold), memory pressure (shrink).
TRACE = [
    {"cpu_util": 25.0, "mem_used": 4 * GIB, "mem_total": 16 * GIB},
    {"cpu_util": 25.0, "mem_used": 4 * GIB, "mem_total": 16 * GIB},
    {"cpu_util": 30.0, "mem_used": 5 * GIB, "mem_total": 16 * GIB},
    {"cpu_util": 60.0, "mem_used": 12 * GIB, "mem_total": 16 * GIB},
    {"cpu_util": 70.0, "mem_used": 15 * GIB, "mem_total": 16 * GIB},
    {"cpu_util": 40.0, "mem_used": 8 * GIB, "mem_total": 16 * GIB},
]


class DigitsClassifier(pl.LightningModule):
    """An ordinary LightningModule; ``slowdown`` makes rank 1 a k-times slower device (demo only)."""

    def __init__(
        self, batch_size: int = 32, lr: float = 2e-3, slowdown: float = 1.0, train_samples: int | None = None
    ) -> None:
        super().__init__()
        self.train_samples = train_samples
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
        self.batch_size = batch_size
        self.lr = lr
        self.slowdown = slowdown
        x, y = load_digits(return_X_y=True)
        data = TensorDataset(torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y))
        self.train_set, self.val_set = torch.utils.data.random_split(
            data, [1497, 300], generator=torch.Generator().manual_seed(0)
        )

    def train_dataloader(self) -> DataLoader:
        data = self.train_set if self.train_samples is None else Subset(self.train_set, range(self.train_samples))
        return DataLoader(data, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=300)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        start = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        if self.slowdown > 1 and self.global_rank == 1:
            # a device k x slower at compute: sleep (k-1) x 3 x forward time (forward + backward ~ 3 x forward)
            time.sleep((self.slowdown - 1) * 3 * (time.perf_counter() - start))
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_acc", (self.net(x).argmax(1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 epochs on 512 samples (CI smoke test)")
    parser.add_argument("--devices", type=int, default=1, help="1 (single process) or 2 (ddp, rank 1 slowed)")
    args = parser.parse_args(argv)
    epochs = 3 if args.quick else 6
    pl.seed_everything(0, workers=True, verbose=False)
    model = DigitsClassifier(slowdown=3.0 if args.devices > 1 else 1.0, train_samples=512 if args.quick else None)
    trace = [TRACE[0], TRACE[3], TRACE[4]] if args.quick else TRACE  # quick: grow, hold, shrink
    probe = ScriptedProbe(trace, clock=lambda: model.current_epoch)
    # the scripted load shows the utilisation rule alone: by default a growth must also raise the goodput
    balancer = IvyLoadBalancer(probes=[probe], interval=0.2, max_batch_size=256, goodput=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        max_epochs=epochs,
        callbacks=[balancer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        log_every_n_steps=10,
    )
    trainer.fit(model)
    if trainer.global_rank == 0:
        print(f"{'epoch':>5} {'B':>5} {'next B':>6} {'shares':>12} {'lr x':>6} {'compute s/rank':>18}  reason")
        for h in balancer.history:
            times = " ".join(f"{r['compute_time']:.2f}" for r in h["ranks"])
            print(
                f"{h['epoch']:>5} {h['batch_size']:>5} {h['next_batch_size']:>6} {h['next_shares']!s:>12} "
                f"{h['lr_factor']:>6.3f} {times:>18}  {h['reason']}"
            )
        print("ivy/ metrics:", ", ".join(f"{k}={v:.3g}" for k, v in sorted(balancer.metrics.items())))
        print(f"validation accuracy: {float(trainer.logged_metrics['val_acc']):.3f}")
    metrics = {**balancer.metrics, "val_acc": float(trainer.logged_metrics["val_acc"])}
    return {"history": balancer.history, "metrics": metrics}


if __name__ == "__main__":
    main()
