"""IvyLoadBalancer on one process: batch size follows a scripted load, LR follows the rule, OOMs are
recovered without losing samples, unsupported loaders are monitored only, checkpoints hold the state."""

from __future__ import annotations

import csv
from collections import Counter
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from ivyplug.integrations.lightning.load_balancer import IvyLoadBalancer
from ivyplug.integrations.lightning.share_sampler import ShareBatchSampler, epoch_order
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from ivyplug.load import OutOfMemoryRecoveryError, ScriptedProbe, TorchAllocatorProbe
from tests.integrations.lightning.lb_models import DigitsMLP, digits_dataset, trainer_kwargs

IDLE = {"cpu_util": 20.0, "mem_used": 3.0, "mem_total": 10.0}
BAND = {"cpu_util": 20.0, "mem_used": 7.5, "mem_total": 10.0}
FULL = {"cpu_util": 50.0, "mem_used": 9.5, "mem_total": 10.0}


def _fit(model: DigitsMLP, cb: IvyLoadBalancer, **kw: object) -> pl.Trainer:
    trainer = pl.Trainer(callbacks=[cb], **trainer_kwargs(**kw))
    trainer.fit(model)
    return trainer


def _per_epoch(model: DigitsMLP) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for epoch, idx in model.seen:
        out.setdefault(epoch, []).append(idx)
    return out


@pytest.mark.parametrize(("optimizer", "rule"), [("adam", "sqrt"), ("sgd", "linear")])
def test_idle_grows_then_memory_pressure_shrinks_with_lr_rescaled(optimizer: str, rule: str, tmp_path: Path) -> None:
    model = DigitsMLP(batch_size=32, n=256, optimizer=optimizer, lr=0.01)
    probe = ScriptedProbe([IDLE, BAND, FULL], clock=lambda: model.current_epoch)
    # goodput=False: one process has no noise-scale estimate (see the test below), the utilisation rules decide
    cb = IvyLoadBalancer(probes=[probe], interval=0.05, max_batch_size=128, goodput=False)
    trainer = _fit(model, cb, max_epochs=3, logger=CSVLogger(tmp_path / "logs"))

    assert [(h["batch_size"], h["next_batch_size"]) for h in cb.history] == [(32, 64), (64, 64), (64, 32)]
    assert "grow" in cb.history[0]["reason"] and "shrink" in cb.history[2]["reason"]
    # the loader really changed: epoch 1 trained on batches of 64, and every sample once per epoch
    sizes = Counter(model.batch_sizes)
    assert sizes[(0, 32)] == 8 and sizes[(1, 64)] == 4 and sizes[(2, 64)] == 4
    for epoch, indices in _per_epoch(model).items():
        assert sorted(indices) == list(range(256)), epoch
    factors = [h["lr_factor"] for h in cb.history]
    expected_up = 2.0 if rule == "linear" else 2.0**0.5
    assert factors == pytest.approx([expected_up, expected_up, 1.0], rel=1e-12)
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.01, rel=1e-12)

    logged = cb.metrics
    for key in ("ivy/batch_size", "ivy/lr_factor", "ivy/utilization", "ivy/memory_fraction", "ivy/share"):
        assert key in logged
    assert logged["ivy/rank0/samples"] == 256.0 and logged["ivy/batch_size"] == 32.0
    rows = list(csv.DictReader((tmp_path / "logs" / "lightning_logs" / "version_0" / "metrics.csv").open()))
    assert [float(r["ivy/batch_size"]) for r in rows if r.get("ivy/rank0/samples")] == [64.0, 64.0, 32.0]
    assert sum(1 for r in rows if r.get("ivy/cpu_util")) == 16  # every step: log_every_n_steps=1, 8 + 4 + 4 steps

    path = tmp_path / "lb.ckpt"
    trainer.save_checkpoint(path)
    state = torch.load(path, weights_only=False)["callbacks"]
    saved = next(v for k, v in state.items() if "IvyLoadBalancer" in k)
    restored = IvyLoadBalancer()
    restored.load_state_dict(saved)
    assert restored.batch_size == 32 and restored.shares == [32] and restored.lr_factor == pytest.approx(1.0)
    assert restored.policy_state == cb.policy_state and len(restored.history) == 3
    # a checkpoint from before the step-time model (it held "speeds") still loads; the fit starts afresh
    old = {k: v for k, v in saved.items() if k not in ("step_observations", "previous_shares", "share_gain")}
    restored.load_state_dict({**old, "speeds": [1.0]})
    assert restored.step_observations == [] and restored.share_gain == 1.0 and restored.batch_size == 32
    # the overhead is all of the callback's time on the training thread, split by where it was spent
    assert set(cb.hook_breakdown) == {"batch", "epoch_start", "epoch_end", "epoch_sync", "loader"}
    assert all(v >= 0 for v in cb.hook_breakdown.values()) and cb.hook_breakdown["batch"] > 0
    assert cb.hook_seconds == sum(cb.hook_breakdown.values())


