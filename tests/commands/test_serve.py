"""``ivyplug serve``'s option checks: a bad option ends the command with a message naming it and exit 2, before
anything listens."""

from __future__ import annotations

import pytest

from ivyplug.cli import main


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--shards", "0"], "--shards must be an int >= 1, got 0"),
        (["--port", "70000"], "--port must be in 0..65535"),
        (["--host", "0.0.0.0"], "--host 0.0.0.0 listens beyond this machine: give a --token"),
        (["--workers", "-1"], "--workers must be an int >= 0"),
        (["--snapshot-every", "5"], "--snapshot-every needs --state-dir"),
        (["--timeout", "-1"], "--timeout must be a finite number of seconds > 0, got -1.0"),
        (["--timeout", "0"], "--timeout must be a finite number of seconds > 0, got 0.0"),
        (["--timeout", "inf"], "--timeout must be a finite number of seconds > 0, got inf"),
        (["--timeout", "nan"], "--timeout must be a finite number of seconds > 0, got nan"),
        (["--status-every", "0"], "--status-every must be a finite number of seconds > 0, got 0.0"),
    ],
)
def test_a_bad_option_is_refused_naming_it_before_anything_listens(
    options: list[str], message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("IVYPLUG_TOKEN", raising=False)
    argv = ["serve", "--shards", "1", "--port", "0", *options]
    if options[0] == "--shards":
        argv = ["serve", "--port", "0", *options]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("ivyplug serve: ") and message in err, err
    assert "Traceback" not in err
