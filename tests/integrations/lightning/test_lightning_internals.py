"""What reaches past Lightning's public API lives in two modules, and a Lightning not checked is named."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest
from ivyplug.integrations.lightning import lightning_internals

PACKAGE = Path(lightning_internals.__file__).parent
#: private attributes a DDPStrategy (or a launcher) subclass inherits from Lightning, read or written on ``self``
INHERITED_PRIVATE = {
    "_get_process_group_backend",
    "_launcher",
    "_process_group_backend",
    "_start_method",
    "_strategy",
    "_timeout",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _reaches_private_lightning(path: Path) -> list[str]:
    """Private names of Lightning imported, and private attributes read or written on anything but ``self`` (the
    module's own state), by attribute or by ``getattr``/``hasattr`` with a literal name, or inherited from
    Lightning (:data:`INHERITED_PRIVATE`) on ``self``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("lightning", "pytorch_lightning"):
            found += [f"imports {a.name}" for a in node.names if _private(a.name)]
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            on_self = isinstance(node.value, ast.Name) and node.value.id == "self"
            if not on_self or node.attr in INHERITED_PRIVATE:
                found.append(f"uses {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
            name = node.args[1] if len(node.args) > 1 else None
            if isinstance(name, ast.Constant) and isinstance(name.value, str) and _private(name.value):
                found.append(f"{node.func.id}(..., {name.value!r})")
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
