"""One figure per benchmark, drawn from the JSON that ``ivyplug bench NAME --json PATH`` writes.

``ivyplug bench NAME --plot PNG`` draws it right after the run; ``python -m ivyplug.benchmarks.plots NAME
results.json --out PNG`` draws it again from a saved run. Figures show what the benchmark's table says, so a
reader can see the ratios at a glance: ``ps`` epoch time and throughput per strategy with and without the slow
worker, and the transport against gloo; ``balance`` epoch time with and without the balancer; ``scale`` push
latency against the number of workers and step cost against model size; ``lamb`` each optimizer's step time
relative to fused AdamW's, per allocator setting; ``hosts`` and ``averaging_hosts`` accuracy against wall time and
against the bytes over the link, per link speed. ``averaging`` has its own plots, :mod:`.averaging_plot`.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, out: Path) -> Path:
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _bars(ax: Any, groups: list[str], series: dict[str, list[float]], ylabel: str) -> None:
    width = 0.8 / max(1, len(series))
    for i, (label, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, values, width, label=label)
        for x, v in zip(xs, values, strict=True):
            ax.annotate(f"{v:.2f}", (x, v), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)


def ps(results: dict[str, Any], out: Path) -> Path:
    """Epoch time per strategy (1× and slow worker), and PS push+pull bandwidth next to gloo's."""
    plt = _pyplot()
    runs = results["runs"]
    strategies = list(dict.fromkeys(r["strategy"] for r in runs))
    slowdowns = sorted({r["slowdown"] for r in runs})
    by = {(r["strategy"], r["slowdown"]): r for r in runs}
    fig, (epochs, wire) = plt.subplots(1, 2, figsize=(12, 4.2))
    _bars(
        epochs,
        [f"{k:g}× slow worker" for k in slowdowns],
        {s: [by[(s, k)]["epoch_time"] if (s, k) in by else math.nan for k in slowdowns] for s in strategies},
        "epoch time (s, median)",
    )
    epochs.set_title("digits MLP, 2 workers: epoch time per strategy")
    bandwidth = results.get("bandwidth_gb_s") or {}
    gloo, pushpull = bandwidth.get("gloo_p2p", {}), bandwidth.get("ps_push_pull", {})
    over_gloo = bandwidth.get("ps_push_pull_gloo", {})
    sizes = sorted(gloo, key=int)
    if sizes:
        _bars(
            wire,
            [f"{mb} MB" for mb in sizes],
            {
                "gloo send/recv": [gloo[mb] for mb in sizes],
                "PS push+pull (shared memory)": [pushpull.get(mb, 0.0) for mb in sizes],
                "PS push+pull (gloo alone)": [over_gloo.get(mb, 0.0) for mb in sizes],
            },
            "GB/s (round trip)",
        )
    wire.set_title("transport on loopback, same run")
    load = results.get("loadavg_end")
    fig.suptitle(f"ivyplug bench ps ({results.get('cpu_count')} CPUs, load at the end {load[0]:.1f})" if load else "")
    return _save(plt, fig, out)


def balance(results: dict[str, Any], out: Path) -> Path:
    """Epoch time with and without IvyLoadBalancer, per strategy and slow-worker factor."""
    plt = _pyplot()
    runs = results["runs"]
    groups = list(dict.fromkeys(f"{r['strategy']}, {r['slowdown']:g}× slow" for r in runs))
    series: dict[str, list[float]] = {"without": [], "with IvyLoadBalancer": []}
    for g in groups:
        for on, label in ((False, "without"), (True, "with IvyLoadBalancer")):
            match = [r for r in runs if f"{r['strategy']}, {r['slowdown']:g}× slow" == g and r["balancer"] is on]
            series[label].append(match[0]["epoch_time"] if match else 0.0)
    fig, ax = plt.subplots(figsize=(9, 4.2))
    _bars(ax, groups, series, "epoch time (s, median of epochs 2-4)")
    ax.set_title("ivyplug bench balance: digits MLP, 2 workers")
    return _save(plt, fig, out)


def scale(results: dict[str, Any], out: Path) -> Path:
    """p50/p99 push+pull latency and pushes/s against the worker count; step cost against model size."""
    plt = _pyplot()
    fig, (latency, cost) = plt.subplots(1, 2, figsize=(12, 4.2))
    rows = results["workers"]
    if rows:
        n = [r["workers"] for r in rows]
        latency.plot(n, [r["p50_ms"] for r in rows], "-o", label="p50 push+pull")
        latency.plot(n, [r["p99_ms"] for r in rows], "-s", label="p99 push+pull")
        latency.set_xscale("log", base=2)
        latency.set_yscale("log")
        latency.set_xlabel("worker processes on one server")
        latency.set_ylabel("ms")
        rate = latency.twinx()
        rate.plot(n, [r["pushes_per_s"] for r in rows], "k--^", label="pushes/s (all)")
        rate.set_ylabel("pushes/s")
        latency.legend(loc="upper left", fontsize=8)
        rate.legend(loc="lower right", fontsize=8)
    steps = results["step_cost"]
    if steps:
        m = [c["params_m"] for c in steps]
        cost.plot(m, [c["step_ms"] for c in steps], "-o", label="measured")
        ideal = steps[0]["step_ms"] / steps[0]["params_m"]
        cost.plot(m, [ideal * x for x in m], ":", label="linear from the smallest")
        cost.set_xscale("log", base=2)
        cost.set_yscale("log")
        cost.set_xlabel("model parameters (millions)")
        cost.set_ylabel("push+pull per step (ms)")
        cost.legend(fontsize=8)
    fig.suptitle("ivyplug bench scale: one ivyplug serve process")
    return _save(plt, fig, out)


