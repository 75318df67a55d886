"""IvyLoadBalancer in real ``model.fit`` runs, driven by scripted load traces."""

from __future__ import annotations

import json
import math
import warnings
from typing import Any

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from ivyplug.integrations.keras.elastic import ElasticDataset  # noqa: E402
from ivyplug.integrations.keras.load_balancer import IvyLoadBalancer  # noqa: E402

from ivyplug.load import ScriptedProbe  # noqa: E402

IDLE = {"cpu_util": 10.0, "mem_used": 3.0, "mem_total": 10.0}  # grow: utilisation < 70 %, memory 30 %
FULL = {"cpu_util": 95.0, "mem_used": 9.5, "mem_total": 10.0}  # shrink: memory 95 %
BUSY = {"cpu_util": 90.0, "mem_used": 7.0, "mem_total": 10.0}  # hold: inside the hysteresis band


@pytest.fixture
def own_mirrored(mirrored: Any) -> Any:
    """A MirroredStrategy with collective keys of its own.

    Every MirroredStrategy in a process starts its collective group and instance keys at the same base,
    and TF caches each instance's shape: a second strategy's all-reduce of another model can then hit
    "Shape mismatch in the collective instance". TF's own tests raise the key base per strategy; so do we.
    """
    tf.distribute.MirroredStrategy._collective_key_base += 100_000
    return tf.distribute.MirroredStrategy(mirrored.extended.worker_devices)


@pytest.fixture(scope="module")
def digits() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 16)).astype("float32")
    y = (x[:, :4].argmax(axis=1)).astype("int64")
    return x, y


class SeenBatch(keras.metrics.Metric):
    """The size of the batch the model just trained on (its variable sums over replicas: the global size)."""

    def __init__(self, name: str = "seen", **kwargs: Any) -> None:
        super().__init__(name=name, **kwargs)
        self.size = self.add_variable(shape=(), initializer="zeros", name="size")

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        self.size.assign(keras.ops.cast(keras.ops.shape(y_true)[0], "float32"))

    def result(self) -> Any:
        return self.size


