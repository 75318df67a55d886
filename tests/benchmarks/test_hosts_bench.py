"""``ivyplug bench hosts`` / ``averaging_hosts``: a real quick two-host job, the summary on canned runs, the grids."""

from __future__ import annotations

from typing import Any

import pytest
from ivyplug.benchmarks import across_hosts, averaging_hosts, hosts
from ivyplug.benchmarks.emulated_hosts import unavailable


@pytest.mark.timeout(300)
def test_quick_runs_cross_the_link_and_count_its_bytes() -> None:
    if unavailable() is not None:
        pytest.skip(str(unavailable()))
    results = averaging_hosts.run(quick=True)
    assert results["skipped"] is None
    ddp, avg = sorted(results["runs"], key=lambda r: r["kind"] != "ddp")
    assert (ddp["config"], avg["config"]) == ("ddp", "avg/4/nesterov/int8/overlap")
    for r in (ddp, avg):
        assert r["nodes"] == 2 and r["rate"] == "unlimited" and len(r["epoch_times"]) == 1
        assert 0.0 < r["val_acc"] <= 1.0
    # DDP all-reduces a 1.13M-parameter fp32 gradient per step: at least 4.5 MB per step over the link
    steps = ddp["train_samples"] / (2 * ddp["batch"])
    assert ddp["link_bytes"] > steps * 4 * ddp["params"]
    # int8 deltas every 4 steps move fewer bytes over the same link (even in 6 steps, with the start's fp32
    # pulls and the validation's), and the link carries at least what the PS clients count crossing it: the
    # half of each worker's traffic that goes to the other host's shard (more: the start's broadcast of the
    # model and the servers' initial state, which the clients do not count, TCP's headers, the rendezvous)
    assert avg["link_bytes"] < ddp["link_bytes"] / 2, (avg["link_bytes"], avg["bytes_moved"])
    assert avg["link_bytes"] > 0.45 * avg["bytes_moved"], (avg["link_bytes"], avg["bytes_moved"])
    table = averaging_hosts.format_table(results)
    assert "avg/4/nesterov/int8/overlap" in table and "QUICK" in table


def _run(config: str, rnd: int, epoch: float, link: float, acc: list[float], rate: str = "100mbit") -> dict[str, Any]:
    return {
        "config": config,
        "kind": config.split("/")[0],
        "rate": rate,
        "slowdown": 1.0,
        "round": rnd,
        "epoch_times": [9.0, epoch, epoch],
        "accuracy_points": [[10.0 * (i + 1), a] for i, a in enumerate(acc)],
        "val_acc": acc[-1],
        "link_bytes": link,
        "loadavg_before": [1.0, 1.0, 1.0],
    }


def test_ratios_are_taken_inside_each_round_then_the_median() -> None:
    runs = [
        _run("ddp", 0, 10.0, 800e6, [0.90, 0.95, 0.96]),
        _run("avg/16/nesterov/int4", 0, 1.0, 10e6, [0.95, 0.96, 0.97]),
        _run("ddp", 1, 20.0, 800e6, [0.90, 0.94, 0.98]),  # a slow round: DDP and averaging alike
        _run("avg/16/nesterov/int4", 1, 2.0, 12e6, [0.95, 0.96, 0.965]),  # never reaches this round's DDP
    ]
    rows = {row["config"]: row for row in across_hosts.summarise(runs)}
    avg = rows["avg/16/nesterov/int4"]
    assert avg["epoch_time"] == pytest.approx(1.5) and avg["epoch_vs_ddp"] == pytest.approx(0.1)
    assert avg["link_bytes_vs_ddp"] == pytest.approx(11e6 / 800e6)
    assert avg["val_acc"] == pytest.approx(0.9675) and avg["acc_points_vs_ddp"] == pytest.approx((1.0 - 1.5) / 2)
    assert avg["time_to_ddp_acc_vs_ddp"] == pytest.approx(20.0 / 30.0) and avg["reached_ddp_acc"] == "1/2"
    assert rows["ddp"]["epoch_vs_ddp"] == 1.0
    table = across_hosts.format_rows("t", {"rows": list(rows.values()), "loadavg_end": [1.0], "cpu_count": 2})
    assert "avg/16/nesterov/int4" in table and "1/2" in table


