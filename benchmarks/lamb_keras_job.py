"""Child process of ``ivyplug bench lamb --keras``: ivyplug's Keras LAMB next to ``keras.optimizers.Lamb`` and
``keras.optimizers.AdamW`` on the TensorFlow backend, with XLA compilation (``jit_compile``) off and on.

How it measures, and why:

* The same variable set as the torch part (half square weights, half biases), one copy per optimizer, with fixed
  random gradients; a step is ``optimizer.apply_gradients`` inside a ``tf.function`` (``jit_compile`` True or
  False), which is what ``model.fit`` runs after the backward pass (``model.compile(jit_compile=...)``).
* Every optimizer is built and its function traced (and compiled) before timing; then all of them step
  interleaved, round-robin in a rotating order, so that foreign load hits them alike. Medians, and ratios to
  Keras's ``Lamb`` and ``AdamW`` with the same ``jit_compile``, come from the same rounds.
* Weight decay 0.01 for all three: inside LAMB's trust-ratio update for ivyplug's LAMB (as in the paper), Keras's
  decoupled decay for its ``Lamb`` and ``AdamW``. ivyplug's LAMB also checks every step for non-finite gradients
  (a global-norm pass Keras's ``Lamb`` does not make) and clips its trust ratio.
* TensorFlow's intra- and inter-op pools get the benchmark's thread count (2 unless ``IVYPLUG_BENCH_THREADS``).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

IVYPLUG = "ivyplug LAMB"
KERAS_LAMB = "keras Lamb"
KERAS_ADAMW = "keras AdamW"
#: ivyplug's Keras LAMB at most this many times the step time of Keras's own Lamb (same jit_compile).
TARGET_VS_KERAS_LAMB = 1.2


def _factories() -> dict[str, Callable[[], Any]]:
    import keras
    from ivyplug.integrations.keras import LAMB

    return {
        KERAS_ADAMW: lambda: keras.optimizers.AdamW(weight_decay=0.01),
        KERAS_LAMB: lambda: keras.optimizers.Lamb(weight_decay=0.01),
        IVYPLUG: lambda: LAMB(weight_decay=0.01),
    }


def _variable_set(total: int, n_tensors: int, seed: int) -> tuple[list[Any], list[Any]]:
    """NumPy initial values and TensorFlow gradients shaped like the torch part's parameters."""
    import numpy as np
    import tensorflow as tf

    n_weights = max(1, n_tensors // 2)
    side = max(1, round((total / n_weights) ** 0.5))
    rng = np.random.default_rng(seed)
    shapes = [shape for _ in range(n_weights) for shape in ((side, side), (side,))]
    values = [(rng.standard_normal(shape) * 0.02).astype("float32") for shape in shapes]
    grads = [tf.constant((rng.standard_normal(shape) * 1e-3).astype("float32")) for shape in shapes]
    return values, grads


def _stepper(factory: Callable[[], Any], values: list[Any], grads: list[Any], jit: bool) -> Callable[[], None]:
    """A built optimizer over its own variables, and its traced (and compiled) step."""
    import keras
    import tensorflow as tf

    variables = [keras.Variable(v) for v in values]
    optimizer = factory()
    optimizer.build(variables)

    @tf.function(jit_compile=jit, reduce_retracing=True)
    def step(gs: list[Any]) -> None:
        optimizer.apply_gradients(zip(gs, variables, strict=True))

    step(grads)  # trace and compile outside the timed rounds
    return lambda: step(grads)


def _measure_size(label: str, total: int, n_tensors: int, config: dict[str, Any]) -> dict[str, Any]:
    values, grads = _variable_set(total, n_tensors, seed=0)
    steppers: dict[str, Callable[[], None]] = {}
    rows: dict[str, dict[str, Any]] = {}
    for jit in (False, True):
        for name, factory in _factories().items():
            key = f"{name} jit_compile={jit}"
            rows[key] = {"name": name, "jit_compile": jit}
            t0 = time.perf_counter()
            steppers[key] = _stepper(factory, values, grads, jit)
            rows[key]["first_call_s"] = time.perf_counter() - t0
    names = list(steppers)
    started = time.perf_counter()
    warm = 0
    while warm < config["warmup"] or time.perf_counter() - started < float(config.get("warmup_s", 0.0)):
        for name in names:
            steppers[name]()
        warm += 1
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(config["steps"]):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            steppers[name]()
            times[name].append(time.perf_counter() - t0)
    medians = {name: statistics.median(samples) * 1e3 for name, samples in times.items()}
    for key, samples in times.items():
        row = rows[key]
        q = statistics.quantiles(samples, n=4) if len(samples) >= 2 else [samples[0]] * 3
        jit = row["jit_compile"]
        row.update(
            median_ms=medians[key],
            p25_ms=q[0] * 1e3,
            p75_ms=q[2] * 1e3,
            ratio_vs_keras_lamb=medians[key] / medians[f"{KERAS_LAMB} jit_compile={jit}"],
            ratio_vs_keras_adamw=medians[key] / medians[f"{KERAS_ADAMW} jit_compile={jit}"],
        )
    return {
        "label": label,
        "params": sum(int(v.size) for v in values),
        "tensors": len(values),
        "steps": config["steps"],
        "warmup": warm,
        "rows": list(rows.values()),
    }


def measure(config: dict[str, Any]) -> dict[str, Any]:
    """Every size of ``config``, in this process (normally a fresh one: see :func:`ivyplug.benchmarks.lamb.run`)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import tensorflow as tf

    threads = int(config.get("threads") or 0)
    if threads:
        try:
            tf.config.threading.set_intra_op_parallelism_threads(threads)
            tf.config.threading.set_inter_op_parallelism_threads(threads)
        except RuntimeError:  # TensorFlow already initialised in this process (the in-process smoke test)
            pass
    tf.get_logger().setLevel("ERROR")
    import keras

    if keras.backend.backend() != "tensorflow":
        raise RuntimeError(f"the Keras LAMB benchmark needs KERAS_BACKEND=tensorflow, got {keras.backend.backend()}")
    load_before = os.getloadavg()
    sizes = [_measure_size(label, total, n, config) for label, (total, n) in config["sizes"]]
    return {
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "threads": threads or None,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "sizes": sizes,
    }


def targets(results: dict[str, Any]) -> dict[str, Any]:
    """ivyplug's LAMB over Keras's Lamb at the largest size, for each ``jit_compile`` setting."""
    size = results["sizes"][-1]
    ratios = {str(row["jit_compile"]): row["ratio_vs_keras_lamb"] for row in size["rows"] if row["name"] == IVYPLUG}
    return {
        "size": size["label"],
        "ivyplug_vs_keras_lamb": ratios,
        "met": all(r <= TARGET_VS_KERAS_LAMB for r in ratios.values()),
    }


def format_table(results: dict[str, Any], target: dict[str, Any]) -> str:
    """A markdown table per size, and the target line."""
    lines = [
        f"### Keras (TensorFlow {results['tensorflow']}, Keras {results['keras']}, {results['threads']} threads)",
        f"load average before {'/'.join(f'{x:.2f}' for x in results['loadavg_before'])}, "
        f"after {'/'.join(f'{x:.2f}' for x in results['loadavg_after'])}",
    ]
    for size in results["sizes"]:
        lines += [
            "",
            f"**{size['label']}**: {size['params']:,} params in {size['tensors']} variables; median of "
            f"{size['steps']} interleaved steps after {size['warmup']} warm-up rounds",
            "",
            "| optimizer | jit_compile | median ms | p25–p75 ms | × Keras Lamb | × Keras AdamW | first call s |",
            "|---|---|---:|---:|---:|---:|---:|",
        ]
        for row in size["rows"]:
            lines.append(
                f"| {row['name']} | {row['jit_compile']} | {row['median_ms']:.2f} | "
                f"{row['p25_ms']:.2f}–{row['p75_ms']:.2f} | {row['ratio_vs_keras_lamb']:.2f} | "
                f"{row['ratio_vs_keras_adamw']:.2f} | {row['first_call_s']:.1f} |"
            )
    ratios = ", ".join(f"jit_compile={k}: {v:.2f}" for k, v in target["ivyplug_vs_keras_lamb"].items())
    lines += [
        "",
        f"target at {target['size']}: ivyplug LAMB / Keras Lamb ({ratios}) <= {TARGET_VS_KERAS_LAMB}: "
        f"{'met' if target['met'] else 'NOT met'}",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(measure(json.loads(sys.argv[2]))))
    else:
        raise SystemExit("usage: python -m ivyplug.benchmarks.lamb_keras_job --child CONFIG_JSON")
