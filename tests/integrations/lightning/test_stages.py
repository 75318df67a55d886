"""fit, then validate / test / predict and a second fit on the same Trainer, in every PS mode and topology.

Real popen-launched ranks (as ``Trainer(devices=2)`` runs from a script): the ranks keep their processes
and the default process group between stages, which is what broke when the strategy destroyed the group
at the end of each stage.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.ps.service_harness import serve

from .test_example import run_script

JOB = Path(__file__).with_name("stages_job.py")
# every mode co-located; the dedicated servers (the job's own ivyplug serve) in async and sync
CONFIGS = [f"{name}/0" for name in ("ivy_ps", "ivy_ps_sync", "ivy_ps_ssp")] + ["ivy_ps/2", "ivy_ps_sync/2"]


def check_stages(tmp_path: Path, configs: list[str], out: str) -> None:
    results = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("*-rank*.json"))]
    by_config: dict[str, list[dict]] = {}
    for r in results:
        by_config.setdefault(r["config"], []).append(r)
    assert sorted(by_config) == sorted(configs), out[-4000:]
    for config, ranks in by_config.items():
        assert sorted(r["rank"] for r in ranks) == [0, 1], config
        for r in ranks:
            assert r["stages"] == ["validate", "fit", "validate", "test", "predict", "fit"], config
            assert r["finite"], config
        # the second fit continued from the first: more steps, on every rank
        assert all(r["steps"][1] > r["steps"][0] > 0 for r in ranks), (config, ranks)
        # both ranks end with the global model (pulled at the end of fit)
        assert ranks[0]["checksum"] == ranks[1]["checksum"], (config, ranks)
        # rank 0's value on both ranks, types kept; a value only pickle carries refused on both, naming its type
        for r in ranks:
            for broadcast, refused in ((r["broadcast"], r["refused"]), r["in_fit"]):
                assert broadcast == {"path": repr(Path("/runs/0/last.ckpt")), "epoch": "2", "t": [0, 1, 2]}, config
                assert "cannot broadcast a Unpicklable from rank 0 without pickle" in refused, (config, r)


@pytest.mark.slow
@pytest.mark.timeout(290)
def test_every_stage_after_fit_on_one_trainer(tmp_path: Path) -> None:
    returncode, out = run_script([str(JOB), str(tmp_path), *CONFIGS], tmp_path, timeout=270)
    assert returncode == 0, out[-4000:]
    check_stages(tmp_path, CONFIGS, out)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_every_stage_against_ivyplug_serve(tmp_path: Path) -> None:
    """Each fit joins the live servers again (the second continues from their state); two ranks, two slots."""
    with serve("--shards", "2", "--workers", "2") as s:
        config = f"ivy_ps/{s.address}"
        returncode, out = run_script([str(JOB), str(tmp_path), config], tmp_path, timeout=180)
        assert returncode == 0, out[-4000:] + s.log()
        check_stages(tmp_path, [config], out)
        assert s.log().count("joined") >= 4  # two ranks, two fits
