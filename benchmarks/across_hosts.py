"""Two emulated hosts, one worker each, at several link speeds: the runner that ``bench hosts`` and
``bench averaging_hosts`` share.

Each job is ``torchrun --nnodes 2`` on both hosts (:mod:`ivyplug.benchmarks.emulated_hosts`: a network
namespace, ``/dev/shm`` and hostname per host, one link each to a bridge), running a list of configurations in
sequence (:mod:`ivyplug.benchmarks.averaging_job` with ``--nodes 2``). Rank 0 reads the bytes that crossed
its host's link around each fit from the kernel's interface counters: with two hosts every byte between the
workers (and the servers they hold) passes it, whatever the strategy. Rounds are interleaved: round ``r`` runs
every link speed once, with seed ``r`` and the configurations in a rotated order, so slow drifts of a shared
machine fall on every configuration alike. Times are medians over rounds, accuracies means over seeds, and
every ratio to DDP is taken inside its round before the median.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ivyplug.benchmarks import SelectionError, selected_numbers
from ivyplug.benchmarks.averaging import OPTIMIZERS, SETTINGS
from ivyplug.benchmarks.emulated_hosts import DEVICE, Hosts, unavailable

#: link speeds (``tc`` rates; None: unlimited)
RATES: tuple[str | None, ...] = (None, "1gbit", "100mbit")
PORT = 29710
GRACE_S = 30.0
#: the keys of ``--select`` for the host benchmarks
SELECT_KEYS = ("rate", "slowdown", "config", "rounds", "first_round", "setting", "optimizer")
#: the model of a selection without ``setting``, and of every quick run
DEFAULT_SETTING = "digits"
#: the optimizer of a selection without ``optimizer``, and of every quick run: ivyplug's LAMB, in every configuration
DEFAULT_OPTIMIZER = "lamb"
ENV = {
    "OMP_NUM_THREADS": "1",
    "PYTHONWARNINGS": "ignore",
    "PYTHONUNBUFFERED": "1",
    "GLOO_SOCKET_IFNAME": DEVICE,  # torch's own groups (DDP's) bind to the link, as on a real cluster
}


def rate_name(rate: str | None) -> str:
    return "unlimited" if rate is None else rate


def _node_job(hosts: Hosts, node: int, port: int, out: Path, args: Sequence[str], log: Path) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"]
    cmd += ["--node-rank", str(node), "--master-addr", hosts[0].address, "--master-port", str(port)]
    cmd += ["-m", "ivyplug.benchmarks.averaging_job", "--nodes", "2", "--link", DEVICE, *args, "--out", str(out)]
    with log.open("w") as sink:  # a file, not a pipe: a full pipe would stall a chatty job
        return hosts.run(node, cmd, env=ENV, stdout=sink, stderr=subprocess.STDOUT)


def run_job(hosts: Hosts, port: int, args: Sequence[str], timeout: float) -> dict[str, Any]:
    """One two-node job; rank 0's result with the load average around it (RuntimeError with both logs if a node
    fails or outlives ``timeout``: every process of the job is killed then)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        load_before = os.getloadavg()
        procs = [_node_job(hosts, node, port, out, args, Path(tmp) / f"node{node}.log") for node in (0, 1)]
        deadline, failed_at = time.monotonic() + timeout, None
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                failed_at = now  # one node failed: the other gets a moment to fail on its own, then is ended
            if now > deadline or (failed_at is not None and now > failed_at + GRACE_S):
                for p in procs:
                    hosts.kill(p)
                break
            time.sleep(0.5)
        logs = [(Path(tmp) / f"node{node}.log").read_text(errors="replace") for node in (0, 1)]
        failed = any(p.returncode != 0 for p in procs)
        if failed or not out.exists():
            tails = "\n".join(f"--- host {i}:\n{log[-2500:]}" for i, log in enumerate(logs))
            raise RuntimeError(f"two-host benchmark job {list(args)} failed or timed out ({timeout:g} s):\n{tails}")
        result: dict[str, Any] = json.loads(out.read_text())
    result["loadavg_before"], result["loadavg_after"] = load_before, os.getloadavg()
    return result


#: (link rate, slowdown of host 1's worker, configs): one job of a round, run on one pair of hosts
GridJob = tuple[str | None, float, list[str]]


def read_selection(
    bench: str, select: dict[str, list[str]], configs: Sequence[str], slowdown: float
) -> tuple[list[str | None], list[float]]:
    """The rates and slowdowns of a ``--select`` (keys ``rate``, ``slowdown``, ``config``, ``rounds``,
    ``first_round``, ``setting``, ``optimizer``), its names checked against ``RATES``, ``configs``, the model
    settings and the optimizers; both host benchmarks read it alike."""
    unknown = sorted(set(select) - set(SELECT_KEYS))
    if unknown:
        raise SelectionError(f"bench {bench}: unknown selection key(s) {unknown}; known: {', '.join(SELECT_KEYS)}")
    selected_setting(bench, select)
    selected_optimizer(bench, select)
    names = {rate_name(r): r for r in RATES}
    for r in select.get("rate", []):
        if r not in names:
            raise SelectionError(f"bench {bench}: rate must be one of {sorted(names)}, got {r!r}")
    for c in select.get("config", []):
        if c not in configs:
            raise SelectionError(f"bench {bench}: config must be one of {tuple(configs)}, got {c!r}")
    rates = [names[r] for r in select.get("rate", [rate_name(r) for r in RATES])]
    return rates, selected_numbers(bench, select, "slowdown", ["1", str(slowdown)], float)


