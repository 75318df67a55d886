"""Smoke test of ``ivyplug bench lamb`` (tiny sizes, one thread): structure, not speed.

The settings normally run in two fresh subprocesses (each pays for ``import torch``); here they run in-process with
the same environment, and the subprocess plumbing is checked with a fake ``subprocess.run``.
"""

from __future__ import annotations

import json
import math
import os
import runpy
import subprocess
import sys
from typing import Any

import pytest
import torch
from ivyplug.benchmarks import lamb as bench

from ivyplug.commands.bench import BENCHMARKS
from ivyplug.optim import compiled_kernel

#: The sequences a run times here: the compiled kernel's only where a C compiler exists.
TIMED_SEQUENCES = sorted(
    name for name in bench.SEQUENCES if name != "compiled kernel" or compiled_kernel._compiler() is not None
)


def test_quick_run_reports_every_contender_for_both_allocators(monkeypatch: pytest.MonkeyPatch) -> None:
    def in_process(config: dict[str, Any], extra_env: dict[str, str], timeout: float) -> dict[str, Any]:
        assert timeout > 0
        for key in [k for k in os.environ if k.startswith("MALLOC_")]:
            monkeypatch.delenv(key)
        for key, value in extra_env.items():
            monkeypatch.setenv(key, value)
        try:
            return json.loads(json.dumps(bench._child(config)))
        finally:
            for key in extra_env:
                monkeypatch.delenv(key)

    monkeypatch.setattr(bench, "_run_child", in_process)
    results = bench.run(quick=True, sizes={"tiny": (4000, 4)}, threads=1)
    json.dumps(results)  # machine-readable as promised
    assert set(results["settings"]) == {"default", "glibc_raised"}
    assert results["settings"]["default"]["malloc_env"] == {}
    assert results["settings"]["glibc_raised"]["malloc_env"] == bench.RAISED_MALLOC_ENV
    for child in results["settings"].values():
        assert child["torch_threads"] == 1
        assert child["lamb_kernel"] == ("compiled" if compiled_kernel.load() is not None else child["lamb_kernel"])
        assert child["lamb_kernel"] == "compiled" or child["lamb_kernel"].startswith("torch (")
        assert len(child["loadavg_before"]) == 3 and len(child["loadavg_after"]) == 3
        (size,) = child["sizes"]
        assert size["tensors"] == 4 and size["params"] > 0 and size["floor_ms"] > 0
        rows = {r["name"]: r for r in size["rows"]}
        assert rows[bench.REFERENCE]["ratio_vs_fused_adamw"] == 1.0
        measured = ("AdamW foreach=True", bench.LAMB_DEFAULT, bench.LAMB_TORCH, "ivyplug LAMB loop (foreach=False)")
        for name in measured:
            assert rows[name]["median_ms"] > 0 and math.isfinite(rows[name]["ratio_vs_floor"])
        for name in ("torch-optimizer Lamb", "timm Lamb"):
            assert name in rows and (rows[name]["status"] == "ok") == ("median_ms" in rows[name])
        breakdown = child["pass_breakdown"]
        assert set(breakdown["ns_per_element"]) == {*bench.PASSES, "AdamW fused=True"}
        assert breakdown["size"] == "tiny" and breakdown["passes_vs_fused_adamw"] > 0
        sequences = breakdown["sequences"]
        assert set(sequences["median_ms"]) == {"AdamW fused=True", *TIMED_SEQUENCES}
        assert sequences["vs_fused_adamw"]["AdamW fused=True"] == 1.0
        assert all(v > 0 and math.isfinite(v) for v in sequences["vs_fused_adamw"].values())
    targets = results["targets"]
    assert set(targets["per_setting"]) == {"default", "glibc_raised"}
    for per in targets["per_setting"].values():
        assert per["lamb_vs_fused_adamw"] > 0 and isinstance(per["lamb_vs_fused_adamw_met"], bool)
    assert "keras" not in results
    table = bench.format_table(results)
    assert "| optimizer |" in table and "glibc_raised" in table and "targets at tiny (default)" in table
    assert "passes of the torch CPU kernel" in table and "orders of operations" in table
    assert "default CPU kernel: " in table
    assert BENCHMARKS["lamb"] == "ivyplug.benchmarks.lamb"


