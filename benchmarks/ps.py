"""``ivyplug bench ps``: the parameter server against DDP, with and without a 3x slower worker.

Side by side in one run, each configuration three times in interleaved rounds (a single 4-epoch run moves by 10-20%
on a quiet machine), 2 workers on this machine's CPU cores: ``ddp``, ``ivy_ps_sync`` and ``ivy_ps`` (async),
each without a slow worker and with rank 1 simulated as a device 3x slower at compute (it sleeps (k-1) x 3 x
its measured forward time every step). Compute-bound setting: the digits MLP 64-1024-1024-10 at batch 256 per
worker on the training set repeated 16x. Epoch time is the median over the epochs after the first (train time
up to validation, which includes the wait for the slowest worker). Reported: epoch time, samples/s, validation
accuracy, bytes each configuration moves per epoch. Targets: without a slow worker sync reaches >= 1.0x DDP's
throughput and async >= 1.05x (the same two with pushes from backward's gradient hooks,
``overlap_backward=True``, off by default, run alongside); with the slow worker
async's epoch time is <= 0.65x DDP's (0.5x is the overhead-free limit) at validation accuracy within 1 point
of DDP's.

The same run measures the PS transport: push+pull of one 4 MB and one 64 MB shard against gloo's raw
point-to-point loopback bandwidth for the same sizes, with the payloads in shared memory (the default between
ranks of one host) and over gloo alone (``shared_memory=False``: the path between hosts). ``os.getloadavg()``
is recorded around every run: on a shared machine a load above the core count inflates every number.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from ivyplug.benchmarks.job_runner import run_job

DESCRIPTION = "PS vs DDP (sync, async; with a 3x slower worker) and PS push/pull vs gloo loopback bandwidth"

SLOWDOWN = 3.0
STRATEGIES = ("ddp", "ivy_ps_sync", "ivy_ps")
#: run without a slow worker only: the PS strategies with ``overlap_backward=True`` (the default: off)
OVERLAPPED = ("ivy_ps_sync_overlap", "ivy_ps_overlap")
SIZES_MB = (4, 64)
#: the PS push+pull measured per configuration: the default (payloads in shared memory between ranks of one
#: host) and gloo alone (``shared_memory=False``, the path between hosts)
PS_WIRES = {"ps_push_pull": True, "ps_push_pull_gloo": False}
TARGET_THROUGHPUT = {"ivy_ps_sync": 1.0, "ivy_ps": 1.05}
ROUNDS = 3  # every configuration runs this many times, interleaved (full run)
TARGET_SLOW_RATIO = 0.65
TARGET_ACC_POINTS = 1.0


def _run_job(strategy: str, slowdown: float, epochs: int, repeat: int, timeout: float) -> dict[str, Any]:
    args = ["--strategy", strategy, "--slowdown", str(slowdown), "--epochs", str(epochs), "--repeat", str(repeat)]
    result = run_job("ivyplug.benchmarks.ps_job", args, timeout)
    times = result["epoch_times"]
    result["epoch_time"] = statistics.median(times[1:] if len(times) > 1 else times)
    result["samples_per_s"] = result["train_samples"] / result["epoch_time"]
    cpu = result.get("epoch_cpu_seconds") or []
    result["epoch_cpu"] = statistics.median(cpu[1:] if len(cpu) > 1 else cpu) if cpu else float("nan")
    return result


def _pool(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration run ``len(rounds)`` times, interleaved with the others: medians over every epoch
    after the first of every round (a single 4-epoch run moved by 10-20% between runs on a quiet machine)."""
    first = dict(rounds[0])
    times = [t for r in rounds for t in (r["epoch_times"][1:] or r["epoch_times"])]
    cpus = [c for r in rounds for c in (r.get("epoch_cpu_seconds") or [])[1:]]
    first["rounds"] = len(rounds)
    first["epoch_times_all_rounds"] = [r["epoch_times"] for r in rounds]
    first["epoch_time"] = statistics.median(times)
    first["samples_per_s"] = first["train_samples"] / first["epoch_time"]
    first["epoch_cpu"] = statistics.median(cpus) if cpus else first["epoch_cpu"]
    first["val_acc"] = statistics.median(r["val_acc"] for r in rounds)
    first["loadavg_after"] = rounds[-1]["loadavg_after"]
    return first


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _bandwidth_worker(rank: int, port: int, sizes_mb: tuple[int, ...], reps: int, out: str) -> None:
    """Rank r of 2: per repetition, a gloo send/recv round trip, then a PS push+pull of one shard held by the
    other rank with each of :data:`PS_WIRES` (interleaved, so that drifts of foreign load hit all alike)."""
    import torch
    import torch.distributed as dist

    from ivyplug.ps import PSClient, PSConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    results: dict[str, Any] = {"gloo_p2p": {}, **{kind: {} for kind in PS_WIRES}}
    try:
        for mb in sizes_mb:
            t = torch.ones(mb * 2**20 // 4)
            clients: dict[str, PSClient] = {}
            try:
                for kind, shared in PS_WIRES.items():
                    weight = torch.nn.Parameter(torch.zeros(mb * 2**20 // 4))
                    clients[kind] = PSClient.start(
                        # whole (max_shard_bytes=None): every byte goes to the other rank's shard
                        PSConfig(mode="async", timeout=120.0, max_shard_bytes=None, shared_memory=shared),
                        [("w", weight)],
                        optimizer=torch.optim.SGD([weight], lr=0.0),
                        rank=rank,
                        world_size=2,
                    )
                    weight.grad = torch.ones_like(weight)
                # the worker whose shard lives on the other rank steps: every byte goes there and back
                stepping = {kind: rank != client.plan.nonempty_shards()[0] for kind, client in clients.items()}
                gloo: list[float] = []
                steps: dict[str, list[float]] = {kind: [] for kind in PS_WIRES}
                for i in range(reps + 2):
                    dist.barrier()
                    start = time.perf_counter()
                    if rank == 0:
                        dist.send(t, 1)
                        dist.recv(t, 1)
                    else:
                        dist.recv(t, 0)
                        dist.send(t, 0)
                    elapsed = time.perf_counter() - start
                    if i >= 2 and rank == 0:
                        gloo.append(elapsed)
                    for kind, client in clients.items():
                        dist.barrier()
                        if stepping[kind]:
                            start = time.perf_counter()
                            client.step(num_samples=1)
                            if i >= 2:
                                steps[kind].append(time.perf_counter() - start)
                for client in clients.values():
                    client.sync()
                # a round trip carries the tensor twice
                if gloo:
                    results["gloo_p2p"][mb] = 2 * t.numel() * 4 / statistics.median(gloo) / 1e9
                for kind, times in steps.items():
                    if times:
                        results[kind][mb] = 2 * t.numel() * 4 / statistics.median(times) / 1e9
            finally:
                for client in clients.values():
                    client.close()
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))


def measure_bandwidth(sizes_mb: tuple[int, ...] = SIZES_MB, reps: int = 5) -> dict[str, dict[int, float]]:
    """GB/s of gloo point-to-point and of PS push+pull (one shard, remote) with shared memory and over gloo
    alone, for each size, on loopback."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        context = mp.start_processes(
            _bandwidth_worker, args=(_free_port(), sizes_mb, reps, tmp), nprocs=2, join=False, start_method="spawn"
        )
        deadline = time.monotonic() + 600
        try:
            while not context.join(timeout=5):
                if time.monotonic() > deadline:
                    raise RuntimeError("bandwidth measurement did not finish within 600 s")
        finally:
            for p in context.processes:
                if p.is_alive():
                    p.kill()
        merged: dict[str, dict[int, float]] = {"gloo_p2p": {}, **{kind: {} for kind in PS_WIRES}}
        for rank in (0, 1):
            data = json.loads(Path(tmp, f"rank{rank}.json").read_text())
            for kind in merged:
                merged[kind].update({int(k): v for k, v in data[kind].items()})
    return merged


def run(quick: bool = False) -> dict[str, Any]:
    """Quick: 2 epochs on the training set repeated twice (a smoke run, not a measurement)."""
    epochs, repeat = (2, 2) if quick else (4, 16)
    timeout = 600.0 if quick else 1800.0
    configs = [(s, k) for k in (1.0, SLOWDOWN) for s in STRATEGIES] + [(s, 1.0) for s in OVERLAPPED]
    rounds: dict[tuple[str, float], list[dict[str, Any]]] = {c: [] for c in configs}
    for _ in range(1 if quick else ROUNDS):  # interleaved: slow drifts of foreign load hit every strategy alike
        for s, k in configs:
            rounds[(s, k)].append(_run_job(s, k, epochs, repeat, timeout))
    runs = [_pool(rounds[c]) for c in configs]
    by = {(r["strategy"], r["slowdown"]): r for r in runs}
    ddp_fast, ddp_slow = by[("ddp", 1.0)], by[("ddp", SLOWDOWN)]
    summary = {
        "throughput_vs_ddp": {
            s: by[(s, 1.0)]["samples_per_s"] / ddp_fast["samples_per_s"]
            for s in ("ivy_ps_sync", "ivy_ps", *OVERLAPPED)
            if (s, 1.0) in by
        },
        # CPU seconds both workers spend per epoch, relative to DDP's: the load-robust view of the overhead
        "cpu_vs_ddp": {s: by[(s, 1.0)]["epoch_cpu"] / ddp_fast["epoch_cpu"] for s in ("ivy_ps_sync", "ivy_ps")},
        "slow_epoch_ratio_vs_ddp": {
            s: by[(s, SLOWDOWN)]["epoch_time"] / ddp_slow["epoch_time"] for s in ("ivy_ps_sync", "ivy_ps")
        },
        "slow_acc_points_vs_ddp": {
            s: 100 * (by[(s, SLOWDOWN)]["val_acc"] - ddp_slow["val_acc"]) for s in ("ivy_ps_sync", "ivy_ps")
        },
    }
    bandwidth = measure_bandwidth(reps=2 if quick else 15)
    return {
        "quick": quick,
        "rounds": 1 if quick else ROUNDS,
        "epochs": epochs,
        "repeat": repeat,
        "slowdown": SLOWDOWN,
        "targets": {
            "throughput_vs_ddp": TARGET_THROUGHPUT,
            "async_slow_epoch_ratio_vs_ddp": TARGET_SLOW_RATIO,
            "acc_points": TARGET_ACC_POINTS,
        },
        "runs": runs,
        "summary": summary,
        "bandwidth_gb_s": bandwidth,
        "cpu_count": os.cpu_count(),
        "loadavg_end": os.getloadavg(),
    }


def format_table(results: dict[str, Any]) -> str:
    quick = ", QUICK: not a measurement" if results["quick"] else ""
    lines = [
        f"ivyplug bench ps (2 workers, epochs={results['epochs']}, data x{results['repeat']}, slow worker "
        f"{results['slowdown']:g}x, {results.get('rounds', 1)} interleaved round(s){quick})",
        f"{'strategy':<22} {'slow':>5} {'epoch s':>8} {'CPU s':>6} {'samples/s':>10} {'val acc':>8} {'MB/epoch':>9} "
        f"{'pushes r0/r1':>13} {'load':>10}",
    ]
    for r in results["runs"]:
        pushes = r.get("ps_pushes") or {}
        push_text = "/".join(f"{pushes[k]:.0f}" for k in sorted(pushes)) if pushes else "-"
        mb = f"{r['bytes_sent_per_epoch'] / 1e6:.0f}" + ("" if r["bytes_measured"] else "*")
        load = f"{r['loadavg_before'][0]:.1f}-{r['loadavg_after'][0]:.1f}"
        lines.append(
            f"{r['strategy']:<22} {r['slowdown']:>4g}x {r['epoch_time']:>8.2f} {r['epoch_cpu']:>6.2f} "
            f"{r['samples_per_s']:>10.0f} "
            f"{r['val_acc']:>8.4f} {mb:>9} {push_text:>13} {load:>10}"
        )
    s = results["summary"]
    t = results["targets"]
    lines.append("(* DDP bytes: analytic, one gradient sent per rank per step; PS bytes: measured)")
    lines.append("(CPU s: CPU seconds of both worker processes per train epoch, every thread; load-robust)")
    for name in ("ivy_ps_sync", "ivy_ps"):
        lines.append(
            f"{name}: throughput {s['throughput_vs_ddp'][name]:.2f}x DDP (target >= {t['throughput_vs_ddp'][name]}), "
            f"CPU per epoch {s['cpu_vs_ddp'][name]:.2f}x DDP's, "
            f"slow-worker epoch {s['slow_epoch_ratio_vs_ddp'][name]:.2f}x DDP's"
            + (f" (target <= {t['async_slow_epoch_ratio_vs_ddp']})" if name == "ivy_ps" else "")
            + f", val acc {s['slow_acc_points_vs_ddp'][name]:+.2f} points vs DDP (target within {t['acc_points']})"
        )
    for name in OVERLAPPED:
        if name in s["throughput_vs_ddp"]:
            lines.append(f"{name} (pushes from backward's hooks): throughput {s['throughput_vs_ddp'][name]:.2f}x DDP")
    bw = results["bandwidth_gb_s"]
    for mb in sorted(bw["gloo_p2p"]):
        raw = bw["gloo_p2p"][mb]
        texts = []
        for kind, label in (("ps_push_pull", "PS push+pull"), ("ps_push_pull_gloo", "over gloo alone")):
            ps = bw.get(kind, {}).get(mb)
            texts.append(f"{label} {ps:.2f} GB/s ({ps / raw:.2f}x gloo)" if ps is not None else f"{label} -")
        lines.append(f"{mb:>3} MB shard: gloo p2p {raw:.2f} GB/s, " + ", ".join(texts))
    lines.append(f"load average at the end: {results['loadavg_end'][0]:.2f} on {results['cpu_count']} CPUs")
    return "\n".join(lines)