class Spy(keras.callbacks.Callback):
    """Per step: the learning rate in force and the global batch size the model saw."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[tuple[float, int]] = []
        self.step_logs: list[list[str]] = []
        self._lr = 0.0

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        self._lr = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.steps.append((self._lr, round(float(logs["seen"]))))
        self.step_logs.append(sorted(k for k in logs if k.startswith("ivy/")))


def _model(optimizer: Any) -> Any:
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(4)])
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[SeenBatch()],
    )
    return model


def _balancer(data: ElasticDataset | None, trace: list[dict[str, float]], **kwargs: Any) -> IvyLoadBalancer:
    holder: list[IvyLoadBalancer] = []
    probe = ScriptedProbe(trace, clock=lambda: holder[0].epoch)
    kwargs.setdefault("goodput", False)  # these tests are about the utilisation and memory rules
    balancer = IvyLoadBalancer(data, probes=[probe], interval=0.02, **kwargs)
    holder.append(balancer)
    return balancer


def _expected_factor(rule: str, batch: int, first: int) -> float:
    return batch / first if rule == "linear" else math.sqrt(batch / first)


def test_mirrored_fit_grows_then_shrinks_and_replicas_stay_equal(own_mirrored: Any, digits: Any) -> None:
    mirrored = own_mirrored
    x, y = digits
    data = ElasticDataset(x, y, batch_size=32, seed=4)
    with mirrored.scope():
        model = _model(keras.optimizers.Adam(0.01))
    balancer = _balancer(data, [IDLE, IDLE, FULL, BUSY])
    spy = Spy()
    history = model.fit(
        data.tf_dataset(mirrored),
        steps_per_epoch=data.steps_per_epoch,
        epochs=4,
        callbacks=[balancer, spy],
        verbose=0,
        shuffle=False,
    )
    h = history.history
    # idle -> grow (x2); cooldown holds one epoch; memory 95 % -> shrink (x0.5); 70 % -> hold.
    assert h["ivy/batch_size"] == [32.0, 64.0, 64.0, 32.0]
    assert h["ivy/lr_factor"] == pytest.approx([1.0, math.sqrt(2), math.sqrt(2), 1.0])
    assert h["ivy/memory_fraction"] == pytest.approx([0.3, 0.3, 0.95, 0.7])
    assert h["ivy/utilization"] == pytest.approx([10.0, 10.0, 95.0, 90.0])
    assert h["ivy/cpu_util"] == pytest.approx([10.0, 10.0, 95.0, 90.0])
    assert h["ivy/oom_count"] == [0.0, 0.0, 0.0, 0.0]
    assert all(0.0 < v <= 1.0 for v in h["ivy/callback_overhead"])  # a share of the epoch's training time
    assert [d[1:3] for d in balancer.decisions] == [(32, 64), (64, 32)]
    # The LR changes exactly when the new batch size reaches the model (not when it is decided).
    sizes = [b for _, b in spy.steps]
    assert sizes[:8] == [32] * 8 and 64 in sizes and sizes[-1] == 32
    first_big = sizes.index(64)
    assert first_big == 8 + data.lag  # decided at the end of epoch 0 (8 steps), lands `lag` steps later
    for lr, batch in spy.steps:
        assert lr == pytest.approx(0.01 * _expected_factor("sqrt", batch, 32), rel=1e-6)
    # Both replicas hold the same weights and optimizer state.
    for variable in model.weights + model.optimizer.variables:
        parts = mirrored.experimental_local_results(variable)
        if len(parts) == 2:
            np.testing.assert_array_equal(parts[0].numpy(), parts[1].numpy())
    assert balancer.sampler is None  # closed at train end


def test_single_device_sgd_grows_linearly(digits: Any) -> None:
    x, y = digits
    data = ElasticDataset(x, y, batch_size=16, seed=2, lag=2)
    model = _model(keras.optimizers.SGD(0.05))
    cores = {"cpu0_util": 5.0, "cpu1_util": 15.0}  # per core: in the epoch's logs, not in the steps'
    trace = [IDLE | cores, BUSY | cores, IDLE | cores, BUSY | cores]
    balancer = _balancer(data, trace, max_batch_size=64, log_every_n_steps=3)
    spy = Spy()
    history = model.fit(
        data.tf_dataset(),
        steps_per_epoch=data.steps_per_epoch,
        epochs=3,
        callbacks=[balancer, spy],
        verbose=0,
        shuffle=False,
    )
    assert history.history["ivy/batch_size"] == [16.0, 32.0, 32.0]
    assert history.history["ivy/lr_factor"] == pytest.approx([1.0, 2.0, 2.0])
    for lr, batch in spy.steps:
        assert lr == pytest.approx(0.05 * _expected_factor("linear", batch, 16), rel=1e-6)
    assert float(keras.ops.convert_to_numpy(model.optimizer.learning_rate)) == pytest.approx(0.1)
    # log_every_n_steps=3: the latest readings join the batch logs every third step only.
    assert [bool(keys) for keys in spy.step_logs] == [(i + 1) % 3 == 0 for i in range(len(spy.step_logs))]
    assert spy.step_logs[2] == ["ivy/cpu_util", "ivy/mem_total", "ivy/mem_used"]
    assert history.history["ivy/cpu1_util"] == [15.0, 15.0, 15.0]


def test_steps_per_execution_counts_every_step_of_an_epochs_last_call(digits: Any) -> None:
    """An ``ElasticDataset`` never runs out, so Keras runs an epoch's last call whole (3 steps) where
    ``steps_per_epoch`` is not a multiple of ``steps_per_execution``: the balancer counts those steps, and where the
    next fit's stream resumes follows them (the optimizer's own step count is the independent reference)."""
    x, y = digits
    data = ElasticDataset(x, y, batch_size=16, seed=2, lag=2)
    assert data.steps_per_epoch % 3 != 0  # the case: a last call that runs past steps_per_epoch
    model = _model(keras.optimizers.SGD(0.05))
    model.compile(
        optimizer=model.optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        steps_per_execution=3,
    )
    balancer = _balancer(data, [BUSY, BUSY])  # hold: the batch size stays 16
    model.fit(data.tf_dataset(), steps_per_epoch=data.steps_per_epoch, epochs=2, callbacks=[balancer], verbose=0)
    steps = int(keras.ops.convert_to_numpy(model.optimizer.iterations))
    assert steps == 2 * math.ceil(data.steps_per_epoch / 3) * 3 > 2 * data.steps_per_epoch
    assert balancer.step == steps
    assert data.resume_position == 16 * steps


def test_one_replica_has_no_noise_scale_so_goodput_warns_once_and_does_not_grow(digits: Any) -> None:
    x, y = digits
    data = ElasticDataset(x, y, batch_size=16, seed=2, lag=2)
    model = _model(keras.optimizers.SGD(0.05))
    balancer = _balancer(data, [IDLE], goodput=True)
    with pytest.warns(RuntimeWarning, match="no gradient noise scale estimate: one replica") as warned:
        history = model.fit(
            data.tf_dataset(), steps_per_epoch=data.steps_per_epoch, epochs=2, verbose=0, callbacks=[balancer]
        )
    assert sum("noise scale" in str(w.message) for w in warned) == 1
    assert history.history["ivy/batch_size"] == [16.0, 16.0] and balancer.decisions == []
    assert all("goodput unknown (one replica" in reason for _, reason in balancer.reasons), balancer.reasons


def test_a_new_balancer_over_the_dataset_applies_the_learning_rate_of_the_batch_size_it_inherits(
    digits: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first fit decides to double B at its second epoch's start, to land after its last step (lag 4, 2 steps
    an epoch); the next fit, with a new balancer over the same dataset, trains at 2B: its learning rate must be
    the doubled one (SGD: linear) from its first step, and the stream continues where the first fit stopped."""
    x, y = digits
    data = ElasticDataset(x, y, batch_size=16, seed=2, lag=4)
    model = _model(keras.optimizers.SGD(0.05))
    first = _balancer(data, [IDLE, IDLE], max_batch_size=64)
    model.fit(data.tf_dataset(), steps_per_epoch=2, epochs=2, callbacks=[first], verbose=0, shuffle=False)
    assert [d[1:3] for d in first.decisions] == [(16, 32)]
    assert float(keras.ops.convert_to_numpy(model.optimizer.learning_rate)) == pytest.approx(0.05)  # not reached
    assert data.resume_position == 4 * 16
    # A fit refused before its first step (a schedule cannot take the inherited batch size's rate) keeps what
    # the batch size owes: the next fit still trains at the doubled rate.
    scheduled = _model(keras.optimizers.SGD(keras.optimizers.schedules.ExponentialDecay(0.05, 10, 0.9)))
    with pytest.raises(ValueError, match="LearningRateSchedule"):
        callbacks = [_balancer(data, [BUSY], adapt_batch_size=False)]
        scheduled.fit(data.tf_dataset(), steps_per_epoch=2, callbacks=callbacks, verbose=0, shuffle=False)
    assert data.owed_lr_factor == 2.0 and data.resume_position == 4 * 16
    # So does a start that fails after its checks (the sampler's probes or the gradient watch raising).
    failing = _balancer(data, [BUSY], max_batch_size=64)

    def fail() -> None:
        raise RuntimeError("a probe's library is missing")

    monkeypatch.setattr(failing, "_watch_gradients", fail)
    with pytest.raises(RuntimeError, match="library is missing"):
        model.fit(data.tf_dataset(), steps_per_epoch=2, callbacks=[failing], verbose=0, shuffle=False)
    assert data.owed_lr_factor == 2.0 and data.resume_position == 4 * 16
    # And one that a later callback refuses at its start (BackupAndRestore failing to read its backup).

    class Refuses(keras.callbacks.Callback):
        def on_train_begin(self, logs: Any = None) -> None:
            raise RuntimeError("the backup cannot be read")

    refused = [_balancer(data, [BUSY], max_batch_size=64), Refuses()]
    with pytest.raises(RuntimeError, match="cannot be read"):
        model.fit(data.tf_dataset(), steps_per_epoch=2, callbacks=refused, verbose=0, shuffle=False)
    assert data.owed_lr_factor == 2.0 and data.resume_position == 4 * 16
    # And a fit that runs no epoch (epochs=0) passes both on untouched.
    idle = _balancer(data, [BUSY], max_batch_size=64)
    model.fit(data.tf_dataset(), steps_per_epoch=2, epochs=0, callbacks=[idle], verbose=0, shuffle=False)
    assert data.owed_lr_factor == 2.0 and data.resume_position == 4 * 16
    spy = Spy()
    second = _balancer(data, [BUSY, BUSY], max_batch_size=64)  # holds B
    model.fit(data.tf_dataset(), steps_per_epoch=2, epochs=2, callbacks=[second, spy], verbose=0, shuffle=False)
    assert [b for _, b in spy.steps] == [32] * 4
    for lr, _ in spy.steps:
        assert lr == pytest.approx(0.1, rel=1e-6)
    assert data.owed_lr_factor == 1.0 and data.resume_position == 4 * 16 + 4 * 32


