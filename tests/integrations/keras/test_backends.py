"""ivyplug's Keras side on every Keras backend: the ``KERAS_BACKEND`` parameter runs each check on TensorFlow,
JAX and PyTorch.

The work happens in :mod:`.backend_scenarios` (in this process for TensorFlow, in one fresh interpreter per other
backend: :mod:`.backend_runner`); here the results are checked against float64 references computed in NumPy and
against the torch ``ivyplug.optim.LAMB``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.ps.diffs import max_abs_diff

pytest.importorskip("tensorflow")
pytest.importorskip("jax")
pytest.importorskip("torch")

from tests.integrations.keras import backend_scenarios as sc
from tests.integrations.keras.backend_runner import ScenarioRuns, run_scenarios, run_workers
from tests.optim.reference import RefGroup, RefLamb


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ScenarioRuns]:
    """One run of every scenario per backend for the whole module (JAX and PyTorch in parallel)."""
    scenario_runs = ScenarioRuns(list(sc.SCENARIOS), tmp_path_factory.mktemp("keras_backends"))
    yield scenario_runs
    scenario_runs.close()


@pytest.fixture
def results(keras_backend: str, runs: ScenarioRuns) -> dict[str, Any]:
    """Every scenario's result on ``keras_backend``."""
    return runs.get(keras_backend)


def _result(results: dict[str, Any], name: str) -> Any:
    entry = results[name]
    if "error" in entry:
        raise AssertionError(f"scenario {name} failed:\n{entry['error']}")
    return entry["result"]


def _keras_lr(value: float) -> float:
    """A learning rate as Keras holds it (a float32 variable)."""
    return float(np.float32(value))


# ------------------------------------------------------------------------------------ LAMB


def _reference(
    x0: list[np.ndarray], grads: list[list[np.ndarray]], hp: dict[str, Any], adapt: list[bool] | None = None
) -> tuple[RefLamb, set[str]]:
    """The float64 LAMB of tests/optim/reference.py on the same gradients; which bounds bound."""
    adapt = [True] * len(x0) if adapt is None else adapt
    groups = [
        RefGroup(
            [i],
            lr=_keras_lr(hp["learning_rate"]),
            weight_decay=hp.get("weight_decay", 0.01),
            max_trust_ratio=hp.get("max_trust_ratio", 10.0),
            exclude_from_layer_adaptation=not adapt[i],
        )
        for i in range(len(x0))
    ]
    ref = RefLamb([a.astype(np.float64) for a in x0], groups, max_grad_norm=hp.get("max_grad_norm"))
    hits: set[str] = set()
    for g in grads:
        norm = math.sqrt(sum(float(np.sum(np.asarray(a, np.float64) ** 2)) for a in g))
        if math.isfinite(norm) and hp.get("max_grad_norm") is not None and norm > hp["max_grad_norm"]:
            hits.add("clip")
        ref.step(g)
        if any(r == hp.get("max_trust_ratio") for r in ref.ratios.values()):
            hits.add("max")
    return ref, hits


def test_lamb_float32_matches_the_float64_reference(results: dict[str, Any]) -> None:
    got = _result(results, "lamb_apply_float32")
    x0, grads = sc.random_problem(seed=5)
    ref, hits = _reference(x0, grads, sc.LAMB_HP)
    assert hits == {"clip", "max"}, "the case must exercise the clip and the trust-ratio bound"
    assert got["dtype"] == "float32" and got["skipped"] == 1 and got["iterations"] == sc.STEPS
    for name, g, w in zip(sc.NAMES, got["values"], ref.params, strict=True):
        np.testing.assert_allclose(np.asarray(g), w, rtol=2e-5, atol=2e-6, err_msg=name)
    assert np.all(np.asarray(got["values"][1]) != 0), "the zero bias must move (trust ratio 1 when ‖x‖ = 0)"


