"""examples/third_party_plugin installs as a real distribution and its probe shows up in ``ivyplug list``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "third_party_plugin"


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("site")
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--quiet"]
    cmd += ["--target", str(target), str(EXAMPLE)]
    subprocess.run(cmd, check=True, timeout=240, capture_output=True)
    return target


def _ivyplug(target: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {**os.environ, "PYTHONPATH": str(target), **env}
    environ.pop("IVYPLUG_DISABLE_PLUGIN_AUTOLOAD", None)
    environ.update(env)
    return subprocess.run(
        [sys.executable, "-m", "ivyplug", *args], capture_output=True, text=True, timeout=120, env=environ, check=True
    )


def test_installed_plugin_is_listed_with_its_provider(installed: Path) -> None:
    data = json.loads(_ivyplug(installed, "list", "--kind", "probe", "--json").stdout)
    rows = {c["name"]: c for c in data["components"]}
    assert rows["loadavg"]["provider"] == "ivyplug-loadavg-probe"
    assert rows["loadavg"]["available"] is True
    assert data["errors"] == []


def test_installed_plugin_probe_reads(installed: Path) -> None:
    code = (
        "import json, ivyplug; cls = ivyplug.get_registry().get('probe', 'loadavg'); p = cls();"
        "print(json.dumps([p.available(), p.read()]))"
    )
    env = {**os.environ, "PYTHONPATH": str(installed)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env, check=True)
    available, reading = json.loads(out.stdout)
    assert available is True
    assert reading["cpu_load"] >= 0.0


def test_autoload_off_hides_it(installed: Path) -> None:
    data = json.loads(
        _ivyplug(installed, "list", "--kind", "probe", "--json", IVYPLUG_DISABLE_PLUGIN_AUTOLOAD="1").stdout
    )
    assert "loadavg" not in {c["name"] for c in data["components"]}


def test_installed_plugin_probe_is_a_probe_that_devices_shows_and_closes(installed: Path) -> None:
    """The example's probe implements the whole protocol (it had no ``close``: ``ivyplug devices`` ended in an
    AttributeError after its table, and a balancer refused the probe object)."""
    assert json.loads(_ivyplug(installed, "devices", "--once", "--probe", "loadavg", "--json").stdout)["loadavg"][
        "available"
    ]
    assert "cpu_load" in _ivyplug(installed, "devices", "--once", "--probe", "loadavg").stdout  # the table, then close
    code = (
        "from ivyplug.load import Probe; from ivyplug_loadavg_probe.probe import LoadAverageProbe;"
        "from ivyplug.load.probes import make_probe; p = LoadAverageProbe(); assert isinstance(p, Probe);"
        "assert make_probe(p) is p; p.close(); print('ok')"
    )
    env = {**os.environ, "PYTHONPATH": str(installed)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
