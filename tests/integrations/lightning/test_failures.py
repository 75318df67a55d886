"""A fit that fails on a rank under Lightning's popen launcher: the user's error is the one raised, at once."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from .failing_job import TIMEOUT_S
from .test_example import run_script

JOB = Path(__file__).with_name("failing_job.py")


def _raised(tmp_path: Path, rank: int, out: str) -> dict:
    path = tmp_path / f"raised_rank{rank}.json"
    assert path.exists(), out[-6000:]
    return json.loads(path.read_text())


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_error_on_rank_0_is_what_fit_raises_not_the_goodbye_after_it(tmp_path: Path, mode: str) -> None:
    """Rank 0's ``fit`` raises the user's ``ValueError``: the launcher ends the other ranks when rank 0 fails, and
    closing the PS after that said goodbye to them, whose error (a peer gone) replaced the user's. (Where every rank
    fails, a rank may first learn of another's failure from its shard and raise that: an error naming the rank.)"""
    returncode, out = run_script([str(JOB), str(tmp_path), mode, "0"], tmp_path, timeout=150)
    assert returncode != 0, out[-6000:]
    raised = _raised(tmp_path, 0, out)
    assert (raised["type"], raised["text"]) == ("ValueError", "a user's bug on rank 0"), (raised, out[-6000:])
    if mode == "async":  # rank 0 left the PS before the launcher ended rank 1: rank 1 hears of it, by name
        assert "rank 0 failed" in _raised(tmp_path, 1, out)["text"], out[-6000:]


@pytest.mark.timeout(180)
def test_an_error_on_one_rank_ends_the_job_long_before_the_timeout(tmp_path: Path) -> None:
    """Async, rank 1 fails: it raises its own error at once (it used to wait ``timeout`` for rank 0's goodbye, while
    rank 0 waited as long for rank 1's batches), and rank 0 learns of it from its shard. Rank 0's launcher, which
    ends the other ranks when rank 0 fails, gives rank 1 the time to end on its own (it killed it mid-traceback)."""
    start = time.monotonic()
    returncode, out = run_script([str(JOB), str(tmp_path), "async", "1"], tmp_path, timeout=150)
    elapsed = time.monotonic() - start
    assert returncode != 0, out[-6000:]
    raised = _raised(tmp_path, 1, out)
    assert (raised["type"], raised["text"]) == ("ValueError", "a user's bug on rank 1"), (raised, out[-6000:])
    assert raised["seconds"] < TIMEOUT_S / 4, raised
    assert elapsed < TIMEOUT_S, (elapsed, out[-6000:])  # start-up included; the old code took 2 x TIMEOUT_S
    if (tmp_path / "raised_rank0.json").exists():  # unless Lightning's launcher killed rank 0 first
        assert "rank 1" in _raised(tmp_path, 0, out)["text"], out[-6000:]