class _Crash(keras.callbacks.Callback):
    """Ends ``fit`` at the end of epoch ``epoch`` (or of its batch ``batch``), after the callbacks before it."""

    def __init__(self, epoch: int, batch: int | None = None) -> None:
        super().__init__()
        self.epoch, self.batch, self._epoch = epoch, batch, -1

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._epoch = epoch

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if self._epoch == self.epoch and batch == self.batch:
            raise KeyboardInterrupt("the job was pre-empted")

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if epoch == self.epoch and self.batch is None:
            raise KeyboardInterrupt("the job was pre-empted")


def _backed_up_fit(
    digits: Any,
    backup: Any,
    crash: _Crash | None,
    balancer_dir: Any,
    save_freq: Any = "epoch",
    optimizer: Any = None,
    double_checkpoint: bool = False,
    **options: Any,
) -> tuple[Any, Spy]:
    """A fresh process's 4-epoch fit (new dataset, model, callbacks) under BackupAndRestore, SGD (linear LR); the
    balancer first, as its docs ask."""
    x, y = digits
    data = ElasticDataset(x, y, batch_size=16, seed=2, lag=2)
    model = _model(keras.optimizers.SGD(0.05) if optimizer is None else optimizer)
    spy = Spy()
    balancer = _balancer(data, [IDLE] * 4, max_batch_size=128, backup_dir=balancer_dir, **options)
    restore = keras.callbacks.BackupAndRestore(str(backup), save_freq=save_freq, double_checkpoint=double_checkpoint)
    callbacks = [balancer, restore, spy]
    callbacks += [crash] if crash is not None else []
    model.fit(data.tf_dataset(), steps_per_epoch=4, epochs=4, callbacks=callbacks, verbose=0, shuffle=False)
    return model, spy


