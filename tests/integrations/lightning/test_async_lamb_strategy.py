"""``AsyncLAMB`` under ``Trainer(strategy="ivy_ps")``: local steps, delta exchanges, one global model."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from ivyplug.integrations.lightning import IvyPSStrategy
from lightning.pytorch import seed_everything

from .digits import DigitsMLP
from .helpers import quiet_trainer, reaped_children

pytestmark = [pytest.mark.timeout(280)]

EPOCHS = 8


class AsyncLambMLP(DigitsMLP):
    def configure_optimizers(self) -> Any:
        from ivyplug.optim import AsyncLAMB

        return AsyncLAMB(self.parameters(), lr=self.hparams.lr, sync_every=4)


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_async_lamb_two_workers_converge_to_one_global_model(mode: str) -> None:
    seed_everything(0)
    model = AsyncLambMLP(hidden=64, lr=0.02, batch_size=32, shuffle=True)
    with reaped_children():
        trainer = quiet_trainer(
            IvyPSStrategy(mode=mode, start_method="spawn", timeout=60, process_group_timeout=timedelta(seconds=60)),
            devices=2,
            max_epochs=EPOCHS,
        )
        trainer.fit(model)
    metrics = trainer.callback_metrics
    # async merges depend on timing: under foreign load seed 0 ended at 0.916-0.933 (with today's merge rule and
    # with a flat rate 1/2 alike) where a quiet machine gives 0.95-0.96; the rule itself is checked exactly
    # in tests/optim/test_async_lamb.py, and async LAMB against sync LAMB (DDP math) in test_averaging_accuracy.py
    assert float(metrics["val_acc"]) >= (0.93 if mode == "sync" else 0.90)
    # 1440 samples / 32 per batch = 45 batches per epoch, split between 2 workers; one push per 4 local steps
    # plus the flush before each validation: far fewer pushes than batches, but some from every worker
    pushes = [float(metrics[f"ivy/rank{r}/pushes"]) for r in (0, 1)]
    assert all(p >= 4 for p in pushes), pushes
    assert sum(pushes) <= EPOCHS * (45 / 4 + 2), pushes
    # what the main process got back is the servers' copy: validating it again gives the logged accuracy
    # (up to the one duplicated sample of DistributedSampler's padding: 357 samples as 2 x 179)
    with reaped_children():
        result = quiet_trainer("auto", devices=1).validate(model, verbose=False)
    assert result[0]["val_acc"] == pytest.approx(float(metrics["val_acc"]), abs=1 / 179)
    assert all(torch.isfinite(p).all() for p in model.parameters())


class OverlapMLP(DigitsMLP):
    """AsyncLAMB with overlapped exchanges; each rank writes whether its model ends equal to the servers' copy."""

    def configure_optimizers(self) -> Any:
        from ivyplug.optim import AsyncLAMB

        return AsyncLAMB(self.parameters(), lr=self.hparams.lr, sync_every=4, overlap=True)

    def on_fit_start(self) -> None:
        client = self.trainer.strategy.client
        self._ps_tensors = [t for _, t in [*client.params, *client.buffers]]  # the shadows the exchanges write

    def teardown(self, stage: str) -> None:  # after the strategy's last sync and the client's close
        if stage != "fit" or self.hparams.record_dir is None:
            return
        mine = [t for _, t in [*self.named_parameters(), *self.named_buffers()]]
        opt = self.trainer.strategy.optimizers[0]
        record = {
            "equal": all(torch.equal(a, b) for a, b in zip(mine, self._ps_tensors, strict=True)),
            "distinct": all(a is not b for a, b in zip(mine, self._ps_tensors, strict=True)),
            "exchanges": opt.exchanges,
        }
        (Path(self.hparams.record_dir) / f"overlap_rank{self.global_rank}.json").write_text(json.dumps(record))


def test_async_lamb_with_overlapped_exchanges_learns_and_ends_on_the_servers_copy(tmp_path: Path) -> None:
    """Two spawned workers in async mode, BatchNorm buffers included: the fit learns, the wait for an exchange
    in flight is logged, and every rank's model (params and buffers) ends equal to the servers' copy."""
    seed_everything(0)
    model = OverlapMLP(hidden=64, lr=0.02, batch_size=32, shuffle=True, batchnorm=True, record_dir=str(tmp_path))
    with reaped_children():
        trainer = quiet_trainer(
            IvyPSStrategy(mode="async", start_method="spawn", timeout=60, process_group_timeout=timedelta(seconds=60)),
            devices=2,
            max_epochs=4,
        )
        trainer.fit(model)
    metrics = trainer.callback_metrics
    print("val_acc:", float(metrics["val_acc"]))  # shown with -rA
    assert float(metrics["val_acc"]) >= 0.85
    records = [json.loads((tmp_path / f"overlap_rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["equal"] and r["distinct"] and r["exchanges"] >= 4 for r in records), records
    assert all(float(metrics[f"ivy/rank{r}/overlap_wait_s"]) >= 0.0 for r in (0, 1))
    assert all(float(metrics[f"ivy/rank{r}/pushes"]) >= 4 for r in (0, 1))
    assert all(torch.isfinite(p).all() for p in model.parameters())