def test_lamb_float64_matches_the_float64_reference(results: dict[str, Any]) -> None:
    """float64 variables (on JAX under ``jax.enable_x64``) agree with the reference to rounding."""
    got = _result(results, "lamb_apply_float64")
    x0, grads = sc.random_problem(seed=5)
    ref, _ = _reference(x0, grads, sc.LAMB_HP)
    assert got["dtype"] == "float64" and got["skipped"] == 1
    for name, g, w in zip(sc.NAMES, got["values"], ref.params, strict=True):
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-10, atol=1e-12, err_msg=name)


def test_lamb_compiled_matches_the_float64_reference_and_skips(keras_backend: str, results: dict[str, Any]) -> None:
    """Compiled steps (jax.jit, torch.compile, XLA) with a NaN gradient in step NAN_STEP and a float32 overflow of
    the global norm in OVERFLOW_STEP: the no-op scalars skip exactly those steps (the float64 reference, which does
    not overflow, is given a NaN there)."""
    got = _result(results, "lamb_apply_compiled")
    x0, grads = sc.random_problem(seed=5)
    groups = [
        RefGroup([i], lr=_keras_lr(sc.LAMB_HP["learning_rate"]), eps=1e-6, weight_decay=0.1, max_trust_ratio=0.4)
        for i in range(3)
    ]
    ref = RefLamb(x0, groups, max_grad_norm=sc.LAMB_HP["max_grad_norm"])
    grads[sc.OVERFLOW_STEP][0][0, 0] = np.nan
    for g in grads:
        ref.step(g)
    assert got["skipped"] == 2 and got["iterations"] == sc.STEPS
    for name, g, w in zip(sc.NAMES, got["values"], ref.params, strict=True):
        np.testing.assert_allclose(np.asarray(g), w, rtol=2e-5, atol=2e-6, err_msg=name)


def test_lamb_agrees_with_the_torch_lamb(results: dict[str, Any]) -> None:
    import torch

    from ivyplug.optim import LAMB as TorchLAMB

    got = _result(results, "lamb_apply_float32")
    x0, grads = sc.random_problem(seed=5)
    params = [torch.nn.Parameter(torch.tensor(a)) for a in x0]
    hp = sc.LAMB_HP
    opt = TorchLAMB(
        params,
        lr=hp["learning_rate"],
        weight_decay=hp["weight_decay"],
        max_trust_ratio=hp["max_trust_ratio"],
        max_grad_norm=hp["max_grad_norm"],
    )
    for g in grads:
        for p, a in zip(params, g, strict=True):
            p.grad = torch.tensor(a)
        opt.step()
    assert opt.skipped_steps == got["skipped"] == 1
    for name, k, p in zip(sc.NAMES, got["values"], params, strict=True):
        np.testing.assert_allclose(np.asarray(k), p.detach().numpy(), rtol=1e-5, atol=1e-5, err_msg=name)


def _fit_reference() -> list[np.ndarray]:
    """The fit scenario in float64: a linear model's MSE gradient on each batch, then a LAMB step."""
    x, y, w0 = sc.linear_data()
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    hp = sc.FIT_HP
    groups = [
        RefGroup([0], lr=_keras_lr(hp["learning_rate"])),
        RefGroup([1], lr=_keras_lr(hp["learning_rate"]), exclude_from_layer_adaptation=True),
    ]
    ref = RefLamb(w0, groups, max_grad_norm=hp["max_grad_norm"])
    for _ in range(sc.FIT_EPOCHS):
        for start in range(0, len(x), sc.FIT_BATCH):
            xb, yb = x64[start : start + sc.FIT_BATCH], y64[start : start + sc.FIT_BATCH]
            residual = xb @ ref.params[0] + ref.params[1] - yb
            scale = 2.0 / residual.size  # mean over the batch and the outputs
            ref.step([scale * xb.T @ residual, scale * residual.sum(axis=0)])
    return ref.params


