"""The console script: --version, --help and ``list``."""

from __future__ import annotations

import json
import subprocess
import sys

import ivyplug
from ivyplug.cli import main


def test_version(capsys) -> None:  # type: ignore[no-untyped-def]
    try:
        main(["--version"])
    except SystemExit as exc:
        assert exc.code == 0
    assert capsys.readouterr().out.strip() == f"ivyplug {ivyplug.__version__}"


def test_list_json_matches_registry(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["list", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    names = sorted((c["kind"], c["name"]) for c in data["components"])
    registry = ivyplug.get_registry()
    expected = sorted((e.kind, e.name) for e in registry.entries())
    assert names == expected


def test_console_script_runs_as_module() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ivyplug", "--help"], capture_output=True, text=True, timeout=60, check=True
    )
    assert "list" in out.stdout


def test_no_command_prints_help_and_fails(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main([]) == 2
    assert "usage" in capsys.readouterr().out
