"""``ivyplug devices``: one snapshot through the real command line, JSON output, value formatting."""

from __future__ import annotations

import json
import subprocess
import sys

from ivyplug.commands.devices import format_value


def _cli(*args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "ivyplug", "devices", *args], capture_output=True, text=True, timeout=120, check=True
    )
    return out.stdout


def test_once_prints_a_table_of_every_probe() -> None:
    text = _cli("--once")
    assert "ivyplug devices" in text
    for needle in ("psutil", "cpu_util", "mem_total", "GiB", "nvml", "torch_allocator"):
        assert needle in text
    assert "scripted" not in text


def test_json_snapshot_and_probe_selection() -> None:
    data = json.loads(_cli("--json", "--probe", "psutil", "--probe", "nvml"))
    assert set(data) == {"psutil", "nvml"}
    assert data["psutil"]["available"] is True
    assert 0.0 <= data["psutil"]["readings"]["cpu_util"] <= 100.0
    assert not any(k.startswith("cpu0") for k in data["psutil"]["readings"])
    if not data["nvml"]["available"]:
        assert data["nvml"]["reason"] and data["nvml"]["readings"] == {}


def test_value_formatting() -> None:
    assert format_value("gpu0_mem_used", 3 * 2**30) == "3.00 GiB"
    assert format_value("cpu_util", 12.345) == "12.3 %"
    assert format_value("gpu1_power", 61.25) == "61.2 W"
    assert format_value("gpu0_temp", 70.0) == "70 °C"
    assert format_value("oom_count", 2.0) == "2"


def test_plain_text_without_rich(monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    from ivyplug.cli import main
    from ivyplug.commands import devices

    monkeypatch.setattr(devices, "_has_rich", lambda: False)
    assert main(["devices", "--count", "2", "--interval", "0.05", "--probe", "psutil"]) == 0
    text = capsys.readouterr().out
    assert text.count("ivyplug devices") == 2
    assert "cpu_util" in text and "%" in text


def test_an_unknown_probe_is_a_usage_error_naming_the_known_ones(capsys) -> None:  # type: ignore[no-untyped-def]
    from ivyplug.cli import main

    assert main(["devices", "--once", "--probe", "psutill"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ivyplug devices: --probe: unknown probe 'psutill'") and "psutil" in err, err


def test_bad_interval_or_count_is_a_usage_error(capsys) -> None:  # type: ignore[no-untyped-def]
    """Exit code 2 and a line naming the option, as argparse's own refusals and --probe's (it exited 1)."""
    from ivyplug.cli import main

    for argv, message in (
        (["--interval", "0"], "--interval must be a finite number of seconds > 0, got 0.0"),
        (["--interval", "nan"], "--interval must be a finite number of seconds > 0, got nan"),
        (["--count", "0"], "--count must be >= 1, got 0"),
    ):
        assert main(["devices", *argv]) == 2
        assert capsys.readouterr().err.strip() == f"ivyplug devices: {message}"