def selected_setting(bench: str, select: dict[str, list[str]]) -> str:
    """The model of a ``--select`` (``setting=digits``, the default, or ``wide``: 64-2048-2048-10 at batch 16, where
    the link is a larger share of a step); one per run, as its rows are grouped without it."""
    return _one_per_run(bench, select, "setting", SETTINGS, DEFAULT_SETTING)


def selected_optimizer(bench: str, select: dict[str, list[str]]) -> str:
    """The optimizer of a ``--select`` (``optimizer=lamb``, the default, or ``adamw``; in the averaging
    configurations the one inside ``LocalUpdates``): every configuration of a run trains with it, DDP too, so its
    ratios compare like with like."""
    return _one_per_run(bench, select, "optimizer", tuple(OPTIMIZERS), DEFAULT_OPTIMIZER)


def _one_per_run(bench: str, select: dict[str, list[str]], key: str, allowed: tuple[str, ...], default: str) -> str:
    """The one value of ``key`` a run takes (``default`` where the selection does not name it)."""
    values = select.get(key, [default])
    if len(values) != 1 or values[0] not in allowed:
        raise SelectionError(f"bench {bench}: {key} must be one of {allowed} (one per run), got {values!r}")
    return values[0]


def optimizer_label(results: dict[str, Any]) -> str:
    """How a results table's title names the run's optimizer."""
    return OPTIMIZERS[results.get("optimizer", DEFAULT_OPTIMIZER)]


def rates_at(slowdown: float, rates: list[str | None], slow_rate: str) -> list[str | None]:
    """The rates a slowdown runs at: all of them without a slow worker; with one, ``slow_rate`` (else the last)."""
    if slowdown == 1.0:
        return rates
    return [r for r in rates if r == slow_rate] or rates[-1:]


def run_selection(
    bench: str,
    quick: bool,
    quick_job: GridJob,
    grid: Callable[[dict[str, list[str]]], list[GridJob]],
    select: dict[str, list[str]] | None,
    *,
    rounds: int,
    epochs: int,
) -> dict[str, Any]:
    """Host benchmark ``bench``'s results (errors name it): its ``grid(select)`` for ``rounds`` rounds, or quick:
    ``quick_job`` once for one epoch on a small training set (a smoke run)."""
    if quick:
        setting, optimizer = DEFAULT_SETTING, DEFAULT_OPTIMIZER
        raw = run_rounds([quick_job], rounds=1, epochs=1, setting=setting, optimizer=optimizer, repeat=2, timeout=600)
    else:
        select = select or {}
        rounds = selected_numbers(bench, select, "rounds", [str(rounds)], int)[-1]
        first = selected_numbers(bench, select, "first_round", ["0"], int)[-1]  # more seeds: they join the earlier
        jobs = grid(select)
        setting = selected_setting(bench, select)
        optimizer = selected_optimizer(bench, select)
        raw = run_rounds(jobs, rounds=rounds, epochs=epochs, setting=setting, optimizer=optimizer, first=first)
    return {
        "quick": quick,
        "select": select or {},
        "setting": setting,
        "optimizer": optimizer,
        "skipped": raw["skipped"],
        "runs": raw["runs"],
        "rows": summarise(raw["runs"]),
        "cpu_count": os.cpu_count(),
        "loadavg_end": os.getloadavg(),
    }


def run_rounds(
    jobs: Sequence[GridJob],
    *,
    rounds: int,
    epochs: int,
    setting: str,
    optimizer: str,
    repeat: int | None = None,
    timeout: float = 3600.0,
    first: int = 0,
) -> dict[str, Any]:
    """Every (rate, slowdown, configs) job once per round (rounds ``first`` ... ``first + rounds - 1``, seed =
    round) on one pair of hosts; the runs, or ``skipped`` with the reason where emulated hosts cannot be made."""
    reason = unavailable()
    if reason is not None:
        return {"skipped": reason, "runs": []}
    runs: list[dict[str, Any]] = []
    with Hosts(2, hostname_maps_to="address") as hosts:
        port = PORT
        for r in range(first, first + rounds):
            for rate, slowdown, configs in jobs:
                shift = r % len(configs)
                order = configs[shift:] + configs[:shift]
                args = ["--setting", setting, "--slowdown", str(slowdown), "--epochs", str(epochs)]
                args += ["--seed", str(r), "--optimizer", optimizer, "--configs", *order]
                if repeat is not None:
                    args += ["--repeat", str(repeat)]
                hosts.limit(rate)
                port += 1  # a fresh rendezvous port: the last job's may linger in TIME_WAIT
                result = run_job(hosts, port, args, timeout)
                for run in result["runs"]:
                    run.update(rate=rate_name(rate), round=r)
                    run["loadavg_before"], run["loadavg_after"] = result["loadavg_before"], result["loadavg_after"]
                runs.extend(result["runs"])
    return {"skipped": None, "runs": runs}


