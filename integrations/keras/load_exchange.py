"""How the Keras ``IvyLoadBalancer``'s workers agree on one epoch's load: one SUM reduce of per-worker slots.

With several workers (MultiWorkerMirroredStrategy) the observations are exchanged with one cross-replica ``SUM``
reduce through the model's ``distribute_strategy`` (each worker writes its own slot of a zero vector, so the sum
copies the values exactly); every worker then runs the same pure policy on the same inputs and reaches the same
decision. Every worker makes the same collective call in the same order, which MultiWorkerMirroredStrategy
requires. In one process (one device, MirroredStrategy) the replicas share one callback, so no collective is
needed. On PyTorch under ``torchrun`` one ``all_reduce`` shares them; several JAX processes do not (warned once).
The reduce waits as the strategy's own collectives do: MultiWorkerMirroredStrategy merges its
``communication_options`` (``timeout_seconds``) into every reduce, and torch's ``all_reduce`` has the default group's
``timeout``; a second bound here would only fire where the next training step's all-reduce waits as long.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf
from ivyplug.integrations.keras.model_access import keras_backend

from ivyplug.load.observation import LoadObservation

#: ``warn_once(key, message)``: the callback's once-per-key warning.
WarnOnce = Callable[[str, str], None]
_SLOT = 5  # per-worker observation: util, util known, memory fraction, memory known, oom count


def exchange_observations(strategy: Any, local: LoadObservation, warn_once: WarnOnce) -> list[LoadObservation]:
    """Every worker's observation, identical on every worker (one SUM reduce per epoch; ``strategy``: the model's
    ``tf.distribute`` strategy, ``None`` on the other backends)."""
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
    if strategy is None:
        return _exchange_other_backend(local, row, warn_once)
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


def _exchange_other_backend(local: LoadObservation, row: np.ndarray, warn_once: WarnOnce) -> list[LoadObservation]:
    """PyTorch under torchrun: one gloo/NCCL ``all_reduce`` (SUM) of the workers' slots. JAX with several
    processes: not exchanged (warned once), each process decides from its own readings."""
    backend = keras_backend()
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
            warn_once(
                "jax_exchange",
                f"IvyLoadBalancer: {jax.process_count()} JAX processes do not exchange their load readings "
                "(implemented for tf.distribute on TensorFlow and torch.distributed on PyTorch): each process "
                "decides from its own, so their batch-size decisions may differ",
            )
    return [local]


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
