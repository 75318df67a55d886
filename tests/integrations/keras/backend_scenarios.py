"""Keras scenarios run on one backend each: ``python -m tests.integrations.keras.backend_scenarios NAMES_JSON``.

Keras picks its backend when it is first imported, so the tests of ``test_backends.py`` run these
functions in a fresh interpreter per backend (``KERAS_BACKEND=jax`` / ``torch``; TensorFlow in the test
process itself). Each scenario returns plain JSON values; the checks, and the float64 references they are
compared with, live in the test module. The helpers at the top import no framework, so the tests share them.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from tests.ps.diffs import max_abs_diff

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

#: Variables of the optimizer scenarios: a kernel, a zero-initialised bias, a norm scale.
SHAPES: tuple[tuple[int, ...], ...] = ((6, 5), (5,), (5,))
NAMES: tuple[str, ...] = ("dense_kernel", "dense_bias", "layer_norm_gamma")
#: The optimizer scenarios' hyperparameters (their float64 reference takes the same).
LAMB_HP: dict[str, Any] = {"learning_rate": 0.05, "weight_decay": 0.1, "max_trust_ratio": 0.4, "max_grad_norm": 2.0}
STEPS = 12
NAN_STEP = 5  # a NaN gradient there: the whole step is skipped
OVERFLOW_STEP = 8  # the compiled scenario's float32 overflow of the global norm


def random_problem(seed: int, steps: int = STEPS) -> tuple[list[np.ndarray], list[list[np.ndarray]]]:
    """Float32 initial values (the bias zero) and gradients, a NaN in step ``NAN_STEP``."""
    rng = np.random.default_rng(seed)
    x0 = [rng.normal(size=SHAPES[0]) * 0.7, np.zeros(SHAPES[1]), 1.0 + 0.1 * rng.normal(size=SHAPES[2])]
    grads = [[rng.normal(size=a.shape) * rng.uniform(0.1, 2.0) for a in x0] for _ in range(steps)]
    grads[NAN_STEP][2][1] = np.nan
    return [a.astype(np.float32) for a in x0], [[a.astype(np.float32) for a in g] for g in grads]


def linear_data(seed: int = 11) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """``x``, ``y`` and the initial ``[kernel, bias]`` of the fit scenario's linear model (float32)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(48, 8)).astype(np.float32)
    y = rng.normal(size=(48, 3)).astype(np.float32)
    w0 = [(rng.normal(size=(8, 3)) * 0.3).astype(np.float32), (rng.normal(size=3) * 0.1).astype(np.float32)]
    return x, y, w0


FIT_BATCH = 16
FIT_EPOCHS = 2
FIT_HP: dict[str, Any] = {"learning_rate": 0.02, "max_grad_norm": 0.5, "exclude_from_layer_adaptation": ["bias"]}


# ------------------------------------------------------------------------------------ scenarios


def _lists(arrays: list[Any]) -> list[Any]:
    return [np.asarray(a, dtype=np.float64).tolist() for a in arrays]


def lamb_apply(dtype: str) -> dict[str, Any]:
    """``LAMB.apply`` on the variables of :func:`random_problem` (eager), in ``dtype``."""
    import keras
    from ivyplug.integrations.keras import LAMB

    x0, grads = random_problem(seed=5)
    x64 = contextlib.nullcontext()
    if keras.backend.backend() == "jax" and dtype == "float64":
        import jax

        x64 = jax.enable_x64(True)  # JAX computes float64 only with x64 on (else silently float32)
    with x64:
        variables = [keras.Variable(a.astype(dtype), dtype=dtype, name=n) for a, n in zip(x0, NAMES, strict=True)]
        opt = LAMB(**LAMB_HP)
        for g in grads:
            opt.apply([keras.ops.convert_to_tensor(a.astype(dtype), dtype=dtype) for a in g], variables)
        values = [keras.ops.convert_to_numpy(v) for v in variables]
    return {
        "values": _lists(values),
        "dtype": str(values[0].dtype),
        "skipped": int(keras.ops.convert_to_numpy(opt.skipped_steps)),
        "iterations": int(keras.ops.convert_to_numpy(opt.iterations)),
    }


