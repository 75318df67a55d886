"""``ivyplug bench averaging``: asynchronous model averaging against DDP and the PS on gradients.

Side by side in one run, 2 workers on this machine's CPU cores: ``ddp``, ``ivy_ps`` (async, AdamW on pushed
gradients) and averaging (AdamW in ``LocalUpdates``, async) with H = ``sync_every`` in {4, 16, 64} x outer in
{average, nesterov, lamb} x wire in {float32, bfloat16} (int8 and int4 when selected), without a slow worker and
with rank 1 3x slower at compute (``bench ps``'s delay injector), on two settings: ``digits`` (the compute-bound
MLP of ``bench ps``, 90 steps per worker and epoch) and ``wide`` (64-2048-2048-10 at batch 16: communication a
larger share of a step). Each (setting, slowdown) runs its configurations in sequence in one job
(benchmarks/averaging_job.py).

Columns: bytes moved per training sample (sent + received, both workers; DDP's analytic, the PS's measured, its
epoch-end pulls for validation included), the median train-epoch time, the wall time until validation first
reached DDP's final accuracy (same setting and slowdown), and the final validation accuracy. Targets: H=16
with ``outer="nesterov"`` moves >= 12x fewer bytes per sample than DDP (>= 24x with bf16) and ends within 0.5
points of DDP's accuracy; with the 3x slower worker averaging reaches DDP's final accuracy in <= 0.6x DDP's
wall time. ``os.getloadavg()`` is recorded around every job: on a shared machine a load above the core count
inflates every time.

The full grid is 80 fits; ``select`` (``--select KEY=V1,V2`` on the command line; keys ``setting``,
``slowdown``, ``H``, ``outer``, ``wire``, or ``avg=H/outer/wire,...`` for explicit averaging configs, where
``outer@lr@momentum`` sets ``outer_lr`` and ``outer_momentum``: ``16/nesterov@0.35@0.9/float32``) runs a
subset. DDP and ``ivy_ps`` always run: they are the reference.
"""

from __future__ import annotations

import os
import statistics
from typing import Any

from ivyplug.benchmarks import SelectionError, selected_numbers
from ivyplug.benchmarks.job_runner import run_job

DESCRIPTION = "async model averaging (H x outer x wire) vs DDP and the PS on gradients, with a 3x slower worker"

SLOWDOWN = 3.0
SETTINGS = ("digits", "wide")
#: the optimizers a benchmark job trains with (the one in ``LocalUpdates`` for local-update configurations)
OPTIMIZERS = {"adamw": "AdamW", "lamb": "LAMB"}  # name -> how a table names it
SLOWDOWNS = (1.0, SLOWDOWN)
SYNC_EVERY = (4, 16, 64)
OUTERS = ("average", "nesterov", "lamb")
WIRES = ("float32", "bfloat16", "int8", "int4")
DEFAULT_WIRES = ("float32", "bfloat16")  # the full grid's; select wire=int8,int4 for the quantized pushes
TARGET_BYTES_RATIO = {"float32": 12.0, "bfloat16": 24.0}
TARGET_ACC_POINTS = 0.5
TARGET_SLOW_TIME_RATIO = 0.6
EPOCHS = 4


def _grid(select: dict[str, list[str]]) -> list[tuple[str, float, list[str]]]:
    """(setting, slowdown, configs) jobs of the selected subset."""
    unknown = sorted(set(select) - {"setting", "slowdown", "H", "outer", "wire", "avg"})
    if unknown:
        raise SelectionError(
            f"bench averaging: unknown selection key(s) {unknown}; known: setting, slowdown, H, outer, wire, avg"
        )
    settings = select.get("setting", list(SETTINGS))
    slowdowns = selected_numbers("averaging", select, "slowdown", [str(s) for s in SLOWDOWNS], float)
    hs = selected_numbers("averaging", select, "H", [str(h) for h in SYNC_EVERY], int)
    outers = select.get("outer", list(OUTERS))
    wires = select.get("wire", list(DEFAULT_WIRES))
    for o in outers:
        if o not in OUTERS:
            raise SelectionError(f"bench averaging: outer must be one of {OUTERS}, got {o!r}")
    for w in wires:
        if w not in WIRES:
            raise SelectionError(f"bench averaging: wire must be one of {WIRES}, got {w!r}")
    if "avg" in select:  # explicit averaging configs H/outer/wire instead of the product
        if {"H", "outer", "wire"} & set(select):
            raise SelectionError("bench averaging: select avg=H/outer/wire or H, outer and wire, not both")
        for c in select["avg"]:
            h, o, w = [*c.split("/"), "", "", ""][:3]
            if not h.isdigit() or int(h) < 1 or not _outer_ok(o) or w not in WIRES or c.count("/") != 2:
                raise SelectionError(
                    f"bench averaging: avg= takes H/outer[@outer_lr[@outer_momentum]]/wire "
                    f"(e.g. 16/nesterov/bfloat16 or 16/nesterov@0.35@0.9/float32), got {c!r}"
                )
        averaging = [f"avg/{c}" for c in select["avg"]]
    else:
        averaging = [f"avg/{h}/{o}/{w}" for h in hs for o in outers for w in wires]
    configs = ["ddp", "ivy_ps", *averaging]
    return [(s, k, configs) for s in settings for k in slowdowns]


