"""A step that runs out of memory is split into micro-batches on the same data, in real ``model.fit`` runs.

The OOM is real: :class:`OOMAbove` allocates a 256 TiB tensor (the CPU allocator answers with
``tf.errors.ResourceExhaustedError``, "OOM when allocating tensor"; the suite runs TensorFlow's plain CPU
allocator, tests/conftest.py, whose OOM is immediate where oneDNN's retries for 10 s) whenever it is armed and sees more
samples than its threshold, and otherwise counts the samples it lets through (after the check, so a
failed attempt counts nothing). The model is linear with a mean-squared loss and SGD, so the update of
the recovered step is checked against an independent float64 computation on the same batch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from ivyplug.integrations.keras.elastic import ElasticDataset  # noqa: E402
from ivyplug.integrations.keras.load_balancer import IvyLoadBalancer  # noqa: E402

from ivyplug.load import OutOfMemoryRecoveryError, ScriptedProbe  # noqa: E402

BUSY = {"cpu_util": 90.0, "mem_used": 7.0, "mem_total": 10.0}  # the policy holds B unless an OOM happened
N, FEATURES, LR = 256, 8, 0.05


class OOMAbove(keras.layers.Layer):
    """Identity that really runs out of memory on more than ``threshold`` samples once armed."""

    def __init__(self, threshold: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # Variables, not constants: grappler must not fold the huge allocation away.
        self.threshold = self.add_weight(
            shape=(), initializer=keras.initializers.Constant(threshold), trainable=False, dtype="int32", name="t"
        )
        self.armed = self.add_weight(shape=(), initializer="zeros", trainable=False, dtype="int32", name="armed")
        self.seen = self.add_weight(
            shape=(), initializer="zeros", trainable=False, dtype="float32", name="seen", aggregation="mean"
        )

    def call(self, x: Any, training: bool = False) -> Any:
        if not training:
            return x
        n = tf.shape(x)[0]
        too_big = tf.logical_and(self.armed.value > 0, n > self.threshold.value)
        rows = tf.where(too_big, tf.constant(2**26, tf.int32), 1)
        block = tf.fill(tf.stack([rows, 2**20]), 0.0)  # 2**46 floats when too big: a real allocator OOM
        with tf.control_dependencies([block]):
            count = self.seen.assign_add(tf.cast(n, "float32"))
        with tf.control_dependencies([count]):
            return tf.identity(x) + 0.0 * block[0, 0]


def _data(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N, FEATURES)).astype("float32")
    y = (x @ rng.normal(size=(FEATURES, 1)) + 0.1 * rng.normal(size=(N, 1))).astype("float32")
    return x, y


def _model(threshold: int) -> Any:
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((FEATURES,)), OOMAbove(threshold), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    return model


class ArmAndRecord(keras.callbacks.Callback):
    """Arms the OOM at global step ``arm_at``; keeps the weights before and after that step."""

    def __init__(self, arm_at: int) -> None:
        super().__init__()
        self.arm_at = arm_at
        self.step = 0
        self.before: list[np.ndarray] = []
        self.after: list[np.ndarray] = []
        self.seen_per_epoch: list[float] = []

    def _layer(self) -> OOMAbove:
        return next(layer for layer in self.model.layers if isinstance(layer, OOMAbove))

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        if self.step == self.arm_at:
            self._layer().armed.assign(1)
            self.before = [np.asarray(w.numpy(), dtype=np.float64) for w in self.model.trainable_weights]

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if self.step == self.arm_at:
            self.after = [np.asarray(w.numpy(), dtype=np.float64) for w in self.model.trainable_weights]
        self.step += 1

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        # assign_add under MirroredStrategy assigns the aggregate of each replica's (seen + n_r): with "mean"
        # (and equal slices) that adds one replica's count.
        replicas = int(self.model.distribute_strategy.num_replicas_in_sync)
        self.seen_per_epoch.append(replicas * float(keras.ops.convert_to_numpy(self._layer().seen.value)))


def _sgd_reference(before: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> list[np.ndarray]:
    """One SGD step of Dense(1) on the mean squared error, in float64."""
    kernel, bias = before
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    residual = x64 @ kernel + bias - y64
    return [kernel - LR * 2.0 * x64.T @ residual / len(x), bias - LR * 2.0 * residual.mean(axis=0)]


def _balancer(data: ElasticDataset, **kwargs: Any) -> IvyLoadBalancer:
    return IvyLoadBalancer(data, probes=[ScriptedProbe([BUSY])], interval=0.05, lr_scaling="linear", **kwargs)


def _fit_and_check(strategy: Any, threshold: int, expected_parts: int) -> IvyLoadBalancer:
    x, y = _data(7)
    data = ElasticDataset(x, y, batch_size=64, seed=11, lag=1)
    if strategy is None:
        model = _model(threshold)
        pipeline = data.tf_dataset()
    else:
        with strategy.scope():
            model = _model(threshold)
        pipeline = data.tf_dataset(strategy)
    balancer = _balancer(data)
    arm = ArmAndRecord(arm_at=5)  # epoch 1, its second step
    history = model.fit(pipeline, steps_per_epoch=4, epochs=3, callbacks=[balancer, arm], verbose=0, shuffle=False)
    h = history.history
    # Steps 5-7 (the rest of epoch 1) and 8 (already in the pipeline when B was lowered) ran split.
    assert balancer.recovered_steps == [(s, expected_parts) for s in (5, 6, 7, 8)]
    # Every sample of the stream went through the model exactly once: 2 full passes after epoch 1.
    assert arm.seen_per_epoch[:2] == [N, 2 * N]
    assert arm.seen_per_epoch[2] == data.position_at(balancer.step) == 2 * N + 64 + 3 * 32
    # The recovered step made the update of the whole batch (float64 reference on the same samples).
    replicas = int(model.distribute_strategy.num_replicas_in_sync)
    index = np.concatenate([data.indices(5, r, replicas) for r in range(replicas)])
    for got, want in zip(arm.after, _sgd_reference(arm.before, x[index], y[index]), strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)
    # B is lowered at the next epoch boundary (with the LR), the OOMs are logged.
    assert [d[:3] for d in balancer.decisions] == [(1, 64, 32)]
    assert h["ivy/batch_size"] == [64.0, 64.0, 32.0]
    assert h["ivy/lr_factor"] == pytest.approx([1.0, 1.0, 0.5])
    # Step 5: the step, then one per doubling. One device: steps 6-8 fail once at 64 before the known split
    # (step 8 is in epoch 2 but at a size already scheduled to shrink: it does not shrink B again). Mirrored:
    # after the OOM the batches come from the ElasticDataset and go straight to the known split.
    first = expected_parts.bit_length() - 1
    later = (2, 3) if strategy is None else (0, 0)
    assert h["ivy/oom_count"] == [0.0, first + later[0], first + later[1]]
    assert balancer.oom_count == first + later[1]
    assert float(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 12  # one update per step
    assert getattr(model.train_function, "_ivyplug_unguarded", None) is None  # Keras's own function is back
    return balancer


def test_single_device_oom_step_is_split_on_the_same_data() -> None:
    # 64 samples are too many; 2 x 32 fit under the threshold of 40 (and so does B = 32 later).
    _fit_and_check(None, threshold=40, expected_parts=2)


def test_a_split_step_counts_on_from_the_step_count_a_later_callback_restored() -> None:
    """``BackupAndRestore``, listed after the balancer, restores the optimizer's step counter after the balancer's
    ``on_train_begin``: split steps count on from it (from 0, Adam's bias correction would start again)."""
    x, y = _data(7)
    data = ElasticDataset(x, y, batch_size=64, seed=11, lag=1)
    model = _model(40)

    class Restores(keras.callbacks.Callback):
        def on_train_begin(self, logs: Any = None) -> None:
            self.model.optimizer.iterations.assign(100)

    balancer, arm = _balancer(data), ArmAndRecord(arm_at=5)
    callbacks = [balancer, Restores(), arm]
    model.fit(data.tf_dataset(), steps_per_epoch=4, epochs=3, callbacks=callbacks, verbose=0, shuffle=False)
    assert balancer.recovered_steps  # the case: steps ran split
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 100 + 12


def test_mirrored_oom_step_is_split_and_replicas_stay_equal(mirrored: Any) -> None:
    # 32 samples per replica -> 2 x 16 fit under the threshold of 20.
    balancer = _fit_and_check(mirrored, threshold=20, expected_parts=2)
    for variable in balancer.model.weights + balancer.model.optimizer.variables:
        parts = mirrored.experimental_local_results(variable)
        if len(parts) == 2:
            np.testing.assert_array_equal(np.asarray(parts[0]), np.asarray(parts[1]))


def test_repeated_oom_doubles_the_parts_up_to_a_clear_error() -> None:
    """64 -> 2 x 32 -> 4 x 16: two real OOMs double the parts; past ``oom_max_parts`` a clear error."""
    x, y = _data(1)
    data = ElasticDataset(x, y, batch_size=64, seed=0, lag=1)
    model = _model(threshold=16)
    balancer = _balancer(data, oom_max_parts=4)  # 64 -> 2 x 32 -> 4 x 16 fits
    arm = ArmAndRecord(1)
    model.fit(data.tf_dataset(), steps_per_epoch=2, epochs=1, callbacks=[balancer, arm], verbose=0, shuffle=False)
    assert balancer.recovered_steps == [(1, 4)] and balancer.oom_count == 2
    assert arm.seen_per_epoch == [128.0]
    index = data.indices(1)
    for got, want in zip(arm.after, _sgd_reference(arm.before, x[index], y[index]), strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)

    data = ElasticDataset(x, y, batch_size=64, seed=0, lag=1)
    model = _model(threshold=16)
    balancer = _balancer(data, oom_max_parts=2)
    limit = r"step 1 \(global batch 64\).*2 micro-batches.*max_parts=2"
    with pytest.raises(OutOfMemoryRecoveryError, match=limit):
        model.fit(
            data.tf_dataset(),
            steps_per_epoch=4,
            epochs=1,
            callbacks=[balancer, ArmAndRecord(1)],
            verbose=0,
            shuffle=False,
        )
    assert balancer.oom_count == 2  # the step, then 2 micro-batches


def test_unsplittable_steps_refuse_with_the_reason() -> None:
    x, y = _data(2)
    data = ElasticDataset(x, y, batch_size=32, seed=0, lag=1)
    model = _model(threshold=8)
    model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse", steps_per_execution=2)
    balancer = _balancer(data)
    fit = {"steps_per_epoch": 4, "epochs": 1, "verbose": 0, "shuffle": False}
    with pytest.raises(OutOfMemoryRecoveryError, match=r"cannot split this step.*steps_per_execution=2"):
        model.fit(data.tf_dataset(), callbacks=[balancer, ArmAndRecord(0)], **fit)
    # Several workers (MultiWorkerMirroredStrategy): the peers of a failed worker cannot follow it.
    model = _model(threshold=8)
    balancer = _balancer(data)
    balancer._workers = lambda: 2  # type: ignore[method-assign]
    with pytest.raises(OutOfMemoryRecoveryError, match=r"cannot split this step.*MultiWorkerMirroredStrategy"):
        model.fit(data.tf_dataset(), callbacks=[balancer, ArmAndRecord(0)], **fit)
    with pytest.raises(ValueError, match="oom_max_parts must be an int >= 1"):
        IvyLoadBalancer(data, oom_max_parts=0)


def test_an_optimizer_that_accumulates_gradients_is_refused_a_split_and_warned_at_fit_start() -> None:
    """Keras's ``gradient_accumulation_steps`` applies gradients every few batches (its ``iterations`` is then
    computed, not a variable): a split step failed with "EagerTensor has no attribute 'assign'". The OOM now ends
    the fit with the reason, announced at fit start."""
    x, y = _data(2)
    data = ElasticDataset(x, y, batch_size=32, seed=0, lag=1)
    model = _model(threshold=8)
    model.compile(optimizer=keras.optimizers.SGD(LR, gradient_accumulation_steps=2), loss="mse")
    fit = {"steps_per_epoch": 4, "epochs": 1, "verbose": 0, "shuffle": False}
    warned = pytest.warns(RuntimeWarning, match=r"gradient_accumulation_steps=2.*stops fit as an OutOfMemoryRecovery")
    refused = pytest.raises(OutOfMemoryRecoveryError, match=r"cannot split this step.*gradient_accumulation_steps=2")
    with warned, refused:
        model.fit(data.tf_dataset(), callbacks=[_balancer(data), ArmAndRecord(1)], **fit)
