"""``ivyplug bench scale``: one server process, 1 to 32 worker processes, and step cost against model size.

One ``ivyplug serve --shards 1`` process serves every worker; the workers (``scale_worker.py``, each a
process of its own joining by address, async mode, SGD) push and pull a tiny model as fast as they can for
a fixed time. Reported per worker count: pushes/s of all workers together, p50/p99 push+pull latency, and
the server's resident memory a quarter into the run (warm: every worker's buffers exist) and at its end (it
should stay flat: nothing accumulates per push). Then one worker against models of 1M to 64M parameters:
the median push+pull time per step, which should grow linearly with the bytes moved.
"""

from __future__ import annotations

import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

DESCRIPTION = "ivyplug serve with 1-32 worker processes (pushes/s, latency, server memory); step cost vs size"
WORKERS = (1, 4, 16, 32)
SIZES_M = (1, 4, 16, 64)
_WORKER = str(Path(__file__).with_name("scale_worker.py"))


#: how long ``ivyplug serve`` may take to say where it listens
START_TIMEOUT_S = 60.0


def _serve(num_workers: int) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "ivyplug", "serve", "--shards", "1", "--workers", str(num_workers), "--port", "0"]
    proc = subprocess.Popen(
        [*cmd, "--status-every", "100000", "--timeout", "300"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.stdout is not None
    started, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT_S)  # a hung start fails, not waits
    line = proc.stdout.readline() if started else f"(nothing within {START_TIMEOUT_S:g} s)"
    if "listening on" not in line:
        proc.kill()
        raise RuntimeError(f"ivyplug serve did not start: {line!r}")
    return proc, line.split("listening on ", 1)[1].split(" ", 1)[0]


def _rss_mb(pid: int) -> float:
    import psutil

    return psutil.Process(pid).memory_info().rss / 2**20


def _sample_rss(pid: int, out: list[tuple[float, float]], stop: threading.Event) -> None:
    while True:
        out.append((time.monotonic(), _rss_mb(pid)))
        if stop.wait(1.0):
            out.append((time.monotonic(), _rss_mb(pid)))
            return


def _workers(address: str, n: int, seconds: float, numel: int, out: Path) -> list[dict[str, Any]]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, _WORKER, address, str(out / f"w{i}.json"), str(seconds), str(numel)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for i in range(n)
    ]
    try:
        for p in procs:
            _, err = p.communicate(timeout=seconds + 600)
            if p.returncode != 0:
                raise RuntimeError(f"a scale worker failed:\n{err[-2000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [json.loads((out / f"w{i}.json").read_text()) for i in range(n)]


def _pool(runs: list[dict[str, Any]]) -> dict[str, float]:
    latencies = sorted(x for r in runs for x in r["latencies"])
    span = max(r["end"] for r in runs) - min(r["start"] for r in runs)
    return {
        "pushes_per_s": sum(len(r["latencies"]) for r in runs) / span,
        "p50_ms": 1e3 * latencies[len(latencies) // 2],
        "p99_ms": 1e3 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
    }


def run(quick: bool = False) -> dict[str, Any]:
    seconds = 5.0 if quick else 120.0
    counts = (1, 4) if quick else WORKERS
    sizes = (1, 4) if quick else SIZES_M
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in counts:
            proc, address = _serve(n)
            try:
                samples: list[tuple[float, float]] = []
                stop = threading.Event()
                sampler = threading.Thread(target=_sample_rss, args=(proc.pid, samples, stop), daemon=True)
                sampler.start()
                t0 = time.monotonic()
                runs = _workers(address, n, seconds, 4096, Path(tmp))
                stop.set()
                sampler.join(5)
                # memory once the run is warm (a quarter in: every worker's pair and buffers exist) and at its end
                warm = next((mb for t, mb in samples if t - t0 >= 0.25 * seconds), samples[-1][1])
                rows.append(
                    {"workers": n, **_pool(runs), "server_rss_start_mb": warm, "server_rss_end_mb": samples[-1][1]}
                )
            finally:
                proc.kill()
                proc.wait(10)
        cost = []
        for m in sizes:
            proc, address = _serve(1)
            try:
                (r,) = _workers(address, 1, 3.0 if quick else 15.0, m * 2**20, Path(tmp))
                cost.append({"params_m": m, "step_ms": 1e3 * statistics.median(r["latencies"])})
            finally:
                proc.kill()
                proc.wait(10)
    per_param = [c["step_ms"] / c["params_m"] for c in cost]
    return {
        "quick": quick,
        "seconds": seconds,
        "workers": rows,
        "step_cost": cost,
        # linear: the cost per million parameters stays within this factor from the smallest to the largest
        "cost_per_m_ratio_largest_to_smallest": per_param[-1] / per_param[0] if per_param[0] else float("nan"),
        "cpu_count": os.cpu_count(),
        "loadavg_end": os.getloadavg(),
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def format_table(results: dict[str, Any]) -> str:
    quick = ", QUICK: not a measurement" if results["quick"] else ""
    lines = [
        f"ivyplug bench scale ({results['seconds']:g} s per worker count, one server process{quick})",
        f"{'workers':>8} {'pushes/s':>10} {'p50 ms':>8} {'p99 ms':>8} {'server MB warm':>15} {'end':>8}",
    ]
    for r in results["workers"]:
        lines.append(
            f"{r['workers']:>8} {r['pushes_per_s']:>10.1f} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} "
            f"{r['server_rss_start_mb']:>15.0f} {r['server_rss_end_mb']:>8.0f}"
        )
    lines.append(f"{'params':>8} {'push+pull ms':>14} {'ms per M':>10}")
    for c in results["step_cost"]:
        lines.append(f"{c['params_m']:>7}M {c['step_ms']:>14.2f} {c['step_ms'] / c['params_m']:>10.3f}")
    lines.append(f"load average at the end: {results['loadavg_end'][0]:.2f} ({results['cpu_count']} CPUs)")
    return "\n".join(lines)