def lamb(results: dict[str, Any], out: Path) -> Path:
    """Step time ÷ fused AdamW's for every optimizer at the largest size, one panel per allocator setting."""
    plt = _pyplot()
    settings = results["settings"]
    fig, axes = plt.subplots(1, len(settings), figsize=(6.5 * len(settings), 4.8), squeeze=False)
    for ax, (name, setting) in zip(axes[0], settings.items(), strict=True):
        size = setting["sizes"][-1]
        rows = [r for r in size["rows"] if r.get("status") == "ok" and r.get("ratio_vs_fused_adamw") is not None]
        ax.barh([r["name"] for r in rows], [r["ratio_vs_fused_adamw"] for r in rows])
        for i, r in enumerate(rows):
            ax.annotate(f"{r['ratio_vs_fused_adamw']:.2f}×", (r["ratio_vs_fused_adamw"], i), va="center", fontsize=7)
        ax.axvline(1.0, color="k", linewidth=0.8)
        ax.invert_yaxis()
        ax.set_xlabel("step time ÷ AdamW(fused=True)'s (median)")
        malloc = "raised glibc thresholds" if name == "glibc_raised" else f"glibc {name}s"
        ax.set_title(f"{size['label']} parameters in {size['tensors']} tensors, {malloc}", fontsize=9)
        ax.tick_params(axis="y", labelsize=7)
    load = results.get("loadavg_before")
    at_load = f", load {load[0]:.1f} at the start" if load else ""
    fig.suptitle(f"ivyplug bench lamb ({results.get('threads', '?')} threads{at_load})")
    return _save(plt, fig, out)


def hosts(results: dict[str, Any], out: Path) -> Path:
    """``hosts`` and ``averaging_hosts``: per link speed (a row each, the slow-worker job last), validation
    accuracy against wall time since the fit started and against the bytes over host 0's link (each epoch moves
    the same share of the fit's bytes), round 0's runs (seed 0)."""
    plt = _pyplot()
    runs = [r for r in results["runs"] if r.get("round", 0) == 0]
    jobs = list(dict.fromkeys((r["rate"], r["slowdown"]) for r in runs))
    fig, axes = plt.subplots(len(jobs), 2, figsize=(12, 3.6 * len(jobs)), squeeze=False)
    for (rate, slowdown), (by_time, by_bytes) in zip(jobs, axes, strict=True):
        for r in (r for r in runs if (r["rate"], r["slowdown"]) == (rate, slowdown)):
            points = r["accuracy_points"]
            style = {"color": "black", "linewidth": 2.5} if r["kind"] == "ddp" else {"linewidth": 1.5}
            mb = [r["link_bytes"] / 1e6 * (i + 1) / len(points) for i in range(len(points))]
            by_time.plot([t for t, _ in points], [a for _, a in points], marker="o", label=r["config"], **style)
            by_bytes.plot(mb, [a for _, a in points], marker="o", label=r["config"], **style)
        title = f"{rate} link" + (f", host 1 {slowdown:g}x slower" if slowdown != 1 else "")
        by_time.set(title=title, xlabel="wall time since the fit started (s)", ylabel="validation accuracy")
        by_bytes.set(title=title, xlabel="MB over host 0's link (log)", ylabel="validation accuracy", xscale="log")
        by_time.legend(fontsize=7)
    load = results.get("loadavg_end")
    fig.suptitle(f"2 emulated hosts, one worker each (seed 0; load {load[0]:.1f} at the end)" if load else "")
    return _save(plt, fig, out)


#: benchmark name -> its figure
PLOTS: dict[str, Callable[[dict[str, Any], Path], Path]] = {
    "ps": ps,
    "balance": balance,
    "scale": scale,
    "lamb": lamb,
    "hosts": hosts,
    "averaging_hosts": hosts,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ivyplug.benchmarks.plots", description=__doc__)
    parser.add_argument("name", choices=sorted(PLOTS))
    parser.add_argument("results", type=Path, help="the JSON of `ivyplug bench NAME --json`")
    parser.add_argument("--out", type=Path, required=True, help="the PNG to write")
    args = parser.parse_args(argv)
    print(PLOTS[args.name](json.loads(args.results.read_text()), args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