def lamb_apply_compiled(epsilon: float) -> dict[str, Any]:
    """The steps of :func:`lamb_apply` (float32) compiled as ``fit`` compiles them: ``jax.jit`` of
    ``stateless_apply``, ``torch.compile`` of ``apply``, ``tf.function(jit_compile=True)`` of ``apply``."""
    import keras
    from ivyplug.integrations.keras import LAMB

    x0, grads = random_problem(seed=5)
    grads[OVERFLOW_STEP][0][0, 0] = 3e38  # finite, but its square overflows float32: the step is skipped too
    variables = [keras.Variable(a, name=n) for a, n in zip(x0, NAMES, strict=True)]
    opt = LAMB(**LAMB_HP, epsilon=epsilon)
    opt.build(variables)
    backend = keras.backend.backend()
    tensors = [[keras.ops.convert_to_tensor(a) for a in g] for g in grads]
    if backend == "jax":
        import jax

        step = jax.jit(opt.stateless_apply)
        tv, ov = [v.value for v in variables], [v.value for v in opt.variables]
        for g in tensors:
            tv, ov = step(ov, g, tv)
        for ref, value in zip(variables, tv, strict=True):
            ref.assign(value)
        for ref, value in zip(opt.variables, ov, strict=True):
            ref.assign(value)
    elif backend == "torch":
        import torch

        @torch.compile
        def torch_step(gs: list[Any]) -> None:
            opt.apply(gs, variables)

        with torch.no_grad():
            for g in tensors:
                torch_step(g)
    else:
        import tensorflow as tf

        @tf.function(jit_compile=True)
        def tf_step(gs: list[Any]) -> None:
            opt.apply(gs, variables)

        for g in tensors:
            tf_step(g)
    return {
        "values": _lists([keras.ops.convert_to_numpy(v) for v in variables]),
        "skipped": int(keras.ops.convert_to_numpy(opt.skipped_steps)),
        "iterations": int(keras.ops.convert_to_numpy(opt.iterations)),
    }


def _backend() -> str:
    import keras

    return str(keras.backend.backend())


def _linear_model(w0: list[np.ndarray]) -> Any:
    import keras

    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
    model.set_weights(w0)
    return model


def lamb_fit(jit_compile: bool) -> dict[str, Any]:
    """``model.fit`` of a linear model (MSE) with LAMB, ``jit_compile`` on or off, no shuffling."""
    import keras
    from ivyplug.integrations.keras import LAMB

    x, y, w0 = linear_data()
    model = _linear_model(w0)
    model.compile(optimizer=LAMB(**FIT_HP), loss="mse", jit_compile=jit_compile)
    model.fit(x, y, batch_size=FIT_BATCH, epochs=FIT_EPOCHS, shuffle=False, verbose=0)
    return {
        "weights": _lists(model.get_weights()),
        "iterations": int(keras.ops.convert_to_numpy(model.optimizer.iterations)),
    }


def lamb_save_load(tmp: str) -> dict[str, Any]:
    """Compile by the registered name, fit, save, load, fit both on: the same weights and optimizer state."""
    import keras
    from ivyplug.integrations.keras import LAMB

    x, y, w0 = linear_data()
    model = _linear_model(w0)
    model.compile(optimizer={"class_name": "ivyplug>LAMB", "config": {"learning_rate": 0.01}}, loss="mse")
    model.fit(x, y, batch_size=FIT_BATCH, epochs=1, shuffle=False, verbose=0)
    path = os.path.join(tmp, f"lamb_{keras.backend.backend()}.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    state_equal = all(
        np.array_equal(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b))
        for a, b in zip(loaded.optimizer.variables, model.optimizer.variables, strict=True)
    )
    for m in (model, loaded):
        m.fit(x, y, batch_size=FIT_BATCH, epochs=1, shuffle=False, verbose=0)
    diff = max_abs_diff(loaded.get_weights(), model.get_weights())
    return {
        "type": type(loaded.optimizer).__name__,
        "is_lamb": isinstance(loaded.optimizer, LAMB),
        "state_equal": state_equal,
        "n_state": len(loaded.optimizer.variables),
        "iterations": int(keras.ops.convert_to_numpy(loaded.optimizer.iterations)),
        "max_diff_after": diff,
        "moved": max_abs_diff(model.get_weights(), w0),
    }