def test_same_permutation_as_lightning_distributed_sampler() -> None:
    data = digits_dataset(100)
    for epoch in (0, 3):
        ds = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=7)
        ds.set_epoch(epoch)
        assert epoch_order(100, epoch, 7, shuffle=True) == list(ds)
        sampler = ShareBatchSampler(100, 10, [7, 3], rank=1, epoch=epoch, seed=7, shuffle=True)
        order = list(ds)
        assert list(sampler) == [order[s * 10 + 7 : s * 10 + 10] for s in range(10)]


class _FirstEpochParams(pl.Callback):
    """Parameters after the first epoch (before batch-size decisions make two runs differ)."""

    def __init__(self) -> None:
        self.params: dict[str, torch.Tensor] = {}

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch == 0:
            self.params = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}


def test_oom_is_recovered_with_the_same_result_and_no_lost_samples() -> None:
    def run(oom_above: int | None) -> tuple[DigitsMLP, IvyLoadBalancer, dict[str, torch.Tensor]]:
        model = DigitsMLP(batch_size=32, n=128, optimizer="sgd", lr=0.1, oom_above=oom_above, seed=3)
        cb = IvyLoadBalancer(probes=[ScriptedProbe([BAND]), TorchAllocatorProbe()], interval=0.05, seed=0)
        snapshot = _FirstEpochParams()
        trainer = pl.Trainer(callbacks=[cb, snapshot], **trainer_kwargs(max_epochs=2))
        trainer.fit(model)
        return model, cb, snapshot.params

    plain, _, plain_params = run(None)
    split, cb, split_params = run(12)
    # 32 -> 2 x 16 still too big -> 4 x 8 fits; every sample trained once per epoch, in the same order
    assert _per_epoch(split) == _per_epoch(plain)
    assert Counter(split.batch_sizes)[(0, 8)] == 16
    # epoch 0: OOM at 32 and at 16, then 4 parts stick for the epoch; B drops to 16, which OOMs once more
    assert cb.oom_count == 3 and cb._sampler is None  # closed at teardown
    assert cb.metrics["ivy/oom_count"] == 3.0
    assert [h["next_batch_size"] for h in cb.history] == [16, 8] and "out of memory" in cb.history[0]["reason"]
    # the micro-batch gradients add up to the whole-batch gradient: same parameters as without OOMs
    assert plain_params.keys() == split_params.keys()
    for name, value in plain_params.items():
        torch.testing.assert_close(split_params[name], value, rtol=1e-5, atol=1e-6)


def test_oom_beyond_the_split_limit_is_a_clear_error() -> None:
    model = DigitsMLP(batch_size=32, n=64, oom_above=0)
    cb = IvyLoadBalancer(probes=[ScriptedProbe([BAND])], interval=0.05, oom_max_parts=4)
    with pytest.raises(OutOfMemoryRecoveryError, match="4 micro-batches"):
        _fit(model, cb, max_epochs=1)


