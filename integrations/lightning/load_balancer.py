"""``IvyLoadBalancer``: a Lightning callback that adapts the global batch size and per-rank shares to load.

How it works (all decisions at epoch boundaries, agreed by every rank):

- Probes are read on a background thread (``ivyplug.load.Sampler``); metrics ``ivy/...`` go to the
  trainer's loggers every ``log_every_n_steps`` steps, per-rank values gathered at epoch end as
  ``ivy/rank{r}/...`` (rank 0 writes, as Lightning's loggers do); ``callback.metrics`` holds the latest.
- A callback has no dataloader hook, and a ``DataLoader`` refuses a new batch sampler, so ``setup``
  wraps ``trainer.strategy.process_dataloader``: the training loader is rebuilt with a
  :class:`ShareBatchSampler` (Lightning's ``DistributedSampler`` permutation, split by shares), and
  ``reload_dataloaders_every_n_epochs`` is set to 1 so each epoch gets the current plan. Iterable data
  sets, custom samplers and DataLoader subclasses get a warning and monitoring only.
- At each epoch end every rank reports its own compute time (batch start to its last gradient
  bucket, i.e. without waiting for others) and load; rank 0 runs the batch-size policy, fits each
  rank's step time t_i(b) = a_i + c_i·b from its (share, mean step time) of recent epochs, picks the
  integer shares that minimise the slowest rank's predicted step time, takes a damped step towards
  them (:mod:`ivyplug.load.share_model`) and broadcasts the decision. The learning rate is rescaled on every change
  of B (``lr_scaling="auto"``: √k for Adam-family/LAMB, k for SGD).
- Growth has to pay (``goodput=True``, the default): the policy grows B only when the predicted goodput,
  throughput × statistical efficiency (:mod:`ivyplug.load.goodput`), rises by ``goodput_threshold``. Under
  ``ddp`` the share-weighting hook sees both gradients the noise scale needs: this rank's own (before the
  all-reduce) and the combined one (after it); each rank sends the epoch's mean estimates of |G|² and tr(Σ)
  (two scalars) with its epoch record, rank 0 smooths them (EMA) into B_noise. Under ``ivy_ps`` sync the
  servers form the combined gradient: this rank's own norm is taken from ``.grad`` in
  ``on_before_optimizer_step`` (after the last accumulated micro-batch, before the push) and the combined one
  is the squared norm the servers report with the step's reply (``PSClient.combined_grad_sq_norm``), with b =
  this rank's samples of the optimizer step and B = the step's global samples. The throughput side is the
  measured wall seconds per step, split into a fixed part and the compute part (taken to scale with B).
  Where the estimate is unavailable (one process; ``ivy_ps`` async/ssp, where each push is applied alone, so
  no step has a combined gradient; a local-update optimizer, which pushes parameter deltas) B does not grow,
  with one warning naming why.
- Under ``ddp`` a communication hook registered in ``on_fit_start`` multiplies each rank's gradient
  by b_i/B and all-reduces with SUM (a user's own ``ddp_comm_hook`` is composed, or refused with
  ``comm_hook="refuse"``). Under ``ivy_ps`` sync the strategy already weights by sample counts.
- An out-of-memory error in a training step splits the batch into micro-batches and accumulates
  (:mod:`.oom_recovery`); the policy then lowers B at the next epoch boundary.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from ivyplug.integrations.lightning.json_collectives import all_gather_json, broadcast_json
from ivyplug.integrations.lightning.oom_recovery import OOMRecovery
from ivyplug.integrations.lightning.share_sampler import ShareBatchSampler, loader_spec, rebuild_loader, why_unsupported
from ivyplug.integrations.lightning.weighted_comm_hook import ShareHookState, share_weighted_hook
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_warn
from torch.nn.parallel import DistributedDataParallel

from ivyplug.load.batch_policy import BatchSizePolicy, PolicyState, default_batch_bounds
from ivyplug.load.goodput import GoodputEstimate, NoiseScale, StepCost
from ivyplug.load.lr_scaling import check_rule, lr_factor, resolve_rule
from ivyplug.load.observation import LoadObservation, combine_observations, observation_from_summary
from ivyplug.load.probe import Probe
from ivyplug.load.probes import DEFAULT_PROBE_NAMES, default_probes, make_probe
from ivyplug.load.sampler import Sampler, Stat
from ivyplug.load.share_model import next_shares
from ivyplug.load.shares import worker_shares
from ivyplug.load.torch_probe import TorchAllocatorProbe

log = logging.getLogger(__name__)


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


def _is_per_core(key: str) -> bool:
    return key.startswith("cpu") and key.endswith("_util") and key[3:-5].isdigit()


class IvyLoadBalancer(Callback):
    """Load-aware batch size, per-rank shares, LR rescaling and OOM recovery for Lightning.

    The options both twins share (this one and ``ivyplug.integrations.keras.IvyLoadBalancer``) have the same
    names, defaults and meaning, so a config moves between them; ``balance_shares`` to ``seed`` are Lightning's own.

    Args:
        probes: probe names from the registry (``"nvml"``, ``"psutil"``, ``"scripted"``...), ``{"name": ...,
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
        probes: Sequence[str | Mapping[str, Any] | Probe] | Callable[[], Sequence[Probe]] | None = None,
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
            oom_max_parts = max_oom_splits
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not interval > 0:
            raise ValueError(f"interval must be a positive number of seconds, got {interval!r}")
        for name, value in (("min_batch_size", min_batch_size), ("max_batch_size", max_batch_size)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be None or an int >= 1, got {value!r}")
        if min_batch_size is not None and max_batch_size is not None and max_batch_size < min_batch_size:
            raise ValueError(f"max_batch_size ({max_batch_size}) must be >= min_batch_size ({min_batch_size})")
        if policy is not None and not isinstance(policy, BatchSizePolicy):
            raise ValueError(f"policy must be an ivyplug.load.BatchSizePolicy, got {policy!r}")
        self._policy_args: dict[str, Any] = {
            "grow_factor": grow_factor,
            "shrink_factor": shrink_factor,
            "grow_below_utilization": grow_below_utilization,
            "memory_low": memory_low,
            "memory_high": memory_high,
            "cooldown": cooldown,
            "min_relative_change": min_relative_change,
            "goodput": goodput,
            "goodput_threshold": goodput_threshold,
            "min_efficiency": min_efficiency,
        }
        BatchSizePolicy(1, 1, **self._policy_args)  # validates every rule now, not at the first epoch end
        if not callable(probes) and probes is not None:
            if isinstance(probes, (str, Mapping)):
                raise ValueError(f"probes must be a list of names, dicts or Probe objects, got {probes!r}")
            for spec in probes:
                if not isinstance(spec, (str, Mapping, Probe)):
                    raise ValueError(f"probes must hold names, dicts or Probe objects, got {spec!r}")
        if isinstance(share_window, bool) or not isinstance(share_window, int) or share_window < 2:
            raise ValueError(f"share_window must be an int >= 2 (a line needs two shares), got {share_window!r}")
        check_rule(lr_scaling)
        if comm_hook not in ("compose", "refuse"):
            raise ValueError(f"comm_hook must be 'compose' or 'refuse', got {comm_hook!r}")
        if isinstance(oom_max_parts, bool) or not isinstance(oom_max_parts, int) or oom_max_parts < 1:
            raise ValueError(f"oom_max_parts must be an int >= 1, got {oom_max_parts!r}")
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        if log_every_n_steps is not None and (not isinstance(log_every_n_steps, int) or log_every_n_steps < 1):
            raise ValueError(f"log_every_n_steps must be None or an int >= 1, got {log_every_n_steps!r}")
        self.probes = probes
        self.interval = float(interval)
        self.adapt_batch_size = adapt_batch_size
        self.min_batch_size = min_batch_size
        self.max_batch_size = max_batch_size
        self.policy = policy
        self.balance_shares = balance_shares
        self.share_window = share_window
        self.lr_scaling = lr_scaling
        self.comm_hook = comm_hook
        self.oom_recovery = oom_recovery
        self.oom_max_parts = oom_max_parts
        self.loss_reduction = loss_reduction
        self.log_every_n_steps = log_every_n_steps
        self.seed = seed

        # decisions (checkpointed)
        self.batch_size: int | None = None
        self.shares: list[int] | None = None
        self.policy_state = PolicyState()
        self.noise = NoiseScale(smoothing=noise_smoothing)  # validates noise_smoothing
        self.step_costs: list[StepCost] = []  # (B, wall seconds per step, compute seconds per step), recent epochs
        self.goodput_unavailable: str | None = None  # why this fit has no noise-scale estimate
        self.initial_batch_size: int | None = None  # B when the first fit started (min_efficiency's reference)
        self.lr_factor = 1.0
        self.oom_count = 0
        # per rank: (median samples per step, median compute seconds per step) of every balanced epoch, oldest first
        self.step_observations: list[list[tuple[float, float]]] = []
        self.previous_shares: list[int] | None = None  # the shares before the current ones (damping)
        self.share_gain = 1.0  # fraction of the way to the target share taken per epoch (damping)
        self.history: list[dict[str, Any]] = []
        self.monitoring_only: str | None = None
        self.metrics: dict[str, float] = {}  # the latest value of every ivy/ metric this callback logged

        # runtime
        # wall time spent in this callback's hooks and loader work on the training thread (overhead measurement):
        # per batch, epoch start, epoch end (local work), epoch sync (the gather of the records and the broadcast of
        # the decision, including the wait for the last rank to finish its epoch), loader rebuild
        self.hook_breakdown: dict[str, float] = {
            "batch": 0.0,
            "epoch_start": 0.0,
            "epoch_end": 0.0,
            "epoch_sync": 0.0,
            "loader": 0.0,
        }
        self._sync_seconds = 0.0
        self._log_every = 50
        self.steps = 0
        self._sampler: Sampler | None = None
        self._share_sampler: ShareBatchSampler | None = None
        self._hook_state: ShareHookState | None = None
        self._ps_noise = False  # ivy_ps sync with the goodput rule: the noise scale from the PS's combined norm
        self._oom: OOMRecovery | None = None
        self._user_hook: tuple[Any, Any] | None = None
        self._taken_hook: tuple[Any, Any] | None = None
        self._orig_process: Callable[[object], object] | None = None
        self._rules: list[str] = []
        self._world = 1
        self._rank = 0
        self._device_index: int | None = None
        self._trainer_ref: pl.Trainer | None = None
        self._reset_epoch()

    @property
    def max_oom_splits(self) -> int:
        """Deprecated name of :attr:`oom_max_parts`."""
        _warn_renamed("max_oom_splits", "oom_max_parts")
        return self.oom_max_parts

    @property
    def hook_seconds(self) -> float:
        """All wall time this callback spent on the training thread (the sum of ``hook_breakdown``)."""
        return sum(self.hook_breakdown.values())

    # ------------------------------------------------------------------ setup / teardown
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._trainer_ref = trainer
        self._log_every = self.log_every_n_steps or getattr(trainer, "log_every_n_steps", 50) or 50
        self._world = trainer.world_size
        self._rank = trainer.global_rank
        probes = self.probes() if callable(self.probes) else self.probes
        # the defaults skip a probe whose package is missing; a probe asked for by name must exist
        built = default_probes(DEFAULT_PROBE_NAMES) if probes is None else [make_probe(p) for p in probes]
        self._sampler = Sampler(built, interval=self.interval)
        trainer_any: Any = trainer  # these Trainer attributes are set in __init__ by connectors (untyped)
        if trainer_any.reload_dataloaders_every_n_epochs != 1:
            log.info("IvyLoadBalancer: reloading training loaders every epoch (reload_dataloaders_every_n_epochs=1)")
            trainer_any.reload_dataloaders_every_n_epochs = 1
        strategy = trainer.strategy
        self.goodput_unavailable = None
        self._ps_noise = False
        ps_config = getattr(strategy, "ps_config", None)
        if self._world == 1:
            self.goodput_unavailable = "one process sees its gradient at one batch size only, the noise scale needs two"
        elif ps_config is not None and getattr(strategy, "is_async", False):
            self.goodput_unavailable = (
                f"under ivy_ps {ps_config.mode} the servers apply each worker's push on arrival, alone, so no step "
                "has a combined gradient of several workers, and the noise scale needs the gradient at two batch "
                "sizes of one step"
            )
        elif ps_config is not None:  # sync: the servers report the combined gradient's norm with each step
            self._ps_noise = True
        elif not isinstance(strategy, DDPStrategy):
            self.goodput_unavailable = (
                f"under {type(strategy).__name__} the combined gradient is formed where this callback cannot see it, "
                "the noise scale needs it"
            )
        if getattr(strategy, "is_async", False):
            self._monitor_only("the ivy_ps async/ssp strategy hands out batches itself")
        if self._orig_process is None:
            self._orig_process = strategy.process_dataloader
            strategy.process_dataloader = self._process_dataloader  # type: ignore[method-assign]
        if isinstance(strategy, DDPStrategy) and getattr(strategy, "_ddp_comm_hook", None) is not None:
            if self.comm_hook == "refuse":
                raise ValueError(
                    "IvyLoadBalancer weights each rank's gradient by its share through a DDP communication hook and "
                    f"torch allows one hook per model, but the strategy already has ddp_comm_hook="
                    f"{strategy._ddp_comm_hook!r}; remove it, or use IvyLoadBalancer(comm_hook='compose') to run it "
                    "after the share weighting"
                )
            hook = strategy._ddp_comm_hook
            wrapper = getattr(strategy, "_ddp_comm_wrapper", None)
            self._user_hook = (wrapper(hook) if wrapper is not None else hook, strategy._ddp_comm_state)
            self._taken_hook = (hook, wrapper)
            strategy._ddp_comm_hook = None  # Lightning must not register it: ours calls it
            strategy._ddp_comm_wrapper = None

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
            strategy: Any = trainer.strategy
            strategy._ddp_comm_hook, strategy._ddp_comm_wrapper = self._taken_hook
            self._taken_hook = None
            self._user_hook = None
        if self._oom is not None:
            self._oom.remove()
            self._oom = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        root = trainer.strategy.root_device
        self._device_index = root.index if root.type == "cuda" else None
        self._rules = (
            [resolve_rule(self.lr_scaling, opt) for opt in trainer.optimizers] if self.adapt_batch_size else []
        )
        model = trainer.strategy.model
        if isinstance(model, DistributedDataParallel) and (self._world > 1 or self._user_hook is not None):
            user_hook, user_state = self._user_hook if self._user_hook is not None else (None, None)
            self._hook_state = ShareHookState(
                world_size=self._world, process_group=model.process_group, user_hook=user_hook, user_state=user_state
            )
            # two squared norms per bucket and step: paid only where the goodput rule uses them
            self._hook_state.measure_noise = self._world > 1 and self.adapt_batch_size and self._goodput_on()
            try:
                model.register_comm_hook(self._hook_state, share_weighted_hook)
            except RuntimeError as exc:
                raise RuntimeError(
                    "IvyLoadBalancer could not register its gradient-weighting DDP communication hook: the model "
                    "already has one (torch allows one per model). Pass your hook as DDPStrategy(ddp_comm_hook=...) "
                    f"so IvyLoadBalancer can compose it, or remove it. Original error: {exc}"
                ) from exc
        elif self._user_hook is not None:
            raise RuntimeError("a ddp_comm_hook was given but the model is not wrapped in DistributedDataParallel")
        elif self._ps_noise:
            from ivyplug.ps.local_updates import LocalUpdates

            if any(isinstance(opt, LocalUpdates) for opt in trainer.optimizers):
                self._ps_noise = False
                self.goodput_unavailable = (
                    "a local-update optimizer (AsyncLAMB) pushes parameter deltas, not gradients, so the servers' "
                    "combined norm is not a gradient's"
                )
        elif self.goodput_unavailable is None:
            self.goodput_unavailable = "the model is not wrapped in DistributedDataParallel, so no gradient is seen"
        # this rank's own gradient norm per optimizer step: paid only where the goodput rule uses it
        self._ps_noise = self._ps_noise and self.adapt_batch_size and self._goodput_on()
        if self.goodput_unavailable is not None and self.adapt_batch_size and self._goodput_on():
            held = (
                "the batch size and shares stay fixed (monitoring only)"
                if self.monitoring_only is not None
                else "the batch size will not grow (it still shrinks on memory pressure)"
            )
            rank_zero_warn(
                f"IvyLoadBalancer(goodput=True): no gradient noise scale estimate: {self.goodput_unavailable}; "
                f"{held}. Pass goodput=False to let utilisation and memory alone decide."
            )
        self._accumulate = max(int(getattr(trainer, "accumulate_grad_batches", 1) or 1), 1)
        if self.oom_recovery and pl_module.automatic_optimization:
            self._oom = OOMRecovery(trainer, pl_module, self.oom_max_parts, self.loss_reduction, self._count_oom)

    # ------------------------------------------------------------------ the loader
    def _monitor_only(self, reason: str) -> None:
        if self.monitoring_only is None:
            rank_zero_warn(f"IvyLoadBalancer: {reason}; batch size and shares stay fixed (monitoring only)")
        self.monitoring_only = reason

    def _process_dataloader(self, dataloader: object) -> object:
        assert self._orig_process is not None
        dataloader = self._orig_process(dataloader)
        start = time.perf_counter()
        try:
            return self._share_loader(dataloader)
        finally:
            self.hook_breakdown["loader"] += time.perf_counter() - start

    def _share_loader(self, dataloader: object) -> object:
        trainer = self._trainer_of()
        if trainer is None or not trainer.training or self.monitoring_only is not None:
            return dataloader
        reason = why_unsupported(dataloader)
        if reason is not None:
            self._monitor_only(reason)
            return dataloader
        assert isinstance(dataloader, torch.utils.data.DataLoader)
        default_seed = self.seed if self.seed is not None else int(os.environ.get("PL_GLOBAL_SEED", 0))
        spec = loader_spec(dataloader, default_seed)
        if self.batch_size is None:
            self.batch_size = spec.batch_size * self._world
        if self.initial_batch_size is None:
            self.initial_batch_size = self.batch_size
        if self.shares is None or len(self.shares) != self._world or sum(self.shares) != self.batch_size:
            self.shares = worker_shares(self.batch_size, [1.0] * self._world)
        sampler = ShareBatchSampler(
            num_samples=len(dataloader.dataset),  # type: ignore[arg-type]
            batch_size=self.batch_size,
            shares=self.shares,
            rank=self._rank,
            epoch=trainer.current_epoch,
            seed=self.seed if self.seed is not None else spec.seed,
            shuffle=spec.shuffle,
            drop_last=spec.drop_last,
        )
        self._share_sampler = sampler
        return rebuild_loader(dataloader, sampler)

    def _trainer_of(self) -> pl.Trainer | None:
        return self._trainer_ref

    # ------------------------------------------------------------------ per step
    def _reset_epoch(self) -> None:
        self._epoch_compute = 0.0
        self._step_computes: list[float] = []  # per step of this epoch, for the median the share fit uses
        self._step_shares: list[int] = []
        self._epoch_samples = 0
        self._epoch_steps = 0
        self._epoch_ooms = 0
        self._t0 = 0.0
        self._t_backward = None  # type: float | None
        self._step_samples = 0
        self._step_global = 0
        self._step_walls: list[float] = []  # wall seconds between consecutive batch ends
        self._last_end = time.perf_counter()
        # sums over this epoch's steps of the per-step (|G|², tr(Σ)) estimates, and how many steps were finite
        self._noise_sum: torch.Tensor | None = None
        self._noise_count: torch.Tensor | None = None
        # ivy_ps sync: this rank's and the global samples of the micro-batches since the last optimizer step, and
        # (|own gradient|², b, B) of an optimizer step whose combined norm the PS reports after the push
        self._since_step_local = 0
        self._since_step_global = 0
        self._ps_pending: tuple[torch.Tensor, int, int] | None = None

    def _count_oom(self) -> None:
        self.oom_count += 1
        self._epoch_ooms += 1
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

    # The three per-batch hooks below only read the clock and index precomputed lists: no tensor op, no
    # device query, no logging (that happens every log_every_n_steps). Their time is summed into
    # hook_breakdown["batch"], on_after_backward's included.
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        start = time.perf_counter()
        sampler = self._share_sampler
        hook_state = self._hook_state
        if sampler is not None and batch_idx < sampler.steps:
            self._step_samples = sampler.local_sizes[batch_idx]
            self._step_global = sampler.step_sizes[batch_idx]
            if hook_state is not None:
                hook_state.weight = sampler.weights[batch_idx]
        else:
            self._step_samples = _batch_len(batch)
            self._step_global = self._step_samples * self._world
            if hook_state is not None:
                hook_state.weight = 1.0 / self._world
        self._since_step_local += self._step_samples
        self._since_step_global += self._step_global
        if hook_state is not None:
            hook_state.last_bucket_time = None
            if hook_state.measure_noise:
                hook_state.local_sq.clear()
                hook_state.combined_sq.clear()
        self._t_backward = None
        self._t0 = time.perf_counter()
        self.hook_breakdown["batch"] += self._t0 - start

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._t_backward = now = time.perf_counter()
        self.hook_breakdown["batch"] += time.perf_counter() - now

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        """ivy_ps sync: keep |this rank's gradient|² of the optimizer step about to be pushed (a 0-d tensor).

        Lightning calls this once per optimizer step, after the last accumulated micro-batch's backward: ``.grad``
        then holds this rank's mean gradient over its samples of the step (the loss of each of the k
        micro-batches is divided by k), b of them; the step's combined gradient is the servers' sample-weighted
        mean over the B samples of every rank. The norm is taken before clipping, as the servers' is.
        """
        b, big = self._since_step_local, self._since_step_global
        self._since_step_local = self._since_step_global = 0
        if not self._ps_noise:
            return
        start = time.perf_counter()
        grads = [p.grad.detach() for p in pl_module.parameters() if p.grad is not None]
        if grads and big > b > 0:
            norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads])
            self._ps_pending = (norms.square().sum(), b, big)
        self.hook_breakdown["batch"] += time.perf_counter() - start

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        end = self._hook_state.last_bucket_time if self._hook_state is not None else None
        if end is None:
            end = self._t_backward if self._t_backward is not None else now
        compute = max(end - self._t0, 0.0)
        self._epoch_compute += compute
        self._step_computes.append(compute)
        self._step_shares.append(self._step_samples)
        self._epoch_samples += self._step_samples
        self._epoch_steps += 1
        self.steps += 1
        self._step_walls.append(now - self._last_end)
        self._last_end = now
        if self._hook_state is not None and self._hook_state.measure_noise:
            self._noise_step(self._hook_state)
        if self._ps_pending is not None:  # the optimizer step ran: the PS reply carried the combined norm
            self._ps_noise_step(trainer, *self._ps_pending)
            self._ps_pending = None
        if self.steps % self._log_every == 0:
            self._log_step()
        self.hook_breakdown["batch"] += time.perf_counter() - now

    def _noise_step(self, state: ShareHookState) -> None:
        """ddp: this step's per-bucket squared norms, seen by the share-weighting hook, into the epoch's sums."""
        local, combined = state.local_sq, state.combined_sq
        b = self._step_samples * self._accumulate
        big = self._step_global * self._accumulate
        if not local or len(local) != len(combined) or big <= b:
            return
        self._add_noise(torch.stack(local).sum(), b, torch.stack(combined).sum(), big)

    def _ps_noise_step(self, trainer: pl.Trainer, small_sq: torch.Tensor, b: int, big: int) -> None:
        """ivy_ps sync: this rank's |gradient|² at b and the servers' |combined gradient|² at B into the sums."""
        client = getattr(trainer.strategy, "client", None)
        big_sq = getattr(client, "combined_grad_sq_norm", None)  # None: not reported for this step
        if big_sq is not None:
            self._add_noise(small_sq, b, torch.tensor(float(big_sq), dtype=small_sq.dtype), big)

    def _add_noise(self, small_sq: torch.Tensor, b: int, big_sq: torch.Tensor, big: int) -> None:
        """Add one step's (|G|², tr(Σ)) estimate (:func:`~ivyplug.load.goodput.noise_components`) to the epoch's
        sums, as tensors (no device sync per step); a non-finite estimate is left out and not counted."""
        big_sq = big_sq.to(small_sq.device)
        values = torch.stack([(big * big_sq - b * small_sq) / (big - b), (small_sq - big_sq) / (1.0 / b - 1.0 / big)])
        finite = torch.isfinite(values).all()
        values = torch.where(finite, values, torch.zeros_like(values))
        if self._noise_sum is None or self._noise_count is None:
            self._noise_sum, self._noise_count = values, finite.to(values.dtype)
        else:
            self._noise_sum = self._noise_sum + values
            self._noise_count = self._noise_count + finite.to(values.dtype)

    def _log_step(self) -> None:
        metrics: dict[str, float] = {}
        if self._sampler is not None:
            latest = self._sampler.latest()
            metrics.update({f"ivy/{k}": v for k, v in latest.items() if not _is_per_core(k)})
            # an epoch shorter than the sampling interval has an empty window yet: use the latest reading
            stats = self._sampler.summary() or {k: Stat(v, v, v, v, 1) for k, v in latest.items()}
            obs = observation_from_summary(stats, self._device_index, self._epoch_ooms)
            if obs.utilization is not None:
                metrics["ivy/utilization"] = obs.utilization
            if obs.memory_fraction is not None:
                metrics["ivy/memory_fraction"] = obs.memory_fraction
        if self.batch_size is not None:
            metrics["ivy/batch_size"] = float(self.batch_size)
        if self.shares is not None:
            metrics["ivy/share"] = float(self.shares[self._rank])
        metrics["ivy/lr_factor"] = self.lr_factor
        metrics["ivy/oom_count"] = float(self.oom_count)
        self._emit(self._trainer_ref, metrics)

    # ------------------------------------------------------------------ epoch boundary
    def _gather(self, record: dict[str, Any]) -> list[dict[str, Any]]:
        if self._world == 1 or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return [record]
        return all_gather_json(record, self._world)  # tensors of JSON: nothing received is unpickled

    def _policy(self) -> BatchSizePolicy:
        if self.policy is not None:
            return self.policy
        assert self.batch_size is not None
        low, high = default_batch_bounds(self.batch_size, self._world)
        low = self.min_batch_size if self.min_batch_size is not None else low
        high = self.max_batch_size if self.max_batch_size is not None else max(high, low)
        self.policy = BatchSizePolicy(max(low, self._world), max(high, low, self._world), **self._policy_args)
        return self.policy

    def _goodput_on(self) -> bool:
        return self.policy.goodput if self.policy is not None else bool(self._policy_args["goodput"])

    def _estimate(self, records: list[dict[str, Any]], batch_size: int) -> tuple[GoodputEstimate, NoiseScale, list]:
        """The gradient noise scale and step costs after this epoch (rank 0; the result is broadcast)."""
        noise = NoiseScale.from_dict(self.noise.to_dict())
        steps = sum(r["noise_steps"] for r in records)
        if steps > 0:  # step-weighted mean over ranks of each rank's epoch mean: unbiased, as each one is
            grad_sq = sum(r["noise_grad_sq"] * r["noise_steps"] for r in records) / steps
            trace = sum(r["noise_trace"] * r["noise_steps"] for r in records) / steps
            noise.update(grad_sq, trace)
        costs = list(self.step_costs)
        wall = max(r["wall_step"] for r in records)
        compute = max(r["step_time"] for r in records)
        if wall > 0 and compute > 0:
            costs = [*costs, StepCost(batch_size, wall, compute)][-8:]
        unavailable = self.goodput_unavailable
        if unavailable is None and self.monitoring_only is not None:
            unavailable = self.monitoring_only
        estimate = GoodputEstimate(noise.value, tuple(costs), unavailable, base_batch_size=self.initial_batch_size)
        return estimate, noise, costs

    def _decide(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        assert self.batch_size is not None and self.shares is not None
        old = self.batch_size
        new, state, reason = old, self.policy_state, "fixed"
        estimate, noise, costs = self._estimate(records, old)
        if self.adapt_batch_size and self.monitoring_only is None:
            observations = [LoadObservation(r["utilization"], r["memory_fraction"], r["oom_count"]) for r in records]
            decision = self._policy().decide(old, combine_observations(observations), self.policy_state, estimate)
            new, state, reason = decision.batch_size, decision.state, decision.reason
        shares = list(self.shares)
        history: list[list[tuple[float, float]]] = [list(h) for h in self.step_observations]
        previous, gain, target, models = self.previous_shares, self.share_gain, None, None
        if self._world > 1 and self.monitoring_only is None:
            measured = all(r["step_share"] > 0 and r["step_time"] > 0 for r in records)
            if self.balance_shares and measured:
                if len(history) != self._world:
                    history = [[] for _ in range(self._world)]
                for r in records:  # median local batch and median compute seconds per step of the epoch
                    history[r["rank"]].append((float(r["step_share"]), float(r["step_time"])))
                    del history[r["rank"]][: -4 * self.share_window]  # bounded history
                step = next_shares(new, self.shares, previous, history, gain, window=self.share_window)
                shares, gain, target = step.shares, step.gain, step.target
                models = [[m.intercept, m.slope] for m in step.models]
                previous = list(self.shares)
            elif new != old:
                shares = worker_shares(new, [float(s) for s in self.shares])
        else:
            shares = [new]
        return {
            "batch_size": new,
            "shares": shares,
            "policy_state": state.to_dict(),
            "reason": reason,
            "step_observations": history,
            "previous_shares": previous,
            "share_gain": gain,
            "target_shares": target,
            "step_models": models,  # per rank [a_i seconds per step, c_i seconds per sample]
            "noise": noise.to_dict(),
            "step_costs": [[c.batch_size, c.seconds, c.compute] for c in costs],
        }

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        start = time.perf_counter()
        self._sync_seconds = 0.0
        try:
            self._epoch_end(trainer, pl_module)
        finally:
            self.hook_breakdown["epoch_sync"] += self._sync_seconds
            self.hook_breakdown["epoch_end"] += time.perf_counter() - start - self._sync_seconds

    def _epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._sampler is None or self.batch_size is None or self.shares is None:
            return
        self._sampler.sample_now()
        obs = observation_from_summary(self._sampler.summary(), self._device_index, self._epoch_ooms)
        record = {
            "rank": self._rank,
            "compute_time": self._epoch_compute,
            "samples": self._epoch_samples,
            "steps": self._epoch_steps,
            # medians, not means: on a shared machine a few preempted steps would tilt the step-time fit
            "step_share": statistics.median(self._step_shares) if self._step_shares else 0.0,
            "step_time": statistics.median(self._step_computes) if self._step_computes else 0.0,
            "wall_step": statistics.median(self._step_walls) if self._step_walls else 0.0,
            **self._noise_record(),
            "utilization": obs.utilization,
            "memory_fraction": obs.memory_fraction,
            "oom_count": self._epoch_ooms,
            "share": self.shares[self._rank],
        }
        sync_start = time.perf_counter()
        records = self._gather(record)
        self._sync_seconds += time.perf_counter() - sync_start
        decision = self._decide(records) if self._rank == 0 else None
        if self._world > 1:
            sync_start = time.perf_counter()
            decision = broadcast_json(decision, src=0)
            self._sync_seconds += time.perf_counter() - sync_start
        assert decision is not None
        old = self.batch_size
        self.batch_size = int(decision["batch_size"])
        self.shares = [int(s) for s in decision["shares"]]
        self.policy_state = PolicyState.from_dict(decision["policy_state"])
        self.step_observations = [[(float(b), float(t)) for b, t in h] for h in decision["step_observations"]]
        self.previous_shares = decision["previous_shares"]
        self.share_gain = float(decision["share_gain"])
        self.noise = NoiseScale.from_dict(decision["noise"])
        self.step_costs = [StepCost(int(b), float(t), float(c)) for b, t, c in decision["step_costs"]]
        if self.batch_size != old:
            self._rescale_lr(trainer, old, self.batch_size)
        self.history.append(
            {
                "epoch": trainer.current_epoch,
                "batch_size": old,
                "next_batch_size": self.batch_size,
                "next_shares": list(self.shares),
                "target_shares": decision["target_shares"],
                "step_models": decision["step_models"],
                "reason": decision["reason"],
                "lr_factor": self.lr_factor,
                "noise_scale": self.noise.value,
                "ranks": records,
            }
        )
        metrics: dict[str, float] = {"ivy/batch_size": float(self.batch_size), "ivy/lr_factor": self.lr_factor}
        if self.noise.value is not None:
            metrics["ivy/noise_scale"] = self.noise.value
        for r in records:
            for key in ("compute_time", "samples", "share", "utilization", "memory_fraction", "oom_count"):
                value = r[key]
                if value is not None:
                    metrics[f"ivy/rank{r['rank']}/{key}"] = float(value)
        self._emit(trainer, metrics)

    def _noise_record(self) -> dict[str, float]:
        """This rank's epoch means of the per-step |G|² and tr(Σ) estimates: the one device sync per epoch."""
        if self._noise_sum is None or self._noise_count is None:
            return {"noise_grad_sq": 0.0, "noise_trace": 0.0, "noise_steps": 0}
        count = int(self._noise_count.item())
        grad_sq, trace = (self._noise_sum / max(count, 1)).tolist()
        return {"noise_grad_sq": float(grad_sq), "noise_trace": float(trace), "noise_steps": count}

    def _emit(self, trainer: pl.Trainer | None, metrics: dict[str, float]) -> None:
        """Hand metrics straight to the loggers (rank 0 only, as Lightning's loggers do).

        ``LightningModule.log`` builds a metric object per key and costs milliseconds per call, which
        would eat the overhead budget; the values here are already final (gathered where per-rank).
        """
        self.metrics.update(metrics)
        if trainer is None or not trainer.is_global_zero:
            return
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    def _rescale_lr(self, trainer: pl.Trainer, old: int, new: int) -> None:
        if not self._rules:
            self._rules = [resolve_rule(self.lr_scaling, opt) for opt in trainer.optimizers]
        for i, (opt, rule) in enumerate(zip(trainer.optimizers, self._rules, strict=True)):
            factor = lr_factor(old, new, rule)
            for group in opt.param_groups:
                group["lr"] *= factor
                if "initial_lr" in group:
                    group["initial_lr"] *= factor
            for config in trainer.lr_scheduler_configs:
                scheduler = config.scheduler
                if getattr(scheduler, "optimizer", None) is opt and hasattr(scheduler, "base_lrs"):
                    scheduler.base_lrs = [b * factor for b in scheduler.base_lrs]
            if i == 0:
                self.lr_factor *= factor

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch_size,
            "shares": self.shares,
            "policy_state": self.policy_state.to_dict(),
            "lr_factor": self.lr_factor,
            "oom_count": self.oom_count,
            "step_observations": self.step_observations,
            "previous_shares": self.previous_shares,
            "share_gain": self.share_gain,
            "noise": self.noise.to_dict(),
            "step_costs": [[c.batch_size, c.seconds, c.compute] for c in self.step_costs],
            "initial_batch_size": self.initial_batch_size,
            "history": self.history,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.batch_size = state_dict["batch_size"]
        self.shares = state_dict["shares"]
        self.policy_state = PolicyState.from_dict(state_dict["policy_state"])
        self.lr_factor = float(state_dict["lr_factor"])
        self.oom_count = int(state_dict["oom_count"])
        # checkpoints written before the step-time model (they held "speeds") start the fit afresh
        self.step_observations = [[(float(b), float(t)) for b, t in h] for h in state_dict.get("step_observations", [])]
        self.previous_shares = state_dict.get("previous_shares")
        self.share_gain = float(state_dict.get("share_gain", 1.0))
        if "noise" in state_dict:  # checkpoints from before the goodput rule start the estimate afresh
            self.noise = NoiseScale.from_dict(state_dict["noise"])
        self.step_costs = [StepCost(int(b), float(t), float(c)) for b, t, c in state_dict.get("step_costs", [])]
        self.initial_batch_size = state_dict.get("initial_batch_size", self.batch_size)
        self.history = list(state_dict["history"])


def _batch_len(batch: Any) -> int:
    from ivyplug.load.oom import batch_length

    try:
        return batch_length(batch)
    except ValueError:
        return 1