def test_grids_and_their_selection() -> None:
    full = hosts.grid({})
    assert [(rate, slow) for rate, slow, _ in full] == [(None, 1.0), ("1gbit", 1.0), ("100mbit", 1.0), ("100mbit", 3.0)]
    (job,) = hosts.grid({"rate": ["100mbit"], "slowdown": ["1"], "config": ["ivy_ps"]})
    assert job == ("100mbit", 1.0, ["ddp", "ivy_ps"])  # DDP always runs: every ratio is to it
    slow = averaging_hosts.grid({"slowdown": ["3"]})
    assert slow == [("100mbit", 3.0, list(averaging_hosts.SLOW_CONFIGS))]
    with pytest.raises(ValueError, match="rate must be one of"):
        hosts.grid({"rate": ["10mbit"]})
    with pytest.raises(ValueError, match="unknown selection key"):
        averaging_hosts.grid({"H": ["16"]})
    with pytest.raises(ValueError, match="config must be one of"):
        averaging_hosts.grid({"config": ["avg/16/lamb/int8"]})
    assert across_hosts.selected_setting("hosts", {}) == "digits"
    assert hosts.grid({"setting": ["wide"]}) == full  # the model changes, not the grid
    for bad in (["huge"], ["digits", "wide"]):
        with pytest.raises(ValueError, match=r"setting must be one of \('digits', 'wide'\)"):
            hosts.grid({"setting": bad})
    with pytest.raises(ValueError, match="bench averaging_hosts: setting"):
        averaging_hosts.run(select={"setting": ["huge"]})


def test_config_names_choose_mode_wire_and_servers() -> None:
    from ivyplug.benchmarks.averaging_job import parse_config

    c = parse_config("ivy_ps/bfloat16/dedicated")
    assert (c["mode"], c["wire"], c["servers"]) == ("async", "bfloat16", 1)
    c = parse_config("ivy_ps/dedicated")
    assert (c["mode"], c["wire"], c["servers"]) == ("async", "float32", 1)
    c = parse_config("ivy_ps_sync/bfloat16")
    assert (c["mode"], c["wire"], c["servers"]) == ("sync", "bfloat16", 0)
    assert parse_config("ddp")["servers"] == 0 and parse_config("avg/16/nesterov/int8")["servers"] == 0
    c = parse_config("ivy_ps_sync/overlap_backward")
    assert (c["mode"], c["wire"], c["overlap_backward"]) == ("sync", "float32", True)
    c = parse_config("ivy_ps/bfloat16/overlap_backward/dedicated")
    assert (c["wire"], c["overlap_backward"], c["servers"]) == ("bfloat16", True, 1)
    assert parse_config("ivy_ps")["overlap_backward"] is False
    for bad in ("ivy_ps/bfloat16/dedicated/x", "ivy_ps/bfloat16/2", "ddp/dedicated", "ivy_ps/overlap_backward/x"):
        with pytest.raises(ValueError, match="unknown config"):
            parse_config(bad)
    assert set(hosts.CONFIGS) >= {"ivy_ps/dedicated", "ivy_ps/bfloat16/dedicated"}


def test_the_selected_setting_and_optimizer_reach_every_job(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, str]] = []

    def rounds(jobs: Any, *, setting: str, optimizer: str, **kwargs: Any) -> dict[str, Any]:
        seen.append((setting, optimizer))
        return {"skipped": None, "runs": []}

    monkeypatch.setattr(across_hosts, "run_rounds", rounds)
    results = hosts.run(select={"setting": ["wide"], "rate": ["1gbit"], "slowdown": ["1"]})
    assert seen == [("wide", "lamb")] and results["setting"] == "wide" and results["optimizer"] == "lamb"
    assert "model setting wide" in hosts.format_table(results) and "one worker each, LAMB," in hosts.format_table(
        results
    )
    assert hosts.run(select={"rate": ["1gbit"]})["setting"] == "digits" and seen[-1] == ("digits", "lamb")
    results = averaging_hosts.run(select={"optimizer": ["adamw"], "rate": ["1gbit"], "slowdown": ["1"]})
    assert seen[-1] == ("digits", "adamw") and "AdamW in LocalUpdates" in averaging_hosts.format_table(results)
    for bad in (["sgd"], ["lamb", "adamw"]):
        with pytest.raises(ValueError, match=r"bench hosts: optimizer must be one of \('adamw', 'lamb'\)"):
            hosts.run(select={"optimizer": bad})
    assert len(seen) == 3  # a bad selection is refused before any job starts
