"""Project defaults from ``[tool.ivyplug.<section>]`` and ``IVYPLUG_*`` variables (ivyplug.settings)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ivyplug.ps.config import PSConfig
from ivyplug.settings import find_pyproject, project_defaults


def _project(tmp_path: Path, body: str) -> Path:
    (tmp_path / "pyproject.toml").write_text(body)
    sub = tmp_path / "src" / "pkg"
    sub.mkdir(parents=True)
    return sub


def test_values_from_the_nearest_pyproject_and_the_environment_wins(tmp_path: Path) -> None:
    sub = _project(tmp_path, '[tool.ivyplug.ps]\ntimeout = 300\nnum_servers = 2\nstaleness_scaling = "none"\n')
    assert find_pyproject(sub) == tmp_path / "pyproject.toml"
    assert project_defaults("ps", start=sub, environ={}) == {
        "timeout": 300.0,
        "num_servers": 2,
        "staleness_scaling": "none",
    }
    env = {"IVYPLUG_PS_TIMEOUT": "45.5", "IVYPLUG_PS_STALENESS_SCALING": "inverse", "IVYPLUG_PS_HOST": "10.0.0.1"}
    got = project_defaults("ps", start=sub, environ=env)
    assert got == {"timeout": 45.5, "num_servers": 2, "staleness_scaling": "inverse"}  # HOST is another setting
    assert isinstance(got["timeout"], float)


def test_nothing_configured_gives_nothing(tmp_path: Path) -> None:
    assert project_defaults("ps", start=_project(tmp_path, "[project]\nname = 'x'\n"), environ={}) == {}


@pytest.mark.parametrize(
    ("body", "env", "match"),
    [
        ("[tool.ivyplug.ps]\ntimeot = 3\n", {}, r"unknown key\(s\) \['timeot'\] in \[tool.ivyplug.ps\]; allowed"),
        ('[tool.ivyplug.ps]\ntimeout = "slow"\n', {}, r"\[tool.ivyplug.ps\] timeout must be a number, got 'slow'"),
        ("[tool.ivyplug.ps]\nnum_servers = 1.5\n", {}, r"num_servers must be an integer, got 1.5"),
        ("", {"IVYPLUG_PS_NUM_SERVERS": "two"}, r"environment variable IVYPLUG_PS_NUM_SERVERS must be an integer"),
        ("[tool.ivyplug]\nps = 3\n", {}, r"\[tool.ivyplug.ps\] must be a table"),
        ('tool = "x"\n', {}, r"\[tool.ivyplug\] must be a table of sections"),
        (
            "[tool.ivyplug.pss]\ntimeout = 3.0\n",
            {},
            r"\['pss'\] in \[tool.ivyplug\]; allowed sections",
        ),
        ("[tool.ivyplug]\ntimeout = 3.0\n", {}, r"unknown name\(s\) \['timeout'\] in \[tool.ivyplug\]"),
        ("[tool.ivyplug.ps]\ntimeout =\n", {}, r"pyproject.toml: not valid TOML \(Invalid value"),
        (
            "",
            {"IVYPLUG_PS_TIMOUT": "5"},
            r"variable\(s\) \['IVYPLUG_PS_TIMOUT'\]; allowed: .*TIMEOUT",
        ),
    ],
)
def test_bad_settings_name_the_key_and_the_source(tmp_path: Path, body: str, env: dict[str, str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        project_defaults("ps", start=_project(tmp_path, body), environ=env)


def test_other_ps_variables_are_not_refused(tmp_path: Path) -> None:
    env = {"IVYPLUG_PS_HOST": "10.0.0.2", "IVYPLUG_PS_TIMEOUT": "5"}  # the host a dedicated server binds
    assert project_defaults("ps", start=_project(tmp_path, ""), environ=env) == {"timeout": 5.0}


@pytest.mark.parametrize(
    ("body", "env", "match"),
    [
        (
            '[tool.ivyplug.ps]\nwire_dtype = "bf16"\n',
            {},
            r"'bf16' \(set by .*toml: \[tool.ivyplug.ps\] wire_dtype\)",
        ),
        ("", {"IVYPLUG_PS_TIMEOUT": "0"}, r"timeout.* \(set by environment variable IVYPLUG_PS_TIMEOUT\)"),
        ("", {"IVYPLUG_PS_NUM_SERVERS": "-1"}, r"num_servers.* \(set by environment variable IVYPLUG_PS_NUM_SERVERS\)"),
    ],
)
def test_a_refused_project_value_names_where_it_was_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str, env: dict[str, str], match: str
) -> None:
    monkeypatch.chdir(_project(tmp_path, body))
    for name in [n for n in os.environ if n.startswith("IVYPLUG_PS_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=match):
        PSConfig.from_settings(wire_dtype=None, timeout=None, num_servers=None)


def test_a_refused_value_from_code_names_no_project_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(_project(tmp_path, "[tool.ivyplug.ps]\ntimeout = 30\n"))
    with pytest.raises(ValueError) as caught:
        PSConfig.from_settings(wire_dtype="bf16", timeout=None)
    assert "got 'bf16'" in str(caught.value) and "set by" not in str(caught.value)


def test_unknown_section_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown ivyplug settings section 'pss'; known: \['ps'\]"):
        project_defaults("pss")


def test_a_switch_in_the_environment_takes_the_spellings_of_ivyplugs_other_switches(tmp_path: Path) -> None:
    """``IVYPLUG_PS_SHARED_MEMORY`` took only TOML's lowercase true/false, where ``IVYPLUG_DISABLE_*`` take
    1/true/yes/on in any case; a project file still takes TOML booleans only."""
    start = _project(tmp_path, "[project]\nname = 'x'\n")
    for raw, want in (("1", True), ("True", True), ("YES", True), ("on", True), ("0", False), ("Off", False)):
        env = {"IVYPLUG_PS_SHARED_MEMORY": raw}
        assert project_defaults("ps", start=start, environ=env) == {"shared_memory": want}, raw
    with pytest.raises(ValueError, match=r"IVYPLUG_PS_SHARED_MEMORY must be true or false \(in an environment"):
        project_defaults("ps", start=start, environ={"IVYPLUG_PS_SHARED_MEMORY": "maybe"})
    with pytest.raises(ValueError, match=r"\[tool.ivyplug.ps\] shared_memory must be true or false"):
        (tmp_path / "b").mkdir()
        project_defaults("ps", start=_project(tmp_path / "b", "[tool.ivyplug.ps]\nshared_memory = 1\n"), environ={})
