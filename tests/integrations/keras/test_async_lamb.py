"""Keras ``AsyncLAMB``: config, one worker = LAMB, two real worker processes averaging through the PS."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
from ivyplug.integrations.keras import LAMB, AsyncLAMB, AsyncLAMBExchange

REPO = Path(__file__).resolve().parents[3]


def _model(seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(3)])


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    return rng.normal(size=(80, 6)).astype("float32"), rng.normal(size=(80, 3)).astype("float32")


def test_config_round_trip_and_bad_arguments() -> None:
    opt = AsyncLAMB(learning_rate=0.01, sync_every=3, merge_rate=0.5, max_trust_ratio=5.0)
    again = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert type(again) is AsyncLAMB
    assert (again.sync_every, again.merge_rate, again.max_trust_ratio) == (3, 0.5, 5.0)
    with pytest.raises(ValueError, match="sync_every must be an int >= 1"):
        AsyncLAMB(sync_every=0)
    with pytest.raises(ValueError, match="merge_rate must be None or a finite number > 0"):
        AsyncLAMB(merge_rate=float("inf"))
    with pytest.raises(ValueError, match=r"PSConfig\.mode"):
        AsyncLAMBExchange(mode="bsp")


def test_exchange_callback_refuses_another_optimizer() -> None:
    model = _model()
    model.compile(optimizer=LAMB(), loss="mse")
    x, y = _data()
    with pytest.raises(ValueError, match="compiled with AsyncLAMB, got LAMB"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[AsyncLAMBExchange()])


def test_one_worker_exchanges_every_h_steps_and_matches_lamb() -> None:
    """One worker (merge rate 1): the exchanges change nothing but rounding; 5 steps/epoch, H = 2."""
    x, y = _data()
    plain = _model()
    plain.compile(optimizer=LAMB(learning_rate=0.02), loss="mse")
    plain.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    model = _model()
    model.compile(optimizer=AsyncLAMB(learning_rate=0.02, sync_every=2), loss="mse")
    exchange = AsyncLAMBExchange(mode="async")
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False, callbacks=[exchange])
    assert exchange.exchanges == 5  # steps 2, 4, 6, 8, 10
    assert exchange.client is None  # closed at the end of fit
    for a, b in zip(model.get_weights(), plain.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def test_mirrored_strategy_worker_exchanges_and_keeps_replicas_equal(mirrored: object) -> None:
    x, y = _data()
    with mirrored.scope():  # type: ignore[attr-defined]
        model = _model()
        model.compile(optimizer=AsyncLAMB(learning_rate=0.02, sync_every=2), loss="mse")
    exchange = AsyncLAMBExchange(mode="sync")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[exchange], validation_data=(x[:16], y[:16]))
    assert exchange.exchanges == 3  # steps 2 and 4, then the flush before validation (step 5)
    for v in model.trainable_variables:
        replicas = [t.numpy() for t in v.value.values]  # the tf MirroredVariable under the keras.Variable
        np.testing.assert_array_equal(replicas[0], replicas[1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_keras_workers_average_into_one_global_model(tmp_path: Path) -> None:
    """async (the torch twin's tests cover sync across processes; sync within a worker is tested above)."""
    mode = "async"
    port = _free_port()
    procs = []
    try:
        for rank in (0, 1):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "tests.integrations.keras.async_lamb_worker", str(tmp_path), mode],
                    cwd=str(REPO),
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        outputs = [p.communicate(timeout=240)[0] for p in procs]
        assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outputs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    for a, b in zip(r0["weights"], r1["weights"], strict=True):  # both hold the servers' final copy
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert r0["val_acc"][-1] == r1["val_acc"][-1] >= 0.9  # validated the same global model
    # 720 samples each = 23 steps/epoch; H = 4 gives 5 exchanges + 1 flush per epoch
    assert r0["exchanges"] == r1["exchanges"] == 5 * 6


def test_docstring_example_runs() -> None:
    import doctest

    from ivyplug.integrations.keras import async_lamb

    tests = [t for t in doctest.DocTestFinder().find(async_lamb.AsyncLAMB, "AsyncLAMB", globs={}) if t.examples]
    assert tests, "AsyncLAMB's docstring must hold a runnable example"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in tests:
        runner.run(test)
    assert runner.summarize(verbose=False).failed == 0
