"""``num_nodes=2`` simulated with two torchrun invocations on loopback (one worker each), ``ivy_ps_ssp``."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ports import free_port

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "lightning_ps.py"


@pytest.mark.slow
@pytest.mark.timeout(295)
def test_two_torchrun_nodes_train_on_the_ps(tmp_path: Path) -> None:
    port = free_port()
    procs = []
    try:
        for node in (0, 1):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1"]
            cmd += [f"--node_rank={node}", "--master_addr=127.0.0.1", f"--master_port={port}"]
            cmd += [str(EXAMPLE), "--quick", "--strategy", "ivy_ps_ssp", "--epochs", "3"]
            cmd += ["--devices", "1", "--num-nodes", "2"]
            procs.append(
                subprocess.Popen(
                    cmd,
                    cwd=tmp_path,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,
                )
            )
        outputs = [p.communicate(timeout=270)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    out = outputs[0]
    assert re.search(r"validation accuracy: 0\.\d+", out), out[-2000:]
    pushes = {int(r): float(v) for r, v in re.findall(r"ivy/rank(\d)/pushes\s+([0-9.]+)", out)}
    assert pushes[0] + pushes[1] == 3 * 45 and min(pushes.values()) > 0
