"""MultiWorkerMirroredStrategy: 2 worker processes on 127.0.0.1.

One pair of processes (TF start-up dominates, so one pair does everything): it reproduces both Keras 3.15
failures, then trains with the fixes and checks identical weights on both workers, then trains with
IvyLoadBalancer on an ElasticDataset while only worker 1 reports memory pressure. A lone MWMS worker
blocks forever and ignores SIGTERM, so the workers run under a hard deadline and are SIGKILLed in
``finally``. Run as a script, this file is the worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

DEADLINE_S = 240.0  # a hang guard: ~50 s of CPU, 95-150 s of wall time at load 7-10 on 2 cores


def _fit_error(model: Any, data: Any) -> str | None:
    try:
        model.fit(data, epochs=1, steps_per_epoch=2, verbose=0)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"[:300]
    return None


def _worker(index: int, ports: list[int], out: Path) -> None:
    os.environ["TF_CONFIG"] = json.dumps(
        {"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]}, "task": {"type": "worker", "index": index}}
    )
    import keras
    import tensorflow as tf
    from ivyplug.integrations.keras import mwms_fixes

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5], [0.0]], dtype="float32")).astype("float32")
    data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(16)

    result: dict[str, Any] = {"replicas": strategy.num_replicas_in_sync, "failures": {}}
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    if mwms_fixes.needs_fixes():
        # Every worker makes the same calls in the same order, so the failures are symmetric.
        result["failures"]["none"] = _fit_error(model, data)
        mwms_fixes.apply_mwms_fixes(("symbolic_build",))
        result["failures"]["symbolic_build"] = _fit_error(model, data)
    result["applied"] = list(mwms_fixes.apply_mwms_fixes()) + list(mwms_fixes.applied_fixes())
    initial = np.concatenate([w.ravel() for w in model.get_weights()])
    history = model.fit(data, epochs=2, steps_per_epoch=4, verbose=0)
    result["loss"] = [float(v) for v in history.history["loss"]]
    result["initial"] = initial.tolist()
    result["weights"] = np.concatenate([w.ravel() for w in model.get_weights()]).tolist()

    # IvyLoadBalancer: worker 1 alone reports memory pressure in epoch 1; both workers must follow it.
    from ivyplug.integrations.keras.elastic import ElasticDataset
    from ivyplug.integrations.keras.load_balancer import IvyLoadBalancer

    from ivyplug.load import ScriptedProbe

    idle = {"cpu_util": 10.0, "mem_used": 3.0, "mem_total": 10.0}
    busy = {"cpu_util": 90.0, "mem_used": 7.0, "mem_total": 10.0}
    full = {"cpu_util": 90.0, "mem_used": 9.5, "mem_total": 10.0}
    trace = [idle, busy, busy] if index == 0 else [idle, full, busy]
    elastic = ElasticDataset(x, y, batch_size=16, seed=3, lag=2)
    pipeline = elastic.tf_dataset(strategy)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        balanced = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
        balanced.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    holder: list[IvyLoadBalancer] = []
    balancer = IvyLoadBalancer(  # the utilisation rule alone: MultiWorkerMirrored has no noise-scale estimate
        elastic, probes=[ScriptedProbe(trace, clock=lambda: holder[0].epoch)], interval=0.02, goodput=False
    )
    holder.append(balancer)
    fitted = balanced.fit(
        pipeline, steps_per_epoch=elastic.steps_per_epoch, epochs=3, callbacks=[balancer], verbose=0, shuffle=False
    )
    result["ivy"] = {k: v for k, v in fitted.history.items() if k.startswith("ivy/")}
    result["balanced_weights"] = np.concatenate([w.ravel() for w in balanced.get_weights()]).tolist()
    out.write_text(json.dumps(result))


def _run_pair(tmp_path: Path) -> list[dict[str, Any]]:
    from tests.ports import free_ports  # here: this file is also each worker's script, where tests/ is not importable

    ports = free_ports(2)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="tensorflow", CUDA_VISIBLE_DEVICES="")
    env.pop("TF_CONFIG", None)
    procs: list[subprocess.Popen[bytes]] = []
    logs = [tmp_path / f"worker{i}.log" for i in range(2)]
    outs = [tmp_path / f"worker{i}.json" for i in range(2)]
    try:
        for i in range(2):
            with logs[i].open("wb") as log:
                cmd = [sys.executable, __file__, str(i), ",".join(map(str, ports)), str(outs[i])]
                procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
        start = time.monotonic()
        for p in procs:
            remaining = DEADLINE_S - (time.monotonic() - start)
            try:
                p.wait(timeout=max(remaining, 0.1))
            except subprocess.TimeoutExpired:
                tails = "\n".join(f"--- worker {i}\n{log.read_text()[-2000:]}" for i, log in enumerate(logs))
                pytest.fail(f"MWMS workers did not finish within {DEADLINE_S} s\n{tails}")
        for i, p in enumerate(procs):
            assert p.returncode == 0, f"worker {i} exited {p.returncode}:\n{logs[i].read_text()[-3000:]}"
        return [json.loads(o.read_text()) for o in outs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # SIGKILL: a blocked MWMS worker ignores SIGTERM
                p.wait(timeout=10)


def test_fixes_apply_idempotently_and_remove_cleanly() -> None:
    pytest.importorskip("tensorflow")
    from ivyplug.integrations.keras import mwms_fixes
    from keras.src.backend.tensorflow import trainer

    if not mwms_fixes.needs_fixes():
        with pytest.warns(RuntimeWarning, match="left unpatched"):
            assert mwms_fixes.apply_mwms_fixes() == ()
        return
    own_build, own_reduce = trainer.TensorFlowTrainer._maybe_symbolic_build, trainer.reduce_per_replica
    try:
        with pytest.raises(ValueError, match="fixes must be a tuple of names"):
            mwms_fixes.apply_mwms_fixes(("no_such_fix",))
        assert mwms_fixes.apply_mwms_fixes() == mwms_fixes.FIXES
        assert mwms_fixes.apply_mwms_fixes() == ()
        assert trainer.reduce_per_replica is not own_reduce
        assert set(mwms_fixes.applied_fixes()) == set(mwms_fixes.FIXES)
    finally:
        mwms_fixes.remove_mwms_fixes()
    assert trainer.TensorFlowTrainer._maybe_symbolic_build is own_build
    assert trainer.reduce_per_replica is own_reduce
    assert mwms_fixes.applied_fixes() == ()


@pytest.mark.slow
def test_mwms_fit_fails_without_fixes_and_trains_identically_with_them(tmp_path: Path) -> None:
    pytest.importorskip("tensorflow")
    from ivyplug.integrations.keras import mwms_fixes

    results = _run_pair(tmp_path)
    assert [r["replicas"] for r in results] == [2, 2]
    if mwms_fixes.needs_fixes():
        for r in results:
            assert "Attempt to convert a value (PerReplica" in r["failures"]["none"]
            assert "Invalid reduction dimension 0 for input with 0 dimensions" in r["failures"]["symbolic_build"]
            assert r["applied"] == ["metric_reduction", "symbolic_build", "metric_reduction"]
    w0, w1 = (np.asarray(r["weights"]) for r in results)
    np.testing.assert_array_equal(w0, w1)
    assert not np.allclose(w0, np.asarray(results[0]["initial"]))
    assert results[0]["loss"] == results[1]["loss"]
    assert results[0]["loss"][-1] < results[0]["loss"][0]
    # IvyLoadBalancer: the same decisions on both workers, from both workers' loads.
    ivy0, ivy1 = results[0]["ivy"], results[1]["ivy"]
    decided = ("ivy/batch_size", "ivy/lr_factor", "ivy/utilization", "ivy/memory_fraction", "ivy/oom_count")
    for key in (*decided, "ivy/rank0/memory_fraction", "ivy/rank1/memory_fraction"):
        assert ivy0[key] == ivy1[key], key
    assert ivy0["ivy/mem_used"] != ivy1["ivy/mem_used"]  # raw readings stay per worker
    assert ivy0["ivy/batch_size"] == [16.0, 32.0, 16.0]
    assert ivy0["ivy/lr_factor"] == pytest.approx([1.0, 2**0.5, 1.0])
    assert ivy0["ivy/rank0/memory_fraction"] == pytest.approx([0.3, 0.7, 0.7])
    assert ivy0["ivy/rank1/memory_fraction"] == pytest.approx([0.3, 0.95, 0.7])
    np.testing.assert_array_equal(results[0]["balanced_weights"], results[1]["balanced_weights"])


if __name__ == "__main__":
    _worker(int(sys.argv[1]), [int(p) for p in sys.argv[2].split(",")], Path(sys.argv[3]))
