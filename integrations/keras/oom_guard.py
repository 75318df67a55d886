"""The Keras ``IvyLoadBalancer``'s out-of-memory guard: a failed training step rerun as micro-batches.

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

from typing import Any

import keras
import tensorflow as tf
from ivyplug.integrations.keras.micro_batches import MicroBatchStep, unsupported_reason
from ivyplug.integrations.keras.model_access import inner_optimizer, keras_backend

from ivyplug.load.oom import OutOfMemoryRecoveryError, next_split


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is the backend's out-of-memory error (TensorFlow, PyTorch or JAX/XLA)."""
    if isinstance(exc, tf.errors.ResourceExhaustedError):
        return True
    backend = keras_backend()
    if backend == "torch":
        import torch

        return isinstance(exc, torch.OutOfMemoryError)
    if backend == "jax":
        return type(exc).__name__ in ("XlaRuntimeError", "JaxRuntimeError") and "RESOURCE_EXHAUSTED" in str(exc)
    return False


class StepGuard:
    """Wraps ``model.train_function`` for one fit of ``owner`` (the callback: its data set, step, OOM counts)."""

    def __init__(self, owner: Any) -> None:
        self.owner = owner
        self.split: tuple[int, int] | None = None  # (global B that ran out of memory, parts that worked)
        self._micro: MicroBatchStep | None = None
        self.reason: str | None = None  # why a step cannot be split here
        self._unguarded: Any = None  # Keras's own train_function while ours wraps it
        self._iterations = 0  # optimizer iterations after the last completed step (kept without reading it)
        self._own_batches = False  # this fit reads its batches from the ElasticDataset, not Keras's iterator

    def count_from(self, model: Any) -> None:
        """Take the optimizer's step counter as it is now (at the first epoch's start again: a ``BackupAndRestore``
        after the balancer in the callbacks restores it after the balancer's ``on_train_begin``)."""
        self._iterations = int(keras.ops.convert_to_numpy(inner_optimizer(model).iterations))

    def install(self, model: Any, workers: int) -> None:
        """Wrap ``model.train_function`` (built by Keras just before ``on_train_begin``) for this fit."""
        current = model.train_function
        original = getattr(current, "_ivyplug_unguarded", current)  # left by a fit that raised
        if original is None:
            return
        reason = unsupported_reason(model)
        if reason is None and workers > 1:
            reason = (
                "under MultiWorkerMirroredStrategy the error is local to one worker while the others wait in the "
                "step's all-reduce; a split step would have to start on every worker at once and the others cannot "
                "learn that one worker failed"
            )
        self.reason = reason
        self._own_batches = False
        self.count_from(model)
        if reason is not None:
            where = f"; on {keras_backend()!r}" if keras_backend() != "tensorflow" else ";"
            self.owner._warn_once(
                "oom_split",
                f"IvyLoadBalancer(oom_recovery=True): {reason}{where} an out-of-memory error is counted and stops "
                "fit as an OutOfMemoryRecoveryError (the batch size, learning rate, probes and metrics work as "
                "without it)",
            )
        if reason is None and self._micro is None:
            self._micro = MicroBatchStep(model)

        def guarded(*args: Any) -> Any:  # TensorFlow and PyTorch pass the iterator; JAX (state, iterator)
            return self._guarded_step(original, *args)

        guarded._ivyplug_unguarded = original  # type: ignore[attr-defined]
        self._unguarded = original
        model.train_function = guarded

    def remove(self, model: Any) -> None:
        if self._unguarded is not None:
            model.train_function = self._unguarded
            self._unguarded = None

    def _known_split(self, step: int) -> int | None:
        """The micro-batch count that got a batch this large through before, if one did."""
        split = self.split
        return split[1] if split is not None and self.owner.dataset.batch_size_at(step) >= split[0] else None

    def _guarded_step(self, original: Any, *args: Any) -> Any:
        owner = self.owner
        step, data = owner.step, owner.dataset
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
            if not is_out_of_memory(exc):
                raise
            owner._record_oom(data.batch_size_at(step))
            if self.reason is not None:
                raise OutOfMemoryRecoveryError(
                    f"out of memory in training step {step} (global batch {data.batch_size_at(step)}); "
                    f"IvyLoadBalancer cannot split this step into micro-batches: {self.reason}"
                ) from exc
            self._own_batches = owner._replicas() > 1
            # A batch this large ran out of memory before: start from the split that worked then.
            return self._split_step(self._rebuild_batch(step), step, self._known_split(step), exc)

    def _rebuild_batch(self, step: int) -> Any:
        """Batch ``step`` as the pipeline fed it (the failed call consumed it from the iterator)."""
        data = self.owner.dataset
        replicas = self.owner._replicas()

        def arrays(replica: int) -> tuple[tf.Tensor, tf.Tensor]:
            index = data.indices(step, replica, replicas)
            return tf.constant(data.x[index]), tf.constant(data.y[index])

        if replicas == 1:
            return arrays(0)
        return self.owner.strategy.experimental_distribute_values_from_function(
            lambda context: arrays(int(context.replica_id_in_sync_group))
        )

    def _split_step(self, batch: Any, step: int, parts: int | None, cause: BaseException | None = None) -> Any:
        owner = self.owner
        assert self._micro is not None
        size = owner.dataset.batch_size_at(step)
        per_replica = size // owner._replicas()
        max_parts = owner.config.oom_max_parts
        # The iteration counter's increment does not wait for the gradients: a failed attempt may have run it.
        iterations = inner_optimizer(owner.model).iterations
        try:
            if parts is None:
                parts = next_split(1, per_replica, max_parts)
            while True:
                try:
                    iterations.assign(self._iterations)
                    logs = self._micro(batch, parts)
                    break
                except tf.errors.ResourceExhaustedError as exc:
                    owner._record_oom(size)
                    cause = exc
                    parts = next_split(parts, per_replica, max_parts)
        except OutOfMemoryRecoveryError as exc:
            raise OutOfMemoryRecoveryError(f"training step {step} (global batch {size}): {exc}") from cause
        self._iterations += 1
        if parts > 1:
            self.split = (size, parts)
            owner.recovered_steps.append((step, parts))
        return logs
