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
from ivyplug.benchmarks import lamb as bench

from ivyplug.commands.bench import BENCHMARKS


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
        assert len(child["loadavg_before"]) == 3 and len(child["loadavg_after"]) == 3
        (size,) = child["sizes"]
        assert size["tensors"] == 4 and size["params"] > 0 and size["floor_ms"] > 0
        rows = {r["name"]: r for r in size["rows"]}
        assert rows[bench.REFERENCE]["ratio_vs_fused_adamw"] == 1.0
        measured = ("AdamW foreach=True", bench.LAMB_DEFAULT, "ivyplug LAMB loop (foreach=False)")
        for name in measured:
            assert rows[name]["median_ms"] > 0 and math.isfinite(rows[name]["ratio_vs_floor"])
        for name in ("torch-optimizer Lamb", "timm Lamb"):
            assert name in rows and (rows[name]["status"] == "ok") == ("median_ms" in rows[name])
    table = bench.format_table(results)
    assert "| optimizer |" in table and "glibc_raised" in table and "targets at tiny" in table
    assert BENCHMARKS["lamb"] == "ivyplug.benchmarks.lamb"


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
