"""``ivyplug bench NAME``: run one benchmark and write machine-readable results.

Benchmarks live in ``benchmarks/`` (installed as ``ivyplug.benchmarks``); each module
exposes ``DESCRIPTION``, ``run(quick: bool) -> dict`` returning JSON-serialisable results
(medians, ratios measured side by side, the machine's foreign load) and ``format_table(results) -> str``
for the human-readable summary printed to stdout.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import sys
from pathlib import Path

from ivyplug.benchmarks import SelectionError

NAME = "bench"
HELP = "run a benchmark (medians and side-by-side ratios) and optionally write JSON results"

#: Benchmark name -> module. Add a line when a benchmark lands.
BENCHMARKS: dict[str, str] = {
    "lamb": "ivyplug.benchmarks.lamb",
    "balance": "ivyplug.benchmarks.balance",
    "ps": "ivyplug.benchmarks.ps",
    "keras_overhead": "ivyplug.benchmarks.keras_overhead",
    "scale": "ivyplug.benchmarks.scale",
    "averaging": "ivyplug.benchmarks.averaging",
    "averaging_hosts": "ivyplug.benchmarks.averaging_hosts",
    "hosts": "ivyplug.benchmarks.hosts",
    "gloo_pairs": "ivyplug.benchmarks.gloo_pairs",
}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=sorted(BENCHMARKS), help="which benchmark")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run, not a measurement)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the results here as JSON")
    parser.add_argument(
        "--plot",
        type=Path,
        metavar="PNG",
        help="ps, balance, scale, lamb, hosts, averaging_hosts: also draw the results' figure here (matplotlib)",
    )
    parser.add_argument(
        "--keras", action="store_true", help="lamb only: also compare the Keras LAMB with Keras's Lamb and AdamW"
    )
    parser.add_argument(
        "--select",
        action="append",
        metavar="KEY=V1,V2",
        help=(
            "averaging, averaging_hosts, hosts: run a subset of the grid (averaging: keys setting, slowdown, H, "
            "outer, wire; the hosts ones: rate, slowdown, config, rounds, first_round, setting, optimizer; repeatable)"
        ),
    )


def run(args: argparse.Namespace) -> int:
    from ivyplug.commands.output_paths import unwritable_file

    for option, path in (("--json", args.json), ("--plot", getattr(args, "plot", None))):
        why = unwritable_file(option, path) if path is not None else None
        if why is not None:  # before the run: its results would be lost at the end
            print(f"ivyplug bench {args.name}: {why}", file=sys.stderr)
            return 2
    module = importlib.import_module(BENCHMARKS[args.name])
    extra: dict[str, object] = {}
    draw = None
    if getattr(args, "plot", None):
        from ivyplug.benchmarks.plots import PLOTS

        if args.name not in PLOTS:
            print(
                f"ivyplug bench {args.name}: --plot draws {', '.join(sorted(PLOTS))} (averaging: "
                "python -m ivyplug.benchmarks.averaging_plot)",
                file=sys.stderr,
            )
            return 2
        draw = PLOTS[args.name]
    if getattr(args, "keras", False):
        if "keras" not in inspect.signature(module.run).parameters:
            print(f"ivyplug bench {args.name}: --keras applies to 'lamb' only", file=sys.stderr)
            return 2
        extra["keras"] = True
    if getattr(args, "select", None):
        if "select" not in inspect.signature(module.run).parameters:
            print(f"ivyplug bench {args.name}: --select applies to averaging and the hosts benchmarks", file=sys.stderr)
            return 2
        select: dict[str, list[str]] = {}
        for item in args.select:
            key, sep, values = item.partition("=")
            if not sep or not values:
                print(f"ivyplug bench {args.name}: --select takes KEY=V1,V2, got {item!r}", file=sys.stderr)
                return 2
            select.setdefault(key, []).extend(values.split(","))
        if args.quick:
            print(
                f"ivyplug bench {args.name}: --quick runs one fixed smoke job and --select chooses the jobs of a "
                "full run; pass one of them",
                file=sys.stderr,
            )
            return 2
        extra["select"] = select
    try:
        results = module.run(quick=args.quick, **extra)
    except SelectionError as exc:  # raised before any job starts: the message names the key and what is allowed
        print(f"ivyplug {exc}", file=sys.stderr)
        return 2
    print(module.format_table(results))
    text = json.dumps(results, indent=2, default=str)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    if draw is not None:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        print(f"wrote {draw(json.loads(text), args.plot)}", file=sys.stderr)
    return 0
