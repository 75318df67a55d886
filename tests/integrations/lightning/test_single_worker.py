"""One worker in this process (popen launcher, world size 1): exactness, precision, evaluation, refusals."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from ivyplug.integrations.lightning import IvyPSStrategy
from lightning.pytorch import seed_everything

from .digits import DigitsMLP, digits_tensors
from .helpers import max_abs_diff, params_of, quiet_trainer, reference_training

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("num_servers", [0, 1])
def test_async_one_worker_equals_single_process_exactly(num_servers: int) -> None:
    """Co-located shard, or one dedicated CPU server process: the same bits as plain torch."""
    seed_everything(0)
    model = DigitsMLP(hidden=32, lr=0.05, train_size=500, batch_size=32)  # 16 batches, the last one of 20
    x, y, _, _ = digits_tensors()
    expected = reference_training(
        model,
        lambda m: (torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9), None),
        x[:500],
        y[:500],
        epochs=2,
        batch_size=32,
        world_size=1,
    )
    trainer = quiet_trainer(
        IvyPSStrategy(mode="async", num_servers=num_servers), devices=1, max_epochs=2, limit_val_batches=0
    )
    trainer.fit(model)
    got = params_of(model)
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    assert trainer.global_step == 32


@pytest.mark.parametrize(("mode", "overlap"), [("async", False), ("sync", True)])
def test_accumulate_grad_batches_and_clipping_one_worker_equal_single_process(mode: str, overlap: bool) -> None:
    """With ``overlap_backward=True`` (sync: the servers clip, so the pushed gradients are backward's own) the
    first micro-batch's backward sends nothing (Lightning's ``block_backward_sync``), the second sends every
    shard, and the step uses what it sent."""
    seed_everything(2)
    model = DigitsMLP(hidden=32, lr=0.05, train_size=512, batch_size=32)
    x, y, _, _ = digits_tensors()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator()
    g.manual_seed(2)  # Lightning's sampler seed is PL_GLOBAL_SEED, set by seed_everything(2)
    perm = torch.randperm(512, generator=g)
    for step in range(8):  # 16 batches, 2 per optimizer step
        opt.zero_grad()
        for micro in range(2):
            b = perm[(2 * step + micro) * 32 : (2 * step + micro + 1) * 32]
            (torch.nn.functional.cross_entropy(ref(x[b]), y[b]) / 2).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
    trainer = quiet_trainer(
        IvyPSStrategy(mode=mode, overlap_backward=overlap),
        devices=1,
        max_epochs=1,
        limit_val_batches=0,
        accumulate_grad_batches=2,
        gradient_clip_val=0.5,
    )
    trainer.fit(model)
    assert trainer.global_step == 8
    assert max_abs_diff(params_of(model), params_of(ref)) == 0.0  # clipped once, by the PS, like torch does
    metrics = trainer.callback_metrics
    assert float(metrics["ivy/rank0/pushes"]) == 8.0
    assert float(metrics["ivy/rank0/shards_sent_early"]) == (8.0 if overlap is True else 0.0)
    assert float(metrics["ivy/rank0/shards_sent_again"]) == 0.0


def test_bf16_fit_then_validate_test_predict_and_weights_only_refusal(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    seed_everything(1)
    model = DigitsMLP(hidden=32, lr=0.1, train_size=256, batch_size=32, log_sync_dist=True)
    before = params_of(model)
    trainer = quiet_trainer(
        IvyPSStrategy(mode="async"), devices=1, max_epochs=1, precision="bf16-mixed", default_root_dir=str(tmp_path)
    )
    trainer.fit(model)
    after = params_of(model)
    assert all(torch.isfinite(v).all() for v in after.values())
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert "ivy/rank0/pushes" in trainer.callback_metrics
    assert float(trainer.callback_metrics["ivy/rank0/pushes"]) == 8.0

    loop = trainer.fit_loop.epoch_loop
    assert "advance" not in vars(loop) and "_broadcast_sigterm_tensor" not in vars(loop)  # patches undone
    assert "clip_gradients" not in vars(trainer.strategy.precision_plugin)

    (val,) = trainer.validate(model, verbose=False)
    (test,) = trainer.test(model, verbose=False)
    predictions = trainer.predict(model)
    assert 0.0 <= val["val_acc"] <= 1.0 and 0.0 <= test["test_acc"] <= 1.0
    assert predictions is not None and sum(len(p) for p in predictions) == len(digits_tensors()[2])

    weights_only = tmp_path / "weights.ckpt"
    trainer.save_checkpoint(weights_only, weights_only=True)
    resumed = quiet_trainer(IvyPSStrategy(mode="sync"), devices=1, max_epochs=2)
    with pytest.raises(ValueError, match="weights-only checkpoint"):
        resumed.fit(DigitsMLP(hidden=32, train_size=256), ckpt_path=weights_only)
    after_fit = tmp_path / "after_fit.ckpt"  # the servers, and their optimizer state, are gone by now
    with caplog.at_level("WARNING"):
        trainer.save_checkpoint(after_fit)
    assert "a checkpoint saved after the PS fit ended holds no optimizer state" in caplog.text
    resumed = quiet_trainer(IvyPSStrategy(mode="sync"), devices=1, max_epochs=2)
    with pytest.raises(ValueError, match="saved after the PS fit had ended"):
        resumed.fit(DigitsMLP(hidden=32, train_size=256), ckpt_path=after_fit)


class _Adafactor(DigitsMLP):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adafactor(self.parameters(), lr=0.01)


def test_a_state_that_is_not_per_element_stays_in_the_ps_state_and_resumes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Adafactor's row and column statistics of a tensor cut over two servers cannot be joined into the whole
    tensor's: the checkpoint keeps them in the PS state (the first format, which DDP cannot read), says so, and
    ``ivy_ps`` resumes from it."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    seed_everything(0)

    def trainer(epochs: int, **kwargs: object) -> object:
        strategy = IvyPSStrategy(mode="async", num_servers=2, max_shard_bytes=4096, timeout=60)
        return quiet_trainer(strategy, devices=1, max_epochs=epochs, limit_val_batches=0, **kwargs)

    with caplog.at_level("WARNING"):
        trainer(
            1,
            enable_checkpointing=True,
            callbacks=[ModelCheckpoint(dirpath=tmp_path, filename="first")],
            default_root_dir=str(tmp_path),
        ).fit(_Adafactor(hidden=32, train_size=256, batch_size=32))
    assert "is not per element" in caplog.text and "which DDP cannot read" in caplog.text
    entry = torch.load(tmp_path / "first.ckpt", weights_only=False)["optimizer_states"][0]
    assert entry["format"] == 1 and any(sh["optimizer"]["state"] for sh in entry["ivyplug_ps"]["shards"])
    resumed = _Adafactor(hidden=32, train_size=256, batch_size=32)
    trainer(2).fit(resumed, ckpt_path=tmp_path / "first.ckpt")
    assert all(torch.isfinite(p).all() for p in resumed.parameters())


def test_a_one_device_worker_of_an_ivyplug_serve_logs_its_counters_under_its_slot() -> None:
    """Slot 0 of a serve is held by another worker of the job; a one-device Lightning fit that joins takes slot 1 and
    logs ``ivy/rank1/...`` (each lone worker is rank 0 of a job of its own: it logged ``ivy/rank0/...``)."""
    from ivyplug.ps import PSClient, PSConfig
    from ivyplug.ps.server.service import PSService

    svc = PSService(2, port=0, num_workers=2, timeout=30, status_every=None, log=lambda line: None)
    holder: PSClient | None = None
    try:
        seed_everything(0)
        model = DigitsMLP(hidden=32, lr=0.05, train_size=256, batch_size=32)
        cfg = PSConfig(mode="async", servers=svc.address, timeout=30)
        holder = PSClient.start(cfg, list(model.named_parameters()), [], model.configure_optimizers())
        assert holder.worker == 0
        trainer = quiet_trainer(
            IvyPSStrategy(mode="async", servers=svc.address, timeout=30), devices=1, max_epochs=1, limit_val_batches=0
        )
        trainer.fit(model)
        keys = {k for k in trainer.callback_metrics if k.endswith("/pushes")}
        assert keys == {"ivy/rank1/pushes"}, keys
        assert float(trainer.callback_metrics["ivy/rank1/pushes"]) == 8.0
    finally:
        if holder is not None:
            holder.close()
        svc.close()