def async_one_worker() -> dict[str, Any]:
    """AsyncLAMB + AsyncLAMBExchange with one worker: every exchange is a no-op but rounding, so LAMB's result."""
    import keras
    from ivyplug.integrations.keras import LAMB, AsyncLAMB, AsyncLAMBExchange

    x, y, w0 = linear_data()
    plain = _linear_model(w0)
    plain.compile(optimizer=LAMB(learning_rate=0.02), loss="mse")
    plain.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
    model = _linear_model(w0)
    model.compile(optimizer=AsyncLAMB(learning_rate=0.02, sync_every=4), loss="mse")
    exchange = AsyncLAMBExchange(mode="async", shared_memory=False)
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False, callbacks=[exchange])
    diff = max_abs_diff(model.get_weights(), plain.get_weights())
    moved = max_abs_diff(model.get_weights(), w0)
    return {
        "exchanges": exchange.exchanges,
        "closed": exchange.client is None,
        "max_diff": diff,
        "moved": moved,
        "iterations": int(keras.ops.convert_to_numpy(model.optimizer.iterations)),
    }


IDLE = {"cpu_util": 10.0, "mem_used": 3.0, "mem_total": 10.0}  # grow: utilisation < 70 %, memory 30 %
BUSY = {"cpu_util": 90.0, "mem_used": 7.0, "mem_total": 10.0}  # hold
FULL = {"cpu_util": 95.0, "mem_used": 9.5, "mem_total": 10.0}  # shrink


def _seen_batch_metric() -> Any:
    import keras

    class SeenBatch(keras.metrics.Metric):
        """The size of the batch the model just trained on."""

        def __init__(self, name: str = "seen", **kwargs: Any) -> None:
            super().__init__(name=name, **kwargs)
            self.size = self.add_variable(shape=(), initializer="zeros", name="size")

        def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
            self.size.assign(keras.ops.cast(keras.ops.shape(y_true)[0], "float32"))

        def result(self) -> Any:
            return keras.ops.convert_to_tensor(self.size)  # JAX traces no Keras variable as a result

    return SeenBatch()


def _spy() -> Any:
    import keras

    class Spy(keras.callbacks.Callback):
        """Per step: the learning rate in force and the batch size the model saw."""

        def __init__(self) -> None:
            super().__init__()
            self.steps: list[tuple[float, int]] = []
            self._lr = 0.0

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            self._lr = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            self.steps.append((self._lr, round(float(logs["seen"]))))

    return Spy()


def _digits() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 16)).astype("float32")
    return x, x[:, :4].argmax(axis=1).astype("int64")


def _classifier(optimizer: Any, **compile_kwargs: Any) -> Any:
    import keras

    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(4)])
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[_seen_batch_metric()],
        **compile_kwargs,
    )
    return model


def _input(data: Any, source: str) -> Any:
    return data.py_dataset() if source == "py" else data.tf_dataset()


def balancer_fit(source: str) -> dict[str, Any]:
    """IvyLoadBalancer with an ElasticDataset: idle grows B (x2, linear LR for SGD), busy holds, full shrinks;
    goodput on (it warns once and, unable to estimate on one replica, keeps B) in a second fit."""
    import keras
    from ivyplug.integrations.keras import LAMB, ElasticDataset, IvyLoadBalancer

    from ivyplug.load import ScriptedProbe

    x, y = _digits()
    data = ElasticDataset(x, y, batch_size=16, seed=2, lag=2)
    model = _classifier(keras.optimizers.SGD(0.05))
    holder: list[Any] = []
    probe = ScriptedProbe([IDLE, BUSY, FULL, BUSY], clock=lambda: holder[0].epoch)
    balancer = IvyLoadBalancer(data, probes=[probe], interval=0.02, goodput=False, max_batch_size=64)
    holder.append(balancer)
    spy = _spy()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(
            _input(data, source), steps_per_epoch=data.steps_per_epoch, epochs=4, callbacks=[balancer, spy], verbose=0
        )
    h = {k: v for k, v in history.history.items() if k.startswith("ivy/")}

    # goodput on: no noise-scale estimate on one replica -> one warning, B held
    data2 = ElasticDataset(x, y, batch_size=16, seed=2, lag=2)
    model2 = _classifier(LAMB(learning_rate=0.01))
    holder2: list[Any] = []
    probe2 = ScriptedProbe([IDLE], clock=lambda: holder2[0].epoch)
    balancer2 = IvyLoadBalancer(data2, probes=[probe2], interval=0.02)
    holder2.append(balancer2)
    with warnings.catch_warnings(record=True) as caught2:
        warnings.simplefilter("always")
        history2 = model2.fit(_input(data2, source), steps_per_epoch=4, epochs=2, callbacks=[balancer2], verbose=0)
    return {
        "history": h,
        "steps": spy.steps,
        "lag": data.lag,
        "steps_per_epoch": data.steps_per_epoch,
        "decisions": [list(d[1:3]) for d in balancer.decisions],
        "segments": [[int(seg.start_step), int(seg.batch_size)] for seg in data.segments],
        "final_lr": float(keras.ops.convert_to_numpy(model.optimizer.learning_rate)),
        "warnings": sorted({str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)}),
        "sampler_closed": balancer.sampler is None,
        "goodput_batch_sizes": history2.history["ivy/batch_size"],
        "goodput_warnings": [str(w.message) for w in caught2 if "noise scale" in str(w.message)],
    }


