"""One Keras training step run as ``k`` micro-batches whose gradients are accumulated and applied once.

Used by :class:`~ivyplug.integrations.keras.load_balancer.IvyLoadBalancer` to get a step that ran out of
memory through on the same data. Each replica splits its slice of the batch (``n`` samples) into ``k``
consecutive parts of ``n_j`` samples (:func:`ivyplug.load.part_sizes`, larger first), computes each
part's gradient exactly as Keras's ``train_step`` does (``_compute_loss`` with its distribution scaling
and regularisation losses, ``optimizer.scale_loss``) and sums them weighted by ``n_j / n``. For a loss
that is a mean over samples this is the gradient of the whole slice: ``sum_j (n_j/n) * mean_j = mean``;
batch-independent terms (weight regularisers) keep weight ``sum_j n_j/n = 1``. The sum is applied with
one ``optimizer.apply_gradients`` (so one optimizer iteration, and under ``MirroredStrategy`` one
cross-replica all-reduce, as in a normal step). Layers whose output depends on the batch composition
(``BatchNormalization`` in training mode) see micro-batch statistics instead: the update is then close
to, not equal to, the full-batch one.

The parts run one after the other (each part's input waits on the previous part's gradients), so only
one part's activations are alive at a time: that is what makes splitting save memory in a graph where
independent branches could otherwise run concurrently. Metrics and the loss tracker are updated per
part, weighted by its size, so the epoch's running means are those of the whole batch.

Written against the Keras 3.15 TensorFlow trainer (``keras/src/backend/tensorflow/trainer.py``):
``train_step``'s private helpers are used, so other versions are refused by :func:`unsupported_reason`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

#: Keras versions (major, minor) whose ``TensorFlowTrainer.train_step`` this module mirrors.
CHECKED_VERSIONS: tuple[tuple[int, int], ...] = ((3, 15),)


def unsupported_reason(model: Any) -> str | None:
    """Why a micro-batched step cannot replace this model's failed step, or ``None`` when it can."""
    version = tuple(int(p) for p in keras.__version__.split(".")[:2])
    if version not in CHECKED_VERSIONS:
        return f"micro-batch recovery was checked against Keras {CHECKED_VERSIONS} only, not {keras.__version__}"
    if keras.backend.backend() != "tensorflow":
        return f"micro-batch recovery needs the TensorFlow backend, not {keras.backend.backend()!r}"
    if type(model).train_step is not keras.Model.train_step:
        return "the model overrides train_step, so a micro-batched step could not do what its own step does"
    accumulate = int(getattr(getattr(model, "optimizer", None), "gradient_accumulation_steps", None) or 1)
    if accumulate > 1:
        return (
            f"the optimizer accumulates gradients (gradient_accumulation_steps={accumulate}): a step applies them "
            "only every few batches, so a micro-batched step could not be made one of those"
        )
    if int(getattr(model, "steps_per_execution", 1) or 1) != 1:
        return (
            f"steps_per_execution={model.steps_per_execution}: one train_function call then runs several "
            "batches, some of which may already have updated the weights when the error is raised"
        )
    return None


def _slice(structure: Any, start: tf.Tensor, size: tf.Tensor) -> Any:
    return tf.nest.map_structure(lambda t: None if t is None else t[start : start + size], structure)


class MicroBatchStep:
    """``step(data, parts)``: one training step on ``data`` (a batch as the input pipeline yields it,
    per-replica values under a strategy) in ``parts`` micro-batches per replica; returns the step's logs."""

    def __init__(self, model: Any) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(reason)
        self.model = model
        self._functions: dict[int, Callable[[Any], Any]] = {}

    def __call__(self, data: Any, parts: int) -> Any:
        if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
            raise ValueError(f"parts must be an int >= 1, got {parts!r}")
        function = self._functions.get(parts)
        if function is None:
            function = self._functions[parts] = self._make(parts)
        return function(data)

    def _make(self, parts: int) -> Callable[[Any], Any]:
        from keras.src.backend.tensorflow import trainer as tf_trainer
        from keras.src.losses import loss as loss_module
        from keras.src.trainers.data_adapters import data_adapter_utils

        model = self.model

        def replica_step(data: Any) -> Any:
            x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
            first = next(t for t in tf.nest.flatten(x) if t is not None)
            total = tf.shape(first)[0]
            base, extra = total // parts, total % parts
            weights = model.trainable_weights
            summed: list[tf.Tensor] | None = None
            start = tf.constant(0, tf.int32)
            logs: Any = None
            for j in range(parts):
                size = base + tf.cast(j < extra, tf.int32)
                xs, ys, sws = (_slice(v, start, size) for v in (x, y, sample_weight))
                if summed is not None:  # run the parts one after another: one part's activations at a time
                    with tf.control_dependencies(summed):
                        xs = tf.nest.map_structure(tf.identity, xs)
                with tf.GradientTape() as tape:
                    y_pred = model(xs, training=True) if model._call_has_training_arg else model(xs)
                    loss = model._compute_loss(x=xs, y=ys, y_pred=y_pred, sample_weight=sws, training=True)
                    unscaled = loss_module.unscale_loss_for_distribution(loss)
                    model._loss_tracker.update_state(unscaled, sample_weight=size)
                    loss = model.optimizer.scale_loss(loss)
                grads = tape.gradient(loss, weights)
                share = tf.cast(size, tf.float32) / tf.cast(total, tf.float32)
                scaled = [
                    tf.zeros_like(w) if g is None else tf.convert_to_tensor(g) * tf.cast(share, g.dtype)
                    for g, w in zip(grads, weights, strict=True)
                ]
                summed = scaled if summed is None else [a + b for a, b in zip(summed, scaled, strict=True)]
                logs = model.compute_metrics(xs, ys, y_pred, sample_weight=sws)
                start = start + size
            if summed:
                model.optimizer.apply_gradients(zip(summed, weights, strict=True))
            return logs

        def step(data: Any) -> Any:
            strategy = model.distribute_strategy
            outputs = strategy.run(replica_step, args=(data,))
            # Looked up at call time, so ivyplug's MWMS fix of this function applies as for Keras's own step.
            return tf_trainer.reduce_per_replica(outputs, strategy, reduction="auto")

        return step if model.run_eagerly else tf.function(step, reduce_retracing=True)
