"""``ivyplug bench hosts``: the gradient path across two emulated hosts at link speed, against DDP.

Two emulated hosts (network namespaces with their own ``/dev/shm``, one Lightning worker each, started by
``torchrun --nnodes 2`` on each; see :mod:`ivyplug.benchmarks.across_hosts`), links unlimited, 1 Gbit/s and
100 Mbit/s (``tc tbf`` on both ends of each host's link), ivyplug's LAMB in every configuration: DDP,
``ivy_ps_sync`` and ``ivy_ps`` (async, co-located servers) with fp32 and bf16 pushes, without and with host 1's
worker 3x slower at compute (at 100 Mbit/s). The digits MLP 64-1024-1024-10 (1.13M parameters) at batch 256,
4 epochs, 3 interleaved rounds (seeds 0-2).

Columns: the median epoch time and its ratio to DDP's, the bytes over host 0's link (the interface's own
counters, both directions), the final validation accuracy (mean of the seeds) and its distance to DDP's, and
the time to DDP's final accuracy as a share of DDP's own. It skips, saying why, where emulated hosts cannot be
made (they need Linux, root and iproute2).
"""

from __future__ import annotations

import os
from typing import Any

from ivyplug.benchmarks.across_hosts import RATES, format_rows, rate_name, run_rounds, summarise

DESCRIPTION = "2 emulated hosts, unlimited / 1 Gbit/s / 100 Mbit/s links: DDP vs ivy_ps sync and async, fp32 and bf16"

CONFIGS = ("ddp", "ivy_ps_sync", "ivy_ps", "ivy_ps_sync/bfloat16", "ivy_ps/bfloat16")
SLOWDOWN = 3.0
SLOW_RATE = "100mbit"
ROUNDS, EPOCHS = 3, 4
OPTIMIZER = "lamb"


def grid(select: dict[str, list[str]]) -> list[tuple[str | None, float, list[str]]]:
    """(rate, slowdown, configs) jobs: every rate without a slow worker, then 100 Mbit/s with one."""
    unknown = sorted(set(select) - {"rate", "slowdown", "config", "rounds"})
    if unknown:
        raise ValueError(f"bench hosts: unknown selection key(s) {unknown}; known: rate, slowdown, config, rounds")
    names = {rate_name(r): r for r in RATES}
    for r in select.get("rate", []):
        if r not in names:
            raise ValueError(f"bench hosts: rate must be one of {sorted(names)}, got {r!r}")
    for c in select.get("config", []):
        if c not in CONFIGS:
            raise ValueError(f"bench hosts: config must be one of {CONFIGS}, got {c!r}")
    configs = list(select.get("config", CONFIGS))
    if "ddp" not in configs:
        configs.insert(0, "ddp")  # the reference of every ratio
    rates = [names[r] for r in select.get("rate", [rate_name(r) for r in RATES])]
    slowdowns = [float(s) for s in select.get("slowdown", ["1", str(SLOWDOWN)])]
    jobs: list[tuple[str | None, float, list[str]]] = []
    for slowdown in slowdowns:
        for rate in rates if slowdown == 1.0 else [r for r in rates if r == SLOW_RATE] or rates[-1:]:
            jobs.append((rate, slowdown, configs))
    return jobs


def run(quick: bool = False, select: dict[str, list[str]] | None = None) -> dict[str, Any]:
    """Quick: one round, the unlimited link, DDP and async bf16, 1 epoch on a small training set (a smoke run)."""
    if quick:
        jobs: list[tuple[str | None, float, list[str]]] = [(None, 1.0, ["ddp", "ivy_ps/bfloat16"])]
        raw = run_rounds(jobs, rounds=1, epochs=1, setting="digits", optimizer=OPTIMIZER, repeat=2, timeout=600)
    else:
        select = select or {}
        rounds = int(select.get("rounds", [str(ROUNDS)])[-1])
        raw = run_rounds(grid(select), rounds=rounds, epochs=EPOCHS, setting="digits", optimizer=OPTIMIZER)
    return {
        "quick": quick,
        "select": select or {},
        "optimizer": OPTIMIZER,
        "skipped": raw["skipped"],
        "runs": raw["runs"],
        "rows": summarise(raw["runs"]),
        "cpu_count": os.cpu_count(),
        "loadavg_end": os.getloadavg(),
    }


def format_table(results: dict[str, Any]) -> str:
    quick = ", QUICK: not a measurement" if results["quick"] else ""
    title = f"ivyplug bench hosts (2 emulated hosts, one worker each, LAMB, slow worker {SLOWDOWN:g}x{quick})"
    return format_rows(title, results)
