"""``ivyplug bench``'s own errors: a selection a benchmark cannot run ends with a message and exit 2, no job started."""

from __future__ import annotations

from pathlib import Path

import pytest
from ivyplug.benchmarks import across_hosts

from ivyplug.cli import main


@pytest.fixture
def no_jobs(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The host benchmarks' runs, recorded instead of started."""
    started: list[object] = []
    monkeypatch.setattr(across_hosts, "run_rounds", lambda *a, **k: started.append(a) or {"skipped": None, "runs": []})
    return started


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["hosts", "--select", "rate=10mbit"],
            "ivyplug bench hosts: rate must be one of ['100mbit', '1gbit', 'unlimited']",
        ),
        (["hosts", "--select", "optimizer=sgd"], "ivyplug bench hosts: optimizer must be one of ('adamw', 'lamb')"),
        (
            ["averaging_hosts", "--select", "wire=int8"],
            "ivyplug bench averaging_hosts: unknown selection key(s) ['wire']",
        ),
        (["averaging", "--select", "outer=sgd"], "ivyplug bench averaging: outer must be one of"),
        (["hosts", "--quick", "--select", "rate=1gbit"], "ivyplug bench hosts: --quick runs one fixed smoke job"),
        (["hosts", "--select", "rate"], "ivyplug bench hosts: --select takes KEY=V1,V2, got 'rate'"),
        (["hosts", "--select", "slowdown=3x"], "ivyplug bench hosts: slowdown takes float values, got ['3x']"),
        (["hosts", "--select", "rounds=two"], "ivyplug bench hosts: rounds takes int values, got ['two']"),
        (["averaging", "--select", "H=16,x"], "ivyplug bench averaging: H takes int values, got ['16', 'x']"),
        (["averaging", "--select", "avg=16/sgd/float32"], "ivyplug bench averaging: avg= takes H/outer"),
        (
            ["lamb", "--select", "rate=1gbit"],
            "ivyplug bench lamb: --select applies to averaging and the hosts benchmarks",
        ),
    ],
)
def test_a_selection_it_cannot_run_is_refused_with_its_reason(
    argv: list[str], message: str, no_jobs: list[object], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert no_jobs == []


def test_a_valid_selection_runs(no_jobs: list[object], capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["bench", "hosts", "--select", "rate=1gbit", "--select", "slowdown=1", "--select", "optimizer=adamw"]) == 0
    )
    assert len(no_jobs) == 1 and "one worker each, AdamW," in capsys.readouterr().out


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_an_output_path_it_cannot_write_is_refused_before_the_run(
    option: str, no_jobs: list[object], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A benchmark ran to its end and then lost its results in a traceback where ``--json`` could not be written;
    the path is checked first (a folder where the file should be, a folder that cannot be made)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for path, why in ((tmp_path, "is a folder; name a file"), (blocker / "r.json", "cannot make its folder")):
        assert main(["bench", "hosts", "--select", "rate=1gbit", option, str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"ivyplug bench hosts: {option} {path}: {why}") and "Traceback" not in err, err
    assert no_jobs == []


def test_demo_refuses_an_out_folder_it_cannot_make_before_starting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["demo", "--quick", "--out", str(blocker / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ivyplug demo: error: --out {blocker / 'out'}: cannot make its folder"), err
    assert "Traceback" not in err