def balancer_monitor() -> dict[str, Any]:
    """No ElasticDataset: the callback only monitors (NumPy input); the metric names of every backend."""
    from ivyplug.integrations.keras import IvyLoadBalancer

    from ivyplug.load import ScriptedProbe

    x, y = _digits()
    import keras

    model = _classifier(keras.optimizers.Adam(0.01))
    balancer = IvyLoadBalancer(None, probes=[ScriptedProbe([IDLE])], interval=0.02)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(x, y, batch_size=64, epochs=1, callbacks=[balancer], verbose=0)
    return {
        "keys": sorted(k for k in history.history if k.startswith("ivy/")),
        "utilization": history.history["ivy/utilization"],
        "warnings": sorted({str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)}),
    }


def balancer_oom() -> dict[str, Any]:
    """An out-of-memory error of the backend inside a step: counted, and a clear OutOfMemoryRecoveryError where
    the micro-batch split cannot apply (not TensorFlow), after one warning that says why."""
    import keras
    from ivyplug.integrations.keras import ElasticDataset, IvyLoadBalancer

    from ivyplug.load import OutOfMemoryRecoveryError, ScriptedProbe

    backend = keras.backend.backend()

    def out_of_memory() -> BaseException:
        if backend == "torch":
            import torch

            return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        if backend == "jax":
            import jax

            return jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 2.00GiB")
        import tensorflow as tf

        return tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor")

    class Raise(keras.callbacks.Callback):
        """Arms the model's raising layer from step 3 on."""

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            armed[0] = batch >= 3

    armed = [False]

    class OOMLayer(keras.layers.Layer):
        def call(self, inputs: Any) -> Any:
            if armed[0]:
                raise out_of_memory()
            return inputs

    x, y = _digits()
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((16,)), OOMLayer(), keras.layers.Dense(4)])
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), run_eagerly=True)
    data = ElasticDataset(x, y, batch_size=16, seed=0)
    balancer = IvyLoadBalancer(data, probes=[ScriptedProbe([BUSY])], interval=0.02, goodput=False)
    error = ""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            model.fit(
                _input(data, "py" if backend == "torch" else "tf"),
                steps_per_epoch=8,
                epochs=1,
                callbacks=[Raise(), balancer],
                verbose=0,
            )
        except OutOfMemoryRecoveryError as exc:
            error = str(exc)
    return {
        "error": error,
        "oom_count": balancer.oom_count,
        "warnings": [str(w.message) for w in caught if "oom_recovery" in str(w.message)],
    }


