"""async/ssp with a step-count LR schedule sized by ``trainer.estimated_stepping_batches``.

Lightning's recipe (``OneCycleLR(total_steps=self.trainer.estimated_stepping_batches)``) loads the
training loader inside ``strategy.setup``, before the PS client exists. The loader must still be a
dispatch loader (a fast worker takes more batches), with a length that bounds what one worker can take,
so the schedule never runs past its end; validation, ``limit_train_batches`` and the progress bar keep
working although a worker's epoch ends before that length.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from ivyplug.integrations.lightning import registration
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import TQDMProgressBar
from torch.utils.data import DataLoader

from .digits import DigitsMLP
from .helpers import quiet_trainer, reaped_children

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

TRAIN_SIZE = 640
BATCH = 32
NUM_BATCHES = TRAIN_SIZE // BATCH  # 20 global batches per epoch
WORKERS = 2
UPPER_BOUND = NUM_BATCHES  # the most one worker can take: every batch, when every other worker is lost
EPOCHS = 2
SLOW_RANK = 1


class OneCycleMLP(DigitsMLP):
    """``OneCycleLR`` sized by ``estimated_stepping_batches``, stepped per batch; records what each worker did."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        self.total_steps = int(self.trainer.estimated_stepping_batches)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=self.hparams.lr, total_steps=self.total_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_train_epoch_start(self) -> None:
        self.validations = 0

    def on_validation_epoch_end(self) -> None:
        self.validations += 1

    def on_train_epoch_end(self) -> None:
        if self.hparams.record_dir is not None:
            bar = getattr(self.trainer.progress_bar_callback, "train_progress_bar", None)
            extra = {
                "total_steps": self.total_steps,
                "num_training_batches": self.trainer.num_training_batches,
                "scheduler_steps": self.lr_schedulers().last_epoch,  # type: ignore[union-attr]
                "validations": self.validations,
                "bar": None if bar is None else [bar.n, bar.total],
            }
            path = Path(self.hparams.record_dir) / f"extra_rank{self.global_rank}_epoch{self.current_epoch}.json"
            path.write_text(json.dumps(extra))
        super().on_train_epoch_end()  # writes the batches and samples of this epoch


def _model(record: Path) -> OneCycleMLP:
    """The slow worker sleeps 0.15 s a batch: at 30 ms, a fast worker slowed by a test running beside this
    one kept pace with it, and checks that need the fast one ahead (a cap it reaches first, a stopping epoch
    that ends before its queue is empty) failed."""
    return OneCycleMLP(
        hidden=32,
        lr=0.05,
        train_size=TRAIN_SIZE,
        batch_size=BATCH,
        shuffle=True,
        slow_rank=SLOW_RANK,
        delay_s=0.15,
        record_dir=str(record),
    )


def _strategy(name: str) -> Any:
    """The registered ``ivy_ps``/``ivy_ps_ssp`` defaults, spawned, with every wait bounded (a hang fails)."""
    factory = {"ivy_ps": registration.ivy_ps, "ivy_ps_ssp": registration.ivy_ps_ssp}[name]
    return factory(start_method="spawn", timeout=60, process_group_timeout=timedelta(seconds=60))


def _read(record: Path, rank: int, epoch: int) -> dict[str, Any]:
    data = json.loads((record / f"rank{rank}_epoch{epoch}.json").read_text())
    data.update(json.loads((record / f"extra_rank{rank}_epoch{epoch}.json").read_text()))
    return data