def test_quick_keras_run_reports_three_optimizers_with_and_without_xla(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--keras``: ivyplug's Keras LAMB, Keras's Lamb and AdamW, each with jit_compile off and on, in the JSON."""
    from ivyplug.benchmarks import lamb_keras_job

    def in_process(config: dict[str, Any], extra_env: dict[str, str], timeout: float) -> dict[str, Any]:
        return json.loads(json.dumps(bench._child(config)))

    def keras_in_process(config: dict[str, Any], timeout: float, backend: str) -> dict[str, Any]:
        assert timeout > 0 and backend == "tensorflow"  # this process's Keras runs on TensorFlow
        return json.loads(json.dumps(lamb_keras_job.measure(config)))

    monkeypatch.setattr(bench, "_run_child", in_process)
    monkeypatch.setattr(bench, "_run_keras_child", keras_in_process)
    results = bench.run(quick=True, sizes={"tiny": (400, 4)}, threads=1, keras=True, keras_backends=("tensorflow",))
    json.dumps(results)
    (size,) = results["keras"]["tensorflow"]["sizes"]
    torch_size = results["settings"]["default"]["sizes"][0]
    assert size["tensors"] == 4 and size["params"] == torch_size["params"]  # the same variable set as the torch part
    rows = {(r["name"], r["jit_compile"]) for r in size["rows"]}
    names = (lamb_keras_job.IVYPLUG, lamb_keras_job.KERAS_LAMB, lamb_keras_job.KERAS_ADAMW)
    assert rows == {(name, jit) for name in names for jit in (False, True)}
    for row in size["rows"]:
        assert row["median_ms"] > 0 and math.isfinite(row["ratio_vs_keras_lamb"])
        if row["name"] == lamb_keras_job.KERAS_LAMB:
            assert row["ratio_vs_keras_lamb"] == 1.0
    target = results["keras_targets"]["tensorflow"]
    assert set(target["ivyplug_vs_keras_lamb"]) == {"False", "True"} and isinstance(target["met"], bool)
    table = bench.format_table(results)
    assert "### Keras on tensorflow" in table and "× Keras Lamb" in table
    with pytest.raises(ValueError, match="keras_backends"):
        bench.run(quick=True, sizes={"tiny": (400, 4)}, threads=1, keras=True, keras_backends=("numpy",))


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_keras_child_times_the_three_optimizers_on_jax_and_torch(backend: str) -> None:
    """The ``--keras`` child on another Keras backend (a fresh interpreter, as ``run`` starts it)."""
    pytest.importorskip("keras")
    pytest.importorskip(backend)
    from ivyplug.benchmarks import lamb_keras_job

    config = {"sizes": [["tiny", [400, 4]]], "warmup": 1, "warmup_s": 0.0, "steps": 3, "threads": 1}
    child = bench._run_keras_child(config, 180.0, backend)
    assert child["backend"] == backend and backend in child["versions"]
    (size,) = child["sizes"]
    jits = lamb_keras_job.JIT_SETTINGS[backend]
    names = (lamb_keras_job.IVYPLUG, lamb_keras_job.KERAS_LAMB, lamb_keras_job.KERAS_ADAMW)
    assert {(r["name"], r["jit_compile"]) for r in size["rows"]} == {(n, j) for n in names for j in jits}
    assert all(r["median_ms"] > 0 for r in size["rows"])
    assert f"### Keras on {backend}" in lamb_keras_job.format_table(child, lamb_keras_job.targets(child))


def test_bench_command_passes_keras_to_lamb_only(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from ivyplug.commands import bench as command

    seen: dict[str, Any] = {}

    def fake_run(quick: bool = False, keras: bool = False) -> dict[str, Any]:
        seen.update(quick=quick, keras=keras)
        return {}

    monkeypatch.setattr(bench, "run", fake_run)
    monkeypatch.setattr(bench, "format_table", lambda results: "table")
    parser = argparse.ArgumentParser()
    command.configure(parser)
    assert command.run(parser.parse_args(["lamb", "--quick", "--keras"])) == 0
    assert seen == {"quick": True, "keras": True}
    assert command.run(parser.parse_args(["balance", "--keras"])) == 2


def test_bad_sizes_and_threads_raise() -> None:
    with pytest.raises(ValueError, match="sizes"):
        bench.run(quick=True, sizes={"x": (1, 1)})
    with pytest.raises(ValueError, match="threads"):
        bench.run(quick=True, sizes={"x": (10, 2)}, threads=0)


@pytest.mark.filterwarnings("ignore:'ivyplug.benchmarks.lamb' found in sys.modules:RuntimeWarning")
def test_child_entry_point_and_allocator_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The ``--child`` entry point prints one JSON line; ``_run_child`` scrubs and sets the MALLOC_ variables.

    (Run in-process: a fresh interpreter would spend most of this test's budget importing torch.)
    """
    config = {"sizes": [["tiny", [2000, 2]]], "warmup": 1, "steps": 2, "threads": 1}
    monkeypatch.setattr(sys, "argv", ["lamb", "--child", json.dumps(config)])
    runpy.run_module("ivyplug.benchmarks.lamb", run_name="__main__")
    child = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert child["sizes"][0]["rows"][0]["median_ms"] > 0

    seen: dict[str, Any] = {}

    def fake_run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        seen.update(cmd=cmd, **kwargs)
        return subprocess.CompletedProcess(cmd, 0, stdout="noise\n" + json.dumps(child) + "\n", stderr="")

    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    assert bench._run_child(config, bench.RAISED_MALLOC_ENV, 10.0) == child
    assert seen["cmd"][1:4] == ["-m", "ivyplug.benchmarks.lamb", "--child"] and seen["timeout"] == 10.0
    assert {k: v for k, v in seen["env"].items() if k.startswith("MALLOC_")} == bench.RAISED_MALLOC_ENV
    bench._run_child(config, {}, 10.0)
    assert not any(k.startswith("MALLOC_") for k in seen["env"])


def _sequence_case(seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(37, 29), (64, 50), (5, 7)]
    weights = [torch.randn(s, generator=gen) * 0.1 for s in shapes]
    weights[2].zero_()  # ‖x‖ = 0: ratio 1
    grads = [torch.randn(s, generator=gen) * (0.1 + torch.rand(s, generator=gen)) for s in shapes]
    return weights, grads


@pytest.mark.parametrize("name", TIMED_SEQUENCES)
def test_each_timed_sequence_takes_lambs_step(name: str) -> None:
    """The orders of operations the bench times are LAMB steps: two steps of each match ivyplug's LAMB."""
    from ivyplug.optim import LAMB

    weights, grads = _sequence_case(7)
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    opt = LAMB(params, lr=0.01, weight_decay=0.01, eps=1e-6, foreach=False)
    exp_avgs = [torch.zeros_like(w) for w in weights]
    exp_avg_sqs = [torch.zeros_like(w) for w in weights]
    steps = [torch.zeros(()) for _ in weights]
    run = bench._sequence_steps(weights, grads, exp_avgs, exp_avg_sqs, steps, lr=0.01)[name]
    for k in range(2):
        for p, g in zip(params, grads, strict=True):
            p.grad = g * (k + 1)
        for g in grads:
            g.mul_(k + 1)
        opt.step()
        torch._foreach_add_(steps, 1.0)
        run()
        for g in grads:
            g.div_(k + 1)
    for p, w, m, v in zip(params, weights, exp_avgs, exp_avg_sqs, strict=True):
        state = opt.state[p]
        torch.testing.assert_close(w, p.detach(), rtol=2e-5, atol=1e-7)
        torch.testing.assert_close(m, state["exp_avg"], rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(v, state["exp_avg_sq"], rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("name", TIMED_SEQUENCES)
def test_only_the_reference_sequence_changes_tensors_before_a_late_nan(name: str) -> None:
    weights, grads = _sequence_case(8)
    grads[-1][0, 0] = float("nan")
    exp_avgs = [torch.zeros_like(w) for w in weights]
    exp_avg_sqs = [torch.zeros_like(w) for w in weights]
    before = [w.clone() for w in weights]
    bench._sequence_steps(weights, grads, exp_avgs, exp_avg_sqs, [torch.ones(()) for _ in weights], lr=0.01)[name]()
    untouched = torch.equal(weights[0], before[0]) and not exp_avgs[0].any()
    assert untouched == (name != "no gradient pass")
