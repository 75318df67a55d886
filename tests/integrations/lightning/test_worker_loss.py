"""A worker SIGKILLed mid-fit under Lightning's popen launcher: the other finishes, with servers outside."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.ps.service_harness import serve

from .test_example import run_script

JOB = Path(__file__).with_name("worker_loss_job.py")


def _check(out: str, tmp_path: Path) -> dict:
    result_file = tmp_path / "result.json"
    assert result_file.exists(), out[-6000:]
    r = json.loads(result_file.read_text())
    assert r["epochs"] == 2, r  # every planned epoch ran on the survivor
    assert r["lost"] == [1], r
    assert r["checkpoint_epoch"] == 1 and r["checkpoint_matches_model"], r  # the last epoch's, loaded
    assert r["val_acc"] > 0.85, r
    assert "rank(s) [1] left the job" in out, out[-6000:]  # the warning names the lost rank
    trained = {r: json.loads((tmp_path / f"trained_rank{r}.json").read_text()) for r in (0, 1)}
    batches = trained[0]["batches"]
    for epoch in ("0", "1"):  # every batch at least once per epoch, the epoch of the loss included
        seen = set(trained[0]["epochs"][epoch]) | set(trained[1]["epochs"].get(epoch, []))
        assert seen == set(range(batches)), (epoch, sorted(seen), batches)
    assert len(trained[1]["epochs"]["0"]) == 8 and "1" not in trained[1]["epochs"]  # it died at its 9th batch
    return r


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_killed_worker_leaves_the_fit_to_the_other_with_dedicated_servers_in_ssp(tmp_path: Path) -> None:
    """ssp: the survivor is not held back by the lost worker's clock (async: the ivyplug serve test below)."""
    returncode, out = run_script([str(JOB), str(tmp_path), "ssp", "1"], tmp_path, timeout=200)
    assert returncode == 0, out[-6000:]
    _check(out, tmp_path)  # run_script then kills the session: no process is left behind either way


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_killed_worker_leaves_the_fit_to_the_other_against_ivyplug_serve(tmp_path: Path) -> None:
    with serve("--shards", "2", "--workers", "2") as s:
        returncode, out = run_script([str(JOB), str(tmp_path), "async", s.address], tmp_path, timeout=200)
        assert returncode == 0, out[-6000:] + s.log()
        _check(out, tmp_path)
        assert "worker 1 is gone" in s.log()
