"""Two Keras worker processes (AsyncLAMB, H = 16, outer="average", bf16 deltas with error feedback) reach
>= 93% validation accuracy on digits; the same fit with AsyncLAMBExchange's bad wire_dtype is refused before
any process group forms."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from ivyplug.integrations.keras import AsyncLAMBExchange

from tests.ports import free_port

REPO = Path(__file__).resolve().parents[3]


def test_a_bad_wire_dtype_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"wire_dtype must be one of \('float32', 'bfloat16', 'int8', 'int4'\)"):
        AsyncLAMBExchange(wire_dtype="float16")


@pytest.mark.timeout(240)
def test_two_keras_workers_with_h16_bf16_deltas_reach_93_percent(tmp_path: Path) -> None:
    port = free_port()
    procs = []
    try:
        for rank in (0, 1):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            env |= {"OUTER": "average", "WIRE": "bfloat16", "SYNC_EVERY": "16", "EPOCHS": "6", "MODE": "sync"}
            env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "tests.integrations.keras.averaging_worker", str(tmp_path)],
                    cwd=str(REPO),
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,  # its own process group: killed whole on failure
                )
            )
        outputs = [p.communicate(timeout=200)[0] for p in procs]
        assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outputs)
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    print("validation accuracy per epoch:", r0["val_acc"])
    assert r0["val_acc"][-1] == r1["val_acc"][-1] >= 0.93  # both validated the servers' copy
    # 720 samples each at batch 32 = 23 steps per epoch: one exchange per 16 steps plus the flush per epoch
    assert 6 <= r0["exchanges"] == r1["exchanges"] <= 6 * 2 + 1
