"""``mode="sync"`` with 2 spawned workers: the same parameters as DDP and as single-process training.

Also checkpoint/resume (stop after epoch 2, resume to 4 == uninterrupted, bitwise) and the sync
convergence check, sharing one PS run (a module fixture) because every spawned fit costs seconds.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from ivyplug.integrations.lightning import IvyPSStrategy
from lightning.pytorch import seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from .digits import DigitsMLP, digits_tensors
from .helpers import SpawnedDDP, max_abs_diff, params_of, quiet_trainer, reaped_children, reference_training

pytestmark = [pytest.mark.timeout(290), pytest.mark.slow]

EPOCHS = 4
BATCH = 32


def _sgd_with_step_lr(m: Any) -> tuple[torch.optim.Optimizer, Any]:
    opt = torch.optim.SGD(m.parameters(), lr=0.2, momentum=0.9)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)


def _model() -> DigitsMLP:
    return DigitsMLP(hidden=128, lr=0.2, optimizer="sgd", step_lr=True, batch_size=BATCH)


@dataclass
class SyncRun:
    init: DigitsMLP
    params: dict[str, torch.Tensor]
    val_acc: float
    checkpoints: Path


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory: pytest.TempPathFactory) -> SyncRun:
    """SGD + momentum, StepLR, gradient_clip_val=0.5, 4 epochs, a checkpoint after every epoch."""
    checkpoints = tmp_path_factory.mktemp("sync_ckpt")
    seed_everything(0)
    init = _model()
    model = copy.deepcopy(init)
    with reaped_children():
        trainer = quiet_trainer(
            IvyPSStrategy(mode="sync", start_method="spawn", timeout=60),
            devices=2,
            max_epochs=EPOCHS,
            gradient_clip_val=0.5,
            enable_checkpointing=True,
            callbacks=[ModelCheckpoint(dirpath=checkpoints, filename="{epoch}", save_top_k=-1, every_n_epochs=1)],
            default_root_dir=str(checkpoints),
        )
        trainer.fit(model)
    return SyncRun(init, params_of(model), float(trainer.callback_metrics["val_acc"]), checkpoints)


def test_sync_sgd_clip_steplr_equals_single_process_and_ddp_and_converges(sync_run: SyncRun) -> None:
    x, y, _, _ = digits_tensors()
    expected = reference_training(sync_run.init, _sgd_with_step_lr, x, y, EPOCHS, BATCH, world_size=2, clip=0.5)
    assert max_abs_diff(sync_run.params, expected) <= 1e-5
    assert max_abs_diff(sync_run.params, params_of(sync_run.init)) > 1e-2  # it trained
    assert sync_run.val_acc >= 0.95

    ddp_model = copy.deepcopy(sync_run.init)
    with reaped_children():
        quiet_trainer("ddp_spawn", devices=2, max_epochs=EPOCHS, gradient_clip_val=0.5, limit_val_batches=0).fit(
            ddp_model
        )
    assert max_abs_diff(sync_run.params, params_of(ddp_model)) <= 1e-5


def test_sync_resume_after_epoch_2_matches_uninterrupted_bitwise(sync_run: SyncRun) -> None:
    checkpoint_path = sync_run.checkpoints / "epoch=1.ckpt"  # written after the second epoch
    ps_state = torch.load(checkpoint_path, weights_only=False)["optimizer_states"][0]["ivyplug_ps"]
    assert ps_state["num_shards"] == 2 and len(ps_state["shards"]) == 2

    seed_everything(0)  # the run's sampler seed (PL_GLOBAL_SEED), as in the uninterrupted run
    torch.manual_seed(123)
    resumed = _model()  # another initialisation: everything must come from the checkpoint
    with reaped_children():
        quiet_trainer(
            IvyPSStrategy(mode="sync", start_method="spawn", timeout=60),
            devices=2,
            max_epochs=EPOCHS,
            gradient_clip_val=0.5,
            limit_val_batches=0,
        ).fit(resumed, ckpt_path=checkpoint_path)
    resumed_params = params_of(resumed)
    for name in sync_run.params:
        assert torch.equal(resumed_params[name], sync_run.params[name]), name


def test_an_ivy_ps_checkpoint_resumes_under_ddp_and_a_ddp_checkpoint_under_ivy_ps(
    sync_run: SyncRun, tmp_path: Path
) -> None:
    """Each entry of ``optimizer_states`` is the optimizer's state dict as torch writes it, its state (SGD's
    momentum) taken from the shards: DDP resumes from it (it raised a bare ``KeyError: 'param_groups'``), and the
    PS from DDP's checkpoint, to the uninterrupted run's parameters (sync equals DDP up to the order of sums)."""
    entry = torch.load(sync_run.checkpoints / "epoch=1.ckpt", weights_only=False)["optimizer_states"][0]
    assert len(entry["state"]) == len(list(sync_run.init.parameters()))
    assert all("momentum_buffer" in s for s in entry["state"].values())
    assert not any(sh["optimizer"]["state"] for sh in entry["ivyplug_ps"]["shards"])  # kept once, in the entry

    def resume(strategy: Any, checkpoint_path: Path, epochs: int = EPOCHS, **kwargs: Any) -> dict[str, torch.Tensor]:
        seed_everything(0)  # the run's sampler seed (PL_GLOBAL_SEED), as in the uninterrupted run
        torch.manual_seed(123)
        resumed = _model()  # another initialisation: everything must come from the checkpoint
        with reaped_children():
            quiet_trainer(
                strategy, devices=2, max_epochs=epochs, gradient_clip_val=0.5, limit_val_batches=0, **kwargs
            ).fit(resumed, ckpt_path=checkpoint_path)
        return params_of(resumed)

    ddp_resumed = resume(SpawnedDDP(start_method="spawn"), sync_run.checkpoints / "epoch=1.ckpt")
    assert max_abs_diff(ddp_resumed, sync_run.params) <= 1e-5

    seed_everything(0)
    ddp_model = copy.deepcopy(sync_run.init)
    with reaped_children():  # DDP's own first two epochs, checkpointed
        quiet_trainer(
            SpawnedDDP(start_method="spawn"),
            devices=2,
            max_epochs=2,
            gradient_clip_val=0.5,
            limit_val_batches=0,
            enable_checkpointing=True,
            callbacks=[ModelCheckpoint(dirpath=tmp_path, filename="ddp")],
            default_root_dir=str(tmp_path),
        ).fit(ddp_model)
    ps_resumed = resume(IvyPSStrategy(mode="sync", start_method="spawn", timeout=60), tmp_path / "ddp.ckpt")
    assert max_abs_diff(ps_resumed, sync_run.params) <= 1e-5


def test_a_checkpoint_resumes_under_another_number_of_servers(sync_run: SyncRun) -> None:
    """The run's checkpoint (a shard on each of the 2 workers) resumed with one dedicated server holding the whole
    model: the shard plan differs, so the PS state cannot load as it is (it was refused); the entries' weights and
    per-parameter state (SGD's momentum) resume as from another strategy's checkpoint, to the uninterrupted run."""
    seed_everything(0)  # the run's sampler seed (PL_GLOBAL_SEED), as in the uninterrupted run
    torch.manual_seed(123)
    resumed = _model()  # another initialisation: everything must come from the checkpoint
    with reaped_children():
        quiet_trainer(
            IvyPSStrategy(mode="sync", num_servers=1, start_method="spawn", timeout=60),
            devices=2,
            max_epochs=EPOCHS,
            gradient_clip_val=0.5,
            limit_val_batches=0,
        ).fit(resumed, ckpt_path=sync_run.checkpoints / "epoch=1.ckpt")
    assert max_abs_diff(params_of(resumed), sync_run.params) <= 1e-5


def _lamb_with_step_lr(m: Any) -> tuple[torch.optim.Optimizer, Any]:
    from ivyplug.optim import LAMB

    opt = LAMB(m.parameters(), lr=0.01)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def test_sync_lamb_clip_steplr_equals_single_process_and_ddp() -> None:
    """LAMB, gradient_clip_val=0.5, StepLR (halves the lr after epoch 1): PS sync == one process == DDP.

    In DDP Lightning clips each rank's gradient after the all-reduce, i.e. by the norm of the combined
    gradient, which is what the PS does on the servers and the reference does on the concatenated batch.
    """
    seed_everything(1)  # also Lightning's sampler seed (PL_GLOBAL_SEED)
    # hidden=128: gradient norms around 0.5, so clipping at 0.5 acts on part of the steps (not at hidden=32)
    init = DigitsMLP(
        hidden=128, lr=0.01, optimizer="lamb", step_lr=True, step_lr_size=1, train_size=512, batch_size=BATCH
    )
    x, y, _, _ = digits_tensors()
    expected = reference_training(init, _lamb_with_step_lr, x[:512], y[:512], 2, BATCH, world_size=2, clip=0.5, seed=1)
    fits = {}
    ddp = SpawnedDDP(start_method="spawn")
    for name, strategy in (("ps", IvyPSStrategy(mode="sync", start_method="spawn", timeout=60)), ("ddp", ddp)):
        model = copy.deepcopy(init)
        with reaped_children():
            quiet_trainer(strategy, devices=2, max_epochs=2, gradient_clip_val=0.5, limit_val_batches=0).fit(model)
        fits[name] = params_of(model)
    assert max_abs_diff(fits["ps"], expected) <= 1e-5
    assert max_abs_diff(fits["ddp"], expected) <= 1e-5
    assert max_abs_diff(fits["ps"], fits["ddp"]) <= 1e-5
    assert max_abs_diff(fits["ps"], params_of(init)) > 1e-3  # it trained
    # the StepLR and the clipping both mattered: without either the same training ends elsewhere
    no_decay = reference_training(
        init, lambda m: (_lamb_with_step_lr(m)[0], None), x[:512], y[:512], 2, BATCH, 2, 0.5, 1
    )
    assert max_abs_diff(no_decay, expected) > 1e-4
    no_clip = reference_training(init, _lamb_with_step_lr, x[:512], y[:512], 2, BATCH, 2, None, 1)
    assert max_abs_diff(no_clip, expected) > 1e-4


def test_sync_value_clipping_clamps_the_combined_gradient_as_ddp_does() -> None:
    """gradient_clip_algorithm="value": DDP clamps the averaged gradient, so sync clamps the combined one on the
    servers (a clamp of each worker's gradient before combining is not the same): PS sync == one process."""
    seed_everything(1)
    init = DigitsMLP(hidden=128, lr=0.2, optimizer="sgd", train_size=512, batch_size=BATCH)
    x, y, _, _ = digits_tensors()

    def sgd(m: Any) -> tuple[torch.optim.Optimizer, Any]:
        return torch.optim.SGD(m.parameters(), lr=0.2, momentum=0.9), None

    expected = reference_training(init, sgd, x[:512], y[:512], 2, BATCH, world_size=2, seed=1, clip_value=0.01)
    model = copy.deepcopy(init)
    with reaped_children():
        quiet_trainer(
            IvyPSStrategy(mode="sync", start_method="spawn", timeout=60),
            devices=2,
            max_epochs=2,
            gradient_clip_val=0.01,
            gradient_clip_algorithm="value",
            limit_val_batches=0,
        ).fit(model)
    assert max_abs_diff(params_of(model), expected) <= 1e-5
    no_clip = reference_training(init, sgd, x[:512], y[:512], 2, BATCH, world_size=2, seed=1)
    assert max_abs_diff(no_clip, expected) > 1e-3  # the clamp acted


class _LocalAdamW(DigitsMLP):
    """AdamW inside LocalUpdates: each worker's moments are its own (the servers merge parameter deltas)."""

    def configure_optimizers(self) -> Any:
        from ivyplug.optim import LocalUpdates

        return LocalUpdates(torch.optim.AdamW(self.parameters(), lr=self.hparams.lr), sync_every=4)


def _tensors(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for k in sorted(state, key=str) for t in _tensors(state[k])]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in _tensors(v)]
    return []


def test_sync_local_updates_resume_with_each_workers_own_optimizer_state(tmp_path: Path) -> None:
    """LocalUpdates(AdamW), sync: the checkpoint keeps every worker's own inner moments, and a resume from epoch 1
    ends bitwise where the uninterrupted fit did. The control, the same checkpoint holding rank 0's state only (as
    the first checkpoint format did, which still resumes), resumes every rank with rank 0's moments and ends
    elsewhere."""
    seed_everything(0)
    init = _LocalAdamW(hidden=64, lr=0.01, train_size=512, batch_size=BATCH)

    def fit(model: DigitsMLP, ckpt_path: Path | None = None, checkpoints: Path | None = None) -> None:
        callbacks = [ModelCheckpoint(dirpath=checkpoints, filename="{epoch}", save_top_k=-1)] if checkpoints else []
        with reaped_children():
            quiet_trainer(
                IvyPSStrategy(mode="sync", start_method="spawn", timeout=60),
                devices=2,
                max_epochs=3,
                limit_val_batches=0,
                enable_checkpointing=bool(checkpoints),
                callbacks=callbacks,
            ).fit(model, ckpt_path=ckpt_path)

    whole = copy.deepcopy(init)
    fit(whole, checkpoints=tmp_path)
    checkpoint = torch.load(tmp_path / "epoch=0.ckpt", weights_only=False)
    entry = checkpoint["optimizer_states"][0]
    own = entry["worker_optimizers"]
    assert sorted(own) == [0, 1]
    assert any(not torch.equal(a, b) for a, b in zip(_tensors(own[0]), _tensors(own[1]), strict=True))

    resumed = copy.deepcopy(init)
    fit(resumed, ckpt_path=tmp_path / "epoch=0.ckpt")
    assert max_abs_diff(params_of(resumed), params_of(whole)) == 0.0

    del entry["worker_optimizers"]  # as the first format held it: rank 0's state, under "worker_optimizer"
    checkpoint["optimizer_states"][0] = {
        "format": 1,
        "mode": entry["mode"],
        "ivyplug_ps": entry["ivyplug_ps"],
        "worker_optimizer": {k: v for k, v in entry.items() if k not in ("format", "mode", "ivyplug_ps")},
    }
    torch.save(checkpoint, tmp_path / "rank0_only.ckpt")
    control = copy.deepcopy(init)
    fit(control, ckpt_path=tmp_path / "rank0_only.ckpt")
    assert max_abs_diff(params_of(control), params_of(whole)) > 1e-4