@pytest.mark.parametrize(
    ("name", "accumulate"),
    [("ivy_ps", 1), ("ivy_ps_ssp", 1), ("ivy_ps", 2)],  # accumulating: the next batch is asked for ahead of one
)
def test_one_cycle_sized_by_estimated_stepping_batches_keeps_dispatch_on(
    name: str, accumulate: int, tmp_path: Path
) -> None:
    seed_everything(0)
    record = tmp_path / "record"
    record.mkdir()
    with reaped_children():
        trainer = quiet_trainer(
            _strategy(name),
            devices=WORKERS,
            max_epochs=EPOCHS,
            default_root_dir=str(tmp_path),
            accumulate_grad_batches=accumulate,
        )
        trainer.fit(_model(record))

    batches = {0: 0, 1: 0}
    steps = {0: 0, 1: 0}
    for epoch in range(EPOCHS):
        seen: list[int] = []
        for rank in (0, 1):
            data = _read(record, rank, epoch)
            # the per-worker upper bound, not infinite
            assert data["total_steps"] == EPOCHS * -(-UPPER_BOUND // accumulate)
            assert data["num_training_batches"] == UPPER_BOUND
            assert data["validations"] == 1, f"rank {rank} epoch {epoch}: validation at this worker's epoch end"
            assert data["batches"] <= UPPER_BOUND
            batches[rank] += data["batches"]
            steps[rank] += -(-data["batches"] // accumulate)  # Lightning steps a partial accumulation at the end
            seen += data["samples"]
            # each worker's scheduler advances with its own steps, and never past the end of its schedule
            assert data["scheduler_steps"] == steps[rank] <= data["total_steps"]
        assert sorted(seen) == list(range(TRAIN_SIZE)), f"epoch {epoch}: samples lost or repeated"
    assert batches[0] + batches[1] == EPOCHS * NUM_BATCHES
    assert batches[1 - SLOW_RANK] > batches[SLOW_RANK], f"the fast worker took no more batches: {batches}"
    metrics = trainer.callback_metrics
    for rank in (0, 1):  # counted by the PS dispatch queue: zero if the fit ran without dispatch
        assert float(metrics[f"ivy/rank{rank}/batches"]) == batches[rank]
    assert {"val_acc", "val_loss"} <= set(metrics)


def test_limit_train_batches_caps_each_worker_and_the_progress_bar_counts_its_batches(tmp_path: Path) -> None:
    seed_everything(0)
    record = tmp_path / "record"
    record.mkdir()
    limit = int(UPPER_BOUND * 0.75)  # limit_train_batches=0.75 of the per-worker upper bound: 14 of 20 batches
    with reaped_children():
        trainer = Trainer(
            strategy=_strategy("ivy_ps"),
            accelerator="cpu",
            devices=WORKERS,
            max_epochs=EPOCHS,
            limit_train_batches=0.75,
            callbacks=[TQDMProgressBar(refresh_rate=1)],
            logger=False,
            enable_checkpointing=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            default_root_dir=str(tmp_path),
        )
        trainer.fit(_model(record))

    for epoch in range(EPOCHS):
        seen: list[int] = []
        taken = {}
        for rank in (0, 1):
            data = _read(record, rank, epoch)
            assert data["num_training_batches"] == limit
            assert data["total_steps"] == EPOCHS * limit
            assert data["validations"] == 1
            if rank == 0:  # the progress bar shows rank 0's epoch: the total is the cap, the count its batches
                assert data["bar"] == [data["batches"], limit]
            taken[rank] = data["batches"]
            seen += data["samples"]
        assert len(seen) == len(set(seen)), f"epoch {epoch}: a sample trained twice"
        # the fast worker reaches the cap and stops; the slow one never gets that far
        assert taken[1 - SLOW_RANK] == limit > taken[SLOW_RANK], taken


class _LoaderWorkersMLP(OneCycleMLP):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(self._train_data(), batch_size=BATCH, shuffle=True, num_workers=2, persistent_workers=True)


@pytest.mark.parametrize("num_workers", [0, 2])  # loader worker processes: the next batch is asked for ahead
def test_max_steps_ends_every_worker_s_fit_when_the_first_reaches_it(num_workers: int, tmp_path: Path) -> None:
    """``max_steps`` in async mode: the fast worker stops at exactly ``max_steps``, the slow one at the same
    epoch's end, each after validating there; no schedule sized by ``max_steps`` runs past its end."""
    seed_everything(0)
    record = tmp_path / "record"
    record.mkdir()
    # 5 epochs hold 100 batches: the step limit, not the epochs, ends this fit. One step past a full epoch, so
    # the stopping epoch empties its queue only if the slow worker kept pace with the fast one (it sleeps).
    max_steps, max_epochs = NUM_BATCHES + 1, 5
    model = _model(record) if not num_workers else _LoaderWorkersMLP(**_model(record).hparams)
    with reaped_children():
        trainer = quiet_trainer(
            _strategy("ivy_ps"),
            devices=WORKERS,
            max_epochs=max_epochs,
            max_steps=max_steps,
            default_root_dir=str(tmp_path),
        )
        trainer.fit(model)

    epochs = {
        rank: sorted(int(p.stem.split("epoch")[1]) for p in record.glob(f"rank{rank}_epoch*.json")) for rank in (0, 1)
    }
    assert epochs[0] == epochs[1], f"the workers ended their fits in different epochs: {epochs}"
    last = epochs[0][-1]
    assert last < max_epochs - 1, f"the fit ran to max_epochs: {epochs}"
    steps = {rank: 0 for rank in (0, 1)}
    for epoch in epochs[0]:
        seen: list[int] = []
        for rank in (0, 1):
            data = _read(record, rank, epoch)
            assert data["total_steps"] == max_steps  # Lightning sizes the schedule by max_steps
            assert data["validations"] == 1, f"rank {rank} epoch {epoch}: one validation, at this worker's epoch end"
            steps[rank] += data["batches"]
            assert data["scheduler_steps"] == steps[rank]
            seen += data["samples"]
        assert len(seen) == len(set(seen)), f"epoch {epoch}: a sample trained twice"
        if epoch < last:
            assert sorted(seen) == list(range(TRAIN_SIZE)), f"epoch {epoch}: a full epoch lost samples"
    fast = 1 - SLOW_RANK
    assert steps[fast] == max_steps > steps[SLOW_RANK], steps
    assert len(seen) < TRAIN_SIZE, "the stopping epoch should end before its queue was empty"
