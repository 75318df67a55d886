"""What reaches past Lightning's public API lives in two modules, and a Lightning not checked is named."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest
from ivyplug.integrations.lightning import lightning_internals

PACKAGE = Path(lightning_internals.__file__).parent
#: Lightning's private attributes the integration uses (on its strategies, loops and launchers)
PRIVATE_ATTRIBUTES = {
    "_broadcast_sigterm_tensor",
    "_ddp_comm_hook",
    "_ddp_comm_state",
    "_ddp_comm_wrapper",
    "_opt_called",
    "_wrap_closure",
}


def _reaches_private_lightning(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("lightning", "pytorch_lightning"):
            found += [f"imports {a.name}" for a in node.names if a.name.startswith("_")]
        elif isinstance(node, ast.Attribute) and node.attr in PRIVATE_ATTRIBUTES:
            found.append(f"uses .{node.attr}")
    return found


def test_at_most_two_modules_reach_lightnings_private_api() -> None:
    reaching = {p.name: r for p in sorted(PACKAGE.glob("*.py")) if (r := _reaches_private_lightning(p))}
    assert set(reaching) <= {"lightning_internals.py", "launchers.py"}, reaching
    assert "lightning_internals.py" in reaching  # control: the scan sees what it looks for


@pytest.mark.parametrize(("version", "warnings"), [("9.0.0", 1), ("2.6.1", 0)])
def test_a_lightning_version_not_checked_is_warned_about_once(
    version: str, warnings: int, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(lightning_internals, "_warned", False)
    monkeypatch.setattr(lightning_internals.lightning, "__version__", version)
    with caplog.at_level(logging.WARNING, logger=lightning_internals.__name__):
        lightning_internals.warn_if_unchecked()
        lightning_internals.warn_if_unchecked()
    warned = [r.getMessage() for r in caplog.records if "was not checked" in r.getMessage()]
    assert len(warned) == warnings, warned
    assert all(version in w and "2.6.x" in w for w in warned)
