"""The ``ivyplug`` command line.

Each subcommand lives in its own module under :mod:`ivyplug.commands` exposing
``NAME``, ``HELP``, ``configure(parser)`` and ``run(args) -> int``; command modules
must import cheaply (frameworks only inside ``run``).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from ivyplug._version import __version__

#: Subcommand modules, in the order ``--help`` lists them.
COMMANDS: tuple[str, ...] = (
    "ivyplug.commands.listing",
    "ivyplug.commands.bench",
    "ivyplug.commands.devices",
    "ivyplug.commands.demo",
    "ivyplug.commands.env",
    "ivyplug.commands.serve",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ivyplug",
        description="Parameter-server training, LAMB and load-aware devices for Lightning and Keras.",
    )
    parser.add_argument("--version", action="version", version=f"ivyplug {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in COMMANDS:
        module = importlib.import_module(module_name)
        cmd = sub.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        module.configure(cmd)
        cmd.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:  # Ctrl-C before a command installs its own handling (a serve still starting)
        print(f"ivyplug {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
