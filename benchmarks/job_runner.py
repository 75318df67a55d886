"""Run one benchmark job in its own process group, bounded in time, and read back its JSON result."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def run_job(module: str, args: list[str], timeout: float) -> dict[str, Any]:
    """``python -m module *args --out FILE``; the whole process group is killed if it outlives ``timeout``.

    The result carries ``loadavg_before`` and ``loadavg_after`` (this machine is shared: record foreign load).
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", module, *args, "--out", str(out)]
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
        load_before = os.getloadavg()
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
        )
        try:
            log, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(f"benchmark job {cmd} did not finish within {timeout} s") from exc
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"benchmark job {cmd} failed ({proc.returncode}):\n{log[-3000:]}")
        result: dict[str, Any] = json.loads(out.read_text())
    result["loadavg_before"] = load_before
    result["loadavg_after"] = os.getloadavg()
    return result
