"""The benchmarks' figures draw from their JSON (synthetic results of the shapes the benchmarks write)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
from ivyplug.benchmarks import plots

from ivyplug.commands import bench

pytest.importorskip("matplotlib")


def _ps() -> dict[str, Any]:
    runs = [
        {"strategy": s, "slowdown": k, "epoch_time": t}
        for (s, k), t in {("ddp", 1.0): 2.5, ("ivy_ps", 1.0): 2.4, ("ddp", 3.0): 4.0, ("ivy_ps", 3.0): 2.8}.items()
    ]
    bandwidth = {"gloo_p2p": {"4": 3.0, "64": 3.1}, "ps_push_pull": {"4": 0.9, "64": 1.3}}
    return {"runs": runs, "bandwidth_gb_s": bandwidth, "cpu_count": 2, "loadavg_end": [1.5, 1.0, 1.0]}


def _balance() -> dict[str, Any]:
    return {
        "runs": [
            {"strategy": s, "slowdown": k, "balancer": b, "epoch_time": 3.0 + k - b}
            for s in ("ddp", "ivy_ps_sync")
            for k in (1.0, 3.0)
            for b in (False, True)
        ]
    }


def _scale() -> dict[str, Any]:
    workers = [{"workers": n, "pushes_per_s": 700.0 + n, "p50_ms": 1.0 + n, "p99_ms": 5.0 + 3 * n} for n in (1, 4)]
    return {"workers": workers, "step_cost": [{"params_m": 1, "step_ms": 11.0}, {"params_m": 4, "step_ms": 40.0}]}


def _lamb() -> dict[str, Any]:
    rows = [
        {"name": "AdamW fused=True", "status": "ok", "ratio_vs_fused_adamw": 1.0},
        {"name": "ivyplug LAMB", "status": "ok", "ratio_vs_fused_adamw": 1.9},
        {"name": "timm Lamb", "status": "not installed", "ratio_vs_fused_adamw": None},
    ]
    size = {"label": "10M", "tensors": 100, "rows": rows}
    return {"settings": {"default": {"sizes": [size]}, "glibc_raised": {"sizes": [size]}}}


@pytest.mark.parametrize(
    "name, results", [("ps", _ps()), ("balance", _balance()), ("scale", _scale()), ("lamb", _lamb())]
)
def test_each_figure_is_written_as_a_png(tmp_path: Path, name: str, results: dict[str, Any]) -> None:
    out = plots.PLOTS[name](results, tmp_path / f"{name}.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_the_saved_json_can_be_drawn_again(tmp_path: Path) -> None:
    import json

    saved = tmp_path / "ps.json"
    saved.write_text(json.dumps(_ps()))
    assert plots.main(["ps", str(saved), "--out", str(tmp_path / "again.png")]) == 0
    assert (tmp_path / "again.png").stat().st_size > 10_000


def test_plot_for_a_benchmark_without_a_figure_is_refused_before_it_runs(capsys: pytest.CaptureFixture[str]) -> None:
    args = argparse.Namespace(
        name="keras_overhead", quick=True, json=None, plot=Path("x.png"), keras=False, select=None
    )
    assert bench.run(args) == 2
    err = capsys.readouterr().err
    assert "--plot draws averaging_hosts, balance, hosts, lamb, ps, scale" in err
