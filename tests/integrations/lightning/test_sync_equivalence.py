"""``mode="sync"`` with 2 spawned workers: the same parameters as DDP and as single-process training.

Also checkpoint/resume (stop after epoch 2, resume to 4 == uninterrupted, bitwise) and the sync
convergence check, sharing the runs because every spawned fit costs seconds.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from ivyplug.integrations.lightning import IvyPSStrategy
from lightning.pytorch import seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from .digits import DigitsMLP, digits_tensors
from .helpers import max_abs_diff, params_of, quiet_trainer, reaped_children, reference_training

pytestmark = pytest.mark.timeout(290)

EPOCHS = 4
BATCH = 32


def _sgd_with_step_lr(m: Any) -> tuple[torch.optim.Optimizer, Any]:
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)


def test_sync_sgd_clip_steplr_equals_ddp_and_single_process_and_resumes_bitwise(tmp_path: Path) -> None:
    seed_everything(0)
    init = DigitsMLP(hidden=64, lr=0.1, optimizer="sgd", step_lr=True, batch_size=BATCH)
    x, y, _, _ = digits_tensors()
    expected = reference_training(init, _sgd_with_step_lr, x, y, EPOCHS, BATCH, world_size=2, clip=0.5)

    with reaped_children():
        ps_model = copy.deepcopy(init)
        ps_trainer = quiet_trainer(
            IvyPSStrategy(mode="sync", start_method="spawn", timeout=60),
            devices=2,
            max_epochs=EPOCHS,
            gradient_clip_val=0.5,
            enable_checkpointing=True,
            callbacks=[ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", save_top_k=-1, every_n_epochs=1)],
            default_root_dir=str(tmp_path),
        )
        ps_trainer.fit(ps_model)
        ps_params = params_of(ps_model)
        val_acc = float(ps_trainer.callback_metrics["val_acc"])

        ddp_model = copy.deepcopy(init)
        quiet_trainer("ddp_spawn", devices=2, max_epochs=EPOCHS, gradient_clip_val=0.5, limit_val_batches=0).fit(
            ddp_model
        )
        ddp_params = params_of(ddp_model)

        resumed = DigitsMLP(hidden=64, lr=0.1, optimizer="sgd", step_lr=True, batch_size=BATCH)  # other init
        quiet_trainer(
            IvyPSStrategy(mode="sync", start_method="spawn", timeout=60),
            devices=2,
            max_epochs=EPOCHS,
            gradient_clip_val=0.5,
            limit_val_batches=0,
        ).fit(resumed, ckpt_path=tmp_path / "epoch=1.ckpt")
        resumed_params = params_of(resumed)

    assert max_abs_diff(ps_params, expected) <= 1e-5
    assert max_abs_diff(ps_params, ddp_params) <= 1e-5
    assert max_abs_diff(ps_params, params_of(init)) > 1e-2  # it trained
    assert val_acc >= 0.95
    for name in ps_params:
        assert torch.equal(resumed_params[name], ps_params[name]), name

    checkpoint = torch.load(tmp_path / "epoch=1.ckpt", weights_only=False)
    ps_state = checkpoint["optimizer_states"][0]["ivyplug_ps"]
    assert ps_state["num_shards"] == 2 and len(ps_state["shards"]) == 2


def test_sync_lamb_equals_single_process() -> None:
    from ivyplug.optim import LAMB

    seed_everything(1)
    init = DigitsMLP(hidden=32, lr=0.01, optimizer="lamb", train_size=512, batch_size=BATCH)
    x, y, _, _ = digits_tensors()
    expected = reference_training(
        init, lambda m: (LAMB(m.parameters(), lr=0.01), None), x[:512], y[:512], 2, BATCH, world_size=2, clip=0.5
    )
    with reaped_children():
        model = copy.deepcopy(init)
        quiet_trainer(
            IvyPSStrategy(mode="sync", start_method="spawn", timeout=60),
            devices=2,
            max_epochs=2,
            gradient_clip_val=0.5,
            limit_val_batches=0,
        ).fit(model)
    assert max_abs_diff(params_of(model), expected) <= 1e-5
    assert max_abs_diff(params_of(model), params_of(init)) > 1e-3
