"""Start ``ivyplug serve`` and worker processes in their own process groups; always end them all."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

WORKER = str(Path(__file__).with_name("service_worker.py"))


class Serve:
    """A running ``ivyplug serve``: its address and the lines it printed."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self._q: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.address = ""

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            self._q.put(line)

    def wait_for(self, text: str, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        for line in list(self.lines):
            if text in line:
                return line
        while time.monotonic() < deadline:
            try:
                line = self._q.get(timeout=0.2)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            if text in line:
                return line
        raise AssertionError(f"ivyplug serve never printed {text!r}; it printed:\n" + "\n".join(self.lines))

    def wait_for_count(self, text: str, count: int, timeout: float = 60.0) -> None:
        """Until ``count`` lines hold ``text`` (the serve's lines so far, then as they come)."""
        deadline = time.monotonic() + timeout
        while sum(text in line for line in list(self.lines)) < count:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise AssertionError(
                    f"ivyplug serve printed {text!r} fewer than {count} times; it printed:\n" + self.log()
                )
            time.sleep(0.2)

    def log(self) -> str:
        return "\n".join(self.lines)


def _kill(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@contextlib.contextmanager
def serve(*args: str, port: str = "0") -> Iterator[Serve]:
    """``ivyplug serve --port PORT ARGS`` until the block ends (killed with its process group if still alive)."""
    cmd = [sys.executable, "-m", "ivyplug", "serve", "--port", port, "--status-every", "1", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env
    )
    s = Serve(proc)
    try:
        line = s.wait_for("listening on")
        s.address = line.split("listening on ", 1)[1].split(" ", 1)[0]
        yield s
    finally:
        _kill(proc)


class Workers:
    """Worker processes of service_worker.py; :meth:`results` waits for their JSON files."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[tuple[subprocess.Popen[str], Path]] = []

    def start(self, address: str, name: str, *args: str) -> Path:
        out = self.tmp / f"{name}.json"
        env = dict(os.environ, OMP_NUM_THREADS="1")
        proc = subprocess.Popen(
            [sys.executable, WORKER, address, str(out), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            env=env,
        )
        self.procs.append((proc, out))
        return out

    def wait(self, timeout: float = 120.0) -> list[tuple[int, str]]:
        deadline = time.monotonic() + timeout
        outs = []
        for proc, _ in self.procs:
            try:
                text, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill(proc)
                text, _ = proc.communicate()
                raise AssertionError(f"a worker did not finish within {timeout:g} s:\n{text}") from None
            outs.append((proc.returncode, text))
        return outs

    def close(self) -> None:
        for proc, _ in self.procs:
            _kill(proc)


def result(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    assert isinstance(data, dict)
    return data


@contextlib.contextmanager
def workers(tmp: Path) -> Iterator[Workers]:
    w = Workers(tmp)
    try:
        yield w
    finally:
        w.close()
