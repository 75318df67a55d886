"""Train a digits MLP on the ivyplug parameter server with 2 CPU workers.

    python examples/lightning_ps.py            # async PS (strategy="ivy_ps"), 15 epochs
    python examples/lightning_ps.py --quick    # a short run (smoke test)
    python examples/lightning_ps.py --strategy ivy_ps_sync
    torchrun --nproc_per_node=2 examples/lightning_ps.py --quick

``strategy="ivy_ps"`` is a plain string: installing ivyplug registers the name with Lightning,
this script never imports ivyplug. Worker 1 is slowed a little (``--slow-ms``) so that the async
PS visibly hands more batches to the faster worker; the PS metrics printed at the end show it.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def digits() -> tuple[TensorDataset, TensorDataset]:
    """sklearn's bundled digits (nothing downloaded): 1440 training and 357 validation images."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    xt = torch.tensor(x, dtype=torch.float32) / 16.0
    yt = torch.tensor(y, dtype=torch.long)
    perm = torch.randperm(len(xt), generator=torch.Generator().manual_seed(0))
    train, val = perm[:1440], perm[1440:]
    return TensorDataset(xt[train], yt[train]), TensorDataset(xt[val], yt[val])


class DigitsMLP(pl.LightningModule):
    def __init__(self, hidden: int = 128, lr: float = 3e-3, slow_ms: float = 0.0, epochs: int = 15) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_rank == 1 and self.hparams.slow_ms > 0:
            time.sleep(self.hparams.slow_ms / 1000)  # a slower worker
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        acc = (self(x).argmax(-1) == y).float().mean()
        self.log("val_acc", acc, prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> Any:
        # the learning rate decays to zero over the run (stepped once per epoch: the async PS loader has no
        # length), so the last epochs' stale pushes barely move the model and the final accuracy is stable
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.hparams.epochs)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "epoch"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run (used by the test suite)")
    parser.add_argument("--strategy", default="ivy_ps", help="ivy_ps (async), ivy_ps_sync, ivy_ps_ssp or ddp")
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--devices", type=int, default=2, help="worker processes per node")
    parser.add_argument("--num-nodes", type=int, default=1, help="nodes (e.g. two torchrun invocations)")
    parser.add_argument("--slow-ms", type=float, default=5.0, help="extra milliseconds per step on worker 1")
    args = parser.parse_args()
    epochs = args.epochs or (10 if args.quick else 15)

    pl.seed_everything(0, verbose=False)
    train, val = digits()
    model = DigitsMLP(slow_ms=args.slow_ms, epochs=epochs)
    trainer = pl.Trainer(
        strategy=args.strategy,
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    start = time.perf_counter()
    trainer.fit(
        model,
        DataLoader(train, batch_size=32, shuffle=True),
        DataLoader(val, batch_size=128),
    )
    seconds = time.perf_counter() - start
    if trainer.global_rank == 0:
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        print(f"\nstrategy {args.strategy}: {epochs} epochs in {seconds:.1f} s")
        print(f"validation accuracy: {metrics['val_acc']:.4f}")
        ps = {k: v for k, v in sorted(metrics.items()) if k.startswith("ivy/")}
        if ps:
            print("PS metrics (whole fit, per worker):")
            for key, value in ps.items():
                print(f"  {key:32s} {value:14.4f}")


if __name__ == "__main__":
    main()
