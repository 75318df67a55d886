"""examples/lightning_ps.py --quick, run as a user runs it (popen launcher)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "lightning_ps.py"


#: Launch variables an earlier in-process fit leaves in this process's environment (Lightning's spawn
#: launcher sets MASTER_PORT in the parent). Inherited, the example would reuse that stale port: if anything
#: holds it by now, rank 0 dies with EADDRINUSE and the popen-launched rank 1 waits for it forever.
_LAUNCH_ENV = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "NODE_RANK",
    "GROUP_RANK",
    "LOCAL_WORLD_SIZE",
    "PL_GLOBAL_SEED",
    "PL_SEED_WORKERS",
    "IVYPLUG_DISABLE_LIGHTNING_AUTOREGISTER",
)


def run_example(cwd: Path, timeout: float) -> tuple[int, str]:
    """Run the example as a user does (see :func:`run_script`)."""
    return run_script([str(EXAMPLE), "--quick"], cwd, timeout)


def run_script(args: list[str], cwd: Path, timeout: float) -> tuple[int, str]:
    """Run ``python *args`` as a user does, in a clean launch environment and a session of its own.

    On a hang every process of the session is sent SIGABRT first (faulthandler prints each thread's
    stack into the output), then SIGKILL; the test fails with that output.
    """
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_ENV and not k.startswith("TORCHELASTIC_")}
    env["PYTHONFAULTHANDLER"] = "1"
    proc = subprocess.Popen(
        [sys.executable, *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its worker processes share the session: one killpg ends them all
    )
    try:
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGABRT)
            time.sleep(3)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate(timeout=30)
            pytest.fail(f"{args[0]} hung for {timeout:g} s; its output, with every process's stacks:\n{out[-12000:]}")
    finally:
        with contextlib.suppress(ProcessLookupError):  # also a worker orphaned by a failed rank 0
            os.killpg(proc.pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.wait(10)
    return proc.returncode, out


@pytest.mark.slow
@pytest.mark.timeout(295)
def test_example_quick_converges_on_async_ps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Async PS, 2 workers, worker 1 slowed: >= 95% validation accuracy and both workers pushed.

    This process's MASTER_PORT names a port that is in use, as after an earlier in-process fit whose port
    was taken since: the run must not inherit it (that hung the suite once).
    """
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(busy.getsockname()[1]))
        returncode, out = run_example(tmp_path, timeout=240)
    assert returncode == 0, out[-3000:]
    match = re.search(r"validation accuracy: ([0-9.]+)", out)
    assert match, out[-3000:]
    assert float(match.group(1)) >= 0.95, out[-3000:]
    pushes = {int(r): float(v) for r, v in re.findall(r"ivy/rank(\d)/pushes\s+([0-9.]+)", out)}
    assert set(pushes) == {0, 1} and min(pushes.values()) > 0
    assert pushes[0] + pushes[1] == 10 * 45  # 1440 samples / 32 per batch, 10 epochs: each batch once