def test_a_split_kept_from_a_larger_batch_fits_a_smaller_one() -> None:
    """The split an OOM found is kept for the rest of the epoch; a later batch with fewer samples than parts (the
    epoch's last, or a small share) ended the fit with "cannot split a batch of 2 samples into 4 non-empty
    parts". It is cut into as many parts as it has samples."""
    model = DigitsMLP(batch_size=4, n=30, optimizer="sgd", lr=0.1, oom_above=1)  # 7 batches of 4, one of 2
    cb = IvyLoadBalancer(probes=[ScriptedProbe([BAND])], interval=0.05, adapt_batch_size=False)
    _fit(model, cb, max_epochs=1)
    assert sorted(_per_epoch(model)[0]) == list(range(30))
    assert Counter(model.batch_sizes) == {(0, 1): 30}


def test_oom_recovery_under_gradient_accumulation_is_warned_at_fit_start() -> None:
    """Micro-batch recovery needs ``accumulate_grad_batches=1``; with more, the first OOM ended the fit and nothing
    had said so. The fit now starts with a warning naming the limit."""
    model = DigitsMLP(batch_size=16, n=64)
    cb = IvyLoadBalancer(probes=[ScriptedProbe([BAND])], interval=0.05, goodput=False)
    with pytest.warns(UserWarning, match=r"oom_recovery splits a batch .* only with accumulate_grad_batches=1; with 2"):
        _fit(model, cb, max_epochs=1, accumulate_grad_batches=2)


def test_a_second_fit_starts_at_the_reached_batch_size_with_its_learning_rate() -> None:
    """A second fit with the same callback starts at the batch size the first reached, with fresh optimizers: they
    are given that batch size's learning rate (the first fit's linear rule: 0.01 x 64/32), as the Keras twin's next
    fit has it. Before, the second fit trained at B=64 with lr 0.01 while ``lr_factor`` said 2."""
    model = DigitsMLP(batch_size=32, n=256, optimizer="sgd", lr=0.01)
    cb = IvyLoadBalancer(probes=[ScriptedProbe([IDLE])], interval=0.05, max_batch_size=64, goodput=False)
    first = _fit(model, cb, max_epochs=1)
    assert cb.batch_size == 64 and first.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.02, rel=1e-12)
    second = _fit(model, cb, max_epochs=1)
    assert Counter(model.batch_sizes)[(0, 64)] == 4  # the second fit's epoch 0, at the reached size
    assert second.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.02, rel=1e-12)
    assert cb.lr_factor == pytest.approx(2.0, rel=1e-12) and cb.metrics["ivy/lr_factor"] == pytest.approx(2.0)


def test_across_ranks_a_loader_lightning_did_not_split_is_not_shared_out() -> None:
    """With ``use_distributed_sampler=False`` each rank's loader holds data of its own (often its own half); shares
    of one global batch over its indices trained half of each rank's data per epoch, without a word. Across ranks
    such a loader is left alone (monitoring only, said once); on one rank, or split by Lightning, it is shared."""
    from ivyplug.integrations.lightning.share_sampler import why_unsupported

    data = digits_dataset(64)
    plain = DataLoader(data, batch_size=8, shuffle=True)
    assert why_unsupported(plain, world=1) is None
    why = why_unsupported(plain, world=2)
    assert why is not None and "use_distributed_sampler=False" in why
    split = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, num_replicas=2, rank=0))
    assert why_unsupported(split, world=2) is None


class _Stream(IterableDataset):
    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(zip(*digits_dataset(64).tensors, strict=True))


def test_one_process_has_no_noise_scale_so_goodput_warns_once_and_does_not_grow() -> None:
    model = DigitsMLP(batch_size=16, n=64)
    cb = IvyLoadBalancer(probes=[ScriptedProbe([IDLE])], interval=0.05)
    with pytest.warns(UserWarning, match="no gradient noise scale estimate: one process") as warned:
        _fit(model, cb, max_epochs=2)
    assert sum("noise scale" in str(w.message) for w in warned) == 1
    assert [h["next_batch_size"] for h in cb.history] == [16, 16]
    assert all("goodput unknown (one process" in h["reason"] for h in cb.history)