def _outer_ok(outer: str) -> bool:
    """``outer`` or ``outer@outer_lr`` or ``outer@outer_lr@outer_momentum`` (numbers; lr > 0, momentum in [0, 1))."""
    name, *values = outer.split("@")
    if name not in OUTERS or len(values) > 2 or (name == "average" and values):
        return False
    try:
        numbers = [float(v) for v in values]
    except ValueError:
        return False
    return all(n > 0 for n in numbers[:1]) and all(0 <= n < 1 for n in numbers[1:])


def _time_to(points: list[list[float]], target: float) -> float | None:
    """Wall seconds until validation first reached ``target`` (None: it never did)."""
    for t, acc in points:
        if acc >= target - 1e-9:
            return float(t)
    return None


def summarise(runs: list[dict[str, Any]]) -> None:
    """Adds epoch time, time to DDP's final accuracy and the ratios to DDP to every run (in place)."""
    ddp = {(r["setting"], r["slowdown"]): r for r in runs if r["kind"] == "ddp"}
    for r in runs:
        times = r["epoch_times"]
        r["epoch_time"] = statistics.median(times[1:] if len(times) > 1 else times)
        ref = ddp.get((r["setting"], r["slowdown"]))
        if ref is None:
            continue
        r["ddp_final_acc"] = ref["val_acc"]
        r["time_to_ddp_acc"] = _time_to(r["accuracy_points"], ref["val_acc"])
        ddp_time = _time_to(ref["accuracy_points"], ref["val_acc"])
        r["time_to_ddp_acc_vs_ddp"] = (
            r["time_to_ddp_acc"] / ddp_time if r["time_to_ddp_acc"] is not None and ddp_time else None
        )
        r["bytes_fewer_than_ddp"] = ref["bytes_per_sample"] / r["bytes_per_sample"] if r["bytes_per_sample"] else None
        r["acc_points_vs_ddp"] = 100 * (r["val_acc"] - ref["val_acc"])


def run(quick: bool = False, select: dict[str, list[str]] | None = None) -> dict[str, Any]:
    """Quick: digits on the training set once, 1 epoch, no slow worker, DDP and H=4 average in bf16 (a smoke
    run, not a measurement)."""
    if quick:
        jobs = [("digits", 1.0, ["ddp", "avg/4/average/bfloat16"])]
        epochs, repeat, timeout = 1, 1, 600.0
    else:
        jobs = _grid(select or {})
        epochs, repeat, timeout = EPOCHS, None, 7200.0
    runs: list[dict[str, Any]] = []
    for setting, slowdown, configs in jobs:
        args = ["--setting", setting, "--slowdown", str(slowdown), "--epochs", str(epochs), "--configs", *configs]
        if repeat is not None:
            args += ["--repeat", str(repeat)]
        result = run_job("ivyplug.benchmarks.averaging_job", args, timeout)
        for r in result["runs"]:
            r["loadavg_before"], r["loadavg_after"] = result["loadavg_before"], result["loadavg_after"]
        runs.extend(result["runs"])
    summarise(runs)
    return {
        "quick": quick,
        "epochs": epochs,
        "select": select or {},
        "slowdown": SLOWDOWN,
        "targets": {
            "bytes_fewer_than_ddp_h16_nesterov": TARGET_BYTES_RATIO,
            "acc_points": TARGET_ACC_POINTS,
            "slow_time_to_ddp_acc_vs_ddp": TARGET_SLOW_TIME_RATIO,
        },
        "runs": runs,
        "cpu_count": os.cpu_count(),
        "loadavg_end": os.getloadavg(),
    }


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(results: dict[str, Any]) -> str:
    quick = ", QUICK: not a measurement" if results["quick"] else ""
    lines = [
        f"ivyplug bench averaging (2 workers, epochs={results['epochs']}, slow worker {results['slowdown']:g}x{quick})",
        f"{'setting':<7} {'slow':>4} {'config':<24} {'B/sample':>9} {'vs DDP':>7} {'epoch s':>8} "
        f"{'t->DDP acc':>10} {'vs DDP':>7} {'val acc':>8} {'load':>9}",
    ]
    for r in results["runs"]:
        load = f"{r['loadavg_before'][0]:.1f}-{r['loadavg_after'][0]:.1f}"
        bps = f"{r['bytes_per_sample']:.0f}" + ("" if r["bytes_measured"] else "*")
        lines.append(
            f"{r['setting']:<7} {r['slowdown']:>3g}x {r['config']:<24} {bps:>9} "
            f"{_fmt(r.get('bytes_fewer_than_ddp'), '.1f') + 'x':>7} {r['epoch_time']:>8.2f} "
            f"{_fmt(r.get('time_to_ddp_acc'), '.1f'):>10} {_fmt(r.get('time_to_ddp_acc_vs_ddp'), '.2f'):>7} "
            f"{r['val_acc']:>8.4f} {load:>9}"
        )
    lines.append("(* DDP bytes: analytic, one fp32 gradient sent and one received per rank per step; PS: measured)")
    lines.append("(vs DDP: bytes per sample DDP's / this; wall time to DDP's final accuracy this / DDP's)")
    lines.append(f"load average at the end: {results['loadavg_end'][0]:.2f} on {results['cpu_count']} CPUs")
    return "\n".join(lines)