def test_a_fit_resumed_by_backup_and_restore_goes_on_as_the_uninterrupted_one(digits: Any, tmp_path: Any) -> None:
    """B doubles at epoch 0's end and at epoch 2's (cooldown 1), each landing 2 steps into the next epoch. Pre-empted
    after epoch 2, with the second change decided but not reached, and run again with a fresh dataset, model and
    balancer, the fit goes on exactly as the uninterrupted one: the same batch size and learning rate at every step
    and the same weights. Without backup_dir it warns, and the learning rate BackupAndRestore restored (scaled for
    32) meets the dataset's initial 16: the control that the backup is what carries the batch size."""
    whole, whole_spy = _backed_up_fit(digits, tmp_path / "whole", None, tmp_path / "whole")
    epoch_3 = [(0.1, 32), (0.1, 32), (0.2, 64), (0.2, 64)]
    assert [b for _, b in whole_spy.steps[-4:]] == [b for _, b in epoch_3]
    assert [lr for lr, _ in whole_spy.steps[-4:]] == pytest.approx([lr for lr, _ in epoch_3], rel=1e-6)
    assert [b for _, b in whole_spy.steps[:12]] == [16] * 6 + [32] * 6
    with pytest.raises(KeyboardInterrupt):
        _backed_up_fit(digits, tmp_path / "cut", _Crash(2), tmp_path / "cut")
    resumed, spy = _backed_up_fit(digits, tmp_path / "cut", None, tmp_path / "cut")
    assert spy.steps == whole_spy.steps[-4:]  # epoch 3 only, as the whole fit took it (exact: float32 products)
    for got, want in zip(resumed.get_weights(), whole.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert not (tmp_path / "cut").exists()  # BackupAndRestore removed its directory, the balancer's file with it

    with pytest.raises(KeyboardInterrupt):
        _backed_up_fit(digits, tmp_path / "control", _Crash(2), None)
    with pytest.warns(RuntimeWarning, match=r"starts at epoch 3 .* pass IvyLoadBalancer\(backup_dir=\.\.\.\)"):
        _, control = _backed_up_fit(digits, tmp_path / "control", None, None)
    assert control.steps[0][1] == 16 and control.steps[0][0] == pytest.approx(0.1, rel=1e-6)


def test_a_fit_that_backup_and_restore_resumes_from_its_previous_backup_takes_that_epochs_state(
    digits: Any, tmp_path: Any
) -> None:
    """``double_checkpoint=True``: pre-empted after epoch 2 with the latest weights unreadable, Keras resumes from the
    backup before it, at epoch 2 (after the balancer's ``on_train_begin``, listed first, has run): epochs 2 and 3 then
    go as in the uninterrupted fit, from the balancer's state of epoch 2, not of 3."""
    _, whole_spy = _backed_up_fit(digits, tmp_path / "whole", None, tmp_path / "whole")
    with pytest.raises(KeyboardInterrupt):
        _backed_up_fit(digits, tmp_path / "cut", _Crash(2), tmp_path / "cut", double_checkpoint=True)
    (tmp_path / "cut" / "latest.weights.h5").write_bytes(b"cut short")
    _, spy = _backed_up_fit(digits, tmp_path / "cut", None, tmp_path / "cut", double_checkpoint=True)
    assert spy.steps == whole_spy.steps[-8:]  # epochs 2 and 3: B 32 then 64 from epoch 3's third step


def test_a_backup_taken_after_a_change_landed_replays_its_epoch_at_the_saved_rate(digits: Any, tmp_path: Any) -> None:
    """BackupAndRestore(save_freq=1) saves after every batch; pre-empted at epoch 3's third batch, after the change to
    64 landed (learning rate 0.2), Keras replays epoch 3 from its start: the balancer sets the rate saved at epoch
    2's end (0.1) again and the change lands at its step, as in the uninterrupted fit."""
    with pytest.raises(KeyboardInterrupt):
        _backed_up_fit(digits, tmp_path / "cut", _Crash(3, batch=2), tmp_path / "cut", save_freq=1)
    _, spy = _backed_up_fit(digits, tmp_path / "cut", None, tmp_path / "cut", save_freq=1)
    assert [b for _, b in spy.steps] == [32, 32, 64, 64]
    assert [lr for lr, _ in spy.steps] == pytest.approx([0.1, 0.1, 0.2, 0.2], rel=1e-6)


def test_backup_dir_with_a_schedule_the_balancer_does_not_scale_and_with_backup_and_restore_first(
    digits: Any, tmp_path: Any
) -> None:
    """lr_scaling="none" leaves a LearningRateSchedule alone, resumed too (the batch size still comes back); a
    BackupAndRestore listed before the balancer is warned once (a stop between their saves would lose the state)."""
    schedule = keras.optimizers.schedules.ExponentialDecay(0.05, decay_steps=4, decay_rate=0.5)
    options = {"lr_scaling": "none", "optimizer": keras.optimizers.SGD(schedule)}
    with pytest.raises(KeyboardInterrupt):
        _backed_up_fit(digits, tmp_path / "cut", _Crash(2), tmp_path / "cut", **options)
    options["optimizer"] = keras.optimizers.SGD(schedule)
    _, spy = _backed_up_fit(digits, tmp_path / "cut", None, tmp_path / "cut", **options)
    assert [b for _, b in spy.steps] == [32, 32, 64, 64]

    x, y = digits
    # resumed on fewer samples than a saved batch size: warned, and the fit starts at the dataset's batch size
    small = ElasticDataset(x[:40], y[:40], batch_size=8, seed=2, lag=2)
    callbacks = [
        _balancer(small, [IDLE], backup_dir=tmp_path / "cut"),
        keras.callbacks.BackupAndRestore(str(tmp_path / "cut")),
    ]
    with pytest.raises(KeyboardInterrupt):
        _backed_up_fit(digits, tmp_path / "cut", _Crash(2), tmp_path / "cut")
    with pytest.warns(RuntimeWarning, match=r"\(\[32, 64\]\) do not fit this fit's 1 replica\(s\) and 40 samples"):
        _model(keras.optimizers.SGD(0.05)).fit(small.tf_dataset(), steps_per_epoch=1, epochs=4, callbacks=callbacks)
    assert small.batch_size_at(0) == 8

    data = ElasticDataset(x, y, batch_size=16, seed=2, lag=2)
    balancer = _balancer(data, [IDLE] * 2, backup_dir=tmp_path / "late")
    callbacks = [keras.callbacks.BackupAndRestore(str(tmp_path / "late")), balancer]
    with pytest.warns(RuntimeWarning, match="list IvyLoadBalancer before BackupAndRestore"):
        _model(keras.optimizers.SGD(0.05)).fit(data.tf_dataset(), steps_per_epoch=2, epochs=2, callbacks=callbacks)


@pytest.mark.parametrize("metadata", [None, 2])
def test_backup_dir_without_a_state_for_the_epoch_warns_once_saying_so(
    digits: Any, tmp_path: Any, metadata: int | None
) -> None:
    """A fit started at epoch 2 with a ``backup_dir`` that holds no balancer state for it: with Keras's metadata
    naming that epoch, or none (``initial_epoch`` alone), one warning that says so and where (the epoch is the one
    the fit starts at, whatever the metadata said before ``BackupAndRestore`` read it)."""
    x, y = digits
    if metadata is not None:
        (tmp_path / "training_metadata.json").write_text(json.dumps({"epoch": metadata}))
    data = ElasticDataset(x, y, batch_size=16, seed=2, lag=2)
    model = _model(keras.optimizers.SGD(0.05))
    balancer = _balancer(data, [BUSY], backup_dir=str(tmp_path))
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        model.fit(data.tf_dataset(), steps_per_epoch=2, initial_epoch=2, epochs=3, callbacks=[balancer], verbose=0)
    said = [str(w.message) for w in warned if "balancer state" in str(w.message)]
    assert len(said) == 1 and "starts at epoch 2" in said[0] and f"{tmp_path} holds no balancer state" in said[0]


def test_memory_pressure_shrinks_to_the_bound(digits: Any) -> None:
    x, y = digits
    data = ElasticDataset(x, y, batch_size=64, seed=0, lag=1)
    model = _model(keras.optimizers.Adam(0.01))
    balancer = _balancer(data, [FULL], min_batch_size=16, lr_scaling="none")
    history = model.fit(data.tf_dataset(), steps_per_epoch=4, epochs=4, callbacks=[balancer], verbose=0, shuffle=False)
    assert history.history["ivy/batch_size"] == [64.0, 32.0, 16.0, 16.0]
    assert history.history["ivy/lr_factor"] == [1.0] * 4


def test_monitoring_only_and_learning_rate_schedule(digits: Any) -> None:
    x, y = digits
    model = _model(keras.optimizers.Adam(0.01))
    balancer = _balancer(None, [IDLE])
    with pytest.warns(RuntimeWarning, match="monitors load"):
        history = model.fit(x, y, batch_size=64, epochs=1, callbacks=[balancer], verbose=0, shuffle=False)
    assert "ivy/batch_size" not in history.history
    assert history.history["ivy/utilization"] == [10.0]
    # per-worker values under the Lightning twin's names, one worker included
    assert history.history["ivy/rank0/utilization"] == [10.0] and history.history["ivy/rank0/oom_count"] == [0.0]
    assert not any(key.startswith("ivy/worker") for key in history.history)
    schedule = keras.optimizers.schedules.ExponentialDecay(0.01, decay_steps=10, decay_rate=0.9)
    scheduled = _model(keras.optimizers.Adam(schedule))
    with pytest.warns(RuntimeWarning, match="monitors load"):  # monitoring never rescales: a schedule is fine
        scheduled.fit(x, y, batch_size=64, epochs=1, callbacks=[_balancer(None, [IDLE])], verbose=0)
    data = ElasticDataset(x, y, batch_size=32)
    with pytest.raises(ValueError, match="LearningRateSchedule"):
        callbacks = [_balancer(data, [IDLE])]
        scheduled.fit(data.tf_dataset(), steps_per_epoch=2, callbacks=callbacks, verbose=0, shuffle=False)


def test_monitoring_takes_any_optimizer_and_a_callable_rate_is_refused_where_it_would_be_scaled(digits: Any) -> None:
    """A balancer that only monitors never changes the learning rate, so it needs no rule for the optimizer (it
    refused RMSprop: "lr_scaling='auto' does not know optimizer 'RMSprop'", where the Lightning twin trained). A
    callable rate (``learning_rate=lambda: ...``) has no variable to assign: it crashed at the first batch-size
    change with "'float' object has no attribute 'assign'"; it is refused at fit start, as a schedule is."""
    x, y = digits
    model = _model(keras.optimizers.RMSprop(0.01))
    with pytest.warns(RuntimeWarning, match="monitors load"):
        history = model.fit(x, y, batch_size=64, epochs=1, callbacks=[_balancer(None, [IDLE])], verbose=0)
    assert history.history["ivy/utilization"] == [10.0]
    data = ElasticDataset(x, y, batch_size=32)
    frozen = _balancer(data, [IDLE], adapt_batch_size=False)
    model.fit(data.tf_dataset(), steps_per_epoch=2, callbacks=[frozen], verbose=0, shuffle=False)
    with pytest.raises(ValueError, match="uses a callable learning rate; pass lr_scaling='none'"):
        _model(keras.optimizers.SGD(learning_rate=lambda: 0.05)).fit(
            data.tf_dataset(), steps_per_epoch=2, callbacks=[_balancer(data, [IDLE])], verbose=0, shuffle=False
        )


def test_a_fit_after_compiling_a_fresh_optimizer_gets_the_rate_of_the_reached_batch_size(digits: Any) -> None:
    """The same balancer's next fit starts at the batch size the last one reached; compiled again with a fresh
    optimizer, that optimizer's rate was the unscaled one (0.05 at B=32, ``ivy/lr_factor`` saying 2). It gets the
    reached batch size's rate, as the same optimizer kept it, and as the Lightning twin's next fit has it."""
    x, y = digits
    data = ElasticDataset(x, y, batch_size=16, seed=2, lag=2)
    model = _model(keras.optimizers.SGD(0.05))
    balancer = _balancer(data, [IDLE, BUSY], max_batch_size=32)
    fit = {"steps_per_epoch": data.steps_per_epoch, "verbose": 0, "shuffle": False}
    model.fit(data.tf_dataset(), epochs=2, callbacks=[balancer], **fit)  # B=32 from epoch 1 on, at lr 0.1
    assert float(keras.ops.convert_to_numpy(model.optimizer.learning_rate)) == pytest.approx(0.1)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss=model.loss, metrics=[SeenBatch()])
    spy = Spy()
    history = model.fit(data.tf_dataset(), epochs=1, callbacks=[balancer, spy], **fit)
    assert history.history["ivy/batch_size"] == [32.0] and history.history["ivy/lr_factor"] == pytest.approx([2.0])
    assert spy.steps and all(batch == 32 for _, batch in spy.steps)
    for lr, _ in spy.steps:
        assert lr == pytest.approx(0.1, rel=1e-6)


