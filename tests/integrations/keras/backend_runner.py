"""Run :mod:`.backend_scenarios` under a given ``KERAS_BACKEND``.

Keras fixes its backend at import, and this test process imports it with TensorFlow, so JAX and PyTorch run
in a fresh interpreter: one per backend for a whole batch of scenarios (the imports dominate the time), in
a process group of its own that is killed on timeout (a hung collective or thread cannot outlive the test).
TensorFlow runs the same functions in this process (in a fresh one too if this process's Keras was given
another backend).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.ports import free_port

REPO = Path(__file__).resolve().parents[3]
#: Keras's backends, as ``KERAS_BACKEND`` spells them.
BACKENDS: tuple[str, ...] = ("tensorflow", "jax", "torch")


def _start(backend: str, names: list[str], tmp: Path, extra_env: dict[str, str]) -> subprocess.Popen[str]:
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):  # one worker on its own unless asked
        env.pop(key, None)
    env.update(extra_env)
    request = json.dumps({"names": names, "tmp": str(tmp)})
    return subprocess.Popen(
        [sys.executable, "-m", "tests.integrations.keras.backend_scenarios", request],
        cwd=str(REPO),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: killed as a whole on timeout
    )


def _collect(proc: subprocess.Popen[str], backend: str, names: list[str], timeout: float) -> dict[str, Any]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(
            f"KERAS_BACKEND={backend}: scenarios {names} ran over {timeout} s\n{err[-3000:]}"
        ) from None
    lines = out.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"KERAS_BACKEND={backend}: exit {proc.returncode}\n{err[-3000:]}")
    results: dict[str, Any] = json.loads(lines[-1])
    if results.pop("backend") != backend:
        raise AssertionError(f"the child ran Keras on another backend than {backend}")
    return results


def run_scenarios(
    backend: str, names: list[str], tmp: Path, timeout: float = 240.0, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """``{name: {"result": ...} | {"error": traceback}}`` of each scenario, run on ``backend`` (``env``: more
    environment for a fresh interpreter; TensorFlow then runs in one too)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "tensorflow" and not env and _in_process_keras() == "tensorflow":
        from tests.integrations.keras import backend_scenarios

        return backend_scenarios.run(names, str(tmp))
    return _collect(_start(backend, names, tmp, env or {}), backend, names, timeout)


def _in_process_keras() -> str:
    """The backend of this process's Keras (TensorFlow unless the test run itself was given KERAS_BACKEND)."""
    import keras

    return str(keras.backend.backend())


class ScenarioRuns:
    """The scenarios on every backend, the JAX and PyTorch interpreters started together on the first request
    (they run while TensorFlow's share runs in this process), each result collected when first asked for."""

    def __init__(self, names: list[str], tmp: Path, timeout: float = 300.0) -> None:
        self.names, self.tmp, self.timeout = names, tmp, timeout
        self._procs: dict[str, subprocess.Popen[str]] = {}
        self._results: dict[str, dict[str, Any]] = {}

    def get(self, backend: str) -> dict[str, Any]:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if backend not in self._results:
            if not self._procs:
                here = "tensorflow" if _in_process_keras() == "tensorflow" else None
                self._procs = {b: _start(b, self.names, self.tmp, {}) for b in BACKENDS if b != here}
            if backend not in self._procs:
                self._results[backend] = run_scenarios(backend, self.names, self.tmp)
            else:
                self._results[backend] = _collect(self._procs[backend], backend, self.names, self.timeout)
        return self._results[backend]

    def close(self) -> None:
        """Kill what still runs (a test session that stopped early)."""
        for proc in self._procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()


def run_workers(backend: str, names: list[str], tmp: Path, world: int, timeout: float = 120.0) -> list[dict[str, Any]]:
    """The scenarios in ``world`` processes started as ``torchrun`` starts workers (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``), each process's results in rank order."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    port = str(free_port())
    procs = [
        _start(
            backend,
            names,
            tmp,
            {"RANK": str(r), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port},
        )
        for r in range(world)
    ]
    try:
        return [_collect(p, backend, names, timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
