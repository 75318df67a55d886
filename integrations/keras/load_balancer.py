"""``IvyLoadBalancer`` for Keras: load-aware global batch size and learning rate inside ``model.fit``.

The decisions are ivyplug's framework-free core (:mod:`ivyplug.load`): probes polled by a background
:class:`~ivyplug.load.Sampler`, :class:`~ivyplug.load.BatchSizePolicy` for the batch size and
:func:`~ivyplug.load.lr_factor` for the learning rate. This module only wires them into Keras:

* **Once per epoch, identical everywhere.** At each epoch end every worker turns its sampler window
  into a :class:`~ivyplug.load.LoadObservation`; with several workers (MultiWorkerMirroredStrategy) the
  observations are exchanged with one cross-replica ``SUM`` reduce through
  ``self.model.distribute_strategy`` (each worker writes its own slot of a
  zero vector, so the sum copies the values exactly), then every worker runs the same pure policy on
  the same inputs and reaches the same decision. Every worker makes the same collective call in the
  same order, which MultiWorkerMirroredStrategy requires. In one process (one device, MirroredStrategy)
  the replicas share one callback, one pipeline and mirrored optimizer variables, so no collective is
  needed. (Callbacks run outside the strategy scope, so ``tf.distribute.get_strategy()`` would be the
  default strategy there.)
* **Batch size** changes go through :class:`~ivyplug.integrations.keras.elastic.ElasticDataset`: the
  new size is scheduled at the first step the input pipeline has not produced yet (``lag`` steps after
  the last consumed one) and is a multiple of the number of replicas.
* **Learning rate** is multiplied by ``lr_factor(old, new, rule)`` with ``optimizer.learning_rate.assign``
  in ``on_train_batch_begin`` of exactly that step, when the new batch size reaches the model.
  ``lr_scaling="auto"`` is the square-root rule for Adam-family optimizers and LAMB, linear for SGD.
  An optimizer driven by a ``LearningRateSchedule`` has no variable to assign: ``fit`` then stops at
  ``on_train_begin`` with a ``ValueError`` unless ``lr_scaling="none"``.
* **Growth has to pay** (``goodput=True``, the default): a growth the utilisation and memory rules ask for
  happens only when the predicted goodput, throughput × statistical efficiency (:mod:`ivyplug.load.goodput`),
  rises by ``goodput_threshold``. Under ``MirroredStrategy`` the callback wraps the optimizer's
  ``_all_reduce_sum_gradients`` (the TensorFlow optimizer's one cross-replica gradient sum) to add, inside the
  compiled step, each replica's |gradient|² before the sum and the summed gradient's after it into
  ``ON_READ`` variables: no extra tensor leaves a replica, and the callback reads three scalars per epoch.
  Keras scales each replica's loss by 1/replicas, so a replica's own mean gradient is replicas × its
  gradient. The throughput side is the median wall seconds per step, of which the ``train_function`` call is
  taken to scale with B. Where no estimate exists (one replica; several workers, whose per-worker norms this
  callback does not exchange) B does not grow, with one warning naming why.
* **Metrics** go into ``logs`` at each epoch end (so into ``History``, TensorBoard and the progress bar):
  ``ivy/batch_size``, ``ivy/lr_factor`` (current LR / LR at the start), ``ivy/utilization``,
  ``ivy/memory_fraction``, ``ivy/oom_count``, ``ivy/callback_overhead`` (this callback's hook time over
  the epoch's training time), the epoch mean of every probe reading as ``ivy/<key>``
  (``ivy/cpu_util``, ``ivy/mem_used``, ``ivy/gpu0_util``, ...) and, per worker ``r``,
  ``ivy/rank{r}/utilization``, ``ivy/rank{r}/memory_fraction`` and ``ivy/rank{r}/oom_count`` (the names the
  Lightning twin logs). With ``log_every_n_steps`` the latest readings are also added to the batch logs every n
  steps.

Keras backends: everything above works on TensorFlow; on JAX and PyTorch the model is one replica (their
trainers take the global batch in one process) and the batch size, the learning rate (on JAX written into the
trainer's state: ``model.jax_state_sync()`` first, so the next step reads it), the probes and the metrics work the
same. What cannot apply there warns once and says why: the gradient noise scale (the per-replica gradients are not
visible, so B does not grow under ``goodput=True``), sharing readings between JAX processes (each decides from its
own; under ``torchrun`` on PyTorch one ``all_reduce`` per epoch shares them), and the micro-batch split below (an
out-of-memory error of the backend is counted and stops ``fit`` as an ``OutOfMemoryRecoveryError`` that says why).

Out of memory (:class:`ElasticDataset` input, Keras 3.15, TensorFlow backend): the callback wraps
``model.train_function`` for the duration of ``fit`` (installed in ``on_train_begin``, which Keras calls
right after ``make_train_function``; removed in ``on_train_end``). A ``tf.errors.ResourceExhaustedError``
raised by step ``i`` is caught there. Batch ``i`` is a pure function of ``i`` and the schedule, so it is
rebuilt from the dataset (every replica's slice) and trained as ``k = 2`` micro-batches per replica whose
gradients are summed weighted by micro-batch size and applied once
(:class:`~ivyplug.integrations.keras.micro_batches.MicroBatchStep`): the same data and, for a mean loss,
the same update as the step that failed; no batch is lost and ``fit`` goes on. Another OOM doubles ``k``
up to ``oom_max_parts`` (and at most the replica's slice size), then
:class:`~ivyplug.load.OutOfMemoryRecoveryError` says how far it went. Later steps with a batch at least as
large as the failed one start from the ``k`` that worked. On one device they first run whole (Keras's own
call takes the batch from the iterator) and are split only if that fails again. Under ``MirroredStrategy``
the distributed iterator can be out of step after a failed call (it may have handed one replica its
element and not the other: observed here as a later step feeding one replica the previous step's larger
slice), so for the rest of that ``fit`` every batch is built from the :class:`ElasticDataset` by its index
and run by the callback, whole or split. At the epoch's end the policy sees the epoch's OOM count (OOMs
at a size already scheduled to shrink do not count again) and lowers B (ignoring the cooldown, and B
does not grow back above that size); the new size reaches the model
``lag`` steps later, like any change, and the LR is rescaled then. ``ivy/oom_count`` counts the OOM
errors met so far; :attr:`IvyLoadBalancer.recovered_steps` lists ``(step, parts)`` of each split step.

Where the step cannot be split, an OOM still stops ``fit``, as an ``OutOfMemoryRecoveryError`` that says
why (raised ``from`` the original error, though Keras's traceback filtering drops that link; set
``keras.config.disable_traceback_filtering()`` to keep it): a monitoring-only callback (no
``ElasticDataset``: the failed batch cannot be rebuilt) leaves the error untouched;
``steps_per_execution > 1`` (one call runs several batches, some of which may already have changed the
weights); a model that overrides ``train_step``; another Keras version or backend. Under
MultiWorkerMirroredStrategy the error is local to one worker
while its peers wait in the step's all-reduce (and after the failed worker leaves they block for good:
the test file ``tests/integrations/keras/test_mwms.py`` notes that a lone MWMS worker ignores SIGTERM);
a split step would have to be agreed on by every worker before any of them starts it, and a worker that
did not fail has no way to learn that another one did, so recovery is refused there with that reason.
A failed attempt may have run state updates that do not wait for the data: the optimizer's iteration
counter (the callback resets it to its count of completed steps before the split step), random seed
generators (Dropout masks then differ from an uninterrupted run), and the loss tracker if the OOM hit
the backward pass (that epoch's running ``loss`` can include a part of the failed attempt). The weights,
the optimizer slots and the data seen are those of one step on the whole batch. Per step, the guard
costs one extra Python call and an integer increment.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from ivyplug.integrations.keras.elastic import ElasticDataset
from ivyplug.integrations.keras.micro_batches import MicroBatchStep, unsupported_reason

from ivyplug.load import (
    DEFAULT_PROBE_NAMES,
    BatchSizePolicy,
    GoodputEstimate,
    LoadObservation,
    NoiseScale,
    OutOfMemoryRecoveryError,
    PolicyState,
    Probe,
    Sampler,
    ScriptedProbe,
    StepCost,
    default_batch_bounds,
    default_probes,
    lr_factor,
    make_probe,
    next_split,
    noise_components,
    observation_from_summary,
    resolve_rule,
)

#: Probes polled when none are given: the same as the Lightning twin's (the torch allocator probe reads
#: nothing but an OOM count where torch has no CUDA device).
DEFAULT_PROBES: tuple[str, ...] = DEFAULT_PROBE_NAMES
_SLOT = 5  # per-worker observation: util, util known, memory fraction, memory known, oom count


def _policy_config(policy: BatchSizePolicy | None) -> dict[str, Any] | None:
    return None if policy is None else dataclasses.asdict(policy)


def _probe_config(spec: str | Mapping[str, Any] | Probe) -> str | dict[str, Any]:
    if isinstance(spec, str):
        return spec
    if isinstance(spec, Mapping):
        return dict(spec)
    if isinstance(spec, ScriptedProbe) and spec.clock is None:
        return {"name": "scripted", "trace": spec.trace, "loop": spec.loop}
    raise ValueError(
        f"probe {spec!r} cannot be written to a config: pass probes by name or as {{'name': ..., **kwargs}} dicts"
    )


def _backend() -> str:
    """The Keras backend (``"tensorflow"``, ``"jax"``, ``"torch"``), fixed when Keras was imported."""
    return str(keras.backend.backend())


def _is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is the backend's out-of-memory error (TensorFlow, PyTorch or JAX/XLA)."""
    if isinstance(exc, tf.errors.ResourceExhaustedError):
        return True
    backend = _backend()
    if backend == "torch":
        import torch

        return isinstance(exc, torch.OutOfMemoryError)
    if backend == "jax":
        return type(exc).__name__ in ("XlaRuntimeError", "JaxRuntimeError") and "RESOURCE_EXHAUSTED" in str(exc)
    return False


