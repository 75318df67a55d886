"""``import ivyplug`` stays framework-free and cheap."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch", "lightning", "pytorch_lightning", "keras", "tensorflow", "pluggy", "numpy")


def _fresh(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return out.stdout


def test_import_does_not_load_frameworks() -> None:
    code = f"import sys, json, ivyplug; print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    assert json.loads(_fresh(code)) == []


def test_version_and_lazy_attributes() -> None:
    import ivyplug

    assert isinstance(ivyplug.__version__, str) and ivyplug.__version__.count(".") >= 2
    assert callable(ivyplug.hookimpl)
    try:
        ivyplug.no_such_thing  # noqa: B018
    except AttributeError as exc:
        assert "no_such_thing" in str(exc)
    else:
        raise AssertionError("missing attribute did not raise")


def test_listing_components_imports_no_framework() -> None:
    code = (
        "import sys, json, ivyplug\n"
        "r = ivyplug.get_registry()\n"
        "[r.names(k) for k in ('strategy','optimizer','callback','probe')]\n"
        "[e.available for e in r.entries()]\n"
        "print(json.dumps([m for m in ('torch','lightning','keras','tensorflow') if m in sys.modules]))"
    )
    assert json.loads(_fresh(code)) == []
