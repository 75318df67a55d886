"""Where the Keras ``IvyLoadBalancer`` sees the gradient at two batch sizes: the optimizer's cross-replica sum.

Under ``MirroredStrategy`` the callback wraps the optimizer's ``_all_reduce_sum_gradients`` (the TensorFlow
optimizer's one cross-replica gradient sum) to add, inside the compiled step, each replica's |gradient|² before the
sum and the summed gradient's after it into ``ON_READ`` variables: no extra tensor leaves a replica, and the
callback reads three scalars per epoch. Keras scales each replica's loss by 1/replicas, so a replica's own mean
gradient is replicas × its gradient. Where no estimate exists (one replica; several workers, whose per-worker norms
this callback does not exchange; another backend) :func:`why_no_noise` says why.
"""

from __future__ import annotations

import warnings
from typing import Any

import tensorflow as tf


def why_no_noise(strategy: Any, replicas: int, workers: int, optimizer: Any, backend: str) -> str | None:
    """Why the gradient noise scale cannot be estimated here, or ``None`` where it can."""
    if strategy is None:
        return (
            f"on the {backend} backend the train step's per-replica gradients are not visible to a callback "
            "(the noise scale needs the gradient at two batch sizes)"
        )
    if replicas == 1:
        return "one replica sees its gradient at one batch size only, the noise scale needs two"
    if workers > 1:
        return "under MultiWorkerMirroredStrategy the per-worker gradient norms are not exchanged by this callback"
    if not callable(getattr(optimizer, "_all_reduce_sum_gradients", None)):
        return (
            f"{type(optimizer).__name__} has no _all_reduce_sum_gradients (a TensorFlow-backend Keras optimizer "
            "has), so the per-replica gradients are not visible"
        )
    return None


def warn_no_noise(reason: str) -> None:
    """Say that B will not grow for want of a noise-scale estimate, and why (the callback says it once)."""
    warnings.warn(
        f"IvyLoadBalancer(goodput=True): no gradient noise scale estimate: {reason}; the batch size will not grow "
        "(it still shrinks on memory pressure). Pass goodput=False to let utilisation and memory alone decide.",
        RuntimeWarning,
        stacklevel=4,
    )


class GradientNoiseWatch:
    """Sums of R²|g_r|², |G|² and steps over the steps since the last :meth:`take`, all at one batch size."""

    def __init__(self, strategy: Any, optimizer: Any) -> None:
        with strategy.scope():
            self.sums = tuple(
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
        self.optimizer = optimizer
        local_sum, combined_sum, step_sum = self.sums
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

    def take(self, replicas: int) -> tuple[float, float] | None:
        """``(mean |own gradient|², mean |combined gradient|²)`` of the steps summed since the last call, and reset;
        ``None`` without a step."""
        local_v, combined_v, steps_v = self.sums
        steps = float(steps_v.read_value()) / replicas  # every replica counted each step
        means = None
        if steps >= 1:
            means = (
                float(local_v.read_value()) / (replicas * steps),
                float(combined_v.read_value()) / (replicas * steps),
            )
        for v in self.sums:
            v.assign(0.0)
        return means
