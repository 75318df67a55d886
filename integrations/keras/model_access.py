"""What the Keras ``IvyLoadBalancer`` reads from Keras: the backend, the optimizer inside a wrapper, replicas."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np


def keras_backend() -> str:
    """The Keras backend (``"tensorflow"``, ``"jax"``, ``"torch"``), fixed when Keras was imported."""
    return str(keras.backend.backend())


def inner_optimizer(model: Any) -> Any:
    """The model's optimizer, unwrapped from a ``LossScaleOptimizer``."""
    optimizer = model.optimizer
    return getattr(optimizer, "inner_optimizer", optimizer)


def steps_in_call(params: dict[str, Any] | None, begin: int, end: int, *, data_ends: bool = True) -> int:
    """The steps one ``train_function`` call ran, from the batch numbers Keras gives its ``on_train_batch_begin``
    and ``on_train_batch_end``: with ``steps_per_execution`` > 1 it reports ``end = begin + steps_per_execution - 1``
    for every call. Where the data ends with the epoch (finite data without ``steps_per_epoch``) the epoch's last
    call is shorter, so ``end`` is clamped to the epoch's last step (``params["steps"]``); infinite data
    (``data_ends=False``, an ``ElasticDataset``) runs every call whole, past ``steps_per_epoch`` if need be."""
    steps = (params or {}).get("steps")
    if data_ends and isinstance(steps, int) and steps > 0:
        end = min(end, steps - 1)
    return max(end - begin + 1, 1)


def model_strategy(model: Any) -> Any:
    """The model's ``tf.distribute`` strategy on the TensorFlow backend; ``None`` on the others."""
    return getattr(model, "distribute_strategy", None) if keras_backend() == "tensorflow" else None


def replica_count(strategy: Any) -> int:
    """Replicas that each get a slice of the global batch (1 outside tf.distribute: JAX's and PyTorch's trainers
    take the global batch in one process)."""
    return 1 if strategy is None else int(strategy.num_replicas_in_sync)


def worker_count(strategy: Any) -> int:
    """Worker processes under ``tf.distribute`` (MultiWorkerMirroredStrategy: several); 1 elsewhere."""
    if strategy is None:
        return 1
    replicas = int(strategy.num_replicas_in_sync)
    return 1 if replicas == 1 else replicas // len(strategy.extended.worker_devices)


def batch_multiple(strategy: Any, replicas: int) -> int:
    """What every global batch size must be a multiple of: the replicas under ``tf.distribute``; on JAX under a
    ``keras.distribution`` (``DataParallel``), the devices along its batch axis (the batch is sharded there)."""
    if strategy is not None or keras_backend() != "jax":
        return replicas
    distribution = keras.distribution.distribution()
    mesh = getattr(distribution, "device_mesh", None)
    axis = getattr(distribution, "batch_dim_name", None)
    if mesh is None or axis not in tuple(mesh.axis_names):
        return 1
    return int(mesh.shape[list(mesh.axis_names).index(axis)])


def check_assignable_lr(optimizer: Any, scales: bool = True) -> None:
    """Refuse a ``LearningRateSchedule`` or a callable where the LR is to be rescaled (``scales``): neither has a
    variable to assign."""
    rate = getattr(optimizer, "_learning_rate", None)
    if not scales:
        return
    schedule = isinstance(rate, keras.optimizers.schedules.LearningRateSchedule)
    if schedule or (callable(rate) and not isinstance(rate, keras.Variable)):
        kind = "a LearningRateSchedule" if schedule else "a callable learning rate"
        raise ValueError(
            "IvyLoadBalancer rescales the learning rate with optimizer.learning_rate.assign, but this optimizer "
            f"uses {kind}; pass lr_scaling='none' (or use a constant learning rate)"
        )


def learning_rate_value(model: Any) -> float:
    """The model's optimizer's learning rate now, as a float (a variable or a schedule's current value)."""
    return float(np.asarray(keras.ops.convert_to_numpy(inner_optimizer(model).learning_rate)))


def scale_learning_rate(model: Any, factor: float) -> None:
    """Multiply the model's optimizer's learning rate by ``factor`` from the next step on."""
    sync = getattr(model, "jax_state_sync", None)
    if callable(sync):
        # JAX trains on a state tuple outside the variables: write it back first, which also makes the
        # next step read its state from the variables again, so the assignment below takes effect.
        sync()
    inner_optimizer(model).learning_rate.assign(learning_rate_value(model) * factor)