def elastic_between_epochs(source: str) -> dict[str, Any]:
    """ElasticDataset: the batch size changed by a callback at an epoch's end reaches the model ``lag`` steps
    later; the samples of each pass are each seen once."""
    import keras
    from ivyplug.integrations.keras import ElasticDataset

    x, y = _digits()
    data = ElasticDataset(x, y, batch_size=32, seed=7, lag=1)

    class Change(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.consumed = 0

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            self.consumed += 1

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            if epoch == 0:  # after what the pipeline produced: TensorFlow prefetches a PyDataset (AUTOTUNE)
                at = max(data.earliest_change_step(self.consumed), data.produced_step() + 1)
                data.set_batch_size(64, at_step=at)

    spy = _spy()
    model = _classifier(keras.optimizers.SGD(0.01))
    model.fit(_input(data, source), steps_per_epoch=4, epochs=3, callbacks=[Change(), spy], verbose=0)
    return {
        "sizes": [b for _, b in spy.steps],
        "segments": [list(map(int, (s.start_step, s.batch_size))) for s in data.segments],
    }


def balancer_exchange() -> dict[str, Any]:
    """The epoch's load readings shared between workers: under ``torchrun`` (``RANK``/``WORLD_SIZE`` set) on
    PyTorch one ``all_reduce``; with several JAX processes (``jax.process_count`` stubbed to 2 here) not shared,
    one warning; one process anywhere: its own reading."""
    import keras
    from ivyplug.integrations.keras import IvyLoadBalancer

    from ivyplug.load import LoadObservation

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=rank, world_size=world)
    balancer = IvyLoadBalancer(None, probes=[])
    local = LoadObservation(utilization=10.0 * (rank + 1), memory_fraction=0.25 * (rank + 1), oom_count=rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if keras.backend.backend() == "jax":
            import jax

            real = jax.process_count
            jax.process_count = lambda: 2  # type: ignore[assignment]
            try:
                rounds = [balancer._exchange(local) for _ in range(2)]
            finally:
                jax.process_count = real  # type: ignore[assignment]
        else:
            rounds = [balancer._exchange(local) for _ in range(2)]
    if world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    return {
        "rounds": [[[o.utilization, o.memory_fraction, o.oom_count] for o in r] for r in rounds],
        "warnings": [str(w.message) for w in caught],
    }


def balancer_data_parallel() -> dict[str, Any]:
    """JAX under ``keras.distribution.DataParallel`` over 2 CPU devices (``XLA_FLAGS`` of the runner): memory
    pressure shrinks B 6 -> 3, rounded to 2 (a multiple of the devices the batch is sharded over)."""
    import jax
    import keras
    from ivyplug.integrations.keras import ElasticDataset, IvyLoadBalancer

    from ivyplug.load import ScriptedProbe

    devices = jax.devices()
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
    try:
        x, y = _digits()
        data = ElasticDataset(x, y, batch_size=6, seed=1, lag=1)
        model = _classifier(keras.optimizers.SGD(0.01))
        balancer = IvyLoadBalancer(data, probes=[ScriptedProbe([FULL])], interval=0.02, goodput=False)
        history = model.fit(_input(data, "tf"), steps_per_epoch=4, epochs=3, callbacks=[balancer], verbose=0)
    finally:
        keras.distribution.set_distribution(None)
    return {"devices": len(devices), "batch_sizes": history.history["ivy/batch_size"]}


SCENARIOS: dict[str, Callable[..., Any]] = {
    "lamb_apply_float32": lambda tmp: lamb_apply("float32"),
    "lamb_apply_float64": lambda tmp: lamb_apply("float64"),
    "lamb_apply_compiled": lambda tmp: lamb_apply_compiled(1e-6),
    "lamb_fit_jit": lambda tmp: lamb_fit(True),
    "lamb_fit_nojit": lambda tmp: lamb_fit(False),
    "lamb_save_load": lamb_save_load,
    "async_one_worker": lambda tmp: async_one_worker(),
    "balancer_fit_tf_data": lambda tmp: balancer_fit("tf"),
    "balancer_fit_py_dataset": lambda tmp: balancer_fit("py"),
    "balancer_monitor": lambda tmp: balancer_monitor(),
    "balancer_oom": lambda tmp: balancer_oom(),
    "elastic_tf_data": lambda tmp: elastic_between_epochs("tf"),
    "elastic_py_dataset": lambda tmp: elastic_between_epochs("py"),
    "balancer_exchange": lambda tmp: balancer_exchange(),
}
#: Run by themselves (another environment): not part of SCENARIOS' batch.
SOLO_SCENARIOS: dict[str, Callable[..., Any]] = {"balancer_data_parallel": lambda tmp: balancer_data_parallel()}


def run(names: list[str], tmp: str) -> dict[str, Any]:
    """``{name: {"result": ...}}`` or ``{name: {"error": traceback}}`` for each scenario, in order."""
    out: dict[str, Any] = {}
    for name in names:
        start = time.perf_counter()
        try:
            out[name] = {"result": {**SCENARIOS, **SOLO_SCENARIOS}[name](tmp)}
        except Exception:
            out[name] = {"error": traceback.format_exc()}
        out[name]["seconds"] = round(time.perf_counter() - start, 2)
    return out


if __name__ == "__main__":
    request = json.loads(sys.argv[1])
    print(json.dumps({"backend": __import__("keras").backend.backend(), **run(request["names"], request["tmp"])}))
    sys.stdout.flush()
    # torch.distributed / TensorFlow threads must not hold the interpreter at exit
    os._exit(0)