def test_iterable_dataset_is_monitored_only() -> None:
    model = DigitsMLP(batch_size=16, n=64)
    model.train_dataloader = lambda: DataLoader(_Stream(), batch_size=16)  # type: ignore[method-assign]
    cb = IvyLoadBalancer(probes=[ScriptedProbe([IDLE])], interval=0.05)
    with pytest.warns(UserWarning, match="IterableDataset.*monitoring only"):
        _fit(model, cb, max_epochs=2)
    assert cb.monitoring_only is not None and cb.batch_size is None
    assert Counter(model.batch_sizes) == {(0, 16): 4, (1, 16): 4}
    assert "ivy/cpu_util" in cb.metrics


def test_bad_arguments_name_the_parameter() -> None:
    for kwargs, match in (
        ({"interval": 0}, "interval"),
        ({"lr_scaling": "cubic"}, "lr_scaling"),
        ({"comm_hook": "ignore"}, "comm_hook"),
        ({"min_batch_size": 8, "max_batch_size": 4}, "max_batch_size"),
        ({"oom_max_parts": 0}, "oom_max_parts"),
        ({"share_window": 1}, "share_window"),
        ({"balance_shares": "no"}, "balance_shares must be True or False"),
        ({"shrink_factor": 1.5}, r"shrink_factor must be a number in \(0, 1\)"),
    ):
        with pytest.raises(ValueError, match=match):
            IvyLoadBalancer(**kwargs)  # type: ignore[arg-type]


def test_unknown_optimizer_with_auto_rule_fails_at_fit_start() -> None:
    model = DigitsMLP(batch_size=32, n=64)
    model.configure_optimizers = lambda: torch.optim.Adagrad(model.parameters())  # type: ignore[method-assign]
    with pytest.raises(ValueError, match="Adagrad"):
        _fit(model, IvyLoadBalancer(probes=[ScriptedProbe([IDLE])]), max_epochs=1)


def test_a_users_comm_hook_is_refused_on_request() -> None:
    from lightning.pytorch.strategies import DDPStrategy
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    strategy = DDPStrategy(ddp_comm_hook=default_hooks.allreduce_hook)
    trainer = pl.Trainer(strategy=strategy, **trainer_kwargs(devices=2))
    cb = IvyLoadBalancer(probes=[ScriptedProbe([IDLE])], comm_hook="refuse")
    with pytest.raises(ValueError, match="torch allows one hook per model"):
        cb.setup(trainer, DigitsMLP(), "fit")
    composed = IvyLoadBalancer(probes=[ScriptedProbe([IDLE])])
    composed.setup(trainer, DigitsMLP(), "fit")
    try:
        assert strategy._ddp_comm_hook is None  # Lightning will not register it: ours calls it
        assert composed._user_hook is not None and composed._user_hook[0] is default_hooks.allreduce_hook
    finally:
        composed.teardown(trainer, DigitsMLP(), "fit")
    assert strategy._ddp_comm_hook is default_hooks.allreduce_hook  # given back for a later fit


def test_ivy_ps_async_is_monitored_only() -> None:
    from ivyplug.integrations.lightning import IvyPSStrategy

    trainer = pl.Trainer(strategy=IvyPSStrategy(mode="async"), **trainer_kwargs(devices=2))
    cb = IvyLoadBalancer(probes=[ScriptedProbe([IDLE])])
    with pytest.warns(UserWarning, match="hands out batches itself.*monitoring only"):
        cb.setup(trainer, DigitsMLP(), "fit")
    try:
        assert cb.monitoring_only is not None
        # and no noise scale: each push is applied alone, so no step has a combined gradient
        assert cb.goodput_unavailable is not None and "push on arrival, alone" in cb.goodput_unavailable
        assert not cb._ps_noise
    finally:
        cb.teardown(trainer, DigitsMLP(), "fit")