@pytest.mark.parametrize("jit", ["jit", "nojit"])
def test_lamb_in_fit_matches_the_reference_with_jit_compile_on_and_off(results: dict[str, Any], jit: str) -> None:
    got = _result(results, f"lamb_fit_{jit}")
    assert got["iterations"] == sc.FIT_EPOCHS * 3
    want = _fit_reference()
    _, _, w0 = sc.linear_data()
    assert max_abs_diff(want, w0) > 0.01  # it trained
    for name, g, w in zip(("kernel", "bias"), got["weights"], want, strict=True):
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-5, atol=1e-6, err_msg=name)


def test_lamb_compiles_by_registered_name_and_saves_and_loads(results: dict[str, Any]) -> None:
    got = _result(results, "lamb_save_load")
    assert got["type"] == "LAMB" and got["is_lamb"]
    assert got["state_equal"] and got["n_state"] == 7  # iterations, lr, 2 moments x 2, skipped_steps
    assert got["iterations"] == 6 and got["moved"] > 1e-3
    assert got["max_diff_after"] == 0.0, "the loaded model must continue exactly like the saved one"


def test_async_lamb_one_worker_exchanges_and_is_lamb(results: dict[str, Any]) -> None:
    got = _result(results, "async_one_worker")
    assert got["exchanges"] == 3 and got["closed"] and got["iterations"] == 12  # 6 steps/epoch, sync_every 4
    assert got["moved"] > 0.01
    assert got["max_diff"] < 1e-6


# ------------------------------------------------------------------------------------ load balancer


@pytest.mark.parametrize("source", ["tf_data", "py_dataset"])
def test_balancer_grows_holds_shrinks_and_rescales_the_lr(
    keras_backend: str, results: dict[str, Any], source: str
) -> None:
    got = _result(results, f"balancer_fit_{source}")
    h = got["history"]
    assert h["ivy/batch_size"] == [16.0, 32.0, 32.0, 16.0]  # idle grows, cooldown holds, full shrinks
    assert h["ivy/lr_factor"] == pytest.approx([1.0, 2.0, 2.0, 1.0])  # linear rule for SGD
    assert h["ivy/memory_fraction"] == pytest.approx([0.3, 0.7, 0.95, 0.7])
    assert h["ivy/oom_count"] == [0.0] * 4 and got["decisions"] == [[16, 32], [32, 16]]
    sizes = [b for _, b in got["steps"]]
    # the new size lands `lag` steps after the decision, or after what the pipeline had read ahead (TensorFlow
    # prefetches a PyDataset); the schedule says where, and the model saw exactly that
    assert [b for _, b in got["segments"]] == [16, 32, 16]
    grow_at = got["segments"][1][0]
    assert sizes.index(32) == grow_at >= got["steps_per_epoch"] + got["lag"]
    if keras_backend != "tensorflow" or source == "tf_data":
        assert grow_at == got["steps_per_epoch"] + got["lag"]
    for lr, batch in got["steps"]:  # the LR in force at every step is that of the batch it trains on
        assert lr == pytest.approx(0.05 * batch / 16, rel=1e-6)
    assert got["final_lr"] == pytest.approx(0.05) and got["sampler_closed"]
    oom_warnings = [w for w in got["warnings"] if "oom_recovery" in w]
    assert len(oom_warnings) == (0 if keras_backend == "tensorflow" else 1)
    assert not any("AttributeError" in w for w in got["warnings"])
    # goodput on, one replica: one warning that says why, and B does not grow
    assert got["goodput_batch_sizes"] == [16.0, 16.0]
    assert len(got["goodput_warnings"]) == 1


def test_balancer_logs_the_same_metric_names(results: dict[str, Any]) -> None:
    got = _result(results, "balancer_monitor")
    assert got["keys"] == [
        "ivy/callback_overhead",
        "ivy/cpu_util",
        "ivy/lr_factor",
        "ivy/mem_total",
        "ivy/mem_used",
        "ivy/memory_fraction",
        "ivy/oom_count",
        "ivy/rank0/memory_fraction",
        "ivy/rank0/oom_count",
        "ivy/rank0/utilization",
        "ivy/utilization",
    ]
    assert got["utilization"] == [10.0]
    assert any("monitors load" in w for w in got["warnings"])


