"""``ivyplug list``: registered components by kind, with provider and availability."""

from __future__ import annotations

import argparse
import json

NAME = "list"
HELP = "list registered components (strategies, optimizers, callbacks, probes) and who provides them"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kind", choices=("strategy", "optimizer", "callback", "probe"), help="only this kind")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    from ivyplug.registry import get_registry

    registry = get_registry()
    entries = registry.entries(args.kind)
    if args.json:
        rows = [
            {
                "kind": e.kind,
                "name": e.name,
                "provider": e.provider,
                "target": e.component.target,
                "available": e.available,
                "missing": e.missing,
                "description": e.component.description,
            }
            for e in entries
        ]
        errors = [{"plugin": x.plugin, "provider": x.provider, "error": repr(x.error)} for x in registry.errors]
        print(json.dumps({"components": rows, "errors": errors}, indent=2))
        return 0
    if not entries:
        print("no components registered")
    current = None
    for e in entries:
        if e.kind != current:
            current = e.kind
            print(f"{current}:")
        status = "available" if e.available else f"unavailable ({e.install_hint()})"
        desc = f"  {e.component.description}" if e.component.description else ""
        print(f"  {e.name:<28} {e.provider:<20} {status}{desc}")
    for err in registry.errors:
        print(f"error: {err}")
    return 0
