"""``mode="async"`` with a straggler: no hang, every sample once per epoch, the fast worker does more.

Run twice (rank 0 slowed, then rank 1 slowed) with validation, ``sync_dist`` on step and epoch,
``ModelCheckpoint`` and ``EarlyStopping``; every PS wait and the default process group time out after
60 s, so a per-batch collective that slipped through fails the test instead of hanging it.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
from ivyplug.integrations.lightning import IvyPSStrategy
from lightning.pytorch import seed_everything
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

from .digits import DigitsMLP
from .helpers import quiet_trainer, reaped_children

pytestmark = [pytest.mark.timeout(280), pytest.mark.slow]

TRAIN_SIZE = 640
BATCH = 32
EPOCHS = 3


@pytest.mark.parametrize("slow_rank", [0, 1])
def test_async_straggler_trains_every_sample_once_and_fast_worker_does_more(slow_rank: int, tmp_path: Path) -> None:
    seed_everything(0)
    record = tmp_path / "record"
    record.mkdir()
    model = DigitsMLP(
        hidden=64,
        lr=0.05,
        train_size=TRAIN_SIZE,
        batch_size=BATCH,
        shuffle=True,
        slow_rank=slow_rank,
        delay_s=0.1,  # at 30 ms, a fast worker slowed by a test running beside this one could keep pace
        log_sync_dist=True,
        record_dir=str(record),
        batchnorm=True,  # buffers travel through the PS too
    )
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="val_acc", mode="max")
    with reaped_children():
        trainer = quiet_trainer(
            IvyPSStrategy(mode="async", start_method="spawn", timeout=60, process_group_timeout=timedelta(seconds=60)),
            devices=2,
            max_epochs=EPOCHS,
            enable_checkpointing=True,
            callbacks=[checkpoint, EarlyStopping(monitor="val_loss", patience=10)],
            default_root_dir=str(tmp_path),
        )
        trainer.fit(model)

    fast_rank = 1 - slow_rank
    batches = {0: 0, 1: 0}
    for epoch in range(EPOCHS):
        seen: list[int] = []
        for rank in (0, 1):
            data = json.loads((record / f"rank{rank}_epoch{epoch}.json").read_text())
            batches[rank] += data["batches"]
            seen += data["samples"]
        assert sorted(seen) == list(range(TRAIN_SIZE)), f"epoch {epoch}: samples lost or repeated"
    assert batches[0] + batches[1] == EPOCHS * TRAIN_SIZE // BATCH
    assert batches[fast_rank] > batches[slow_rank]

    metrics = trainer.callback_metrics
    for rank in (0, 1):  # the PS's batch counter includes the batch each worker takes without asking
        assert float(metrics[f"ivy/rank{rank}/batches"]) == batches[rank]
    assert float(metrics[f"ivy/rank{fast_rank}/pushes"]) > float(metrics[f"ivy/rank{slow_rank}/pushes"])
    assert float(metrics[f"ivy/rank{fast_rank}/staleness_max"]) >= 1.0
    assert {"val_acc", "val_loss", "train_loss_epoch"} <= set(metrics)
    assert Path(checkpoint.best_model_path).is_file()
