"""``ivyplug bench scale``: two real workers against one server for a second, and the table."""

from __future__ import annotations

from pathlib import Path

from ivyplug.benchmarks import scale


def test_two_workers_against_one_server_report_pushes_latency_and_memory(tmp_path: Path) -> None:
    proc, address = scale._serve(2)
    try:
        rss = scale._rss_mb(proc.pid)
        runs = scale._workers(address, 2, 1.0, 4096, tmp_path)
    finally:
        proc.kill()
        proc.wait(10)
    pooled = scale._pool(runs)
    assert all(len(r["latencies"]) > 0 for r in runs)
    assert pooled["pushes_per_s"] > 0 and 0 < pooled["p50_ms"] <= pooled["p99_ms"]
    assert rss > 0
    results = {
        "quick": True,
        "seconds": 1.0,
        "workers": [{"workers": 2, **pooled, "server_rss_start_mb": rss, "server_rss_end_mb": rss}],
        "step_cost": [{"params_m": 1, "step_ms": 2.0}, {"params_m": 4, "step_ms": 8.0}],
        "cpu_count": 2,
        "loadavg_end": (1.0, 1.0, 1.0),
    }
    table = scale.format_table(results)
    assert "pushes/s" in table and "ms per M" in table and "QUICK" in table
