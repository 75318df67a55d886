"""The popen launcher ends the other ranks when rank 0 fails (Lightning only does so on KeyboardInterrupt)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import psutil
import pytest

pytestmark = [pytest.mark.timeout(200)]

SCRIPT = textwrap.dedent(
    """
    import sys
    from lightning.pytorch import Trainer
    from tests.integrations.lightning.digits import DigitsMLP
    trainer = Trainer(strategy="ivy_ps", accelerator="cpu", devices=2, max_epochs=1, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(DigitsMLP(train_size=64))
    """
)


def _tagged(tag: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if any(tag in part for part in (p.info["cmdline"] or [])):
            found.append(p)
    return found


def test_rank0_failure_ends_the_popen_launched_ranks(tmp_path: Path) -> None:
    repo = Path(__file__).resolve().parents[3]
    tag = f"ivyplug-launcher-test-{uuid.uuid4().hex}"
    script = tmp_path / f"{tag}.py"
    script.write_text(SCRIPT)
    with socket.socket() as busy:  # rank 0 cannot create the store: its port is taken
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(busy.getsockname()[1]))
        env["PYTHONPATH"] = os.pathsep.join([str(repo), env.get("PYTHONPATH", "")])
        env.pop("WORLD_SIZE", None)
        env.pop("RANK", None)
        env.pop("LOCAL_RANK", None)
        proc = subprocess.Popen(
            [sys.executable, str(script)],
            cwd=str(tmp_path),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            out, _ = proc.communicate(timeout=150)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait(10)
            leftovers = _tagged(tag)
            deadline = time.monotonic() + 10
            while leftovers and time.monotonic() < deadline:
                time.sleep(0.2)
                leftovers = [p for p in leftovers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
            for p in leftovers:
                p.kill()
    assert proc.returncode != 0, out[-3000:]
    assert "address already in use" in out.lower() or "EADDRINUSE" in out, out[-3000:]
    assert not leftovers, f"rank 1 outlived rank 0: {[p.pid for p in leftovers]}"
