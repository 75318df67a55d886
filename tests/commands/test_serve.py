"""``ivyplug serve``'s option checks: a bad option ends the command with a message naming it and exit 2, before
anything listens; ``--status-every 0`` turns the status lines off."""

from __future__ import annotations

import signal
import socket
from typing import Any

import pytest

from ivyplug.cli import main
from ivyplug.ps.server import service as service_module


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The services ``main`` starts: closed at once instead of served until a signal (a bad option that is not
    refused then fails its test at once, and never installs its signal handlers in this process)."""
    started: list[Any] = []

    def close_at_once(service: Any, stop: Any) -> None:
        started.append(service)
        service.close()

    monkeypatch.setattr(service_module, "run_forever", close_at_once)
    monkeypatch.setattr(signal, "signal", lambda *args: None)
    monkeypatch.delenv("IVYPLUG_TOKEN", raising=False)
    return started


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--shards", "0"], "--shards must be an int >= 1, got 0"),
        (["--port", "70000"], "--port must be in 0..65535"),
        (["--host", "0.0.0.0"], "--host 0.0.0.0 listens beyond this machine: give a --token"),
        (["--workers", "-1"], "--workers must be an int >= 0"),
        (["--snapshot-every", "5"], "--snapshot-every needs --state-dir"),
        (["--state-dir", "s", "--snapshot-every", "0"], "--snapshot-every must be a finite number of seconds > 0"),
        (["--state-dir", "s", "--snapshot-every", "nan"], "--snapshot-every must be a finite number of seconds > 0"),
        (["--state-dir", "s", "--snapshot-every", "inf"], "--snapshot-every must be a finite number of seconds > 0"),
        (["--timeout", "-1"], "--timeout must be a finite number of seconds > 0, got -1.0"),
        (["--timeout", "0"], "--timeout must be a finite number of seconds > 0, got 0.0"),
        (["--timeout", "inf"], "--timeout must be a finite number of seconds > 0, got inf"),
        (["--timeout", "nan"], "--timeout must be a finite number of seconds > 0, got nan"),
        (["--status-every", "-1"], "--status-every must be a finite number of seconds > 0 (0: no status lines)"),
        (["--status-every", "inf"], "--status-every must be a finite number of seconds > 0 (0: no status lines)"),
        (["--state-dir", "/proc/no-such-dir"], "--state-dir /proc/no-such-dir: No such file or directory"),
    ],
)
def test_a_bad_option_is_refused_naming_it_before_anything_listens(
    options: list[str], message: str, capsys: pytest.CaptureFixture[str], served: list[Any]
) -> None:
    argv = ["serve", "--shards", "1", "--port", "0", *options]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("ivyplug serve: ") and message in err, err
    assert "Traceback" not in err and served == []


@pytest.mark.parametrize("host", ["127.0.0.1", "192.0.2.1", "nosuchhost.invalid"])
def test_an_address_it_cannot_listen_on_is_refused_naming_it(
    host: str, capsys: pytest.CaptureFixture[str], served: list[Any]
) -> None:
    """A taken port, an address of no interface here (TEST-NET-1), a name that does not resolve: exit 2, one line."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        argv = ["serve", "--shards", "1", "--host", host, "--port", str(port), "--token", "t", "--timeout", "5"]
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ivyplug serve: cannot listen on {host}:{port} ("), err
    assert "--host must be an address of this machine" in err and "Traceback" not in err and served == []


def test_status_every_0_turns_the_status_lines_off(served: list[Any]) -> None:
    assert main(["serve", "--shards", "1", "--port", "0", "--status-every", "0"]) == 0
    assert [s.status_every for s in served] == [None]
    assert main(["serve", "--shards", "1", "--port", "0", "--status-every", "2.5"]) == 0
    assert served[-1].status_every == 2.5


def test_a_stop_without_a_job_names_no_snapshot(
    tmp_path: Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No worker ever joined, so nothing was written: the last line does not claim a snapshot (it did)."""
    import threading

    stop = threading.Event()
    stop.set()
    svc = service_module.PSService(1, port=0, state_dir=str(tmp_path), status_every=None, log=lambda line: None)
    service_module.run_forever(svc, stop)
    err = capsys.readouterr().err
    assert err.strip() == "ivyplug serve: stopped" and list(tmp_path.iterdir()) == [], (err, list(tmp_path.iterdir()))


def test_a_join_where_nothing_listens_ends_within_timeout_naming_why(
    capsys: pytest.CaptureFixture[str], served: list[Any]
) -> None:
    """``--join`` toward a port nothing listens on: refused within ``--timeout`` with the reason, exit code 2 (torch's
    store client waited about twice the timeout, printing its C++ frames)."""
    import time

    from tests.ports import free_port

    start = time.monotonic()
    argv = ["serve", "--shards", "1", "--port", "0", "--join", f"127.0.0.1:{free_port()}", "--timeout", "3"]
    assert main(argv) == 2
    assert time.monotonic() - start < 3 + 3
    err = capsys.readouterr().err
    assert err.startswith("ivyplug serve: --join 127.0.0.1:") and "within 3 s: nothing listens" in err, err
    assert "frame #" not in err and served == []


def test_ctrl_c_while_a_join_waits_ends_with_one_line_and_exit_130() -> None:
    """Ctrl-C before the serve's own signal handling is in place (here: waiting up to ``--timeout`` for the serve
    to join) ends the command with one line and the shell's code for SIGINT, not a KeyboardInterrupt traceback."""
    import os
    import subprocess
    import sys
    import time

    from tests.ports import free_port

    argv = ["serve", "--shards", "1", "--port", "0", "--join", f"127.0.0.1:{free_port()}", "--timeout", "60"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "ivyplug", *argv],
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        # as typed in a shell: a test runner's worker (or a background job) may ignore SIGINT, and a child that
        # starts with it ignored never gets Python's KeyboardInterrupt
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        time.sleep(3.0)  # past the imports, into the wait
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "ivyplug serve: interrupted" and "Traceback" not in err, err


def test_sigterm_with_a_worker_connected_stops_cleanly_with_exit_0(tmp_path: Any) -> None:
    """Stopped while a worker trains, the serve wrote its snapshot and "stopped", then aborted in the interpreter's
    teardown ("terminate called without an active exception", exit 134): its member threads sat in gloo's
    receives. It ends with exit code 0, as the command's help promises."""
    import os
    import re
    import subprocess
    import sys
    import time
    from pathlib import Path

    worker_script = Path(__file__).resolve().parents[1] / "ps" / "service_worker.py"
    argv = ["serve", "--shards", "1", "--port", "0", "--state-dir", str(tmp_path / "state"), "--timeout", "20"]
    serve = subprocess.Popen(
        [sys.executable, "-m", "ivyplug", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    worker = None
    try:
        assert serve.stdout is not None
        first = serve.stdout.readline()
        address = re.search(r"listening on (\S+) ", first)
        assert address is not None, first
        worker = subprocess.Popen(
            [sys.executable, str(worker_script), address.group(1), str(tmp_path / "w.json"), "--steps", "2000",
             "--sleep", "0.01", "--timeout", "20"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        joined = serve.stdout.readline()
        assert "joined" in joined, joined
        time.sleep(1.0)  # training
        assert worker.poll() is None
        os.killpg(serve.pid, signal.SIGTERM)
        _, err = serve.communicate(timeout=30)
    finally:
        for proc in (serve, worker):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert serve.returncode == 0, err
    assert "ivyplug serve: stopped (snapshot in" in err and "terminate called" not in err, err


def test_a_state_dir_whose_snapshot_does_not_fit_is_refused_by_name(
    tmp_path: Any, capsys: pytest.CaptureFixture[str], served: list[Any]
) -> None:
    """A file that is no snapshot ended in "truncated PS state" without its name, or a KeyError traceback; a
    snapshot of a job of another number of worker slots was resumed with the snapshot's, whatever ``--workers``
    said (a second worker was then refused "start with a larger --workers"). Both are refused, naming the file."""
    from ivyplug.ps.server.service import JOB_FILE
    from ivyplug.ps.wire import typed_state

    state = tmp_path / "state"
    state.mkdir()
    argv = ["serve", "--shards", "1", "--port", "0", "--state-dir", str(state)]
    for blob in (b"", b"\x00" * 7, typed_state.encode({"num_shards": 1})):
        (state / JOB_FILE).write_bytes(blob)
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"{state / JOB_FILE} is not a snapshot of ivyplug serve" in err and "Traceback" not in err, err
    saved = {"job": {}, "num_workers": 1, "num_shards": 1, "first": 0, "shards": []}
    (state / JOB_FILE).write_bytes(typed_state.encode(saved))
    assert main([*argv, "--workers", "2"]) == 2
    err = capsys.readouterr().err
    assert "holds a job of 1 worker slots; start ivyplug serve with --workers 1" in err, err
    assert served == []


def test_a_small_timeout_never_drops_a_member_between_two_heartbeats() -> None:
    """Workers beat once a second (at most); ``--timeout 1`` dropped healthy ones after 0.75 s of silence."""
    from ivyplug.ps.server.service import silence_bound

    assert silence_bound(1.0) == silence_bound(0.1) == 2.5
    assert silence_bound(120.0) == 115.0 and silence_bound(8.0) == 6.0
