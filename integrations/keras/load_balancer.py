"""``IvyLoadBalancer`` for Keras: load-aware global batch size and learning rate inside ``model.fit``.

It measures and applies; the decisions are :class:`~ivyplug.load.balancer.BalancerCore`'s, the Lightning twin's
too, with the same options, defaults and ``ivy/...`` metric names. Once per epoch every worker turns its sampler
window into a :class:`~ivyplug.load.LoadObservation`; several workers exchange them (:mod:`.load_exchange`) and
all reach the same decision. A new batch size is scheduled on the
:class:`~ivyplug.integrations.keras.elastic.ElasticDataset` at the first step the pipeline has not produced yet (a
multiple of the replicas); the learning rate is multiplied by ``lr_factor(old, new, rule)`` with
``optimizer.learning_rate.assign`` at exactly that step (a ``LearningRateSchedule`` is refused unless
``lr_scaling="none"``). A growth has to pay in goodput: the noise scale comes from the optimizer's cross-replica
sum under ``MirroredStrategy`` (:mod:`.noise_watch`), the step cost from the median seconds per step. Metrics go
into the epoch ``logs`` (``History``, TensorBoard): ``ivy/batch_size``, ``ivy/lr_factor``, ``ivy/utilization``,
``ivy/memory_fraction``, ``ivy/oom_count``, ``ivy/callback_overhead``, every probe reading's epoch mean as
``ivy/<key>`` and ``ivy/rank{r}/...`` per worker. An out-of-memory step is rerun as micro-batches
(:mod:`.oom_guard`) or stops ``fit`` with an ``OutOfMemoryRecoveryError`` that says why. On JAX and PyTorch the
model is one replica; what cannot apply there (the noise scale, the split) warns once and says why.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
import warnings
from collections.abc import Mapping
from typing import Any

import keras
from ivyplug.integrations.keras import balancer_backup
from ivyplug.integrations.keras.balancer_backup import BalancerBackup
from ivyplug.integrations.keras.elastic import ElasticDataset
from ivyplug.integrations.keras.load_exchange import exchange_observations
from ivyplug.integrations.keras.model_access import (
    batch_multiple,
    check_assignable_lr,
    inner_optimizer,
    keras_backend,
    learning_rate_value,
    model_strategy,
    replica_count,
    scale_learning_rate,
    steps_in_call,
    worker_count,
)
from ivyplug.integrations.keras.noise_watch import GradientNoiseWatch, warn_no_noise, why_no_noise
from ivyplug.integrations.keras.oom_guard import StepGuard

from ivyplug.load import DEFAULT_PROBE_NAMES, BatchSizePolicy, LoadObservation, Sampler
from ivyplug.load.balancer import BalancerCore, CoreState, round_batch
from ivyplug.load.balancer_config import BalancerConfig, ProbeSpecs
from ivyplug.load.balancer_metrics import decision_metrics, load_metrics, rank_metrics, reading_metrics
from ivyplug.load.lr_scaling import lr_factor, resolve_rule
from ivyplug.load.observation import combine_observations, observation_from_summary
from ivyplug.load.probes import probe_config

#: Probes polled when none are given: the same as the Lightning twin's (the torch allocator probe reads
#: nothing but an OOM count where torch has no CUDA device).
DEFAULT_PROBES: tuple[str, ...] = DEFAULT_PROBE_NAMES


class IvyLoadBalancer(CoreState, keras.callbacks.Callback):
    """Adapt the global batch size (and learning rate) to device load during ``model.fit``.

    The options both twins share (this one and ``ivyplug.integrations.lightning.IvyLoadBalancer``) have the same
    names, defaults and meaning, so a config moves between them (``log_every_n_steps=None`` follows each framework's own
    logging: the Trainer's period, Keras's epoch logs); ``dataset``, ``device_index`` and ``backup_dir`` are Keras's own
    (Lightning saves the twin's state in its checkpoints).

    Args:
        dataset: the :class:`ElasticDataset` that feeds ``fit``; without one the callback only monitors.
        probes: probe names from the registry (``"nvml"``, ``"psutil"``...), ``{"name": ...,
            **kwargs}`` dicts or probe objects (default: :data:`DEFAULT_PROBES`); a zero-argument callable returning
            them is accepted too (it cannot be written by ``get_config``).
        interval: seconds between probe reads on the background thread.
        adapt_batch_size: let the policy change the global batch size B (``False``: monitor, keep B).
        min_batch_size, max_batch_size: bounds for B (default: one sample per replica, and 8 × the initial B,
            within the data set size); rounded to multiples of the replica count.
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
        log_every_n_steps: add the latest readings to the batch logs every n steps (``None``: epoch logs only).
        oom_recovery: split a step that runs out of memory into micro-batches (``False``: the error stops ``fit``).
        oom_max_parts: the most micro-batches per replica a step that ran out of memory is split into
            before :class:`~ivyplug.load.OutOfMemoryRecoveryError` (1: no splitting).
        device_index: the GPU index whose readings decide (``None``: host CPU and memory).
        backup_dir: the ``backup_dir`` of the fit's ``keras.callbacks.BackupAndRestore``: the batch size, the
            stream position and the learning-rate factors are saved there at every epoch's end, so that a fit
            it resumes continues at the batch size the restored learning rate belongs to (``None``: a resumed fit
            starts at the dataset's batch size, warned once).

    Example::

        data = ElasticDataset(x_train, y_train, batch_size=64)
        with strategy.scope():
            model = build_model()
            model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        balancer = IvyLoadBalancer(data, max_batch_size=512)
        history = model.fit(data.tf_dataset(strategy), steps_per_epoch=data.steps_per_epoch, epochs=10,
                            callbacks=[balancer])
        history.history["ivy/batch_size"]  # the global batch size at the end of each epoch
    """

    def __init__(
        self,
        dataset: ElasticDataset | None = None,
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
        device_index: int | None = None,
        backup_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__()
        if dataset is not None and not isinstance(dataset, ElasticDataset):
            raise ValueError(f"dataset must be an ElasticDataset or None, got {type(dataset).__name__}")
        if device_index is not None and (
            isinstance(device_index, bool) or not isinstance(device_index, int) or device_index < 0
        ):
            raise ValueError(f"device_index must be None or an int >= 0, got {device_index!r}")
        if backup_dir is not None and (not isinstance(backup_dir, (str, os.PathLike)) or not str(backup_dir)):
            raise ValueError(f"backup_dir must be None or a BackupAndRestore's backup_dir path, got {backup_dir!r}")
        if backup_dir is not None and "://" in os.fspath(backup_dir):
            raise ValueError(f"backup_dir must be a local folder (or a mounted one), got {os.fspath(backup_dir)!r}")
        if backup_dir is not None and dataset is None:
            raise ValueError(
                "backup_dir needs an ElasticDataset: without one IvyLoadBalancer only monitors and has nothing to "
                "restore (pass the dataset, or backup_dir=None)"
            )
        given = locals()
        self.config = BalancerConfig(**{k: given[k] for k in BalancerConfig.option_names()})  # names a bad one
        self.core = BalancerCore(self.config)
        for name in BalancerConfig.option_names():  # every option readable as an attribute, as before
            if name not in ("policy", "probes"):
                setattr(self, name, getattr(self.config, name))
        self.probe_specs = (
            self.config.probes if callable(self.config.probes) else list(self.config.probes or DEFAULT_PROBES)
        )
        self.dataset = dataset
        self.device_index = device_index
        self.backup_dir = None if backup_dir is None else os.fspath(backup_dir)
        self.restored: BalancerBackup | None = None  # the backup this fit resumed from
        self.sampler: Sampler | None = None
        self.epoch = 0  # the epoch in progress (a ScriptedProbe clock can read it)
        self.step = 0  # global steps consumed in the current fit
        self.recovered_steps: list[tuple[int, int]] = []  # (step in its fit, micro-batches per replica)
        self.decisions: list[tuple[int, int, int, str]] = []  # (epoch, old B, new B, reason)
        self.reasons: list[tuple[int, str]] = []  # (epoch, reason) of every decision, changes and holds
        self.noise_history: list[float | None] = []  # B_noise after each epoch
        self.epoch_start_positions: dict[int, int] = {}
        self._guard = StepGuard(self)
        self._epoch_ooms = 0
        self._watch: GradientNoiseWatch | None = None  # the optimizer's gradient sum, watched
        self._noise_batch = 0  # the global batch of the steps summed in the watch
        self._goodput_warned = False
        self._warned: set[str] = set()  # keys of the once-per-callback warnings given
        self._step_walls: list[float] = []  # wall seconds per step this epoch, and of the train_function call
        self._step_calls: list[float] = []
        self._rule = "none"
        self._pending: list[tuple[int, float]] = []  # (step, LR factor) not applied yet
        self._lr_optimizer: Any = None  # the optimizer whose rate the last fit scaled (a recompile brings another)
        self._stream_started = False  # the first epoch's start has set where the stream starts
        self._chunk_begin = 0
        self._hook_s = 0.0  # time spent in this callback's hooks this epoch
        self._batch_t = self._epoch_t0 = self._last_batch_t = 0.0

    # ----------------------------------------------------------------- config
    def get_config(self) -> dict[str, Any]:
        """Constructor arguments as plain values (the dataset is not part of the config)."""
        if callable(self.probe_specs):
            raise ValueError("probes given as a callable cannot be written to a config: pass names or dicts")
        options = {name: getattr(self.config, name) for name in BalancerConfig.option_names()}
        policy = self.config.policy
        options["probes"] = [probe_config(p) for p in self.probe_specs]
        options["policy"] = None if policy is None else dataclasses.asdict(policy)
        return {**options, "device_index": self.device_index, "backup_dir": self.backup_dir}

    @classmethod
    def from_config(cls, config: Mapping[str, Any], dataset: ElasticDataset | None = None) -> IvyLoadBalancer:
        """Build from a config dict (``get_config()`` output, or a hand-written subset of it)."""
        if not isinstance(config, Mapping):
            raise ValueError(f"config must be a dict of IvyLoadBalancer arguments, got {config!r}")
        known = {*BalancerConfig.option_names(), "device_index", "backup_dir"}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"unknown IvyLoadBalancer config keys {unknown}; allowed: {sorted(known)}")
        kwargs = dict(config)
        if isinstance(kwargs.get("policy"), Mapping):  # get_config writes the policy as its fields
            kwargs["policy"] = BatchSizePolicy(**kwargs["policy"])
        return cls(dataset, **kwargs)

    # ----------------------------------------------------------------- helpers
    @property
    def strategy(self) -> Any:
        """The model's ``tf.distribute`` strategy on the TensorFlow backend; ``None`` on the others."""
        return model_strategy(self.model)

    def _replicas(self) -> int:
        return replica_count(self.strategy)

    def _workers(self) -> int:
        return worker_count(self.strategy)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    def _batch_multiple(self) -> int:
        return batch_multiple(self.strategy, self._replicas())

    def _build_policy(self) -> None:
        assert self.dataset is not None
        multiple = self._batch_multiple()
        self.core.batch_size = self.dataset.batch_size
        self.core.build_policy(multiple, multiple, self.dataset.num_samples)

    def _apply_lr(self, factor: float) -> None:
        if factor != 1.0:
            scale_learning_rate(self.model, factor)
            self.lr_factor *= factor

    # ----------------------------------------------------------------- hooks
    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        optimizer = inner_optimizer(self.model)
        # a balancer that only monitors never changes the learning rate: it needs no rule for this optimizer
        self._rule = resolve_rule(self.config.lr_scaling, optimizer) if self._adapts() else "none"
        if self._adapts():
            check_assignable_lr(optimizer, self._rule != "none")
            if self._lr_optimizer is not None and optimizer is not self._lr_optimizer and self.lr_factor != 1.0:
                # compiled again with a fresh optimizer: it gets the rate of the batch size this callback reached
                scale_learning_rate(self.model, self.lr_factor)
        self._lr_optimizer = optimizer
        if self.dataset is not None:
            if self.dataset.num_replicas != self._replicas():
                raise ValueError(
                    f"the ElasticDataset was built for {self.dataset.num_replicas} replica(s) but the model's "
                    f"strategy has {self._replicas()}: pass model.distribute_strategy to tf_dataset()"
                )
            # factors left over from a fit that ended without on_train_end join what the dataset owes: this fit
            # trains at the batch size the last one scheduled (the dataset keeps it until the stream has started)
            self.dataset.owed_lr_factor *= math.prod(f for _, f in self._pending)
            if self.dataset.owed_lr_factor != 1.0:
                check_assignable_lr(optimizer)  # the inherited batch size's rate is assigned, whatever this one does
        self.step = 0
        self._pending = []
        self.restored = None
        self._stream_started = False
        if self.dataset is None:
            warnings.warn(
                "IvyLoadBalancer has no ElasticDataset: it monitors load but cannot change the batch size",
                RuntimeWarning,
                stacklevel=2,
            )
        if self.sampler is None:
            self.sampler = Sampler(self.config.build_probes(), interval=self.config.interval)
        self._watch_gradients()
        if self.dataset is not None and self.config.oom_recovery:
            self._guard.install(self.model, self._workers())

    def _start_stream(self, epoch: int) -> None:
        """Where this fit's stream starts and at which batch size: the state saved for ``epoch`` in ``backup_dir``
        (a fit ``BackupAndRestore`` resumed at ``epoch``), else where the dataset's last fit left it. Run at the
        first epoch's start, before any batch is produced: only then has every callback's ``on_train_begin`` run,
        ``BackupAndRestore``'s with it, which may have fallen back to its previous backup (``double_checkpoint``)."""
        assert self.dataset is not None
        restored = self._restore(epoch)
        if restored is not None:  # the schedule as it stood when the backup was taken, whatever this process held
            pending = [(int(ahead), float(f)) for ahead, f in restored.pending]
            if pending:
                scales = any(f != 1.0 for _, f in pending)
                check_assignable_lr(inner_optimizer(self.model), scales)  # checked before anything changes
            self.core.load_state_dict(restored.core)
            self.dataset.restart(restored.batch_now, start_position=restored.position)
            for ahead, size in restored.scheduled:  # changes decided but not reached: at the same steps
                self.dataset.set_batch_size(int(size), at_step=int(ahead))
        else:
            owed = self.dataset.owed_lr_factor
            pending = [(0, owed)] if owed != 1.0 else []
            position = self.dataset.resume_position
            start = self.dataset.position_at(0) if position is None else position
            self.dataset.restart(self.dataset.batch_size, start_position=start)
        self.restored, self._pending = restored, pending
        batch = self.dataset.batch_size
        self.core.batch_size = batch
        self.core.start(batch)
        if self.policy is None:
            self._build_policy()
        if self.config.oom_recovery:  # BackupAndRestore, later in the callbacks, may have restored the counter
            self._guard.count_from(self.model)
        self.dataset.owed_lr_factor = 1.0  # this fit took it (pending): last, so a start that failed leaves it
        self._stream_started = True

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        t = time.perf_counter()
        if self.dataset is not None and not self._stream_started:
            self._start_stream(epoch)
        self._epoch_t0 = self._last_batch_t = t
        self.epoch = epoch
        self._epoch_ooms = 0
        self._step_walls, self._step_calls = [], []
        if self.dataset is not None:
            self.epoch_start_positions[epoch] = self.dataset.position_at(self.step)
        if self.sampler is not None:
            self.sampler.reset_window()
        self._hook_s = time.perf_counter() - t

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        t = time.perf_counter()
        self._chunk_begin = batch
        if self.step == 0 and self.restored is not None:
            self._check_restored_lr(self.restored)
        while self._pending and self._pending[0][0] <= self.step:
            self._apply_lr(self._pending.pop(0)[1])
        if self._watch is not None and self.dataset is not None:
            batch_now = self.dataset.batch_size_at(self.step)
            if batch_now != self._noise_batch:  # the sums hold steps of one batch size only
                self._flush_noise()
                self._noise_batch = batch_now
        self._batch_t = time.perf_counter()
        self._hook_s += self._batch_t - t

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        t = time.perf_counter()
        # an ElasticDataset never runs out: each call trains its steps_per_execution steps whole
        steps = steps_in_call(self.params, self._chunk_begin, batch, data_ends=self.dataset is None)
        self._step_calls.append((t - self._batch_t) / steps)
        self._step_walls.append((t - self._last_batch_t) / steps)
        self.step += steps
        n = self.config.log_every_n_steps
        if n is not None and logs is not None and self.sampler is not None and self.step % n == 0:
            logs.update(reading_metrics(self.sampler.latest(), per_core=False))  # as the Lightning twin logs steps
        self._last_batch_t = time.perf_counter()
        self._hook_s += self._last_batch_t - t

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        t = time.perf_counter()
        assert self.sampler is not None
        # one reading at the epoch's end, as the Lightning twin takes: an epoch shorter than the sampling
        # interval has one then, and never a reading of the epoch before (the window dropped those)
        self.sampler.sample_now()
        summary = self.sampler.summary()
        workers = self._exchange(observation_from_summary(summary, self.device_index, self._epoch_ooms))
        observation = combine_observations(workers)
        metrics = reading_metrics({k: s.mean for k, s in summary.items()})
        self._flush_noise()
        if self.dataset is not None and self._step_walls and self._step_calls:
            batch = self.dataset.batch_size_at(self.step - 1)
            self.core.add_step_cost(batch, statistics.median(self._step_walls), statistics.median(self._step_calls))
        self.noise_history.append(self.noise.value)
        if self.dataset is not None:
            self._decide(epoch, observation)  # an epoch with an OOM shrinks B (ignoring the cooldown)
            if self.backup_dir is not None:
                named = balancer_backup.keras_epoch(self.backup_dir)
                if named == epoch + 1:
                    self._warn_once(
                        "backup_order",
                        "IvyLoadBalancer(backup_dir=...): BackupAndRestore saved this epoch before the balancer did; "
                        "list IvyLoadBalancer before BackupAndRestore in callbacks, so that a job stopped between "
                        "the two saves cannot resume weights without the balancer's state",
                    )
                state = BalancerBackup(
                    epochs_done=epoch + 1,
                    core=self.core.state_dict(),
                    position=self.dataset.position_at(self.step),
                    batch_now=self.dataset.batch_size_at(self.step),
                    scheduled=[
                        (seg.start_step - self.step, seg.batch_size)
                        for seg in self.dataset.segments
                        if seg.start_step > self.step
                    ],
                    pending=[(at - self.step, f) for at, f in self._pending],
                    learning_rate=learning_rate_value(self.model),
                )
                balancer_backup.save(self.backup_dir, state, named)
        batch_size = self.dataset.batch_size_at(max(self.step - 1, 0)) if self.dataset is not None else None
        metrics.update(decision_metrics(batch_size, self.lr_factor, self.noise.value))
        metrics["ivy/oom_count"] = float(self.oom_count)
        metrics.update(load_metrics(observation))
        ranks = [{"rank": r, **dataclasses.asdict(obs)} for r, obs in enumerate(workers)]
        metrics.update(rank_metrics(ranks))
        # Hook time over training time (epoch start to last batch, plus this hook); validation not counted.
        hooks = self._hook_s + (time.perf_counter() - t)
        metrics["ivy/callback_overhead"] = hooks / max(
            self._last_batch_t - self._epoch_t0 + (time.perf_counter() - t), 1e-9
        )
        if logs is not None:
            logs.update(metrics)

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        self._guard.remove(self.model)
        if self.dataset is not None and self._stream_started:  # (no epoch ran: the dataset keeps what it had)
            # The next fit starts a new iterator at batch 0: continue the stream, with what is scheduled, and the
            # learning rate of what is scheduled (on the dataset: a new callback over it continues alike).
            self.dataset.resume_position = self.dataset.position_at(self.step)
            self.dataset.owed_lr_factor *= math.prod(f for _, f in self._pending)
        self._pending = []
        self.close()

    def close(self) -> None:
        """Stop the sampler thread (``on_train_end`` does this)."""
        if self.sampler is not None:
            self.sampler.close()
            self.sampler = None

    # ----------------------------------------------------------------- decisions
    def _exchange(self, local: LoadObservation) -> list[LoadObservation]:
        """Every worker's observation, identical on every worker (one SUM reduce per epoch)."""
        return exchange_observations(self.strategy, local, self._warn_once)

    def _adapts(self) -> bool:
        """Whether this balancer may change the batch size (and so the learning rate)."""
        return self.dataset is not None and self.config.adapt_batch_size

    def _restore(self, epoch: int) -> BalancerBackup | None:
        """The state saved for ``epoch`` in ``backup_dir``, if any; a fit started past epoch 0 without one is warned
        (once): the learning rate restored with the weights may be that of a batch size the earlier run reached."""
        assert self.dataset is not None
        restored = None if self.backup_dir is None or epoch == 0 else balancer_backup.state_at(self.backup_dir, epoch)
        sizes = [] if restored is None else [restored.batch_now, *(size for _, size in restored.scheduled)]
        if any(size % self.dataset.num_replicas or size > self.dataset.num_samples for size in sizes):
            self._warn_once(
                "backup_sizes",
                f"IvyLoadBalancer: the batch sizes saved in {self.backup_dir} ({sizes}) do not fit this fit's "
                f"{self.dataset.num_replicas} replica(s) and {self.dataset.num_samples} samples (resumed on other "
                f"devices?); the fit starts at the ElasticDataset's batch size {self.dataset.batch_size}",
            )
            return None
        carried = self.dataset.resume_position is not None  # a refit in this process goes on where the last ended
        if epoch > 0 and restored is None and not carried and self._adapts():
            start = (
                f"IvyLoadBalancer: this fit starts at epoch {epoch} (resumed by BackupAndRestore, or initial_epoch) "
                f"at the ElasticDataset's batch size {self.dataset.batch_size}, but a learning rate restored with "
                "the weights may be the one of a batch size the earlier run reached: "
            )
            self._warn_once(
                "resumed",
                start + "pass IvyLoadBalancer(backup_dir=...) the BackupAndRestore's backup_dir to restore both"
                if self.backup_dir is None
                else start + f"{self.backup_dir} holds no balancer state for it",
            )
        return restored

    def _check_restored_lr(self, restored: BalancerBackup) -> None:
        """The learning rate now (``BackupAndRestore``'s) is the saved one, or one that already took the changes
        scheduled then (a backup taken between epoch ends, after a change landed; the epoch is replayed from its
        start, so the saved rate is set again and the changes land at their steps)."""
        if self._rule == "none" or not hasattr(inner_optimizer(self.model).learning_rate, "assign"):
            return  # the balancer never scales this rate (a schedule, lr_scaling="none")
        now = learning_rate_value(self.model)
        if math.isclose(now, restored.learning_rate, rel_tol=1e-5):
            return
        landed = restored.learning_rate
        for _, factor in restored.pending:
            landed *= factor
            if math.isclose(now, landed, rel_tol=1e-5):
                scale_learning_rate(self.model, restored.learning_rate / now)
                return
        self._warn_once(
            "restored_lr",
            f"IvyLoadBalancer: the optimizer's learning rate is {now:g}, not the {restored.learning_rate:g} "
            f"saved in {self.backup_dir} with batch size {restored.batch_now} (were the weights restored from "
            "another backup?); the batch size is restored and the learning rate scaled from where it is",
        )

    def _decide(self, epoch: int, observation: LoadObservation) -> None:
        assert self.dataset is not None and self.policy is not None
        if not self.config.adapt_batch_size:
            return
        old = self.dataset.batch_size
        decision = self.core.decide_batch(old, observation)
        self.reasons.append((epoch, decision.reason))
        new = round_batch(decision.batch_size, self._batch_multiple(), self.dataset.num_samples)
        if not decision.changed or new == old:
            return
        # Not a batch the pipeline has produced already (a PyDataset may read further ahead than ``lag``).
        at = max(self.dataset.earliest_change_step(self.step), self.dataset.produced_step() + 1)
        every = int(getattr(self.model, "steps_per_execution", 1) or 1)
        at = math.ceil(at / every) * every
        self.dataset.set_batch_size(new, at_step=at)
        self.core.batch_size, self.core.shares = new, [new]  # tf.distribute splits B evenly
        self._pending.append((at, lr_factor(old, new, self._rule)))
        self.decisions.append((epoch, old, new, decision.reason))

    def _watch_gradients(self) -> None:
        """Count |per-replica gradient|² and |summed gradient|² in the compiled step (once per optimizer)."""
        strategy, optimizer = self.strategy, inner_optimizer(self.model)
        reason = why_no_noise(strategy, self._replicas(), self._workers(), optimizer, keras_backend())
        self.goodput_unavailable = reason
        used = self.config.adapt_batch_size and self.dataset is not None and self.config.goodput_on
        if reason is not None:
            if used and not self._goodput_warned:
                self._goodput_warned = True
                warn_no_noise(reason)
            return
        if not used or (self._watch is not None and self._watch.optimizer is optimizer):
            return  # the watch costs two squared norms per step: only where the goodput rule uses them
        self._watch = GradientNoiseWatch(strategy, optimizer)
        self.model.make_train_function(force=True)  # trace the step again, with the watch in it
        assert self.dataset is not None
        self._noise_batch = self.dataset.batch_size_at(self.step)

    def _flush_noise(self) -> None:
        """Fold the steps summed since the last flush (all at one batch size) into the noise-scale EMA."""
        if self._watch is None or self.dataset is None:
            return
        replicas, big = self._replicas(), self._noise_batch
        means = self._watch.take(replicas)
        if means is not None and big > replicas:
            self.core.add_norms(means[0], big / replicas, means[1], big)

    def _record_oom(self, batch_size: int) -> None:
        self.oom_count += 1
        assert self.dataset is not None
        if batch_size <= self.dataset.batch_size:  # not at a size already scheduled to shrink
            self._epoch_ooms += 1