def test_balancer_out_of_memory_is_counted_and_refused_with_the_reason(
    keras_backend: str, results: dict[str, Any]
) -> None:
    got = _result(results, "balancer_oom")
    if keras_backend == "tensorflow":  # split into 2, 4 and 8 parts: every part still fails here
        assert got["oom_count"] == 4 and "after splitting a batch of 16 samples into 8 micro-batches" in got["error"]
        assert got["warnings"] == []
        return
    assert got["oom_count"] == 1
    assert "micro-batch recovery needs the TensorFlow backend" in got["error"] and keras_backend in got["error"]
    assert len(got["warnings"]) == 1


def test_balancer_exchange_in_one_process(keras_backend: str, results: dict[str, Any]) -> None:
    got = _result(results, "balancer_exchange")
    assert got["rounds"] == [[[10.0, 0.25, 0]]] * 2  # its own reading
    if keras_backend == "jax":  # two JAX processes (stubbed): not shared, said once
        (message,) = got["warnings"]
        assert "2 JAX processes do not exchange their load readings" in message
    else:
        assert got["warnings"] == []


def test_balancer_shares_load_readings_between_torchrun_workers_on_pytorch(tmp_path: Path) -> None:
    """Two PyTorch-backend workers (gloo): every worker gets both readings, in rank order, each epoch."""
    workers = run_workers("torch", ["balancer_exchange"], tmp_path, world=2)
    want = [[10.0, 0.25, 0], [20.0, 0.5, 1]]
    for worker in workers:
        got = _result(worker, "balancer_exchange")
        assert got["rounds"] == [want, want] and got["warnings"] == []


def test_balancer_rounds_to_the_data_parallel_devices_on_jax(tmp_path: Path) -> None:
    """JAX, keras.distribution.DataParallel over two (forced host) CPU devices: B stays a multiple of 2."""
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    got = _result(run_scenarios("jax", ["balancer_data_parallel"], tmp_path, env=env), "balancer_data_parallel")
    assert got["devices"] == 2
    assert got["batch_sizes"] == [6.0, 2.0, 2.0]  # 6 * 0.5 = 3, rounded down to 2; the lower bound holds it


@pytest.mark.parametrize("source", ["tf_data", "py_dataset"])
def test_elastic_dataset_batch_size_changes_between_epochs(
    keras_backend: str, results: dict[str, Any], source: str
) -> None:
    got = _result(results, f"elastic_{source}")
    # lag 1: decided after 4 consumed batches, the new size reaches batch 5 (later where TensorFlow prefetched
    # the PyDataset further: then at the step the schedule names)
    at = got["segments"][1][0]
    assert got["segments"] == [[0, 32], [at, 64]] and 5 <= at < 12
    assert got["sizes"] == [32] * at + [64] * (12 - at)
    if keras_backend != "tensorflow" or source == "tf_data":
        assert at == 5


def test_elastic_numpy_indices_equal_the_pipeline_indices() -> None:
    from ivyplug.integrations.keras.elastic import ElasticDataset

    x = np.arange(100, dtype=np.float32)[:, None]
    data = ElasticDataset(x, x, batch_size=16, seed=3)
    data.set_batch_size(48, at_step=5)
    data.set_batch_size(24, at_step=9)
    for step in range(20):  # across passes (a batch spanning two)
        np.testing.assert_array_equal(data.numpy_indices(step), data.indices(step), err_msg=f"step {step}")
    for step in range(3):
        for replica in range(2):
            np.testing.assert_array_equal(data.numpy_indices(step, replica, 2), data.indices(step, replica, 2))


def test_runner_refuses_an_unknown_backend(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="backend must be one of"):
        run_scenarios("numpy", [], tmp_path)