def test_from_config_dict_and_registry() -> None:
    from ivyplug import get_registry

    config = {
        "probes": [{"name": "scripted", "trace": [IDLE]}, "psutil"],
        "max_batch_size": 256,
        "lr_scaling": "sqrt",
        "cooldown": 2,
    }
    balancer = IvyLoadBalancer.from_config(config)
    full = balancer.get_config()
    assert full["max_batch_size"] == 256 and full["cooldown"] == 2 and full["lr_scaling"] == "sqrt"
    assert full["probes"] == [{"name": "scripted", "trace": [IDLE]}, "psutil"]
    assert IvyLoadBalancer.from_config(full).get_config() == full
    assert get_registry().get("callback", "keras.ivy_load_balancer") is IvyLoadBalancer
    with pytest.raises(ValueError, match="unknown IvyLoadBalancer config keys"):
        IvyLoadBalancer.from_config({"max_batchsize": 3})
    with pytest.raises(ValueError, match="lr_scaling must be one of"):
        IvyLoadBalancer(lr_scaling="cubic")
    with pytest.raises(ValueError, match="memory_low"):
        IvyLoadBalancer(memory_low=0.95)
    with pytest.raises(ValueError, match="min_batch_size must be None or an int >= 1"):
        IvyLoadBalancer(min_batch_size=0)
    with pytest.raises(ValueError, match=r"max_batch_size \(4\) must be >= min_batch_size \(8\)"):
        IvyLoadBalancer(min_batch_size=8, max_batch_size=4)
    with pytest.raises(ValueError, match="interval must be a positive number"):
        IvyLoadBalancer(interval=0)
    with pytest.raises(ValueError, match="backup_dir must be None or a BackupAndRestore's backup_dir path"):
        IvyLoadBalancer(ElasticDataset(np.zeros((4, 1)), np.zeros(4), batch_size=2), backup_dir=3)
    with pytest.raises(ValueError, match="backup_dir needs an ElasticDataset"):
        IvyLoadBalancer(backup_dir="backup")
    with pytest.raises(ValueError, match="backup_dir must be a local folder"):
        IvyLoadBalancer(ElasticDataset(np.zeros((4, 1)), np.zeros(4), batch_size=2), backup_dir="gs://bucket/run")
    with pytest.raises(ValueError, match="dataset must be an ElasticDataset"):
        IvyLoadBalancer([1, 2, 3])  # type: ignore[arg-type]