def _time_to(points: list[list[float]], target: float) -> float | None:
    for t, acc in points:
        if acc >= target - 1e-9:
            return float(t)
    return None


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (rate, slowdown, config): medians over rounds and means over seeds, ratios to the DDP run of
    the same round, rate and slowdown."""
    ddp = {(r["rate"], r["slowdown"], r["round"]): r for r in runs if r["kind"] == "ddp"}
    groups: dict[tuple[str, float, str], list[dict[str, Any]]] = {}
    for r in runs:
        times = r["epoch_times"]
        r["epoch_time"] = statistics.median(times[1:] if len(times) > 1 else times)
    for r in runs:
        ref = ddp.get((r["rate"], r["slowdown"], r["round"]))
        if ref is not None:
            r["epoch_vs_ddp"] = r["epoch_time"] / ref["epoch_time"]
            r["link_bytes_vs_ddp"] = r["link_bytes"] / ref["link_bytes"] if ref["link_bytes"] else None
            r["time_to_ddp_acc"] = _time_to(r["accuracy_points"], ref["val_acc"])
            ref_time = _time_to(ref["accuracy_points"], ref["val_acc"])
            r["time_to_ddp_acc_vs_ddp"] = (
                r["time_to_ddp_acc"] / ref_time if r["time_to_ddp_acc"] is not None and ref_time else None
            )
            r["acc_points_vs_ddp"] = 100 * (r["val_acc"] - ref["val_acc"])
        groups.setdefault((r["rate"], r["slowdown"], r["config"]), []).append(r)
    rows = []
    for (rate, slowdown, config), rs in groups.items():
        reached = [r["time_to_ddp_acc_vs_ddp"] for r in rs if r.get("time_to_ddp_acc_vs_ddp") is not None]
        rows.append(
            {
                "rate": rate,
                "slowdown": slowdown,
                "config": config,
                "rounds": len(rs),
                "epoch_time": statistics.median(r["epoch_time"] for r in rs),
                "epoch_vs_ddp": _median([r["epoch_vs_ddp"] for r in rs if "epoch_vs_ddp" in r]),
                "link_mb": statistics.median(r["link_bytes"] for r in rs) / 1e6,
                "link_bytes_vs_ddp": _median([r["link_bytes_vs_ddp"] for r in rs if r.get("link_bytes_vs_ddp")]),
                "val_acc": statistics.fmean(r["val_acc"] for r in rs),
                "acc_points_vs_ddp": statistics.fmean(r["acc_points_vs_ddp"] for r in rs if "acc_points_vs_ddp" in r)
                if any("acc_points_vs_ddp" in r for r in rs)
                else None,
                "time_to_ddp_acc_vs_ddp": _median(reached),
                "reached_ddp_acc": f"{len(reached)}/{len(rs)}",
                "sync_every_chosen": [r.get("sync_every_chosen") for r in rs],
                "load": [r["loadavg_before"][0] for r in rs],
            }
        )
    order = {rate_name(rate): i for i, rate in enumerate(RATES)}
    rows.sort(key=lambda row: (row["slowdown"], order.get(row["rate"], 9)))
    return rows


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_rows(title: str, results: dict[str, Any]) -> str:
    if results.get("skipped"):
        return f"{title}: skipped, {results['skipped']}"
    lines = [
        f"{title}, model setting {results.get('setting', 'digits')}",
        f"{'link':<9} {'slow':>4} {'config':<30} {'epoch s':>8} {'vs DDP':>7} {'link MB':>8} {'vs DDP':>7} "
        f"{'val acc':>8} {'pts':>6} {'t->DDP acc':>10} {'load':>9}",
    ]
    for row in results["rows"]:
        load = f"{min(row['load']):.1f}-{max(row['load']):.1f}"
        lines.append(
            f"{row['rate']:<9} {row['slowdown']:>3g}x {row['config']:<30} {row['epoch_time']:>8.2f} "
            f"{_fmt(row['epoch_vs_ddp'], '.2f'):>7} {row['link_mb']:>8.1f} {_fmt(row['link_bytes_vs_ddp'], '.4f'):>7} "
            f"{row['val_acc']:>8.4f} {_fmt(row['acc_points_vs_ddp'], '+.2f'):>6} "
            f"{_fmt(row['time_to_ddp_acc_vs_ddp'], '.2f') + ' ' + row['reached_ddp_acc']:>10} {load:>9}"
        )
    lines.append(
        "(epoch s: median over rounds of each run's median epoch after the first, on rank 0's host; link MB: bytes "
        "over host 0's link, both directions, from the interface's counters; val acc: mean over seeds; pts: "
        "points vs DDP's final accuracy; t->DDP acc: median of (time to DDP's final accuracy / DDP's own), "
        "reached in k/n rounds; every ratio is taken inside its round)"
    )
    lines.append(f"load average at the end: {results['loadavg_end'][0]:.2f} on {results['cpu_count']} CPUs")
    return "\n".join(lines)
