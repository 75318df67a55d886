"""``ivyplug bench balance``: IvyLoadBalancer's per-rank shares against a 3x slower worker, and its overhead.

Side by side in one run: ``ddp`` and ``ivy_ps`` sync, each without and with IvyLoadBalancer,
without and with a slow worker (rank 1 is a device 3x slower at compute: it sleeps 2 x 3 x its measured
forward time per step). Compute-bound setting: the digits MLP 64-1024-1024-10, batch 256 per worker, the
training set repeated 16x; batch-size policy pinned so only the shares move and epoch times compare.
Epoch time is the median over epochs after the first (the first runs on equal shares, before any
measurement). Targets: with the balancer, epoch time <= 0.7x the same strategy's without it when a worker is
slow (the overhead-free limit is 0.5x), validation accuracy within 1 point, and the callback's summed hook
time <= 1% of the training time without a slow worker. ``os.getloadavg()`` is recorded around every run:
on a shared machine, a load above the core count inflates every number.
"""

from __future__ import annotations

import os
import statistics
from typing import Any

from ivyplug.benchmarks.job_runner import run_job

DESCRIPTION = "IvyLoadBalancer shares vs a 3x slower worker (ddp, ivy_ps sync) and the callback's overhead"

SLOWDOWN = 3.0
TARGET_RATIO = 0.7
TARGET_OVERHEAD = 0.01
TARGET_ACC_POINTS = 1.0


def _run_job(strategy: str, balancer: bool, slowdown: float, epochs: int, repeat: int, timeout: float) -> dict:
    args = ["--strategy", strategy, "--balancer", str(int(balancer)), "--slowdown", str(slowdown)]
    args += ["--epochs", str(epochs), "--repeat", str(repeat)]
    result = run_job("ivyplug.benchmarks.balance_job", args, timeout)
    times = result["epoch_times"]
    result["epoch_time"] = statistics.median(times[1:] if len(times) > 1 else times)
    result["overhead"] = result["hook_seconds"] / sum(times) if result["balancer"] else None
    result["overhead_by_hook"] = {k: v / sum(times) for k, v in result.get("hook_breakdown", {}).items()}
    return result


def run(quick: bool = False) -> dict[str, Any]:
    """Quick: ddp only, 2 epochs on the training set repeated twice (a smoke run, not a measurement)."""
    epochs, repeat = (2, 2) if quick else (4, 16)
    strategies = ("ddp",) if quick else ("ddp", "ivy_ps_sync")
    timeout = 600.0 if quick else 1800.0
    runs: list[dict[str, Any]] = []
    for strategy in strategies:
        for slowdown in (1.0, SLOWDOWN):
            for balancer in (False, True):
                if quick and slowdown == 1.0 and not balancer:
                    continue
                runs.append(_run_job(strategy, balancer, slowdown, epochs, repeat, timeout))
    summary: dict[str, Any] = {}
    for strategy in strategies:
        by = {(r["slowdown"], r["balancer"]): r for r in runs if r["strategy"] == strategy}
        slow_plain, slow_lb = by.get((SLOWDOWN, False)), by.get((SLOWDOWN, True))
        fast_lb = by.get((1.0, True))
        entry: dict[str, Any] = {}
        if slow_plain and slow_lb:
            entry["slow_ratio"] = slow_lb["epoch_time"] / slow_plain["epoch_time"]
            entry["acc_points"] = 100 * (slow_lb["val_acc"] - slow_plain["val_acc"])
        if fast_lb:
            entry["overhead"] = fast_lb["overhead"]
        if (1.0, False) in by and fast_lb:
            entry["fast_ratio"] = fast_lb["epoch_time"] / by[(1.0, False)]["epoch_time"]
        summary[strategy] = entry
    return {
        "quick": quick,
        "epochs": epochs,
        "repeat": repeat,
        "slowdown": SLOWDOWN,
        "targets": {"slow_ratio": TARGET_RATIO, "overhead": TARGET_OVERHEAD, "acc_points": TARGET_ACC_POINTS},
        "runs": runs,
        "summary": summary,
        "cpu_count": os.cpu_count(),
    }


def format_table(results: dict[str, Any]) -> str:
    lines = [
        f"ivyplug bench balance (epochs={results['epochs']}, data x{results['repeat']}, slow worker "
        f"{results['slowdown']:g}x{', QUICK: not a measurement' if results['quick'] else ''})",
        f"{'strategy':<12} {'slow':>5} {'balancer':>8} {'epoch s':>8} {'val acc':>8} {'overhead':>9} "
        f"{'per batch':>9} {'load':>6}  shares per epoch",
    ]
    for r in results["runs"]:
        overhead = f"{100 * r['overhead']:.2f}%" if r["overhead"] is not None else "-"
        per_batch = r.get("overhead_by_hook", {}).get("batch")
        batch_cell = f"{100 * per_batch:.3f}%" if per_batch is not None else "-"
        lines.append(
            f"{r['strategy']:<12} {r['slowdown']:>5g} {('yes' if r['balancer'] else 'no'):>8} {r['epoch_time']:>8.3f} "
            f"{r['val_acc']:>8.3f} {overhead:>9} {batch_cell:>9} {r['loadavg_before'][0]:>6.1f}  {r['shares']}"
        )
    for strategy, s in results["summary"].items():
        parts = []
        if "slow_ratio" in s:
            parts.append(f"slow worker: epoch time with/without balancer {s['slow_ratio']:.2f} (target <= 0.7)")
            parts.append(f"accuracy {s['acc_points']:+.1f} points")
        if "overhead" in s:
            parts.append(f"hook overhead {100 * s['overhead']:.2f}% (target <= 1%)")
        if "fast_ratio" in s:
            parts.append(f"no slow worker: with/without {s['fast_ratio']:.2f}")
        lines.append(f"{strategy}: " + "; ".join(parts))
    lines.append(
        "overhead: all of the callback's time on the training thread (per-batch hooks, epoch start/end, the "
        "epoch-end gather and broadcast of the decision including the wait for the last rank, loader rebuild) / "
        "summed train-epoch time; per batch: the per-batch hooks alone (the JSON has every part)"
    )
    return "\n".join(lines)
