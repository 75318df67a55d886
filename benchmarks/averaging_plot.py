"""Plots of ``ivyplug bench averaging`` JSON: validation accuracy against wall time and against bytes moved.

``python -m ivyplug.benchmarks.averaging_plot results.json [more.json ...] --out docs/averaging``
writes ``<out>-<setting>-<slowdown>x.png`` per (setting, slowdown): two panels, accuracy after each epoch
against the wall time since the fit started, and against the bytes the workers had moved by then (sent +
received; the run records the fit's total, spread over its epochs in proportion: each epoch moves the same).
Averaging lines take a colour per outer optimizer, a line style per H and a marker per wire dtype.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

#: averaging lines: a colour per outer optimizer, a line style per H, a marker per wire dtype
_COLOURS = {"average": "tab:blue", "nesterov": "tab:orange", "lamb": "tab:green"}
_LINES = {4: ":", 16: "-", 64: "--"}
_MARKERS = {"float32": "o", "bfloat16": "^"}
#: the lowest accuracy shown: a collapsed run would squeeze every other line into the top of the chart
FLOOR = 0.9


def _style(run: dict[str, Any]) -> dict[str, Any]:
    if run["kind"] == "ddp":
        return {"color": "black", "linestyle": "-", "marker": "o", "linewidth": 2.5}
    if run["kind"] == "ivy_ps":
        return {"color": "tab:gray", "linestyle": "-", "marker": "s", "linewidth": 2}
    outer = str(run["outer"]).split("@")[0]
    return {
        "color": _COLOURS.get(outer, "tab:red"),
        "linestyle": _LINES.get(run["sync_every"], "-."),
        "marker": _MARKERS.get(run["wire"], "x"),
        "linewidth": 1.2,
    }


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
            kw = _style(r)
            by_time.plot(times, accs, label=r["config"], markersize=4, **kw)
            by_bytes.plot(moved, accs, label=r["config"], markersize=4, **kw)
        by_time.set_xlabel("wall time since the fit started (s)")
        by_bytes.set_xlabel("MB moved by both workers (sent + received)")
        by_bytes.set_xscale("log")
        lowest = min((a for r in group for _, a in r["accuracy_points"]), default=FLOOR)
        for ax in (by_time, by_bytes):
            ax.set_ylabel("validation accuracy" + (f" (below {FLOOR:g} off the chart)" if lowest < FLOOR else ""))
            ax.set_ylim(bottom=max(FLOOR, lowest - 0.005))
            ax.grid(alpha=0.3)
        by_bytes.legend(fontsize=6, loc="lower right", ncol=2)
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
