"""The dependency rule of pyproject.toml's [tool.importlinter] contracts holds (import-linter).

ivyplug ships ``integrations/`` and ``benchmarks/`` as ``ivyplug.integrations`` and ``ivyplug.benchmarks``
(setup.py), which an editable install maps from outside ``ivyplug/``; import-linter reads one directory per
package, so the check runs on a copy of the sources laid out as installed.
"""

from __future__ import annotations

import pkgutil
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAPPED = {"integrations": "integrations", "benchmarks": "benchmarks"}  # folder -> subpackage of ivyplug

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def _contracts() -> list[dict[str, object]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    return list(config["tool"]["importlinter"]["contracts"])


def _installed_layout(target: Path) -> Path:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "build")
    shutil.copytree(ROOT / "ivyplug", target / "ivyplug", ignore=ignore)
    for folder, sub in MAPPED.items():
        shutil.copytree(ROOT / folder, target / "ivyplug" / sub, ignore=ignore)
    return target


def test_import_contracts_hold(tmp_path: Path) -> None:
    pytest.importorskip("importlinter")
    layout = _installed_layout(tmp_path / "src")
    # the start-up hooks (.pth) may have imported the installed ivyplug already: forget it, read the copy
    code = (
        "import sys\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "for name in [m for m in sys.modules if m == 'ivyplug' or m.startswith('ivyplug.')]:\n"
        "    del sys.modules[name]\n"
        "from importlinter.cli import lint_imports\n"
        "sys.exit(lint_imports(config_filename=sys.argv[2], no_cache=True))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(layout), str(ROOT / "pyproject.toml")],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "broken" not in out.stdout.lower().replace("0 broken", ""), out.stdout


def test_core_contract_names_every_core_module() -> None:
    """A module added to ivyplug's top level is covered by "the core imports no framework" only if listed."""
    (core,) = [c for c in _contracts() if c["name"] == "the core imports no framework and no integration"]
    children = {f"ivyplug.{m.name}" for m in pkgutil.iter_modules([str(ROOT / "ivyplug")])}
    children |= {"ivyplug.__main__"}
    listed = set(core["source_modules"])  # type: ignore[call-overload]
    assert listed == children - {"ivyplug.integrations", "ivyplug.benchmarks"}
