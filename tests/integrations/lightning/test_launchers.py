"""The popen launcher ends the other ranks when rank 0 fails (Lightning only does so on KeyboardInterrupt), and, in
a job that survives a lost worker, every rank when a child dies before the process group is up."""

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

from tests.ports import free_port

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


EARLY_LOSS_SCRIPT = textwrap.dedent(
    """
    import os, sys
    if os.environ.get("LOCAL_RANK") == "1":
        sys.exit(3)  # a child lost before it joins the process group (an import error, an OOM at start)
    from lightning.pytorch import Trainer
    from ivyplug.integrations.lightning import IvyPSStrategy
    from tests.integrations.lightning.digits import DigitsMLP
    trainer = Trainer(strategy=IvyPSStrategy(mode="async", num_servers=1, timeout=20), accelerator="cpu", devices=2,
                      max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=False)
    trainer.fit(DigitsMLP(train_size=64))
    """
)


def _tagged(tag: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if any(tag in part for part in (p.info["cmdline"] or [])):
            found.append(p)
    return found


def _run_job(tmp_path: Path, source: str, port: int, timeout: float) -> tuple[subprocess.Popen[str], str, list]:
    """Run ``source`` as a popen-launched job's rank 0; its return code, output and the ranks it left running."""
    repo = Path(__file__).resolve().parents[3]
    tag = f"ivyplug-launcher-test-{uuid.uuid4().hex}"
    script = tmp_path / f"{tag}.py"
    script.write_text(source)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
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
    out = ""
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            out, _ = proc.communicate(timeout=10)
        leftovers = _tagged(tag)
        deadline = time.monotonic() + 10
        while leftovers and time.monotonic() < deadline:
            time.sleep(0.2)
            leftovers = [p for p in leftovers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        for p in leftovers:
            p.kill()
    return proc, out, leftovers


def test_rank0_failure_ends_the_popen_launched_ranks(tmp_path: Path) -> None:
    with socket.socket() as busy:  # rank 0 cannot create the store: its port is taken
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        proc, out, leftovers = _run_job(tmp_path, SCRIPT, busy.getsockname()[1], timeout=150)
    assert proc.returncode != 0, out[-3000:]
    assert "address already in use" in out.lower() or "EADDRINUSE" in out, out[-3000:]
    assert not leftovers, f"rank 1 outlived rank 0: {[p.pid for p in leftovers]}"


def test_a_child_lost_before_the_group_is_up_ends_a_loss_tolerant_job(tmp_path: Path) -> None:
    """Async with a dedicated server survives a lost worker, but only once it has started: before, rank 0 would
    wait for the lost child in the rendezvous for the process-group timeout (30 minutes)."""
    started = time.monotonic()
    proc, out, leftovers = _run_job(tmp_path, EARLY_LOSS_SCRIPT, free_port(), timeout=90)
    took = time.monotonic() - started
    assert proc.returncode not in (0, None), out[-3000:]
    assert "rank 1" in out and "ended with code 3 before every rank joined the process group" in out, out[-3000:]
    assert took < 60, (took, out[-3000:])
    assert not leftovers
