"""``ivyplug bench averaging``: one real quick job (2 Lightning workers, tiny data) and the summary on canned runs."""

from __future__ import annotations

from typing import Any

import pytest
from ivyplug.benchmarks import averaging


@pytest.mark.timeout(200)
def test_quick_run_measures_bytes_times_and_accuracy() -> None:
    results = averaging.run(quick=True)
    ddp, avg = results["runs"]
    assert (ddp["config"], avg["config"]) == ("ddp", "avg/4/average/bfloat16")
    for r in (ddp, avg):
        assert len(r["epoch_times"]) == 1 and len(r["accuracy_points"]) == 1
        assert 0.0 < r["val_acc"] <= 1.0 and r["bytes_per_sample"] > 0
    assert not ddp["bytes_measured"] and avg["bytes_measured"]
    assert avg["bytes_fewer_than_ddp"] > 1.0  # H=4 in bf16 moves fewer bytes, even with the epoch-end pulls
    assert ddp["time_to_ddp_acc_vs_ddp"] == 1.0
    table = averaging.format_table(results)
    assert "avg/4/average/bfloat16" in table and "QUICK" in table


def _run(config: str, slowdown: float, acc: list[float], bps: float) -> dict[str, Any]:
    kind = config.split("/")[0]
    return {
        "config": config,
        "kind": kind,
        "setting": "digits",
        "slowdown": slowdown,
        "epoch_times": [5.0, 2.0, 2.0, 2.0],
        "accuracy_points": [[10.0 * (i + 1), a] for i, a in enumerate(acc)],
        "val_acc": acc[-1],
        "bytes_per_sample": bps,
        "bytes_measured": kind != "ddp",
    }


def test_summary_ratios_on_canned_runs() -> None:
    runs = [
        _run("ddp", 3.0, [0.90, 0.95, 0.96, 0.97], 8000.0),
        _run("avg/16/nesterov/bfloat16", 3.0, [0.93, 0.97, 0.975, 0.975], 250.0),
        _run("avg/64/lamb/float32", 3.0, [0.80, 0.85, 0.90, 0.92], 100.0),
    ]
    averaging.summarise(runs)
    ddp, fast, never = runs
    assert ddp["time_to_ddp_acc"] == 40.0 and fast["time_to_ddp_acc"] == 20.0
    assert fast["time_to_ddp_acc_vs_ddp"] == pytest.approx(0.5)
    assert fast["bytes_fewer_than_ddp"] == pytest.approx(32.0)
    assert fast["acc_points_vs_ddp"] == pytest.approx(0.5)
    assert never["time_to_ddp_acc"] is None and never["time_to_ddp_acc_vs_ddp"] is None
    assert fast["epoch_time"] == 2.0  # the first epoch (start-up) is left out


def test_the_grid_and_its_selection() -> None:
    full = averaging._grid({})
    assert len(full) == 4 and all(len(configs) == 2 + 18 for _, _, configs in full)
    (job,) = averaging._grid({"setting": ["wide"], "slowdown": ["3"], "H": ["16"], "outer": ["nesterov"]})
    assert job == ("wide", 3.0, ["ddp", "ivy_ps", "avg/16/nesterov/float32", "avg/16/nesterov/bfloat16"])
    (job,) = averaging._grid({"setting": ["digits"], "slowdown": ["1"], "avg": ["64/lamb/float32"]})
    assert job[2] == ["ddp", "ivy_ps", "avg/64/lamb/float32"]
    (job,) = averaging._grid({"setting": ["digits"], "slowdown": ["1"], "avg": ["16/nesterov@0.7@0.9/float32"]})
    assert job[2][-1] == "avg/16/nesterov@0.7@0.9/float32"  # outer_lr and outer_momentum given (a control)
    for bad in ("16/adam/float32", "16/nesterov@x/float32", "16/nesterov@0.7@1.0/float32", "16/average@0.5/float32"):
        with pytest.raises(ValueError, match="avg= takes H/outer"):
            averaging._grid({"avg": [bad]})
    with pytest.raises(ValueError, match="unknown selection key"):
        averaging._grid({"hidden": ["5"]})
    with pytest.raises(ValueError, match="outer must be one of"):
        averaging._grid({"outer": ["adam"]})
