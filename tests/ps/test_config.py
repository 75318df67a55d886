from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ivyplug.ps import PSConfig


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"mode": "bsp"}, "PSConfig.mode"),
        ({"mode": "ssp"}, "PSConfig.staleness"),
        ({"mode": "ssp", "staleness": -1}, "PSConfig.staleness"),
        ({"mode": "ssp", "staleness": 1.5}, "PSConfig.staleness"),
        ({"mode": "async", "staleness": 2}, "PSConfig.staleness"),
        ({"staleness_scaling": "sqrt"}, "PSConfig.staleness_scaling"),
        ({"timeout": 0}, "PSConfig.timeout"),
        ({"timeout": float("inf")}, "PSConfig.timeout"),
        ({"timeout": True}, "PSConfig.timeout"),
        ({"num_servers": -1}, "PSConfig.num_servers"),
        ({"max_shard_bytes": 0}, "PSConfig.max_shard_bytes"),
        ({"overlap_backward": "yes"}, "PSConfig.overlap_backward"),
        ({"overlap_backward": 1}, "PSConfig.overlap_backward"),
    ],
)
def test_bad_config_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        PSConfig(**kwargs)


def test_unknown_field_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown PSConfig field\(s\) \['stalenes'\].*staleness"):
        PSConfig.from_kwargs(mode="ssp", stalenes=2)


def test_good_configs() -> None:
    assert PSConfig().mode == "async"
    cfg = PSConfig.from_kwargs(mode="ssp", staleness=0, timeout=5)
    assert cfg.to_dict()["staleness"] == 0


def test_config_import_is_torch_free() -> None:
    code = "import sys, ivyplug.ps; ivyplug.ps.PSConfig(mode='sync'); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_from_settings_fills_only_the_keywords_given_as_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Project defaults fill a None the caller passed; a keyword not passed keeps the built-in default."""
    for name in ("IVYPLUG_PS_TIMEOUT", "IVYPLUG_PS_NUM_SERVERS", "IVYPLUG_PS_NONFINITE", "IVYPLUG_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "pyproject.toml").write_text('[tool.ivyplug.ps]\ntimeout = 300\nnum_servers = 2\nnonfinite = "raise"\n')
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("IVYPLUG_PS_TIMEOUT", "42")
    cfg = PSConfig.from_settings(mode="sync", timeout=None, nonfinite=None, staleness=None)
    assert (cfg.mode, cfg.timeout, cfg.nonfinite, cfg.staleness) == ("sync", 42.0, "raise", None)
    assert cfg.num_servers == 0 and cfg.token is None  # not asked for: the built-in default
    assert PSConfig.from_settings(num_servers=None).num_servers == 2
    assert PSConfig.from_settings(timeout=7.0, nonfinite="skip").timeout == 7.0
    monkeypatch.setenv("IVYPLUG_TOKEN", "secret")
    assert PSConfig.from_settings().token == "secret"
    assert PSConfig.from_settings(token="mine").token == "mine"
    with pytest.raises(ValueError, match="unknown PSConfig field"):
        PSConfig.from_settings(timeot=None)


def test_a_topology_chosen_in_code_overrides_the_projects_other_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``servers`` and ``num_servers`` choose where the shards run: ``servers=`` in code with ``num_servers = 2`` in
    the project (or the reverse through the environment) was refused as if the code had set both; an argument in
    code comes first. Both from the same source are still refused."""
    for name in ("IVYPLUG_PS_NUM_SERVERS", "IVYPLUG_PS_SERVERS"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "pyproject.toml").write_text("[tool.ivyplug.ps]\nnum_servers = 2\n")
    monkeypatch.chdir(tmp_path)
    cfg = PSConfig.from_settings(servers="127.0.0.1:29600", num_servers=None)
    assert (cfg.servers, cfg.num_servers) == ("127.0.0.1:29600", 0)
    assert PSConfig.from_settings(servers=None, num_servers=None).num_servers == 2  # the project's, unchallenged
    monkeypatch.setenv("IVYPLUG_PS_SERVERS", "10.0.0.1:29600")
    cfg = PSConfig.from_settings(servers=None, num_servers=1)
    assert (cfg.servers, cfg.num_servers) == (None, 1)
    with pytest.raises(ValueError, match=r"num_servers=2 would start servers of the job's own: set one of them"):
        PSConfig.from_settings(servers=None, num_servers=None)  # both from the project's settings
    with pytest.raises(ValueError, match=r"set one of them"):
        PSConfig.from_settings(servers="127.0.0.1:29600", num_servers=1)  # both in code
