"""Lightning under torchrun --max-restarts: the restarted ranks rejoin the live servers and go on from their state."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.ports import free_port
from tests.ps.service_harness import serve

from .test_example import run_script

JOB = Path(__file__).with_name("torchrun_restart_job.py")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_restarted_lightning_ranks_rejoin_the_live_servers_without_a_checkpoint(tmp_path: Path) -> None:
    with serve("--shards", "2", "--workers", "2") as s:
        args = ["-m", "torch.distributed.run", "--nproc_per_node=2", "--max-restarts=1", "--rdzv-backend=c10d"]
        args += [f"--rdzv-endpoint=127.0.0.1:{free_port()}", str(JOB), str(tmp_path), s.address]
        returncode, out = run_script(args, tmp_path, timeout=240)
        assert returncode == 0, out[-6000:] + s.log()
        log = s.log()
    first = [json.loads((tmp_path / f"rank{r}_attempt0.json").read_text()) for r in (0, 1)]
    again = [json.loads((tmp_path / f"rank{r}_attempt1.json").read_text()) for r in (0, 1)]
    assert all(r["start_acc"] < 0.3 for r in first), first  # a fresh model: about chance
    assert all(r["start_acc"] > 0.7 for r in again), again  # the servers' trained state, no checkpoint
    # two more async epochs, their push order timing's: learning goes on from there (one CI run ended at 0.894)
    assert all(r["epochs"] == 2 and r["val_acc"] > 0.85 for r in again), again
    assert log.count("joined") == 4 and "worker 1 is gone" in log, log
