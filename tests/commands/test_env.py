"""``ivyplug env``: in-process and through ``python -m ivyplug``, text and JSON, defaults with their sources."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ivyplug
from ivyplug.cli import main
from ivyplug.commands import env

KEYS = {"ivyplug", "python", "packages", "startup_hooks", "nvml", "settings"}


def _json(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, object]]:
    rc = main(["env", "--json", *args])
    return rc, json.loads(capsys.readouterr().out)


def test_json_in_process_names_every_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "pyproject.toml").write_text("[tool.ivyplug.ps]\nnum_servers = 2\ntimeout = 10.0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("IVYPLUG_PS_TIMEOUT", "300")
    rc, info = _json(capsys)
    assert rc == 0 and set(info) == KEYS
    assert info["ivyplug"]["version"] == ivyplug.__version__  # type: ignore[index]
    assert set(info["packages"]) == {"torch", "lightning", "keras", "tensorflow"}  # type: ignore[arg-type]
    settings = info["settings"]
    assert settings["pyproject"] == str(tmp_path / "pyproject.toml")  # type: ignore[index]
    keys = settings["sections"]["ps"]["keys"]  # type: ignore[index]
    assert keys["timeout"] == {"value": 300.0, "source": "environment variable IVYPLUG_PS_TIMEOUT"}
    assert keys["num_servers"] == {
        "value": 2,
        "source": f"{tmp_path / 'pyproject.toml'}: [tool.ivyplug.ps] num_servers",
    }
    assert keys["nonfinite"] == {"value": "skip", "source": "built-in default"}
    assert keys["servers"] == {"value": None, "source": "built-in default"}
    assert "error" not in settings["sections"]["ps"]  # type: ignore[index]
    nvml = info["nvml"]
    assert isinstance(nvml["available"], bool) and (nvml["available"] or nvml["reason"])  # type: ignore[index]


def test_a_broken_settings_table_is_reported_with_exit_status_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "pyproject.toml").write_text("[tool.ivyplug.ps]\nnum_server = 2\n")
    monkeypatch.chdir(tmp_path)
    assert main(["env"]) == 1
    out = capsys.readouterr().out
    assert "[ps] error:" in out and "num_server" in out


def test_a_value_the_strategy_would_refuse_is_reported_with_exit_status_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A value that parses but that no configuration takes (a negative timeout) is an error, as for a broken
    table, naming where it was set; the values in effect are still listed."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("IVYPLUG_PS_TIMEOUT", "-3")
    assert main(["env"]) == 1
    out = capsys.readouterr().out
    assert "[ps] error: PSConfig.timeout must be a finite number of seconds > 0, got -3.0" in out, out
    assert "(set by environment variable IVYPLUG_PS_TIMEOUT)" in out and "ps.timeout" in out, out


def test_start_up_hooks_active_installed_or_switched_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "ivyplug_keras_autoregister.pth").write_text("")
    (tmp_path / "ivyplug_lightning_autoregister.pth").write_text("")
    monkeypatch.setattr(env, "_site_dirs", lambda: [tmp_path])
    monkeypatch.setitem(sys.modules, "ivyplug.integrations.keras.autoregister", sys.modules[__name__])
    monkeypatch.delitem(sys.modules, "ivyplug.integrations.lightning.autoregister", raising=False)
    monkeypatch.setenv("IVYPLUG_DISABLE_LIGHTNING_AUTOREGISTER", "1")
    hooks = env.startup_hooks()
    assert hooks["keras"]["active"] is True and hooks["keras"]["pth"] == str(
        tmp_path / "ivyplug_keras_autoregister.pth"
    )
    assert hooks["lightning"]["active"] is False and hooks["lightning"]["disabled"] is True
    assert "IVYPLUG_DISABLE_LIGHTNING_AUTOREGISTER" in hooks["lightning"]["detail"]
    monkeypatch.setattr(env, "_site_dirs", lambda: [tmp_path / "elsewhere"])
    assert all(h["pth"] is None and not h["active"] for h in env.startup_hooks().values())


def test_missing_packages_read_not_installed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(env.PACKAGES, "tensorflow", ("no-such-distribution-ivyplug",))
    assert env.package_versions()["tensorflow"] is None
    assert main(["env"]) in (0, 1)
    assert "tensorflow   not installed" in capsys.readouterr().out


def test_python_m_ivyplug_env(tmp_path: Path) -> None:
    root = Path(ivyplug.__file__).parents[1]
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    environ.pop("IVYPLUG_PS_TIMEOUT", None)
    environ["IVYPLUG_PS_NONFINITE"] = "raise"

    def run(*args: str) -> str:
        command = [sys.executable, "-m", "ivyplug", "env", *args]
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=120, check=True, cwd=tmp_path, env=environ
        )
        return done.stdout

    info = json.loads(run("--json"))
    assert set(info) == KEYS and info["settings"]["pyproject"] is None
    assert info["settings"]["sections"]["ps"]["keys"]["nonfinite"]["value"] == "raise"
    text = run()
    assert text.startswith(f"ivyplug {ivyplug.__version__}") and "start-up hooks:" in text and "NVML:" in text
    assert "ps.nonfinite" in text and "environment variable IVYPLUG_PS_NONFINITE" in text


def test_the_module_imports_no_framework() -> None:
    code = (
        "import sys, ivyplug.commands.env as e; e.collect(); "
        "print(sorted(m for m in ('torch', 'lightning', 'keras', 'tensorflow') if m in sys.modules))"
    )
    environ = {**os.environ, "IVYPLUG_DISABLE_LIGHTNING_AUTOREGISTER": "1", "IVYPLUG_DISABLE_KERAS_AUTOREGISTER": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True, env=environ
    )
    assert out.stdout.strip() == "[]"