@pytest.mark.parametrize("reported", [True, False])
def test_ivy_ps_sync_noise_step_pairs_own_norm_at_b_with_the_servers_norm_at_big_b(reported: bool) -> None:
    """Rank 1 of 2 with shares 32/16 and accumulate_grad_batches=2: the optimizer step covers b = 2 x 16 of its
    samples and B = 2 x 48 in all; its own |g|² is taken from .grad before the push, the combined one from the PS
    reply. The epoch's estimate equals the closed form (noise_components); no reported norm: no estimate."""
    from types import SimpleNamespace

    from ivyplug.integrations.lightning import IvyPSStrategy

    from ivyplug.load.goodput import noise_components

    trainer = pl.Trainer(strategy=IvyPSStrategy(mode="sync"), **trainer_kwargs(devices=2))
    cb = IvyLoadBalancer(probes=[ScriptedProbe([IDLE])], interval=0.05)
    module = DigitsMLP()
    cb.setup(trainer, module, "fit")
    try:
        assert cb.goodput_unavailable is None and cb._ps_noise  # sync: the servers report the combined norm
        cb._rank = 1
        cb._share_sampler = ShareBatchSampler(
            num_samples=192, batch_size=48, shares=[32, 16], rank=1, epoch=0, seed=0, shuffle=True
        )
        cb._reset_epoch()
        torch.manual_seed(0)
        grads = [torch.randn_like(p) for p in module.parameters()]
        for p, g in zip(module.parameters(), grads, strict=True):
            p.grad = g.clone()
        own_sq = float(sum(g.double().square().sum() for g in grads))
        big_sq = 0.25 * own_sq
        client = SimpleNamespace(combined_grad_sq_norm=big_sq if reported else None)
        fake = SimpleNamespace(strategy=SimpleNamespace(client=client))
        for batch_idx in (0, 1):  # two micro-batches, then the optimizer step (Lightning's order)
            cb.on_train_batch_start(trainer, module, None, batch_idx)
            if batch_idx == 1:
                cb.on_before_optimizer_step(trainer, module, torch.optim.SGD(module.parameters(), lr=0.1))
            cb.on_train_batch_end(fake, module, None, None, batch_idx)  # type: ignore[arg-type]
        record = cb._noise_record()
        if not reported:
            assert record["noise_steps"] == 0
            return
        assert record["noise_steps"] == 1
        grad_sq, trace = noise_components(own_sq, 32, big_sq, 96)
        assert record["noise_grad_sq"] == pytest.approx(grad_sq, rel=1e-5)
        assert record["noise_trace"] == pytest.approx(trace, rel=1e-5)
        # the control: b and B of one micro-batch (16, 48) would give another estimate
        wrong = noise_components(own_sq, 16, big_sq, 48)
        assert record["noise_trace"] != pytest.approx(wrong[1], rel=1e-3)
    finally:
        cb.teardown(trainer, module, "fit")


def test_resume_from_a_checkpoint_continues_with_the_saved_batch_size(tmp_path: Path) -> None:
    model = DigitsMLP(batch_size=16, n=128, optimizer="sgd")
    probe = ScriptedProbe([IDLE, BAND], clock=lambda: model.current_epoch)
    trainer = _fit(model, IvyLoadBalancer(probes=[probe], interval=0.05, goodput=False), max_epochs=1)
    path = tmp_path / "epoch1.ckpt"
    trainer.save_checkpoint(path)
    lr_saved = trainer.optimizers[0].param_groups[0]["lr"]
    assert lr_saved == pytest.approx(0.02)  # B 16 -> 32, linear rule

    resumed = DigitsMLP(batch_size=16, n=128, optimizer="sgd")
    cb = IvyLoadBalancer(probes=[ScriptedProbe([BAND])], interval=0.05)
    trainer = pl.Trainer(callbacks=[cb], **trainer_kwargs(max_epochs=2))
    trainer.fit(resumed, ckpt_path=path)
    assert Counter(resumed.batch_sizes) == {(1, 32): 4}  # the loader of epoch 1 already uses the saved B
    assert cb.history[0]["epoch"] == 0 and cb.history[-1]["batch_size"] == 32
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(lr_saved)