def _digits_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(3).permutation(len(y))
    x, y = (x / 16.0).astype("float32")[order], y.astype("int64")[order]
    return x[:1024], y[:1024], x[1024:], y[1024:]  # 16 steps of 64; 773 samples validate (1 = 0.13 points)


class _Accuracy(keras.callbacks.Callback):
    """Validation accuracy and optimizer steps after every epoch (an eager call: no eval function to build)."""

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        super().__init__()
        self.x, self.y = x, y
        self.curve: list[tuple[int, float]] = []  # (steps so far, accuracy)

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        pred = np.argmax(keras.ops.convert_to_numpy(self.model(self.x, training=False)), axis=1)
        steps = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
        self.curve.append((steps, float(np.mean(pred == self.y))))


def test_mirrored_goodput_on_digits_is_not_slower_and_goodput_off_is_the_control(mirrored: Any) -> None:
    """Default balancer (goodput on) vs none vs goodput off, 2 replicas, a scripted idle probe: the utilisation rule
    asks to grow after every epoch, the goodput rule decides. Steps to 97% and the final accuracy match the fit
    without the balancer; goodput off grows where goodput on holds."""
    xtr, ytr, xv, yv = _digits_split()
    epochs = 14
    runs: dict[str, tuple[_Accuracy, IvyLoadBalancer | None]] = {}
    for offset, mode in enumerate(("none", "goodput", "utilisation")):

        class _Keys(tf.distribute.MirroredStrategy):  # type: ignore[misc,name-defined]
            _collective_key_base = mirrored._collective_key_base + 1_000_000 * (offset + 1)

        strategy = _Keys(mirrored.extended.worker_devices)
        data = ElasticDataset(xtr, ytr, batch_size=64, seed=0)
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential(
                [keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)]
            )
            model.compile(
                optimizer=keras.optimizers.Adam(1e-2),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
        accuracy = _Accuracy(xv, yv)
        balancer = None
        if mode != "none":
            balancer = IvyLoadBalancer(data, probes=[ScriptedProbe([IDLE])], interval=0.05, goodput=mode == "goodput")
        callbacks = [accuracy] if balancer is None else [balancer, accuracy]
        model.fit(
            data.tf_dataset(strategy),
            steps_per_epoch=data.steps_per_epoch,
            epochs=epochs if mode != "utilisation" else 3,  # the control only has to show it grows
            callbacks=callbacks,
            verbose=0,
        )
        runs[mode] = (accuracy, balancer)

    def steps_to(curve: list[tuple[int, float]], target: float = 0.97) -> int | None:
        return next((steps for steps, acc in curve if acc >= target), None)

    base, (on, on_balancer), (_, off_balancer) = runs["none"][0], runs["goodput"], runs["utilisation"]
    assert on_balancer is not None and off_balancer is not None
    assert steps_to(base.curve) is not None, base.curve
    reached = steps_to(on.curve)
    assert reached is not None and reached <= steps_to(base.curve), (on.curve, base.curve)
    assert abs(on.curve[-1][1] - base.curve[-1][1]) <= 0.005 + 1e-9, (on.curve[-1], base.curve[-1])
    # the estimate exists under MirroredStrategy and grows as the loss falls
    assert on_balancer.goodput_unavailable is None
    known = [n for n in on_balancer.noise_history if n is not None]
    # (an epoch whose tr(Σ) estimate averages below zero reads 0: no measurable noise, B holds; which epochs do
    # depends on when the balancer grew B, which its measured step times decide)
    assert len(known) == epochs and all(n >= 0 for n in known), known  # NaN fails: nan >= 0 is False
    assert max(known[len(known) // 2 :]) > 2 * known[0], known
    # the control: the same load, goodput off, grows at once; goodput on holds and says why
    assert [d[1:3] for d in off_balancer.decisions][:1] == [(64, 128)]
    assert not on_balancer.decisions or on_balancer.decisions[0][0] > 0
    assert "hold" in on_balancer.reasons[0][1] and "goodput x" in on_balancer.reasons[0][1], on_balancer.reasons
    assert len(on_balancer.noise_history) == epochs
