"""``ivyplug devices``: a live table (rich) of every registered probe's readings.

Probes are built from the registry (``nvml``, ``torch.torch_allocator``, ``psutil``; third-party probes
that need no arguments too). An unavailable probe is listed with the reason, so the table also
answers "why don't I see my GPU". ``--once`` prints one snapshot and exits.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any

NAME = "devices"
HELP = "show device load (GPU via NVML, torch allocator, CPU/memory via psutil) as a live table"

_BYTES_SUFFIXES = ("_mem_used", "_mem_free", "_mem_total", "_allocated", "_reserved", "_peak", "_total")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--once", action="store_true", help="print one snapshot and exit")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    parser.add_argument("--count", type=int, default=None, help="stop after this many refreshes")
    parser.add_argument("--probe", action="append", default=None, help="only these probes (repeatable)")
    parser.add_argument("--per-core", action="store_true", help="also show per-core CPU utilisation")
    parser.add_argument("--json", action="store_true", help="one machine-readable snapshot and exit")


def format_value(key: str, value: float) -> str:
    """Human units: bytes as GiB, percentages with %, watts, degrees."""
    if key in ("mem_used", "mem_available", "mem_total") or key.endswith(_BYTES_SUFFIXES):
        return f"{value / 2**30:.2f} GiB"
    if key.endswith(("_util", "_percent")):
        return f"{value:.1f} %"
    if key.endswith("_power"):
        return f"{value:.1f} W"
    if key.endswith("_temp"):
        return f"{value:.0f} °C"
    if float(value).is_integer():
        return f"{int(value)}"
    return f"{value:.3f}"


def _is_per_core(key: str) -> bool:
    return key.startswith("cpu") and key.endswith("_util") and key[3:-5].isdigit()


def _probes(names: list[str] | None) -> list[tuple[str, Any, str | None]]:
    """(name, probe or None, why unavailable) for every selected registered probe."""
    from ivyplug.load.probe import Probe
    from ivyplug.registry import get_registry

    registry = get_registry()
    rows: list[tuple[str, Any, str | None]] = []
    entries = registry.entries("probe")
    if names:
        entries = [registry.resolve("probe", n) for n in names]
    for entry in entries:
        if not entry.available:
            rows.append((entry.name, None, entry.install_hint()))
            continue
        try:
            probe = entry.component.load()()
        except Exception as exc:
            rows.append((entry.name, None, f"could not start: {exc!r}"))
            continue
        if not isinstance(probe, Probe):
            rows.append((entry.name, None, "does not implement ivyplug.load.Probe (name, available, read, close)"))
            continue
        if not probe.available():
            reason = getattr(probe, "unavailable_reason", None) or "not available on this machine"
            rows.append((entry.name, probe, reason))
        else:
            rows.append((entry.name, probe, None))
    return rows


def snapshot(probes: list[tuple[str, Any, str | None]], per_core: bool) -> dict[str, Any]:
    """{probe name: {"available": bool, "reason": str | None, "readings": {...}}}."""
    out: dict[str, Any] = {}
    for name, probe, reason in probes:
        readings: dict[str, float] = {}
        if reason is None and probe is not None:
            try:
                readings = {k: v for k, v in probe.read().items() if per_core or not _is_per_core(k)}
            except Exception as exc:
                reason = f"read failed: {exc!r}"
        out[name] = {"available": reason is None, "reason": reason, "readings": readings}
    return out


def render(snap: dict[str, Any]) -> Any:
    from rich.table import Table

    table = Table(title="ivyplug devices", caption=time.strftime("%H:%M:%S"))
    table.add_column("probe", style="bold")
    table.add_column("reading")
    table.add_column("value", justify="right")
    for name, info in snap.items():
        if not info["available"]:
            table.add_row(name, "[dim]unavailable[/dim]", f"[dim]{info['reason']}[/dim]")
            continue
        if not info["readings"]:
            table.add_row(name, "[dim](no readings)[/dim]", "")
        for i, (key, value) in enumerate(sorted(info["readings"].items())):
            table.add_row(name if i == 0 else "", key, format_value(key, value))
    return table


def render_plain(snap: dict[str, Any]) -> str:
    """The same table as :func:`render` in plain text, for installs without rich (it ships in ``[demo]``)."""
    lines = [f"ivyplug devices  {time.strftime('%H:%M:%S')}"]
    for name, info in snap.items():
        if not info["available"]:
            lines.append(f"{name:<18} unavailable: {info['reason']}")
            continue
        if not info["readings"]:
            lines.append(f"{name:<18} (no readings)")
        for i, (key, value) in enumerate(sorted(info["readings"].items())):
            lines.append(f"{name if i == 0 else '':<18} {key:<24} {format_value(key, value):>12}")
    return "\n".join(lines)


def _has_rich() -> bool:
    import importlib.util

    return importlib.util.find_spec("rich") is not None


def run(args: argparse.Namespace) -> int:
    from ivyplug.registry import AmbiguousComponentError, DuplicateComponentError, UnknownComponentError

    bad = None
    if not (args.interval > 0 and math.isfinite(args.interval)):
        bad = f"--interval must be a finite number of seconds > 0, got {args.interval!r}"
    elif args.count is not None and args.count < 1:
        bad = f"--count must be >= 1, got {args.count}"
    if bad is not None:  # exit code 2, as for argparse's own refusals and --probe's
        print(f"ivyplug devices: {bad}", file=sys.stderr)
        return 2
    try:
        probes = _probes(args.probe)
    except (UnknownComponentError, AmbiguousComponentError, DuplicateComponentError) as exc:
        print(f"ivyplug devices: --probe: {exc}", file=sys.stderr)
        return 2
    # psutil's CPU percentage is measured between two reads: wait a little before the first one
    time.sleep(min(args.interval, 0.2))
    if args.json:
        try:
            print(json.dumps(snapshot(probes, args.per_core), indent=2))
        finally:
            _close(probes)
        return 0
    if not _has_rich():
        try:
            shown = 0
            while True:
                print(render_plain(snapshot(probes, args.per_core)), flush=True)
                shown += 1
                if args.once or (args.count is not None and shown >= args.count):
                    return 0
                time.sleep(args.interval)
        except KeyboardInterrupt:
            return 0
        finally:
            _close(probes)
    from rich.console import Console

    console = Console()
    try:
        if args.once:
            console.print(render(snapshot(probes, args.per_core)))
            return 0
        from rich.live import Live

        shown = 0
        with Live(render(snapshot(probes, args.per_core)), console=console, auto_refresh=False) as live:
            shown = 1
            while args.count is None or shown < args.count:
                time.sleep(args.interval)
                live.update(render(snapshot(probes, args.per_core)), refresh=True)
                shown += 1
    except KeyboardInterrupt:
        pass
    finally:
        _close(probes)
    return 0


def _close(probes: list[tuple[str, Any, str | None]]) -> None:
    for _, probe, _ in probes:
        if probe is not None:
            probe.close()
