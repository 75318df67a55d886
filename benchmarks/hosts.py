"""``ivyplug bench hosts``: the gradient path across two emulated hosts at link speed, against DDP.

Two emulated hosts (network namespaces with their own ``/dev/shm``, one Lightning worker each, started by
``torchrun --nnodes 2`` on each; see :mod:`ivyplug.benchmarks.across_hosts`), links unlimited, 1 Gbit/s and
100 Mbit/s (``tc tbf`` on both ends of each host's link), ivyplug's LAMB in every configuration: DDP,
``ivy_ps_sync`` and ``ivy_ps`` (async, co-located servers) with fp32 and bf16 pushes, and async with one dedicated
server process on host 0 (``/dedicated``: host 0's worker pushes through shared memory, only host 1's crosses the
link), without and with host 1's worker 3x slower at compute (at 100 Mbit/s). The digits MLP 64-1024-1024-10
(1.13M parameters) at batch 256, 4 epochs, 3 interleaved rounds (seeds 0-2); ``--select setting=wide``: the MLP
64-2048-2048-10 (4.35M parameters) at batch 16, where the link is a larger share of a step; ``--select
optimizer=adamw``: torch's AdamW in every configuration instead of LAMB.

Columns: the median epoch time and its ratio to DDP's, the bytes over host 0's link (the interface's own
counters, both directions), the final validation accuracy (mean of the seeds) and its distance to DDP's, and
the time to DDP's final accuracy as a share of DDP's own. It skips, saying why, where emulated hosts cannot be
made (they need Linux, root and iproute2).
"""

from __future__ import annotations

from typing import Any

from ivyplug.benchmarks.across_hosts import (
    GridJob,
    format_rows,
    optimizer_label,
    rates_at,
    read_selection,
    run_selection,
)

DESCRIPTION = (
    "2 emulated hosts, unlimited / 1 Gbit/s / 100 Mbit/s links: DDP vs ivy_ps sync and async (co-located or "
    "dedicated servers), fp32 and bf16"
)

CONFIGS = (
    "ddp", "ivy_ps_sync", "ivy_ps", "ivy_ps_sync/bfloat16", "ivy_ps/bfloat16", "ivy_ps/dedicated",
    "ivy_ps/bfloat16/dedicated",
)  # fmt: skip
#: run when selected (``--select config=...``), not by default
OPTIONAL_CONFIGS = ("ivy_ps_sync/overlap_backward", "ivy_ps/overlap_backward")
SLOWDOWN = 3.0
SLOW_RATE = "100mbit"
ROUNDS, EPOCHS = 3, 4


def grid(select: dict[str, list[str]]) -> list[GridJob]:
    """(rate, slowdown, configs) jobs: every rate without a slow worker, then 100 Mbit/s with one."""
    rates, slowdowns = read_selection("hosts", select, CONFIGS + OPTIONAL_CONFIGS, SLOWDOWN)
    configs = list(select.get("config", CONFIGS))
    if "ddp" not in configs:
        configs.insert(0, "ddp")  # the reference of every ratio
    return [(rate, slowdown, configs) for slowdown in slowdowns for rate in rates_at(slowdown, rates, SLOW_RATE)]


def run(quick: bool = False, select: dict[str, list[str]] | None = None) -> dict[str, Any]:
    """Quick: one round, the unlimited link, DDP and async bf16, 1 epoch on a small training set (a smoke run)."""
    quick_job: GridJob = (None, 1.0, ["ddp", "ivy_ps/bfloat16"])
    return run_selection("hosts", quick, quick_job, grid, select, rounds=ROUNDS, epochs=EPOCHS)


def format_table(results: dict[str, Any]) -> str:
    quick = ", QUICK: not a measurement" if results["quick"] else ""
    title = (
        f"ivyplug bench hosts (2 emulated hosts, one worker each, {optimizer_label(results)}, "
        f"slow worker {SLOWDOWN:g}x{quick})"
    )
    return format_rows(title, results)