def _inner_optimizer(model: Any) -> Any:
    optimizer = model.optimizer
    return getattr(optimizer, "inner_optimizer", optimizer)  # LossScaleOptimizer


class IvyLoadBalancer(keras.callbacks.Callback):
    """Adapt the global batch size (and learning rate) to device load during ``model.fit``.

    The options both twins share (this one and ``ivyplug.integrations.lightning.IvyLoadBalancer``) have the same
    names, defaults and meaning, so a config moves between them; ``dataset`` and ``device_index`` are Keras's own.

    Args:
        dataset: the :class:`ElasticDataset` that feeds ``fit``; without one the callback only monitors.
        probes: probe names from the registry (``"nvml"``, ``"psutil"``, ``"scripted"``...), ``{"name": ...,
            **kwargs}`` dicts or probe objects; default :data:`DEFAULT_PROBES`.
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
        probes: Sequence[str | Mapping[str, Any] | Probe] | None = None,
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
    ) -> None:
        super().__init__()
        if dataset is not None and not isinstance(dataset, ElasticDataset):
            raise ValueError(f"dataset must be an ElasticDataset or None, got {type(dataset).__name__}")
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not 0 < interval < math.inf:
            raise ValueError(f"interval must be a positive number of seconds, got {interval!r}")
        if oom_max_parts is None:
            raise ValueError("oom_max_parts must be an int >= 1, got None")
        optional_ints = (
            ("device_index", device_index, 0),
            ("log_every_n_steps", log_every_n_steps, 1),
            ("min_batch_size", min_batch_size, 1),
            ("max_batch_size", max_batch_size, 1),
            ("oom_max_parts", oom_max_parts, 1),
        )
        for name, value, low in optional_ints:
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                allowed = "an int" if name == "oom_max_parts" else "None or an int"
                raise ValueError(f"{name} must be {allowed} >= {low}, got {value!r}")
        if policy is not None and not isinstance(policy, BatchSizePolicy):
            raise ValueError(f"policy must be an ivyplug.load.BatchSizePolicy, got {policy!r}")
        resolve_rule(lr_scaling, "SGD")  # validates the rule name
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
        bounds = (min_batch_size or 1, max_batch_size or max(min_batch_size or 1, 1))
        BatchSizePolicy(*bounds, **self._policy_args)  # validates every policy argument now
        self.dataset = dataset
        self.probe_specs = list(DEFAULT_PROBES if probes is None else probes)
        for spec in self.probe_specs:
            if not isinstance(spec, (str, Mapping, Probe)):
                raise ValueError(f"probes must hold names, dicts or Probe objects, got {spec!r}")
        self.interval = float(interval)
        self.adapt_batch_size = bool(adapt_batch_size)
        self.oom_recovery = bool(oom_recovery)
        self._user_policy = policy
        self.min_batch_size = min_batch_size
        self.max_batch_size = max_batch_size
        self.lr_scaling = lr_scaling
        self.device_index = device_index
        self.log_every_n_steps = log_every_n_steps
        self.oom_max_parts = oom_max_parts

        self.policy: BatchSizePolicy | None = None
        self.policy_state: PolicyState | None = None
        self.sampler: Sampler | None = None
        self.epoch = 0  # the epoch in progress (a ScriptedProbe clock can read it)
        self.step = 0  # global steps consumed in the current fit
        self.lr_factor = 1.0  # current LR / LR when training started
        self.oom_count = 0  # out-of-memory errors met (each failed attempt counts)
        self.recovered_steps: list[tuple[int, int]] = []  # (step in its fit, micro-batches per replica)
        self._epoch_ooms = 0
        self._split: tuple[int, int] | None = None  # (global B that ran out of memory, parts that worked)
        self._micro: MicroBatchStep | None = None
        self._guard_reason: str | None = None
        self._unguarded: Any = None  # Keras's own train_function while ours wraps it
        self._iterations = 0  # optimizer iterations after the last completed step (kept without reading it)
        self._own_batches = False  # this fit reads its batches from the ElasticDataset, not Keras's iterator
        self.decisions: list[tuple[int, int, int, str]] = []  # (epoch, old B, new B, reason)
        self.reasons: list[tuple[int, str]] = []  # (epoch, reason) of every decision, changes and holds
        self.noise = NoiseScale(smoothing=noise_smoothing)  # validates noise_smoothing
        self.noise_smoothing = float(noise_smoothing)
        self.step_costs: list[StepCost] = []  # (B, wall seconds per step, train_function seconds per step)
        self.goodput_unavailable: str | None = None  # why this fit has no noise-scale estimate
        self.initial_batch_size: int | None = None  # B when the first fit started (min_efficiency's reference)
        self.noise_history: list[float | None] = []  # B_noise after each epoch
        self._noise_vars: tuple[Any, Any, Any] | None = None  # ON_READ sums: R²|g_r|², |G|², steps
        self._watched: Any = None  # the optimizer whose gradient sum is watched
        self._noise_batch = 0  # the global batch of the steps summed in _noise_vars
        self._goodput_warned = False
        self._warned: set[str] = set()  # keys of the once-per-callback warnings given
        self._step_walls: list[float] = []
        self._step_calls: list[float] = []
        self._batch_t = 0.0
        self.epoch_start_positions: dict[int, int] = {}
        self._rule = "none"
        self._pending: list[tuple[int, float]] = []  # (step, LR factor) not applied yet
        self._next_start: tuple[int, int] | None = None  # (B, stream position) for the next fit
        self._chunk_begin = 0
        self._hook_s = 0.0  # time spent in this callback's hooks this epoch
        self._epoch_t0 = 0.0
        self._last_batch_t = 0.0

    # ----------------------------------------------------------------- config
    def get_config(self) -> dict[str, Any]:
        """Constructor arguments as plain values (the dataset is not part of the config)."""
        return {
            "probes": [_probe_config(p) for p in self.probe_specs],
            "interval": self.interval,
            "adapt_batch_size": self.adapt_batch_size,
            "min_batch_size": self.min_batch_size,
            "max_batch_size": self.max_batch_size,
            **self._policy_args,
            "noise_smoothing": self.noise_smoothing,
            "policy": _policy_config(self._user_policy),
            "lr_scaling": self.lr_scaling,
            "log_every_n_steps": self.log_every_n_steps,
            "oom_recovery": self.oom_recovery,
            "oom_max_parts": self.oom_max_parts,
            "device_index": self.device_index,
        }

    @classmethod
    def from_config(cls, config: Mapping[str, Any], dataset: ElasticDataset | None = None) -> IvyLoadBalancer:
        """Build from a config dict (``get_config()`` output, or a hand-written subset of it)."""
        if not isinstance(config, Mapping):
            raise ValueError(f"config must be a dict of IvyLoadBalancer arguments, got {config!r}")
        known = set(cls(None).get_config())
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
        return getattr(self.model, "distribute_strategy", None) if _backend() == "tensorflow" else None

    def _replicas(self) -> int:
        """Replicas that each get a slice of the global batch from the input pipeline (1 outside tf.distribute:
        JAX's and PyTorch's trainers take the global batch in one process)."""
        strategy = self.strategy
        return 1 if strategy is None else int(strategy.num_replicas_in_sync)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    def _batch_multiple(self) -> int:
        """What every global batch size must be a multiple of: the replicas under ``tf.distribute``; on JAX under a
        ``keras.distribution`` (``DataParallel``), the devices along its batch axis (the batch is sharded there)."""
        if self.strategy is not None or _backend() != "jax":
            return self._replicas()
        distribution = keras.distribution.distribution()
        mesh = getattr(distribution, "device_mesh", None)
        axis = getattr(distribution, "batch_dim_name", None)
        if mesh is None or axis not in tuple(mesh.axis_names):
            return 1
        return int(mesh.shape[list(mesh.axis_names).index(axis)])

    def _round(self, batch_size: int) -> int:
        assert self.dataset is not None
        r = self._batch_multiple()
        top = (self.dataset.num_samples // r) * r
        return max(r, min(top, (batch_size // r) * r))

    def _build_policy(self) -> None:
        assert self.dataset is not None
        if self._user_policy is not None:
            self.policy = self._user_policy
            return
        low, high = default_batch_bounds(self.dataset.batch_size, self._batch_multiple())
        low = self._round(self.min_batch_size if self.min_batch_size is not None else low)
        high = self._round(self.max_batch_size if self.max_batch_size is not None else max(high, low))
        self.policy = BatchSizePolicy(min(low, high), max(low, high), **self._policy_args)

    def _current_lr(self) -> float:
        return float(np.asarray(keras.ops.convert_to_numpy(_inner_optimizer(self.model).learning_rate)))

    def _apply_lr(self, factor: float) -> None:
        if factor == 1.0:
            return
        sync = getattr(self.model, "jax_state_sync", None)
        if callable(sync):
            # JAX trains on a state tuple outside the variables: write it back first, which also makes the
            # next step read its state from the variables again, so the assignment below takes effect.
            sync()
        variable = _inner_optimizer(self.model).learning_rate
        variable.assign(self._current_lr() * factor)
        self.lr_factor *= factor

    # ----------------------------------------------------------------- hooks
    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        optimizer = _inner_optimizer(self.model)
        self._rule = resolve_rule(self.lr_scaling, optimizer)
        if self._rule != "none" and isinstance(
            getattr(optimizer, "_learning_rate", None), keras.optimizers.schedules.LearningRateSchedule
        ):
            raise ValueError(
                "IvyLoadBalancer rescales the learning rate with optimizer.learning_rate.assign, but this optimizer "
                "uses a LearningRateSchedule; pass lr_scaling='none' (or use a constant learning rate)"
            )
        self.step = 0
        self._pending = [(0, f) for _, f in self._pending]  # left over from an interrupted fit: apply first
        if self.dataset is None:
            warnings.warn(
                "IvyLoadBalancer has no ElasticDataset: it monitors load but cannot change the batch size",
                RuntimeWarning,
                stacklevel=2,
            )
        else:
            if self.dataset.num_replicas != self._replicas():
                raise ValueError(
                    f"the ElasticDataset was built for {self.dataset.num_replicas} replica(s) but the model's "
                    f"strategy has {self._replicas()}: pass model.distribute_strategy to tf_dataset()"
                )
            batch, position = self._next_start or (self.dataset.batch_size, self.dataset.position_at(0))
            if self.initial_batch_size is None:
                self.initial_batch_size = batch
            self.dataset.restart(batch, start_position=position)
            if self.policy is None:
                self._build_policy()
        if self.sampler is None:
            # the defaults skip a probe whose package is missing (torch_allocator without torch), as Lightning's do
            built = default_probes() if self.probe_specs == list(DEFAULT_PROBES) else map(make_probe, self.probe_specs)
            self.sampler = Sampler(list(built), interval=self.interval)
        self._watch_gradients()
        if self.dataset is not None and self.oom_recovery:
            self._install_step_guard()

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        t = time.perf_counter()
        self._epoch_t0 = self._last_batch_t = t
        self.epoch = epoch
        self._epoch_ooms = 0
        self._step_walls = []
        self._step_calls = []
        if self.dataset is not None:
            self.epoch_start_positions[epoch] = self.dataset.position_at(self.step)
        if self.sampler is not None:
            self.sampler.reset_window()
        self._hook_s = time.perf_counter() - t

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        t = time.perf_counter()
        self._chunk_begin = batch
        while self._pending and self._pending[0][0] <= self.step:
            self._apply_lr(self._pending.pop(0)[1])
        if self._noise_vars is not None and self.dataset is not None:
            batch_now = self.dataset.batch_size_at(self.step)
            if batch_now != self._noise_batch:  # the sums hold steps of one batch size only
                self._flush_noise()
                self._noise_batch = batch_now
        self._batch_t = time.perf_counter()
        self._hook_s += self._batch_t - t

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        t = time.perf_counter()
        steps = batch - self._chunk_begin + 1
        self._step_calls.append((t - self._batch_t) / steps)
        self._step_walls.append((t - self._last_batch_t) / steps)
        self.step += steps
        n = self.log_every_n_steps
        if n is not None and logs is not None and self.sampler is not None and self.step % n == 0:
            logs.update({f"ivy/{k}": v for k, v in self.sampler.latest().items()})
        self._last_batch_t = time.perf_counter()
        self._hook_s += self._last_batch_t - t

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        t = time.perf_counter()
        assert self.sampler is not None
        # one reading at the epoch's end, as the Lightning twin takes: an epoch shorter than the sampling
        # interval has one then, and never a reading of the epoch before (the window dropped those)
        self.sampler.sample_now()
        summary = self.sampler.summary()
        local = observation_from_summary(summary, self.device_index, self._epoch_ooms)
        workers = self._exchange(local)
        observation = _combine(workers)
        metrics: dict[str, float] = {f"ivy/{k}": float(s.mean) for k, s in summary.items()}
        self._flush_noise()
        self._record_cost()
        if self.noise.value is not None:
            metrics["ivy/noise_scale"] = float(self.noise.value)
        self.noise_history.append(self.noise.value)
        if self.dataset is not None:
            # An epoch with an OOM shrinks B (the policy ignores its cooldown for that).
            self._decide(epoch, observation)
            metrics["ivy/batch_size"] = float(self.dataset.batch_size_at(max(self.step - 1, 0)))
        metrics["ivy/lr_factor"] = float(self.lr_factor)
        metrics["ivy/oom_count"] = float(self.oom_count)
        if observation.utilization is not None:
            metrics["ivy/utilization"] = float(observation.utilization)
        if observation.memory_fraction is not None:
            metrics["ivy/memory_fraction"] = float(observation.memory_fraction)
        for r, obs in enumerate(workers):  # ivy/rank{r}/...: the Lightning twin's names
            if obs.utilization is not None:
                metrics[f"ivy/rank{r}/utilization"] = float(obs.utilization)
            if obs.memory_fraction is not None:
                metrics[f"ivy/rank{r}/memory_fraction"] = float(obs.memory_fraction)
            metrics[f"ivy/rank{r}/oom_count"] = float(obs.oom_count)
        # Hook time over training time (epoch start to last batch, plus this hook); validation not counted.
        hooks = self._hook_s + (time.perf_counter() - t)
        metrics["ivy/callback_overhead"] = hooks / max(
            self._last_batch_t - self._epoch_t0 + (time.perf_counter() - t), 1e-9
        )
        if logs is not None:
            logs.update(metrics)

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        self._remove_step_guard()
        if self.dataset is not None:
            # The next fit starts a new iterator at batch 0: continue the stream, with what is scheduled.
            self._next_start = (self.dataset.batch_size, self.dataset.position_at(self.step))
        self._pending = [(0, f) for _, f in self._pending]
        self.close()

    def close(self) -> None:
        """Stop the sampler thread (``on_train_end`` does this)."""
        if self.sampler is not None:
            self.sampler.close()
            self.sampler = None

    # ----------------------------------------------------------------- decisions
    def _exchange(self, local: LoadObservation) -> list[LoadObservation]:
        """Every worker's observation, identical on every worker (one SUM reduce per epoch)."""
        row = np.array(
            [
                local.utilization or 0.0,
                float(local.utilization is not None),
                local.memory_fraction or 0.0,
                float(local.memory_fraction is not None),
                float(local.oom_count),
            ],
            dtype=np.float32,
        )
        strategy = self.strategy
        if strategy is None:
            return self._exchange_other_backend(local, row)
        replicas = int(strategy.num_replicas_in_sync)
        if replicas == 1:  # the default strategy has no worker_devices
            return [local]
        per_worker = len(strategy.extended.worker_devices)
        workers = replicas // per_worker
        if workers == 1:  # one process (single device, MirroredStrategy): nothing to agree on
            return [local]

        def slot(context: Any) -> tf.Tensor:
            vector = np.zeros(workers * _SLOT, dtype=np.float32)
            replica = context.replica_id_in_sync_group
            if replica % per_worker == 0:  # one writer per worker
                w = replica // per_worker
                vector[w * _SLOT : (w + 1) * _SLOT] = row
            return tf.constant(vector)

        values = strategy.experimental_distribute_values_from_function(slot)
        total = np.asarray(strategy.reduce("SUM", values, axis=None)).reshape(workers, _SLOT)
        return _observations(total)

    def _exchange_other_backend(self, local: LoadObservation, row: np.ndarray) -> list[LoadObservation]:
        """PyTorch under torchrun: one gloo/NCCL ``all_reduce`` (SUM) of the workers' slots. JAX with several
        processes: not exchanged (warned once), each process decides from its own readings."""
        backend = _backend()
        if backend == "torch":
            import torch
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
                return [local]
            workers, rank = dist.get_world_size(), dist.get_rank()
            vector = torch.zeros(workers * _SLOT, dtype=torch.float64)
            vector[rank * _SLOT : (rank + 1) * _SLOT] = torch.from_numpy(row.astype(np.float64))
            if dist.get_backend() == "nccl":
                vector = vector.cuda()
            dist.all_reduce(vector)
            return _observations(vector.cpu().numpy().reshape(workers, _SLOT))
        if backend == "jax":
            import jax

            if jax.process_count() > 1:
                self._warn_once(
                    "jax_exchange",
                    f"IvyLoadBalancer: {jax.process_count()} JAX processes do not exchange their load readings "
                    "(implemented for tf.distribute on TensorFlow and torch.distributed on PyTorch): each process "
                    "decides from its own, so their batch-size decisions may differ",
                )
        return [local]

    def _decide(self, epoch: int, observation: LoadObservation) -> None:
        assert self.dataset is not None and self.policy is not None
        if not self.adapt_batch_size:
            return
        old = self.dataset.batch_size
        estimate = GoodputEstimate(
            self.noise.value, tuple(self.step_costs), self.goodput_unavailable, self.initial_batch_size
        )
        decision = self.policy.decide(old, observation, self.policy_state, estimate)
        self.policy_state = decision.state
        self.reasons.append((epoch, decision.reason))
        new = self._round(decision.batch_size)
        if not decision.changed or new == old:
            return
        # Not a batch the pipeline has produced already (a PyDataset may read further ahead than ``lag``).
        at = max(self.dataset.earliest_change_step(self.step), self.dataset.produced_step() + 1)
        every = int(getattr(self.model, "steps_per_execution", 1) or 1)
        at = math.ceil(at / every) * every
        self.dataset.set_batch_size(new, at_step=at)
        self._pending.append((at, lr_factor(old, new, self._rule)))
        self.decisions.append((epoch, old, new, decision.reason))

    # ----------------------------------------------------------------- gradient noise scale
    def _goodput_on(self) -> bool:
        return self.policy.goodput if self.policy is not None else bool(self._policy_args["goodput"])

    def _watch_gradients(self) -> None:
        """Count |per-replica gradient|² and |summed gradient|² in the compiled step (once per optimizer)."""
        strategy = self.strategy
        replicas = self._replicas()
        self.goodput_unavailable = None
        if strategy is None:
            self.goodput_unavailable = (
                f"on the {_backend()} backend the train step's per-replica gradients are not visible to a callback "
                "(the noise scale needs the gradient at two batch sizes)"
            )
        elif replicas == 1:
            self.goodput_unavailable = "one replica sees its gradient at one batch size only, the noise scale needs two"
        elif self._workers() > 1:
            self.goodput_unavailable = (
                "under MultiWorkerMirroredStrategy the per-worker gradient norms are not exchanged by this callback"
            )
        optimizer = _inner_optimizer(self.model)
        if self.goodput_unavailable is None and not callable(getattr(optimizer, "_all_reduce_sum_gradients", None)):
            self.goodput_unavailable = (
                f"{type(optimizer).__name__} has no _all_reduce_sum_gradients (a TensorFlow-backend Keras optimizer "
                "has), so the per-replica gradients are not visible"
            )
        if self.goodput_unavailable is not None:
            if self.adapt_batch_size and self.dataset is not None and self._goodput_on() and not self._goodput_warned:
                self._goodput_warned = True
                warnings.warn(
                    f"IvyLoadBalancer(goodput=True): no gradient noise scale estimate: {self.goodput_unavailable}; "
                    "the batch size will not grow (it still shrinks on memory pressure). Pass goodput=False to let "
                    "utilisation and memory alone decide.",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return
        used = self.adapt_batch_size and self.dataset is not None and self._goodput_on()
        if self._watched is optimizer or not used:
            return  # the watch costs two squared norms per step: only where the goodput rule uses them
        with strategy.scope():
            sums = tuple(
                tf.Variable(
                    0.0,
                    trainable=False,
                    dtype=tf.float32,
                    synchronization=tf.VariableSynchronization.ON_READ,
                    aggregation=tf.VariableAggregation.SUM,
                    name=f"ivy_noise_{name}",
                )
                for name in ("local", "combined", "steps")
            )
        local_sum, combined_sum, step_sum = sums
        original = optimizer._all_reduce_sum_gradients

        def sq_norm(grads: list[Any]) -> Any:
            return tf.add_n([tf.reduce_sum(tf.square(tf.cast(tf.convert_to_tensor(g), tf.float32))) for g in grads])

        def watched(grads_and_vars: Any) -> Any:
            grads_and_vars = list(grads_and_vars)
            reduced = original(grads_and_vars)
            context = tf.distribute.get_replica_context()
            own = [g for g, _ in grads_and_vars if g is not None]
            summed = [g for g, _ in reduced if g is not None]
            if context is not None and own and summed:
                r = float(context.num_replicas_in_sync)
                local_sum.assign_add(r * r * sq_norm(own))  # the loss was scaled by 1/r on each replica
                combined_sum.assign_add(sq_norm(summed))
                step_sum.assign_add(1.0)
            return reduced

        optimizer._all_reduce_sum_gradients = watched
        self._watched = optimizer
        self._noise_vars = sums
        self.model.make_train_function(force=True)  # trace the step again, with the watch in it
        self._noise_batch = self.dataset.batch_size_at(self.step) if self.dataset is not None else 0

    def _flush_noise(self) -> None:
        """Fold the steps summed since the last flush (all at one batch size) into the noise-scale EMA."""
        if self._noise_vars is None or self.dataset is None:
            return
        local_v, combined_v, steps_v = self._noise_vars
        replicas = self._replicas()
        steps = float(steps_v.read_value()) / replicas  # every replica counted each step
        if steps >= 1:
            small_sq = float(local_v.read_value()) / (replicas * steps)
            big_sq = float(combined_v.read_value()) / (replicas * steps)
            big = self._noise_batch
            if big > replicas:
                self.noise.update(*noise_components(small_sq, big / replicas, big_sq, big))
        for v in self._noise_vars:
            v.assign(0.0)

    def _record_cost(self) -> None:
        if self.dataset is None or not self._step_walls or not self._step_calls:
            return
        import statistics

        wall = statistics.median(self._step_walls)
        call = statistics.median(self._step_calls)
        if wall > 0 and call > 0:
            self.step_costs = [*self.step_costs, StepCost(self.dataset.batch_size_at(self.step - 1), wall, call)][-8:]

    # ----------------------------------------------------------------- out of memory
    def _workers(self) -> int:
        strategy = self.strategy
        if strategy is None:
            return 1  # the step guard's concern (tf.distribute's collectives) does not arise
        replicas = int(strategy.num_replicas_in_sync)
        return 1 if replicas == 1 else replicas // len(strategy.extended.worker_devices)

    def _install_step_guard(self) -> None:
        """Wrap ``model.train_function`` (built by Keras just before ``on_train_begin``) for this fit."""
        model = self.model
        current = model.train_function
        original = getattr(current, "_ivyplug_unguarded", current)  # left by a fit that raised
        if original is None:
            return
        reason = unsupported_reason(model)
        if reason is None and self._workers() > 1:
            reason = (
                "under MultiWorkerMirroredStrategy the error is local to one worker while the others wait in the "
                "step's all-reduce; a split step would have to start on every worker at once and the others cannot "
                "learn that one worker failed"
            )
        self._guard_reason = reason
        self._own_batches = False
        self._iterations = int(keras.ops.convert_to_numpy(_inner_optimizer(model).iterations))
        if reason is not None and _backend() != "tensorflow":
            self._warn_once(
                "oom_split",
                f"IvyLoadBalancer(oom_recovery=True): {reason}; on {_backend()!r} an out-of-memory error is counted "
                "and stops fit as an OutOfMemoryRecoveryError (the batch size, learning rate, probes and metrics "
                "work as on TensorFlow)",
            )
        if reason is None and self._micro is None:
            self._micro = MicroBatchStep(model)

        def guarded(*args: Any) -> Any:  # TensorFlow and PyTorch pass the iterator; JAX (state, iterator)
            return self._guarded_step(original, *args)

        guarded._ivyplug_unguarded = original  # type: ignore[attr-defined]
        self._unguarded = original
        model.train_function = guarded

    def _remove_step_guard(self) -> None:
        if self._unguarded is not None:
            self.model.train_function = self._unguarded
            self._unguarded = None

    def _record_oom(self, batch_size: int) -> None:
        self.oom_count += 1
        assert self.dataset is not None
        if batch_size <= self.dataset.batch_size:  # not at a size already scheduled to shrink
            self._epoch_ooms += 1

    def _known_split(self, step: int) -> int | None:
        """The micro-batch count that got a batch this large through before, if one did."""
        assert self.dataset is not None
        split = self._split
        return split[1] if split is not None and self.dataset.batch_size_at(step) >= split[0] else None

    def _guarded_step(self, original: Any, *args: Any) -> Any:
        step = self.step
        assert self.dataset is not None
        if self._own_batches:
            # After an OOM under MirroredStrategy the distributed iterator can be out of step with the replicas
            # (the failed call may have taken one replica's element and not another's): read batches straight
            # from the ElasticDataset for the rest of this fit, whole or split as a batch this large needs.
            return self._split_step(self._rebuild_batch(step), step, self._known_split(step) or 1)
        try:
            logs = original(*args)
            self._iterations += 1
            return logs
        except Exception as exc:
            if not _is_out_of_memory(exc):
                raise
            self._record_oom(self.dataset.batch_size_at(step))
            if self._guard_reason is not None:
                raise OutOfMemoryRecoveryError(
                    f"out of memory in training step {step} (global batch {self.dataset.batch_size_at(step)}); "
                    f"IvyLoadBalancer cannot split this step into micro-batches: {self._guard_reason}"
                ) from exc
            self._own_batches = self._replicas() > 1
            # A batch this large ran out of memory before: start from the split that worked then.
            return self._split_step(self._rebuild_batch(step), step, self._known_split(step), exc)

    def _rebuild_batch(self, step: int) -> Any:
        """Batch ``step`` as the pipeline fed it (the failed call consumed it from the iterator)."""
        data = self.dataset
        assert data is not None
        replicas = self._replicas()

        def arrays(replica: int) -> tuple[tf.Tensor, tf.Tensor]:
            index = data.indices(step, replica, replicas)
            return tf.constant(data.x[index]), tf.constant(data.y[index])

        if replicas == 1:
            return arrays(0)
        return self.strategy.experimental_distribute_values_from_function(
            lambda context: arrays(int(context.replica_id_in_sync_group))
        )

    def _split_step(self, batch: Any, step: int, parts: int | None, cause: BaseException | None = None) -> Any:
        assert self.dataset is not None and self._micro is not None
        size = self.dataset.batch_size_at(step)
        per_replica = size // self._replicas()
        # The iteration counter's increment does not wait for the gradients: a failed attempt may have run it.
        iterations = _inner_optimizer(self.model).iterations
        try:
            if parts is None:
                parts = next_split(1, per_replica, self.oom_max_parts)
            while True:
                try:
                    iterations.assign(self._iterations)
                    logs = self._micro(batch, parts)
                    break
                except tf.errors.ResourceExhaustedError as exc:
                    self._record_oom(size)
                    cause = exc
                    parts = next_split(parts, per_replica, self.oom_max_parts)
        except OutOfMemoryRecoveryError as exc:
            raise OutOfMemoryRecoveryError(f"training step {step} (global batch {size}): {exc}") from cause
        self._iterations += 1
        if parts > 1:
            self._split = (size, parts)
            self.recovered_steps.append((step, parts))
        return logs


def _combine(workers: list[LoadObservation]) -> LoadObservation:
    from ivyplug.load import combine_observations

    return combine_observations(workers)


def _observations(total: np.ndarray) -> list[LoadObservation]:
    """One :class:`LoadObservation` per row of a summed ``(workers, _SLOT)`` table."""
    return [
        LoadObservation(
            utilization=float(u) if uk else None,
            memory_fraction=float(m) if mk else None,
            oom_count=round(float(o)),
        )
        for u, uk, m, mk, o in total
    ]
