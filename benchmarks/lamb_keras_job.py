"""Child process of ``ivyplug bench lamb --keras``: ivyplug's Keras LAMB next to ``keras.optimizers.Lamb`` and
``keras.optimizers.AdamW`` on one Keras backend (``KERAS_BACKEND``: TensorFlow, JAX or PyTorch; the parent starts
one child per backend), with compilation (``jit_compile``) off and on where ``model.fit`` would use it.

How it measures, and why:

* The same variable set as the torch part (half square weights, half biases), one copy per optimizer, with fixed
  random gradients. A step is what ``model.fit`` runs after the backward pass on that backend:
  TensorFlow: ``optimizer.apply_gradients`` inside a ``tf.function`` (``jit_compile`` False or True, XLA);
  JAX: ``optimizer.stateless_apply`` inside ``jax.jit`` (``jit_compile=True``, Keras's default there; the state
  is donated as in Keras's trainer), or ``optimizer.apply`` eagerly (``jit_compile=False``);
  PyTorch: ``optimizer.apply`` under ``torch.no_grad()`` (``jit_compile=False``, Keras's default there; the
  ``torch.compile`` path is checked by the tests but not timed: its compile time is minutes at these sizes).
  JAX steps end with ``block_until_ready``, so a step is timed to its last write.
* Every optimizer is built and its step traced (and compiled) before timing; then all of them step
  interleaved, round-robin in a rotating order, so that foreign load hits them alike. Medians, and ratios to
  Keras's ``Lamb`` and ``AdamW`` with the same ``jit_compile``, come from the same rounds.
* Weight decay 0.01 for all three: inside LAMB's trust-ratio update for ivyplug's LAMB (as in the paper), Keras's
  decoupled decay for its ``Lamb`` and ``AdamW``. ivyplug's LAMB also checks every step for non-finite gradients
  (a global-norm pass Keras's ``Lamb`` does not make) and clips its trust ratio.
* The backend's thread pools get the benchmark's thread count (2 unless ``IVYPLUG_BENCH_THREADS``): TensorFlow's
  intra- and inter-op pools, torch's ``set_num_threads``; XLA on CPU (JAX) takes its own.
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


#: The ``jit_compile`` settings timed per backend (see the module docstring).
JIT_SETTINGS: dict[str, tuple[bool, ...]] = {"tensorflow": (False, True), "jax": (False, True), "torch": (False,)}


def _variable_set(total: int, n_tensors: int, seed: int) -> tuple[list[Any], list[Any]]:
    """NumPy initial values and gradients (backend tensors) shaped like the torch part's parameters."""
    import keras
    import numpy as np

    n_weights = max(1, n_tensors // 2)
    side = max(1, round((total / n_weights) ** 0.5))
    rng = np.random.default_rng(seed)
    shapes = [shape for _ in range(n_weights) for shape in ((side, side), (side,))]
    values = [(rng.standard_normal(shape) * 0.02).astype("float32") for shape in shapes]
    grads = [keras.ops.convert_to_tensor((rng.standard_normal(shape) * 1e-3).astype("float32")) for shape in shapes]
    return values, grads


def _stepper(factory: Callable[[], Any], values: list[Any], grads: list[Any], jit: bool) -> Callable[[], None]:
    """A built optimizer over its own variables, and its traced (and compiled) step on this backend."""
    import keras

    variables = [keras.Variable(v) for v in values]
    optimizer = factory()
    optimizer.build(variables)
    backend = keras.backend.backend()
    step: Callable[[], None]
    if backend == "tensorflow":
        import tensorflow as tf

        @tf.function(jit_compile=jit, reduce_retracing=True)
        def tf_step(gs: list[Any]) -> None:
            optimizer.apply_gradients(zip(gs, variables, strict=True))

        step = lambda: tf_step(grads)
    elif backend == "jax" and jit:
        import jax

        stateless = jax.jit(lambda ov, gs, tv: optimizer.stateless_apply(ov, gs, tv), donate_argnums=(0, 2))
        state = [[v.value for v in variables], [v.value for v in optimizer.variables]]

        def jax_step() -> None:
            state[0], state[1] = stateless(state[1], grads, state[0])
            jax.block_until_ready(state[0])

        step = jax_step
    elif backend == "jax":
        import jax

        def eager_step() -> None:
            optimizer.apply(grads, variables)
            jax.block_until_ready(variables[-1].value)

        step = eager_step
    elif backend == "torch" and not jit:
        import torch

        def torch_step() -> None:
            with torch.no_grad():
                optimizer.apply(grads, variables)

        step = torch_step
    else:
        raise ValueError(f"jit_compile={jit} is not timed on the {backend} backend")
    step()  # trace and compile outside the timed rounds
    return step


def _measure_size(label: str, total: int, n_tensors: int, config: dict[str, Any]) -> dict[str, Any]:
    values, grads = _variable_set(total, n_tensors, seed=0)
    steppers: dict[str, Callable[[], None]] = {}
    rows: dict[str, dict[str, Any]] = {}
    import keras

    for jit in JIT_SETTINGS[keras.backend.backend()]:
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
    """Every size of ``config`` on the backend ``KERAS_BACKEND`` names, in this process (normally a fresh one:
    see :func:`ivyplug.benchmarks.lamb.run`)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    threads = int(config.get("threads") or 0)
    backend = os.environ["KERAS_BACKEND"]
    versions: dict[str, str] = {}
    if backend == "tensorflow":
        import tensorflow as tf

        if threads:
            try:
                tf.config.threading.set_intra_op_parallelism_threads(threads)
                tf.config.threading.set_inter_op_parallelism_threads(threads)
            except RuntimeError:  # TensorFlow already initialised in this process (the in-process smoke test)
                pass
        tf.get_logger().setLevel("ERROR")
        versions["tensorflow"] = tf.__version__
    elif backend == "torch":
        import torch

        if threads:
            torch.set_num_threads(threads)
        versions["torch"] = torch.__version__.split("+")[0]
    elif backend == "jax":
        import jax

        versions["jax"] = jax.__version__
    import keras

    if keras.backend.backend() != backend:
        raise RuntimeError(f"Keras runs on {keras.backend.backend()}, not KERAS_BACKEND={backend}: import order")
    load_before = os.getloadavg()
    sizes = [_measure_size(label, total, n, config) for label, (total, n) in config["sizes"]]
    return {
        "backend": backend,
        "versions": versions,
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
    backend = results.get("backend", "tensorflow")
    versions = ", ".join(f"{k} {v}" for k, v in results.get("versions", {}).items())
    lines = [
        f"### Keras on {backend} ({versions}, Keras {results['keras']}, {results['threads']} threads)",
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
        f"target on {backend} at {target['size']}: ivyplug LAMB / Keras Lamb ({ratios}) <= {TARGET_VS_KERAS_LAMB}: "
        f"{'met' if target['met'] else 'NOT met'}",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(measure(json.loads(sys.argv[2]))))
    else:
        raise SystemExit("usage: python -m ivyplug.benchmarks.lamb_keras_job --child CONFIG_JSON")
