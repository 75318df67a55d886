"""Lightning features a user combines with the PS, in one popen-launched job (2 ranks) per call.

``python features_job.py OUT`` runs, each rank writing ``OUT/<name>-rank<r>.json``:

* ``async``: ``Tuner.lr_find`` (its callback read back as ``trainer.callbacks[0]``; its trial fit ends with the
  tuner's exception on every rank, which must not make the launcher kill the others), then a fit with the default
  ``ModelCheckpoint`` (each rank names files from its own step count; only rank 0 writes them), then
  ``test(ckpt_path="best")`` on every rank;
* ``sync``: a fit with ``StochasticWeightAveraging``, whose average copied in at the end of
  training must stay the model's.

``python features_job.py OUT resume``: async, a checkpoint saved mid-epoch resumed by ``fit(ckpt_path=...)``
(each rank writes ``OUT/resume-rank<r>.json``: the indices it trained per epoch, its LR at each epoch's end).

``python features_job.py OUT allgather``: ``self.all_gather`` inside ``training_step`` in async, which must fail
on every rank at once with an error that says why, not wait for workers that are elsewhere.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from ivyplug.integrations.lightning import IvyPSStrategy
from lightning.pytorch.callbacks import StochasticWeightAveraging
from lightning.pytorch.tuner import Tuner
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset


class MLP(pl.LightningModule):
    def __init__(self, gather: bool = False, slow_rank1: bool = False) -> None:
        super().__init__()
        self.lr = 1e-3
        self.gather = gather
        self.slow_rank1 = slow_rank1  # rank 1 trains fewer of the dispatched batches: the ranks' steps differ
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])
        if self.gather:
            self.all_gather(loss.detach())
        if self.slow_rank1 and self.global_rank == 1:
            time.sleep(0.03)
        return loss

    def test_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.log("test_acc", (self.net(batch[0]).argmax(1) == batch[1]).float().mean(), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def data() -> TensorDataset:
    x, y = load_digits(return_X_y=True)
    return TensorDataset(torch.tensor(x[:640] / 16.0, dtype=torch.float32), torch.tensor(y[:640]))


def trainer(strategy: object, root: Path, **kwargs: object) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
        **kwargs,  # type: ignore[arg-type]
    )


def main() -> None:
    out = Path(sys.argv[1])
    loader = DataLoader(data(), batch_size=32, shuffle=True)
    if sys.argv[2:] == ["allgather"]:
        trainer("ivy_ps", out / "allgather", max_epochs=1, enable_checkpointing=False).fit(MLP(gather=True), loader)
        return
    if sys.argv[2:] == ["resume"]:
        resume_mid_epoch(out, loader)
        return
    pl.seed_everything(0, verbose=False)
    model = MLP(slow_rank1=True)
    t = trainer("ivy_ps", out / "async", max_epochs=2)
    found = Tuner(t).lr_find(model, train_dataloaders=loader, num_training=20, early_stop_threshold=None)
    lrs = len(found.results["lr"]) if found is not None else 0
    suggested, model.lr = model.lr, 1e-2  # (20 steps of a tiny set suggest a rate too large to train with)
    t.fit(model, loader)
    tested = t.test(model, DataLoader(data(), batch_size=128), ckpt_path="best", verbose=False)
    best = t.checkpoint_callback.best_model_path if t.checkpoint_callback is not None else ""
    result = {"lrs": lrs, "lr": suggested, "test_acc": tested[0]["test_acc"], "steps": t.global_step}
    result |= {"best": best, "tested": str(t.ckpt_path), "checksum": checksum(model)}
    (out / f"async-rank{t.global_rank}.json").write_text(json.dumps(result))

    pl.seed_everything(0, verbose=False)
    model = MLP()
    swa = StochasticWeightAveraging(swa_lrs=1e-3, swa_epoch_start=1)
    trained = TrainedWeights()  # before SWA's on_train_end: the servers' final weights
    t = trainer("ivy_ps_sync", out / "sync", max_epochs=3, enable_checkpointing=False, callbacks=[trained, swa])
    model.lr = 1e-2
    t.fit(model, loader)
    average = swa._average_model
    assert average is not None
    gap = largest_gap(list(model.parameters()), list(average.parameters()))
    moved = largest_gap(trained.weights, list(average.parameters()))
    result = {"swa_gap": gap, "swa_moved": moved, "steps": t.global_step}
    (out / f"sync-rank{t.global_rank}.json").write_text(json.dumps(result))


class SaveMidEpoch(pl.Callback):
    """Every rank saves ``mid.ckpt`` after batch 3 of epoch 1 (rank 0 writes it)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.current_epoch == 1 and args[-1] == 3:
            trainer.save_checkpoint(self.path)


class Batches(pl.Callback):
    """The dataset indices each epoch trained on this rank, and the learning rate at each epoch's end."""

    def __init__(self) -> None:
        self.seen: dict[int, list[int]] = {}
        self.lrs: list[float] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: object, i: int) -> None:
        self.seen.setdefault(trainer.current_epoch, []).extend(batch[2].tolist())  # type: ignore[index]

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


class IndexedMLP(MLP):
    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return super().training_step(batch[:2], batch_idx)

    def configure_optimizers(self) -> object:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)}


def resume_mid_epoch(out: Path, loader: DataLoader) -> None:
    """async: a checkpoint saved mid-epoch resumed with ``fit(ckpt_path=...)``; Lightning then skips that epoch's
    ``on_train_epoch_start``, where the dispatch found its sampler (both workers waited for each other's batches
    until the PS timeout)."""
    x, y = data().tensors
    indexed = DataLoader(TensorDataset(x, y, torch.arange(len(y))), batch_size=32, shuffle=True)
    strategy = IvyPSStrategy(mode="async", timeout=30)
    pl.seed_everything(0, verbose=False)
    save = SaveMidEpoch(out / "mid.ckpt")
    first = trainer(strategy, out / "first", max_epochs=2, enable_checkpointing=False, callbacks=[save])
    first.fit(IndexedMLP(), indexed)
    seen = Batches()
    strategy = IvyPSStrategy(mode="async", timeout=30)
    resumed = trainer(strategy, out / "resumed", max_epochs=4, enable_checkpointing=False, callbacks=[seen])
    resumed.fit(IndexedMLP(), indexed, ckpt_path=out / "mid.ckpt")
    result = {"seen": seen.seen, "lrs": seen.lrs, "epoch": resumed.current_epoch}
    (out / f"resume-rank{resumed.global_rank}.json").write_text(json.dumps(result))


def checksum(model: pl.LightningModule) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def largest_gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """max |a - b| over every tensor pair; NaN if any difference is NaN (torch's max keeps it, Python's may not)."""
    return float(torch.stack([(x.detach() - y.detach()).abs().max() for x, y in zip(a, b, strict=True)]).max())


class TrainedWeights(pl.Callback):
    def __init__(self) -> None:
        self.weights: list[torch.Tensor] = []

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.weights = [p.detach().clone() for p in pl_module.parameters()]


if __name__ == "__main__":
    main()
