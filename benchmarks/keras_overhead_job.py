"""One process of ``ivyplug bench keras_overhead``: Keras ``IvyLoadBalancer`` hook time vs. step time.

TensorFlow has to split the CPU into two logical devices before it starts (for ``MirroredStrategy``), so
this runs in a process of its own (``python -m ivyplug.benchmarks.keras_overhead_job --out FILE``);
:func:`measure` is also called in-process by the Keras tests, where the split is already done.

Workload: the digits MLP 64-1024-1024-10 (compute-bound), global batch 256, Adam, on one device and under
``MirroredStrategy`` over 2 logical CPUs, fed by an :class:`ElasticDataset` with the batch size pinned
(``min_batch_size == max_batch_size``) so every fit runs the same steps. Per mode and round, a fit
without the callback and one with it (real probes: NVML where present, psutil; 1 s sampling interval).
Epoch 0 of every fit (tracing) is dropped. Per measured epoch:

* ``self_reported``: the callback's own ``ivy/callback_overhead`` (its summed hook time over the
  epoch's training time, epoch start to last batch end).
* ``hooks_over_steps``: the callback's hooks timed from outside (each hook method wrapped with
  ``perf_counter``), summed, over the summed wall time of the steps (``on_train_batch_begin`` to
  ``on_train_batch_end`` as seen by a timing callback).
* ``epoch_ratio``: median epoch time with the callback / without it (everything the callback costs,
  its sampler thread included; the two fits alternate their order per round; noisy on a shared
  machine, so read it with the load average).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

HOOKS = ("on_epoch_begin", "on_train_batch_begin", "on_train_batch_end", "on_epoch_end")


def _split_cpu() -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import tensorflow as tf

    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)


def _timing_callback() -> Any:
    import keras

    class Timing(keras.callbacks.Callback):
        """Epoch wall time and summed step time (begin to end of each train_function call)."""

        def __init__(self) -> None:
            super().__init__()
            self.epochs: list[tuple[float, float]] = []  # (epoch seconds, summed step seconds)
            self._t0 = self._begin = self._steps = 0.0

        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            self._t0, self._steps = time.perf_counter(), 0.0

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            self._begin = time.perf_counter()

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            self._steps += time.perf_counter() - self._begin

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            self.epochs.append((time.perf_counter() - self._t0, self._steps))

    return Timing()


def _time_hooks(balancer: Any) -> list[float]:
    """Wrap the balancer's hooks (instance attributes shadow the methods); returns per-epoch hook seconds."""
    per_epoch: list[float] = []
    current = [0.0]

    def wrap(name: str) -> None:
        method = getattr(balancer, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                current[0] += time.perf_counter() - t
                if name == "on_epoch_end":
                    per_epoch.append(current[0])
                    current[0] = 0.0

        setattr(balancer, name, timed)

    for name in HOOKS:
        wrap(name)
    return per_epoch


def measure(
    epochs: int = 6, rounds: int = 2, modes: tuple[str, ...] = ("single", "mirrored"), samples: int | None = None
) -> dict[str, Any]:
    """Run the fits and return per-mode medians (see the module docstring); ``samples`` cuts the data (tests)."""
    import keras
    import tensorflow as tf
    from ivyplug.integrations.keras import ElasticDataset, IvyLoadBalancer
    from sklearn.datasets import load_digits

    if epochs < 2 or rounds < 1:
        raise ValueError(f"epochs must be >= 2 and rounds >= 1, got epochs={epochs}, rounds={rounds}")
    digits = load_digits()
    x = (digits.data[:samples] / 16.0).astype("float32")
    y = digits.target[:samples].astype("int64")
    out: dict[str, Any] = {"epochs": epochs, "rounds": rounds, "batch_size": 256, "modes": {}}
    for mode in modes:
        if mode == "mirrored":
            logical = tf.config.list_logical_devices("CPU")
            if len(logical) < 2:
                raise RuntimeError("MirroredStrategy needs 2 logical CPUs: TensorFlow started before the split")
            strategy = tf.distribute.MirroredStrategy([d.name for d in logical[:2]])
        elif mode == "single":
            strategy = None
        else:
            raise ValueError(f"modes must hold 'single' and/or 'mirrored', got {mode!r}")
        base_epochs: list[float] = []
        ivy_epochs: list[float] = []
        self_reported: list[float] = []
        ratios: list[float] = []
        step_s: list[float] = []
        for r in range(rounds):
            for with_callback in (False, True) if r % 2 == 0 else (True, False):  # no order bias
                data = ElasticDataset(x, y, batch_size=256, seed=r)
                scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
                with scope:
                    keras.utils.set_random_seed(r)
                    model = keras.Sequential(
                        [
                            keras.Input((64,)),
                            keras.layers.Dense(1024, activation="relu"),
                            keras.layers.Dense(1024, activation="relu"),
                            keras.layers.Dense(10),
                        ]
                    )
                    model.compile(
                        optimizer=keras.optimizers.Adam(1e-3),
                        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    )
                timing = _timing_callback()
                callbacks: list[Any] = [timing]
                hooks: list[float] = []
                if with_callback:
                    balancer = IvyLoadBalancer(data, min_batch_size=256, max_batch_size=256)
                    hooks = _time_hooks(balancer)
                    callbacks.insert(0, balancer)
                history = model.fit(
                    data.tf_dataset(strategy),
                    steps_per_epoch=data.steps_per_epoch,
                    epochs=epochs,
                    callbacks=callbacks,
                    verbose=0,
                    shuffle=False,
                )
                measured = timing.epochs[1:]  # epoch 0 traces the step function
                (ivy_epochs if with_callback else base_epochs).extend(e for e, _ in measured)
                step_s.extend(s / data.steps_per_epoch for _, s in measured)
                if with_callback:
                    self_reported.extend(history.history["ivy/callback_overhead"][1:])
                    ratios.extend(h / s for h, (_, s) in zip(hooks[1:], measured, strict=True))
        out["modes"][mode] = {
            "replicas": 1 if strategy is None else int(strategy.num_replicas_in_sync),
            "measured_epochs": len(ratios),
            "step_ms_median": 1e3 * statistics.median(step_s),
            "self_reported_median": statistics.median(self_reported),
            "self_reported_max": max(self_reported),
            "hooks_over_steps_median": statistics.median(ratios),
            "hooks_over_steps_max": max(ratios),
            "epoch_s_without": statistics.median(base_epochs),
            "epoch_s_with": statistics.median(ivy_epochs),
            "epoch_ratio": statistics.median(ivy_epochs) / statistics.median(base_epochs),
            "loadavg_after": list(os.getloadavg()),
        }
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    _split_cpu()
    args.out.write_text(json.dumps(measure(args.epochs, args.rounds)))


if __name__ == "__main__":
    main()
