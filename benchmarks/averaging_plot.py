"""Plots of ``ivyplug bench averaging`` JSON: validation accuracy against wall time and against bytes moved.

``python -m ivyplug.benchmarks.averaging_plot results.json [more.json ...] --out docs/averaging``
writes ``<out>-<setting>-<slowdown>x.png`` per (setting, slowdown): two panels, accuracy after each epoch
against the wall time since the fit started, and against the bytes the workers had moved by then (sent +
received; the run records the fit's total, spread over its epochs in proportion: each epoch moves the same).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def plot(runs: list[dict[str, Any]], out: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    groups: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["setting"], r["slowdown"]), []).append(r)
    for (setting, slowdown), group in sorted(groups.items()):
        fig, (by_time, by_bytes) = plt.subplots(1, 2, figsize=(12, 4.5))
        for r in group:
            points = r["accuracy_points"]
            times = [t for t, _ in points]
            accs = [a for _, a in points]
            total = r["bytes_per_sample"] * r["epochs"] * r["train_samples"]
            moved = [total * (i + 1) / len(points) / 1e6 for i in range(len(points))]
            style = "k-o" if r["kind"] == "ddp" else ("-s" if r["kind"] == "ivy_ps" else "-.")
            by_time.plot(times, accs, style, label=r["config"], markersize=4)
            by_bytes.plot(moved, accs, style, label=r["config"], markersize=4)
        by_time.set_xlabel("wall time since the fit started (s)")
        by_bytes.set_xlabel("MB moved by both workers (sent + received)")
        by_bytes.set_xscale("log")
        for ax in (by_time, by_bytes):
            ax.set_ylabel("validation accuracy")
            ax.grid(alpha=0.3)
        by_bytes.legend(fontsize=7, loc="lower right")
        fig.suptitle(f"bench averaging: {setting}, slow worker {slowdown:g}x")
        fig.tight_layout()
        path = Path(f"{out}-{setting}-{slowdown:g}x.png")
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    runs = [r for p in args.results for r in json.loads(p.read_text())["runs"]]
    for path in plot(runs, args.out):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
