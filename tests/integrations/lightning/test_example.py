"""examples/lightning_ps.py --quick: the README's first command, as a user runs it (popen launcher)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "lightning_ps.py"


@pytest.mark.slow
@pytest.mark.timeout(295)
def test_example_quick_converges_on_async_ps(tmp_path: Path) -> None:
    """Async PS, 2 workers, worker 1 slowed: >= 95% validation accuracy and both workers pushed."""
    env = {k: v for k, v in os.environ.items() if k != "IVYPLUG_DISABLE_LIGHTNING_AUTOREGISTER"}
    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLE), "--quick"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its worker processes share the session: one killpg ends them all
    )
    try:
        try:
            out, _ = proc.communicate(timeout=270)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate(timeout=30)
            pytest.fail(f"the example hung; its output:\n{out[-4000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == 0, out[-3000:]
    match = re.search(r"validation accuracy: ([0-9.]+)", out)
    assert match, out[-3000:]
    assert float(match.group(1)) >= 0.95
    pushes = {int(r): float(v) for r, v in re.findall(r"ivy/rank(\d)/pushes\s+([0-9.]+)", out)}
    assert set(pushes) == {0, 1} and min(pushes.values()) > 0
    assert pushes[0] + pushes[1] == 10 * 45  # 1440 samples / 32 per batch, 10 epochs: each batch once
