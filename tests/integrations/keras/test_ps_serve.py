"""Two Keras processes started on their own (examples/keras_ps_serve.py) against ``ivyplug serve``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ps.service_harness import serve

pytest.importorskip("tensorflow")
pytest.importorskip("sklearn")

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "keras_ps_serve.py"


def _worker(address: str, part: int, token: str) -> subprocess.Popen[str]:
    env = dict(os.environ, IVYPLUG_TOKEN=token, OMP_NUM_THREADS="1", TF_NUM_INTEROP_THREADS="1")
    return subprocess.Popen(
        [sys.executable, str(EXAMPLE), "--servers", address, "--part", f"{part}/2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_keras_workers_reach_93_percent_and_a_wrong_token_is_refused() -> None:
    with serve("--shards", "2", "--workers", "2", "--token", "right") as s:
        procs = [_worker(s.address, 0, "right"), _worker(s.address, 1, "right")]
        # both joined (one may have finished before the other started, freeing slot 0 for it: seen in CI under load)
        s.wait_for_count(" joined (member ", 2, timeout=200)
        intruder = _worker(s.address, 0, "wrong")
        try:
            outs = [p.communicate(timeout=360)[0] for p in procs]
            bad = intruder.communicate(timeout=120)[0]
        finally:
            for p in [*procs, intruder]:
                if p.poll() is None:
                    os.killpg(p.pid, 9)
        for p, out in zip(procs, outs, strict=True):
            assert p.returncode == 0, out[-3000:]
        accs = [float(m) for out in outs for m in re.findall(r"validation accuracy ([0-9.]+)", out)]
        assert len(accs) == 2 and min(accs) >= 0.93, (accs, outs)
        # each logs its counters under the slot the serve gave it (each is rank 0 of a job of its own)
        slots = sorted(m for out in outs for m in re.findall(r"\(ivy/rank(\d)/pushes = \d+\)", out))
        joined = sorted(re.findall(r"worker (\d) joined \(member", s.log()))
        assert len(slots) == 2 and slots == joined, (slots, joined, outs)
        assert intruder.returncode != 0 and "PSAuthError" in bad, bad[-2000:]
        assert "wrong token" in s.log()
        assert s.log().count("left") == 2  # both finished cleanly, neither was disturbed by the refused one
