"""What the cross-host tests share: the worker scripts, environments, and reading a process's output."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SERVICE_WORKER = str(ROOT / "tests" / "ps" / "service_worker.py")
KERAS_WORKER = str(Path(__file__).with_name("keras_worker.py"))
TOKEN = "cross-host-token"
ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore", "TF_CPP_MIN_LOG_LEVEL": "2"}


class Output:
    """The lines a process prints, read on a thread, with a timed wait for one of them."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.lines: list[tuple[float, str]] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def wait_for(self, text: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for _, line in list(self.lines):
                if text in line:
                    return line
            if self.proc.poll() is not None and not self._thread.is_alive():
                break
            time.sleep(0.05)
        raise AssertionError(f"never printed {text!r} within {timeout:g} s; printed:\n{self.text()}")

    def finish(self, timeout: float) -> int:
        """Wait for the process to exit (AssertionError after ``timeout``); its exit code."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {timeout:g} s; printed:\n{self.text()}") from None
        self._thread.join(5)
        return code

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


def serve(
    hosts: Any,
    i: int,
    *args: str,
    env: dict[str, str] | None = None,
    timeout: float = 20,
    host: str | None = None,
    port: int = 29600,
) -> Output:
    """``ivyplug serve`` on host ``i`` at ``host`` (default: the host's address) and ``port``, with the test
    token; waits until it listens."""
    cmd = [sys.executable, "-m", "ivyplug", "serve", "--host", host or hosts[i].address, "--port", str(port)]
    cmd += ["--token", TOKEN, "--timeout", str(timeout), "--status-every", "1", *args]
    out = Output(hosts.run(i, cmd, env={**ENV, **(env or {})}))
    out.wait_for("listening on", 60)
    return out


def service_worker(
    hosts: Any, i: int, address: str, result: Path, *args: str, env: dict[str, str] | None = None
) -> Output:
    cmd = [sys.executable, SERVICE_WORKER, address, str(result), "--token", TOKEN, *args]
    return Output(hosts.run(i, cmd, env={**ENV, **(env or {})}))
