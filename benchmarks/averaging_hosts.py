"""``ivyplug bench averaging_hosts``: asynchronous model averaging across two emulated hosts, against DDP.

The setting of ``bench hosts`` (two emulated hosts, one Lightning worker each, links unlimited, 1 Gbit/s and
100 Mbit/s, ivyplug's LAMB everywhere, the 1.13M-parameter digits MLP at batch 256, 4 epochs, 3 interleaved
rounds with seeds 0-2), with LAMB wrapped in ``LocalUpdates`` (async, outer Nesterov): H = 16 with fp32, bf16,
int8 and int4 deltas; int8 and int4 with the exchange overlapping local steps (``overlap=True``); and
``sync_every="auto"`` in int8, with and without overlap. With host 1's worker 3x slower at compute (at 100
Mbit/s): DDP, H = 16 and auto, both int8 with overlap. Columns as in ``bench hosts``; ``--select
optimizer=adamw``: AdamW in place of LAMB, in DDP and inside ``LocalUpdates``.

Targets at 100 Mbit/s against DDP in the same round: int4 moves <= 1/60 of DDP's bytes over the link, int4 and
int8 end within 0.5 points of DDP's validation accuracy (mean of the seeds); with overlap the epoch takes <=
1.3x its epoch on the unlimited link; ``auto`` ends within 0.5 points of DDP; with the slow worker, averaging
(overlap, int8) reaches DDP's final accuracy in <= 0.1x DDP's time to it.
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

DESCRIPTION = "async averaging across 2 emulated hosts: int8/int4 deltas, overlap, sync_every='auto', vs DDP"

CONFIGS = (
    "ddp",
    "avg/16/nesterov/float32",
    "avg/16/nesterov/bfloat16",
    "avg/16/nesterov/int8",
    "avg/16/nesterov/int4",
    "avg/16/nesterov/int8/overlap",
    "avg/16/nesterov/int4/overlap",
    "avg/auto/nesterov/int8",
    "avg/auto/nesterov/int8/overlap",
)
SLOW_CONFIGS = ("ddp", "avg/16/nesterov/int8/overlap", "avg/auto/nesterov/int8/overlap")
SLOWDOWN = 3.0
SLOW_RATE = "100mbit"
ROUNDS, EPOCHS = 3, 4
TARGETS = {
    "int4_link_bytes_vs_ddp": 1 / 60,
    "acc_points": 0.5,
    "overlap_epoch_vs_unlimited": 1.3,
    "slow_time_to_ddp_acc_vs_ddp": 0.1,
}


def grid(select: dict[str, list[str]]) -> list[GridJob]:
    """(rate, slowdown, configs) jobs of the selected subset (keys ``rate``, ``slowdown``, ``config``; ``rounds``
    sets how many rounds run)."""
    rates, slowdowns = read_selection("averaging_hosts", select, CONFIGS, SLOWDOWN)
    jobs: list[GridJob] = []
    for slowdown in slowdowns:
        base = CONFIGS if slowdown == 1.0 else SLOW_CONFIGS
        configs = [c for c in base if c in select.get("config", base) or c == "ddp"]
        jobs += [(rate, slowdown, configs) for rate in rates_at(slowdown, rates, SLOW_RATE)]
    return jobs


def run(quick: bool = False, select: dict[str, list[str]] | None = None) -> dict[str, Any]:
    """Quick: one round on the unlimited link, DDP and H=4 int8 with overlap, 1 epoch (a smoke run)."""
    quick_job: GridJob = (None, 1.0, ["ddp", "avg/4/nesterov/int8/overlap"])
    results = run_selection("averaging_hosts", quick, quick_job, grid, select, rounds=ROUNDS, epochs=EPOCHS)
    return {**results, "targets": TARGETS}


def format_table(results: dict[str, Any]) -> str:
    quick = ", QUICK: not a measurement" if results["quick"] else ""
    title = (
        f"ivyplug bench averaging_hosts (2 emulated hosts, one worker each, {optimizer_label(results)} in "
        f"LocalUpdates, outer Nesterov, slow worker {SLOWDOWN:g}x{quick})"
    )
    return format_rows(title, results)
