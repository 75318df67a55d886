"""Lightning features combined with the PS as users combine them (popen-launched, 2 ranks): the tuner's
``lr_find``, ``test(ckpt_path="best")`` after an async fit, ``StochasticWeightAveraging``, and a collective
inside an async training step refused at once."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from .test_example import run_script

JOB = Path(__file__).with_name("features_job.py")


@pytest.mark.slow
@pytest.mark.timeout(280)
def test_lr_find_best_checkpoint_and_swa_work_under_the_ps(tmp_path: Path) -> None:
    returncode, out = run_script([str(JOB), str(tmp_path)], tmp_path, timeout=260)
    assert returncode == 0, out[-4000:]
    a0, a1 = (json.loads((tmp_path / f"async-rank{r}.json").read_text()) for r in (0, 1))
    assert a0["lrs"] == a1["lrs"] == 20, (a0, a1)  # lr_find read its own callback's 20 rates
    assert a0["lr"] == a1["lr"] != 1e-3, (a0, a1)  # its suggestion, the same on both ranks
    # each rank counted its own steps, but both know rank 0's checkpoints and tested its best one
    # the names differ: rank 1 sleeps at each step, so it trains fewer of the dispatched batches (on a loaded
    # machine rank 0 can be the slower one after all: 18 against 22 steps once, with tests running beside)
    assert a0["steps"] != a1["steps"], (a0, a1)
    assert a0["best"] == a1["best"] == a0["tested"] == a1["tested"] and Path(a0["best"]).is_file(), (a0, a1)
    assert a0["checksum"] == a1["checksum"] and a0["test_acc"] > 0.5, (a0, a1)
    for r in (0, 1):
        s = json.loads((tmp_path / f"sync-rank{r}.json").read_text())
        assert s["swa_gap"] == 0.0 and s["swa_moved"] > 1e-4, s  # SWA's average, not the servers' last weights


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_all_gather_inside_an_async_training_step_is_refused_on_every_rank(tmp_path: Path) -> None:
    started = time.monotonic()
    returncode, out = run_script([str(JOB), str(tmp_path), "allgather"], tmp_path, timeout=150)
    assert returncode != 0, out[-4000:]
    assert "an all_gather (self.all_gather) inside a training batch would wait for the other workers" in out, out
    assert time.monotonic() - started < 120


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_an_async_fit_resumes_from_a_mid_epoch_checkpoint(tmp_path: Path) -> None:
    """Resumed mid-epoch, Lightning skips that epoch's ``on_train_epoch_start``, where the async dispatch found its
    sampler: both workers then waited for each other's batches until the PS timeout and failed naming it. The
    resumed fit ends its epoch, steps the epoch scheduler alike on both ranks, and each later epoch trains every
    sample once across the two."""
    returncode, out = run_script([str(JOB), str(tmp_path), "resume"], tmp_path, timeout=220)
    assert returncode == 0, out[-4000:]
    ranks = [json.loads((tmp_path / f"resume-rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["epoch"] == ranks[1]["epoch"] == 4
    assert ranks[0]["lrs"] == ranks[1]["lrs"] == [0.05 / 4, 0.05 / 8, 0.05 / 16], ranks  # epochs 1 (resumed), 2, 3
    for epoch in ("2", "3"):
        together = sorted(ranks[0]["seen"][epoch] + ranks[1]["seen"][epoch])
        assert together == list(range(640)), epoch
