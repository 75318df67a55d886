"""``ivyplug bench gloo_pairs``: does one gloo pair carry a link's two directions at once?

Two emulated hosts (:mod:`ivyplug.benchmarks.emulated_hosts`), one rank each, at 100 Mbit/s and 1 Gbit/s: a
2.25 MB message one way, twice that one way, 2.25 MB each way at once on one pair (one process group), the same
on two pairs (each direction on a group of its own, as the PS's co-located ranks send), and an all-reduce of
4.5 MB. Medians of 9 repeats per case, each between barriers; the ratios are to the one-way time, measured in the
same run. It skips, saying why, where emulated hosts cannot be made.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from ivyplug.benchmarks.emulated_hosts import DEVICE, Hosts, unavailable

DESCRIPTION = "2 emulated hosts: one gloo pair against two for a send and a receive at once (100 Mbit/s, 1 Gbit/s)"
RATES = ("100mbit", "1gbit")
PORT = 29790
CASES = ("one_way", "one_way_double", "both_ways_one_pair", "both_ways_two_pairs", "all_reduce_double")


def _measure(hosts: Hosts, repeats: int) -> dict[str, float]:
    procs = []
    for i in range(2):
        env = {"MASTER_ADDR": hosts[0].address, "MASTER_PORT": str(PORT), "RANK": str(i), "WORLD_SIZE": "2",
               "GLOO_SOCKET_IFNAME": DEVICE, "PYTHONWARNINGS": "ignore"}  # fmt: skip
        cmd = [sys.executable, "-m", "ivyplug.benchmarks.gloo_pairs_job", str(repeats)]
        procs.append(hosts.run(i, cmd, env=env, stderr=subprocess.DEVNULL))
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=300)
        if p.returncode != 0:
            raise RuntimeError(f"a rank of gloo_pairs_job failed ({p.returncode}): {out[-2000:]}")
        outs.append(out)
    line = [x for x in outs[0].splitlines() if x.startswith("{")][-1]
    medians: dict[str, float] = json.loads(line)
    return medians


def run(quick: bool = False) -> dict[str, Any]:
    why = unavailable()
    if why is not None:
        return {"skipped": why, "quick": quick}
    rows = []
    with Hosts(2) as hosts:
        for rate in RATES[:1] if quick else RATES:
            hosts.limit(rate)
            load = os.getloadavg()[0]
            medians = _measure(hosts, 3 if quick else 9)
            rows.append({"rate": rate, "load": load, **medians})
    return {"quick": quick, "rows": rows, "loadavg_end": os.getloadavg(), "cpu_count": os.cpu_count()}


def format_table(results: dict[str, Any]) -> str:
    if "skipped" in results:
        return f"ivyplug bench gloo_pairs: skipped: {results['skipped']}"
    quick = " (QUICK: not a measurement)" if results["quick"] else ""
    lines = [f"ivyplug bench gloo_pairs: 2.25 MB messages between 2 emulated hosts, median ms{quick}"]
    lines.append(f"{'link':<8} " + " ".join(f"{c:>20}" for c in CASES) + f" {'load':>5}")
    for row in results["rows"]:
        base = row["one_way"]
        cells = [f"{row[c] * 1000:8.0f} ({row[c] / base:4.2f}x)" for c in CASES]
        lines.append(f"{row['rate']:<8} " + " ".join(f"{c:>20}" for c in cells) + f" {row['load']:5.2f}")
    lines.append("(x: against one way's time in the same run; load: 1-min load average before each rate)")
    return "\n".join(lines)
