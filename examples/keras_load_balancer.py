"""IvyLoadBalancer in Keras: a MirroredStrategy fit whose global batch size follows device load.

The CPU is split into 2 logical devices so MirroredStrategy has two replicas on any machine. A scripted
load trace (one entry per epoch) stands in for real probes so the run is reproducible: idle devices
make the batch grow, memory pressure makes it shrink, and the learning rate follows (square-root rule
for Adam). Each epoch prints the ``ivy/...`` metrics that also land in ``History``.

    python examples/keras_load_balancer.py            # 8 epochs
    python examples/keras_load_balancer.py --quick    # 5 epochs, for CI smoke tests

With real hardware, drop ``probes=`` to poll NVML and psutil instead of the trace.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np
import tensorflow as tf

# Two logical CPUs: this must happen before TensorFlow initialises its devices (RuntimeError when it
# already has, e.g. when a test imports this file: then the existing devices are used).
with contextlib.suppress(RuntimeError):
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2
    )

import keras
from ivyplug.integrations.keras import ElasticDataset, IvyLoadBalancer
from sklearn.datasets import load_digits

from ivyplug.load import ScriptedProbe

IDLE = {"cpu_util": 15.0, "mem_used": 4.0, "mem_total": 16.0}  # grow: utilisation < 70 %, memory 25 %
BUSY = {"cpu_util": 85.0, "mem_used": 11.0, "mem_total": 16.0}  # hold: memory 69 %, inside the band
FULL = {"cpu_util": 95.0, "mem_used": 15.0, "mem_total": 16.0}  # shrink: memory 94 %
TRACE = [IDLE, IDLE, IDLE, FULL, BUSY, BUSY, IDLE, BUSY]
COLUMNS = ("ivy/batch_size", "ivy/lr_factor", "ivy/utilization", "ivy/memory_fraction", "ivy/callback_overhead")


class PrintEpoch(keras.callbacks.Callback):
    """One line per epoch: loss, validation accuracy and the ivy/... metrics."""

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        print(f"{'epoch':>5} {'loss':>7} {'val_acc':>7} " + " ".join(f"{c:>21}" for c in COLUMNS), flush=True)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        logs = logs or {}
        cells = " ".join(f"{logs.get(c, float('nan')):>21.4f}" for c in COLUMNS)
        print(f"{epoch:>5} {logs['loss']:>7.4f} {logs.get('val_accuracy', float('nan')):>7.3f} {cells}", flush=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 epochs (CI smoke test)")
    parser.add_argument("--batch-size", type=int, default=64, help="initial global batch size")
    args = parser.parse_args(argv)
    epochs = 5 if args.quick else len(TRACE)

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int64")
    order = np.random.default_rng(0).permutation(len(x))
    train, val = order[:1440], order[1440:]

    strategy = tf.distribute.MirroredStrategy([d.name for d in tf.config.list_logical_devices("CPU")[:2]])
    data = ElasticDataset(x[train], y[train], batch_size=args.batch_size, seed=0)
    pipeline = data.tf_dataset(strategy)  # outside strategy.scope(): the schedule is not a model variable
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((64,)), keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)]
        )
        model.compile(
            optimizer=keras.optimizers.Adam(2e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )

    # the scripted load shows the utilisation rule alone: by default a growth must also raise the goodput
    balancer = IvyLoadBalancer(
        data, probes=[ScriptedProbe(TRACE, clock=lambda: balancer.epoch)], interval=0.05, goodput=False
    )
    print(f"{strategy.num_replicas_in_sync} replicas, {data.num_samples} training samples, lag {data.lag} steps")
    history = model.fit(
        pipeline,
        steps_per_epoch=data.steps_per_epoch,
        epochs=epochs,
        validation_data=(x[val], y[val]),
        validation_batch_size=128,
        callbacks=[balancer, PrintEpoch()],
        shuffle=False,
        verbose=0,
    )
    for epoch, old, new, reason in balancer.decisions:
        print(f"end of epoch {epoch}: batch {old} -> {new} ({reason})")
    result = {
        "batch_size": history.history["ivy/batch_size"],
        "lr_factor": history.history["ivy/lr_factor"],
        "val_accuracy": history.history["val_accuracy"],
        "callback_overhead": history.history["ivy/callback_overhead"],
    }
    print("RESULT " + json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
