"""``ivyplug bench balance`` summary logic on canned job results (the real runs are benchmarks, not tests)."""

from __future__ import annotations

from typing import Any

import pytest
from ivyplug.benchmarks import balance


def test_summary_ratios_and_table(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[Any, ...]] = []

    def fake_job(strategy: str, balancer: bool, slowdown: float, epochs: int, repeat: int, timeout: float) -> dict:
        calls.append((strategy, balancer, slowdown, epochs, repeat))
        epoch = {(1.0, False): 1.0, (1.0, True): 1.01, (3.0, False): 2.6, (3.0, True): 1.6}[(slowdown, balancer)]
        return {
            "strategy": strategy,
            "balancer": balancer,
            "slowdown": slowdown,
            "epoch_times": [9.0, epoch, epoch],
            "epoch_time": epoch,
            "val_acc": 0.95 if balancer else 0.955,
            "overhead": 0.004 if balancer else None,
            "overhead_by_hook": {"batch": 0.0005, "epoch_end": 0.0035} if balancer else {},
            "shares": [[256, 256], [380, 132]] if balancer else [],
            "loadavg_before": (1.0, 1.0, 1.0),
        }

    monkeypatch.setattr(balance, "_run_job", fake_job)
    results = balance.run(quick=False)
    assert len(calls) == 8 and {c[0] for c in calls} == {"ddp", "ivy_ps_sync"}
    assert all(c[3:] == (4, 16) for c in calls)
    s = results["summary"]["ddp"]
    assert s["slow_ratio"] == pytest.approx(1.6 / 2.6)
    assert s["acc_points"] == pytest.approx(-0.5)
    assert s["overhead"] == 0.004 and s["fast_ratio"] == pytest.approx(1.01)
    table = balance.format_table(results)
    assert "0.62 (target <= 0.7)" in table and "hook overhead 0.40%" in table and "0.050%" in table
    quick = balance.run(quick=True)
    assert {(r["slowdown"], r["balancer"]) for r in quick["runs"]} == {(1.0, True), (3.0, False), (3.0, True)}
