"""``IvyLoadBalancer``: a Lightning callback that adapts the global batch size and per-rank shares to load.

It measures and applies; the decisions are :class:`~ivyplug.load.balancer.BalancerCore`'s, the Keras twin's too.
Each epoch's loader is rebuilt with a :class:`ShareBatchSampler` (``process_dataloader`` is wrapped); at its end
every rank's record is gathered, rank 0 decides B and the shares and broadcasts, the LR follows B; an OOM splits
the step (:mod:`.oom_recovery`). docs/design.md has the flow of an epoch.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from ivyplug.integrations.lightning.balancer_noise import fit_noise_source, noise_source, warn_no_estimate
from ivyplug.integrations.lightning.epoch_meter import EpochMeter, samples_in
from ivyplug.integrations.lightning.json_collectives import all_gather_json, broadcast_json
from ivyplug.integrations.lightning.lightning_internals import give_back_ddp_comm_hook, take_ddp_comm_hook
from ivyplug.integrations.lightning.lr_rescale import rescale_lr
from ivyplug.integrations.lightning.oom_recovery import OOMRecovery
from ivyplug.integrations.lightning.share_sampler import ShareBatchSampler, share_loader
from ivyplug.integrations.lightning.weighted_comm_hook import ShareHookState, register_share_hook
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.nn.parallel import DistributedDataParallel

from ivyplug.load.balancer import BalancerCore, CoreState
from ivyplug.load.balancer_config import BalancerConfig, ProbeSpecs, ShareOptions
from ivyplug.load.balancer_metrics import decision_metrics, load_metrics, rank_metrics, reading_metrics
from ivyplug.load.batch_policy import BatchSizePolicy
from ivyplug.load.lr_scaling import resolve_rule
from ivyplug.load.observation import observation_from_summary
from ivyplug.load.sampler import Sampler, Stat
from ivyplug.load.torch_probe import TorchAllocatorProbe

_warned: set[str] = set()


def _warn_renamed(old: str, new: str) -> None:
    """One DeprecationWarning per process and old name: configs repeat the name, the message need not repeat."""
    if old in _warned:
        return
    _warned.add(old)
    warnings.warn(
        f"IvyLoadBalancer({old}=...) is deprecated and will be removed in the next release; use {new}=... "
        "(the name the Lightning and Keras twins share)",
        DeprecationWarning,
        stacklevel=3,
    )


class IvyLoadBalancer(CoreState, Callback):
    """Load-aware batch size, per-rank shares, LR rescaling and OOM recovery for Lightning.

    The options both twins share (this one and ``ivyplug.integrations.keras.IvyLoadBalancer``) have the same
    names, defaults and meaning, so a config moves between them (``log_every_n_steps=None`` follows each framework's own
    logging: the Trainer's period, Keras's epoch logs); ``balance_shares`` to ``seed`` are Lightning's own.

    Args:
        probes: probe names from the registry (``"nvml"``, ``"psutil"``...), ``{"name": ...,
            **kwargs}`` dicts or probe objects (default: :data:`~ivyplug.load.probes.DEFAULT_PROBE_NAMES`); a
            zero-argument callable returning them is accepted too, for spawn.
        interval: seconds between probe reads on the background thread.
        adapt_batch_size: let the policy change the global batch size B.
        min_batch_size, max_batch_size: bounds for B (default: one sample per rank, and 8 × the initial B).
        grow_factor, shrink_factor, grow_below_utilization, memory_low, memory_high, cooldown,
            min_relative_change: the :class:`~ivyplug.load.BatchSizePolicy` rules.
        goodput: grow B only when the predicted goodput (throughput × statistical efficiency from the gradient
            noise scale) rises by ``goodput_threshold`` (a fraction: 0.05 is 5%); ``False``: utilisation and
            memory alone decide.
        min_efficiency: a growth must also keep the statistical efficiency relative to the batch the fit started
            with at least this high (0.9: at most 1/0.9 times the samples for the same progress), so that a
            schedule tuned in epochs for that batch does not end less accurate; 0 disables this floor.
        noise_smoothing: weight of the past in the per-epoch moving averages of |G|² and tr(Σ), in [0, 1).
        policy: a full :class:`~ivyplug.load.BatchSizePolicy` (overrides the bounds and the rules above).
        lr_scaling: ``"auto"``, ``"sqrt"``, ``"linear"`` or ``"none"``.
        log_every_n_steps: metric logging period (default: the trainer's ``log_every_n_steps``).
        oom_recovery: split a batch that runs out of memory into micro-batches.
        oom_max_parts: the most micro-batches a batch that ran out of memory is split into before
            :class:`~ivyplug.load.OutOfMemoryRecoveryError` (1: no splitting).
        balance_shares: split B across ranks by measured throughput (multi-process only).
        share_window: how many of a rank's most recent distinct shares its step-time fit uses (>= 2).
        comm_hook: ``"compose"`` a user's ``ddp_comm_hook`` with the share weighting, or ``"refuse"`` it.
        loss_reduction: ``"mean"`` (micro-batch losses are weighted by their size) or ``"sum"``.
        seed: permutation seed (default: the loader's ``DistributedSampler`` seed or ``PL_GLOBAL_SEED``).
        max_oom_splits: deprecated name of ``oom_max_parts`` (kept for one release, with a DeprecationWarning).
    """

    def __init__(
        self,
        *,
        probes: ProbeSpecs = None,
        interval: float = 1.0,
        adapt_batch_size: bool = True,
        min_batch_size: int | None = None,
        max_batch_size: int | None = None,
        grow_factor: float = 2.0,
        shrink_factor: float = 0.5,
        grow_below_utilization: float = 70.0,
        memory_low: float = 0.6,
        memory_high: float = 0.9,
        cooldown: int = 1,
        min_relative_change: float = 0.05,
        goodput: bool = True,
        goodput_threshold: float = 0.05,
        min_efficiency: float = 0.9,
        noise_smoothing: float = 0.5,
        policy: BatchSizePolicy | None = None,
        lr_scaling: str = "auto",
        log_every_n_steps: int | None = None,
        oom_recovery: bool = True,
        oom_max_parts: int = 8,
        balance_shares: bool = True,
        share_window: int = 4,
        comm_hook: str = "compose",
        loss_reduction: str = "mean",
        seed: int | None = None,
        max_oom_splits: int | None = None,
    ) -> None:
        super().__init__()
        if max_oom_splits is not None:
            _warn_renamed("max_oom_splits", "oom_max_parts")
            if isinstance(max_oom_splits, bool) or not isinstance(max_oom_splits, int) or max_oom_splits < 1:
                raise ValueError(f"max_oom_splits (now oom_max_parts) must be an int >= 1, got {max_oom_splits!r}")
            oom_max_parts = max_oom_splits
        given = locals()
        self.config = BalancerConfig(**{k: given[k] for k in BalancerConfig.option_names()})  # names a bad one
        self.share_options = ShareOptions(**{k: given[k] for k in ShareOptions.option_names()})
        self.core = BalancerCore(self.config)
        for options in (self.config, self.share_options):  # every option readable as an attribute, as before
            for name in options.option_names():
                if name != "policy":
                    setattr(self, name, getattr(options, name))
        self.monitoring_only: str | None = None
        self.metrics: dict[str, float] = {}  # the latest value of every ivy/ metric this callback logged
        # wall seconds of this callback's work on the training thread; epoch_sync: gather and broadcast (with the wait)
        self.hook_breakdown = dict.fromkeys(("batch", "epoch_start", "epoch_end", "epoch_sync", "loader"), 0.0)
        self._sync_seconds, self._log_every, self.steps = 0.0, 50, 0
        self._sampler: Sampler | None = None
        self._share_sampler: ShareBatchSampler | None = None
        self._hook_state: ShareHookState | None = None
        self._ps_noise = False  # ivy_ps sync with the goodput rule: the noise scale from the PS's combined norm
        self._oom: OOMRecovery | None = None
        self._user_hook: tuple[Any, Any] | None = None
        self._taken_hook: tuple[Any, Any] | None = None
        self._orig_process: Callable[[object], object] | None = None
        self._rules: list[str] = []
        self._world, self._rank, self._accumulate = 1, 0, 1
        self._device_index: int | None = None
        self._trainer_ref: pl.Trainer | None = None
        self._reset_epoch()

    @property
    def max_oom_splits(self) -> int:
        """Deprecated name of :attr:`oom_max_parts`."""
        _warn_renamed("max_oom_splits", "oom_max_parts")
        return self.config.oom_max_parts

    @property
    def hook_seconds(self) -> float:
        """All wall time this callback spent on the training thread (the sum of ``hook_breakdown``)."""
        return sum(self.hook_breakdown.values())

    # ------------------------------------------------------------------ setup / teardown
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._trainer_ref = trainer
        self._log_every = self.config.log_every_n_steps or getattr(trainer, "log_every_n_steps", 50) or 50
        self._world = trainer.world_size
        self._rank = trainer.global_rank
        self._sampler = Sampler(self.config.build_probes(), interval=self.config.interval)
        trainer_any: Any = trainer  # these Trainer attributes are set in __init__ by connectors (untyped)
        if trainer_any.reload_dataloaders_every_n_epochs != 1:
            rank_zero_info(
                "IvyLoadBalancer: reloading training loaders every epoch (reload_dataloaders_every_n_epochs=1)"
            )
            trainer_any.reload_dataloaders_every_n_epochs = 1
        strategy = trainer.strategy
        self.goodput_unavailable, self._ps_noise = noise_source(strategy, self._world)
        if getattr(strategy, "is_async", False):
            self._monitor_only("the ivy_ps async/ssp strategy hands out batches itself")
        if self._orig_process is None:
            self._orig_process = strategy.process_dataloader
            strategy.process_dataloader = self._process_dataloader  # type: ignore[method-assign]
        if isinstance(strategy, DDPStrategy):
            taken = take_ddp_comm_hook(strategy, self.share_options.comm_hook)
            if taken is not None:
                self._user_hook, self._taken_hook = taken

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if self._sampler is not None:
            self._sampler.close()
            self._sampler = None
        if self._orig_process is not None:
            trainer.strategy.__dict__.pop("process_dataloader", None)
            self._orig_process = None
        self._trainer_ref = None
        if self._taken_hook is not None:  # give the user's hook back to the strategy (a later fit may reuse it)
            give_back_ddp_comm_hook(trainer.strategy, self._taken_hook)
            self._taken_hook = self._user_hook = None
        if self._oom is not None:
            self._oom.remove()
            self._oom = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        root = trainer.strategy.root_device
        self._device_index = root.index if root.type == "cuda" else None
        adapt, goodput = self.config.adapt_batch_size, self.config.goodput_on
        self._rules = [resolve_rule(self.config.lr_scaling, opt) for opt in trainer.optimizers] if adapt else []
        if adapt and self.monitoring_only is None:
            for config in trainer.lr_scheduler_configs:
                total = getattr(config.scheduler, "total_steps", None)
                if isinstance(total, int):  # OneCycleLR: a shrink of B adds steps to the epochs that follow
                    rank_zero_warn(
                        f"IvyLoadBalancer: {type(config.scheduler).__name__}(total_steps={total}) counts steps, and a "
                        "smaller batch size makes more steps per epoch: sized for the loader's batch size, it can "
                        "run past its end (torch then raises); leave it room, or set min_batch_size to that size"
                    )
        current, initial = self.core.batch_size, self.core.initial_batch_size
        if adapt and current is not None and initial is not None and current != initial:
            # a later fit starts at the B the last one reached, with fresh optimizers: give them that B's LR, as the
            # Keras twin's next fit has it (a resumed fit's optimizer state, restored after this, brings it too)
            self.lr_factor = 1.0  # these optimizers are at the rate the first fit started from
            self._rescale_lr(trainer, initial, current)
        model = trainer.strategy.model
        ddp = isinstance(model, DistributedDataParallel) and (self._world > 1 or self._user_hook is not None)
        if ddp:  # two squared norms per bucket and step: paid only where the goodput rule uses them
            measure = self._world > 1 and adapt and goodput
            self._hook_state = register_share_hook(model, self._world, self._user_hook, measure)
        elif self._user_hook is not None:
            raise RuntimeError("a ddp_comm_hook was given but the model is not wrapped in DistributedDataParallel")
        self.goodput_unavailable, self._ps_noise = fit_noise_source(
            self.goodput_unavailable, self._ps_noise, ddp, trainer.optimizers
        )
        self._ps_noise = self._ps_noise and adapt and goodput  # |own gradient|² per step only where it is used
        if self.goodput_unavailable is not None and adapt and goodput:
            warn_no_estimate(self.goodput_unavailable, self.monitoring_only is not None)
        self._accumulate = max(int(getattr(trainer, "accumulate_grad_batches", 1) or 1), 1)
        if self.config.oom_recovery and pl_module.automatic_optimization and self._accumulate > 1:
            rank_zero_warn(
                f"IvyLoadBalancer: oom_recovery splits a batch that ran out of memory only with "
                f"accumulate_grad_batches=1; with {self._accumulate} an out-of-memory error ends the fit "
                "(oom_recovery=False turns recovery off)"
            )
        if self.config.oom_recovery and pl_module.automatic_optimization:
            self._oom = OOMRecovery(
                trainer, pl_module, self.config.oom_max_parts, self.share_options.loss_reduction, self._count_oom
            )

    # ------------------------------------------------------------------ the loader
    def _monitor_only(self, reason: str) -> None:
        if self.monitoring_only is None:
            rank_zero_warn(f"IvyLoadBalancer: {reason}; batch size and shares stay fixed (monitoring only)")
        self.monitoring_only = reason

    def _process_dataloader(self, dataloader: object) -> object:
        assert self._orig_process is not None
        dataloader = self._orig_process(dataloader)
        start, trainer = time.perf_counter(), self._trainer_ref
        if trainer is not None and trainer.training and self.monitoring_only is None:
            epoch, seed = trainer.current_epoch, self.share_options.seed
            dataloader, sampler = share_loader(dataloader, self.core, self._world, self._rank, epoch, seed)
            if isinstance(sampler, str):
                self._monitor_only(sampler)
            else:
                self._share_sampler = sampler
        self.hook_breakdown["loader"] += time.perf_counter() - start
        return dataloader

    # ------------------------------------------------------------------ per step
    def _reset_epoch(self) -> None:
        self._meter = EpochMeter()

    def _count_oom(self) -> None:
        self.oom_count += 1
        self._meter.ooms += 1
        for probe in self._sampler.probes if self._sampler is not None else ():
            if isinstance(probe, TorchAllocatorProbe):
                probe.record_oom()  # its oom_count reading then shows up in ivy/oom_count of the probe too

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        start = time.perf_counter()
        self._reset_epoch()
        if self._sampler is not None:
            self._sampler.reset_window()
        if self._oom is not None:
            self._oom.new_epoch()
        self.hook_breakdown["epoch_start"] += time.perf_counter() - start

    # The per-batch hooks only read the clock and index precomputed lists (no tensor op, no device query, no
    # logging but every log_every_n_steps); their time is summed into hook_breakdown["batch"].
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        start = time.perf_counter()
        sampler = self._share_sampler
        if sampler is not None and batch_idx < sampler.steps:
            local, total = sampler.local_sizes[batch_idx], sampler.step_sizes[batch_idx]
            weight = sampler.weights[batch_idx]
        else:
            local = samples_in(batch)
            total, weight = local * self._world, 1.0 / self._world
        if self._hook_state is not None:
            self._hook_state.new_step(weight)
        self._meter.batch_start(local, total)
        self.hook_breakdown["batch"] += time.perf_counter() - start

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        start = time.perf_counter()
        self._meter.backward_done()
        self.hook_breakdown["batch"] += time.perf_counter() - start

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        """ivy_ps sync: |this rank's gradient|² at its b samples of the step, before clipping and the push."""
        start = time.perf_counter()
        self._meter.optimizer_step(pl_module, self._ps_noise)
        self.hook_breakdown["batch"] += time.perf_counter() - start

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        ps_norm = None
        if self._meter.ps_pending is not None:
            ps_norm = getattr(getattr(trainer.strategy, "client", None), "combined_grad_sq_norm", None)
        self._meter.batch_end(now, self._hook_state, self._accumulate, ps_norm)
        self.steps += 1
        if self.steps % self._log_every == 0:
            self._log_step()
        self.hook_breakdown["batch"] += time.perf_counter() - now

    def _noise_record(self) -> dict[str, float]:
        """This rank's epoch means of the per-step |G|² and tr(Σ) estimates: the one device sync per epoch."""
        return self._meter.noise.record()

    def _log_step(self) -> None:
        metrics: dict[str, float] = {}
        if self._sampler is not None:
            latest = self._sampler.latest()
            metrics.update(reading_metrics(latest, per_core=False))
            # an epoch shorter than the sampling interval has an empty window yet: use the latest reading
            stats = self._sampler.summary() or {k: Stat(v, v, v, v, 1) for k, v in latest.items()}
            metrics.update(load_metrics(observation_from_summary(stats, self._device_index, self._meter.ooms)))
        metrics.update(decision_metrics(self.batch_size, self.lr_factor))
        if self.shares is not None:
            metrics["ivy/share"] = float(self.shares[self._rank])
        metrics["ivy/oom_count"] = float(self.oom_count)
        self._emit(self._trainer_ref, metrics)

    # ------------------------------------------------------------------ epoch boundary
    def _policy(self) -> BatchSizePolicy:
        return self.core.build_policy(self._world)

    def _decide(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """Rank 0: the next B and shares from every rank's record (the core), to broadcast."""
        adapt, held = self.config.adapt_batch_size, self.monitoring_only
        if adapt and held is None:
            self._policy()
        return self.core.decide_epoch(records, adapt=adapt, share_options=self.share_options, held=held)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        start = time.perf_counter()
        self._sync_seconds = 0.0
        try:
            self._epoch_end(trainer)
        finally:
            self.hook_breakdown["epoch_sync"] += self._sync_seconds
            self.hook_breakdown["epoch_end"] += time.perf_counter() - start - self._sync_seconds

    def _epoch_end(self, trainer: pl.Trainer) -> None:
        if self._sampler is None or self.batch_size is None or self.shares is None:
            return
        self._sampler.sample_now()
        obs = observation_from_summary(self._sampler.summary(), self._device_index, self._meter.ooms)
        record = self._meter.record(self._rank, self.shares[self._rank], obs)
        sync_start = time.perf_counter()
        distributed = self._world > 1 and torch.distributed.is_available() and torch.distributed.is_initialized()
        records = all_gather_json(record, self._world) if distributed else [record]  # JSON: nothing is unpickled
        self._sync_seconds += time.perf_counter() - sync_start
        decision = self._decide(records) if self._rank == 0 else None
        if self._world > 1:
            sync_start = time.perf_counter()
            decision = broadcast_json(decision, src=0)
            self._sync_seconds += time.perf_counter() - sync_start
        assert decision is not None
        old = self.core.apply_epoch(decision)
        if self.batch_size != old:
            self._rescale_lr(trainer, old, self.batch_size)
        self.core.note_epoch(trainer.current_epoch, old, decision, records)
        metrics = {**decision_metrics(self.batch_size, self.lr_factor, self.noise.value), **rank_metrics(records)}
        self._emit(trainer, metrics)

    def _emit(self, trainer: pl.Trainer | None, metrics: dict[str, float]) -> None:
        """Hand metrics straight to rank 0's loggers: ``LightningModule.log`` costs milliseconds per call."""
        self.metrics.update(metrics)
        if trainer is None or not trainer.is_global_zero:
            return
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    def _rescale_lr(self, trainer: pl.Trainer, old: int, new: int) -> None:
        if not self._rules:
            self._rules = [resolve_rule(self.config.lr_scaling, opt) for opt in trainer.optimizers]
        self.lr_factor *= rescale_lr(trainer.optimizers, trainer.lr_scheduler_configs, self._rules, old, new)

    def state_dict(self) -> dict[str, Any]:
        return self.core.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.core.load_state_dict(state_dict)
