"""``ivyplug bench ps``: one real job (2 Lightning workers, tiny data) and the summary logic on canned results."""

from __future__ import annotations

from typing import Any

import pytest
from ivyplug.benchmarks import ps


def test_one_real_sync_job_reports_epoch_cpu_and_pushes() -> None:
    r = ps._run_job("ivy_ps_sync", 1.0, epochs=2, repeat=1, timeout=240.0)
    assert len(r["epoch_times"]) == 2 and len(r["epoch_cpu_seconds"]) == 2
    # both worker processes' CPU seconds: at least something, and no more than 2 cores x the wall time (+slack)
    assert all(0 < c <= 2 * t + 1.0 for c, t in zip(r["epoch_cpu_seconds"], r["epoch_times"], strict=True))
    assert r["epoch_cpu"] == r["epoch_cpu_seconds"][1]
    assert 0.0 <= r["val_acc"] <= 1.0
    assert r["ps_pushes"]["0"] == r["ps_pushes"]["1"] > 0  # sync: every worker pushes every step
    assert r["bytes_measured"] and r["bytes_sent_per_epoch"] > 0


def test_summary_and_table_on_canned_results(monkeypatch: pytest.MonkeyPatch) -> None:
    wall = {("ddp", 1.0): 3.0, ("ivy_ps_sync", 1.0): 3.3, ("ivy_ps", 1.0): 3.1}
    wall |= {("ddp", 3.0): 6.0, ("ivy_ps_sync", 3.0): 6.2, ("ivy_ps", 3.0): 3.6}
    wall |= {("ivy_ps_sync_overlap", 1.0): 3.6, ("ivy_ps_overlap", 1.0): 3.4}

    def fake_job(strategy: str, slowdown: float, epochs: int, repeat: int, timeout: float) -> dict[str, Any]:
        t = wall[(strategy, slowdown)]
        calls.append((strategy, slowdown))
        return {
            "strategy": strategy,
            "slowdown": slowdown,
            "epoch_times": [9.0, t, t],  # the first epoch (start-up) is left out
            "epoch_cpu_seconds": [20.0, 2 * t, 2 * t],
            "epoch_time": t,
            "epoch_cpu": 2 * t,
            "train_samples": 23040,
            "samples_per_s": 23040 / t,
            "val_acc": 0.97,
            "bytes_sent_per_epoch": 2e8,
            "bytes_measured": strategy != "ddp",
            "ps_pushes": {"0": 90.0, "1": 90.0} if strategy != "ddp" else {},
            "loadavg_before": (0.5, 0.5, 0.5),
            "loadavg_after": (0.6, 0.5, 0.5),
        }

    calls: list[tuple[str, float]] = []
    monkeypatch.setattr(ps, "_run_job", fake_job)
    monkeypatch.setattr(ps, "measure_bandwidth", lambda reps: {"gloo_p2p": {4: 1.5}, "ps_push_pull": {4: 0.75}})
    results = ps.run(quick=False)
    assert len(calls) == 8 * ps.ROUNDS and calls[:8] == calls[8:16]  # every configuration, interleaved rounds
    assert results["runs"][0]["rounds"] == ps.ROUNDS
    s = results["summary"]
    assert s["throughput_vs_ddp"]["ivy_ps_sync"] == pytest.approx(3.0 / 3.3)
    assert s["throughput_vs_ddp"]["ivy_ps_sync_overlap"] == pytest.approx(3.0 / 3.6)
    assert s["cpu_vs_ddp"]["ivy_ps"] == pytest.approx(3.1 / 3.0)
    assert s["slow_epoch_ratio_vs_ddp"]["ivy_ps"] == pytest.approx(0.6)
    table = ps.format_table(results)
    assert "ivy_ps: throughput 0.97x DDP (target >= 1.05)" in table
    assert "ivy_ps_sync_overlap (pushes from backward's hooks): throughput 0.83x DDP" in table
    assert "ivy_ps: throughput 0.97x DDP" in table and "slow-worker epoch 0.60x DDP's (target <= 0.65)" in table
    assert "PS push+pull 0.75 GB/s (0.50x gloo)" in table
