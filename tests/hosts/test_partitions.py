"""Partitions of an ``ivyplug serve`` job across emulated hosts: a host's link cut (its packets dropped silently,
as on a pulled cable), not a process killed.

Lightning workers of one serve on host 0, one on host 0 and one on host 1, each a job of its own (they meet
through the serve's batch queue). A worker cut off for longer than the serve's bound is dropped by the serve
(its heartbeat stops), so the others are served on; in sync mode the step cannot complete without it, so every
worker ends with an error naming what is missing. A cut of the serve's own host ends every worker; a serve
restarted on its ``--state-dir`` afterwards resumes.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from .helpers import ENV, TOKEN, Output, serve, service_worker

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

LIGHTNING_JOB = str(Path(__file__).with_name("lightning_job.py"))
TIMEOUT = 8.0  # the serve's and the workers' timeout


def _worker(hosts: Any, i: int, out: Path, mode: str, epochs: int, servers: str) -> Output:
    out.mkdir(exist_ok=True)
    cmd = [sys.executable, LIGHTNING_JOB, str(out), "--strategy", f"ivy_ps_{mode}", "--nodes", "1"]
    cmd += ["--servers", servers, "--timeout", str(TIMEOUT), "--epochs", str(epochs), "--sleep", "0.05"]
    return Output(hosts.run(i, cmd, env={**ENV, "IVYPLUG_TOKEN": TOKEN}))


def _seconds(error_line: str) -> float:
    return float(error_line.split("error after ", 1)[1].split(" s", 1)[0])


def _ended_within(worker: Output, since: float, bound: float, what: str) -> str:
    """The worker's error line; AssertionError unless it exited non-zero within ``bound`` s of ``since``."""
    code = worker.finish(bound + 20)
    waited = time.monotonic() - since
    assert code == 3, f"{what}:\n{worker.text()[-3000:]}"
    assert waited <= bound, f"{what} ended {waited:.1f} s after the cut (bound {bound:g} s):\n{worker.text()[-3000:]}"
    print(f"{what} ended {waited:.1f} s after the cut")  # shown with -rA
    return worker.wait_for("error after", 1)


def test_a_silent_worker_does_not_stall_the_serve_for_the_others(emulated_hosts: Any, tmp_path: Path) -> None:
    """async: host 1's link cut for good while both train; host 0's worker reaches its epoch ends (where it
    waits on the batches the silent one holds) and must finish its fit; the cut-off one ends within timeout +
    10 s naming the serve."""
    hosts = emulated_hosts(2, hostname_maps_to="loopback")
    server = serve(hosts, 0, "--shards", "2", "--workers", "2", timeout=TIMEOUT)
    servers = f"{hosts[0].address}:29600"
    near = _worker(hosts, 0, tmp_path / "near", "async", 3, servers)
    far = _worker(hosts, 1, tmp_path / "far", "async", 3, servers)
    near.wait_for("batch 3", 90)
    far.wait_for("batch 3", 60)
    hosts.cut(1)
    cut = time.monotonic()
    error = _ended_within(far, cut, TIMEOUT + 10, "the cut-off worker")
    assert servers in error and "Error" in error, error
    line = server.wait_for("is gone: no heartbeat", 1)  # the serve dropped it before its own timeout
    assert hosts[1].address in line, line
    assert near.finish(90) == 0, near.text()[-3000:]
    near.wait_for("rank 0 done", 1)
    dropped = next(t for t, text in server.lines if "is gone: no heartbeat" in text) - cut
    print(f"the serve dropped the silent worker {dropped:.1f} s after the cut")
    assert dropped <= TIMEOUT


def test_sync_cannot_step_without_a_silent_worker_and_every_worker_says_why(
    emulated_hosts: Any, tmp_path: Path
) -> None:
    """sync: a step needs every worker, so host 1's cut ends both workers within timeout + 10 s; the one on the
    serve's host names the missing worker and its host, the cut-off one the serve; none hangs."""
    hosts = emulated_hosts(2, hostname_maps_to="loopback")
    serve(hosts, 0, "--shards", "2", "--workers", "2", timeout=TIMEOUT)
    servers = f"{hosts[0].address}:29600"
    near = _worker(hosts, 0, tmp_path / "near", "sync", 20, servers)
    far = _worker(hosts, 1, tmp_path / "far", "sync", 20, servers)
    near.wait_for("batch 3", 90)
    far.wait_for("batch 3", 60)
    hosts.cut(1)
    cut = time.monotonic()
    near_error = _ended_within(near, cut, TIMEOUT + 10, "the worker on the serve's host")
    far_error = _ended_within(far, cut, TIMEOUT + 10, "the cut-off worker")
    assert re.search(r"worker \d is gone", near_error) and hosts[1].address in near_error, near_error
    assert servers in far_error, far_error


def test_a_cut_of_the_serves_host_ends_the_workers_and_a_restarted_serve_resumes(
    emulated_hosts: Any, tmp_path: Path
) -> None:
    """The serve's host is cut off: the worker on the other host ends within timeout + 10 s naming the serve
    (and the serve drops it); after the link heals the serve is killed (as a host that went down) and started
    again on its --state-dir: it resumes at the version it had saved, and a new run trains on from there.
    (PSClient workers: their start-up is short; Lightning's and Keras's cut-off ends are checked in
    test_training_across_hosts.py.)"""
    hosts = emulated_hosts(2, hostname_maps_to="loopback")
    state = tmp_path / "state"
    args = ("--shards", "2", "--workers", "1", "--state-dir", str(state), "--snapshot-every", "1")
    server = serve(hosts, 0, *args, timeout=5.0)
    servers = f"{hosts[0].address}:29600"
    common = ("--mode", "async", "--sleep", "0.05", "--timeout", "5")
    worker = service_worker(hosts, 1, servers, tmp_path / "w.json", "--steps", "1000", *common)
    server.wait_for("version 2", 60)  # it trains
    hosts.cut(0)
    cut = time.monotonic()
    assert worker.finish(5 + 10) != 0, worker.text()[-3000:]
    print(f"the worker cut off from the serve's host ended {time.monotonic() - cut:.1f} s after the cut")
    assert f"the ivyplug serve at {servers}: timed out after 5 s" in worker.text(), worker.text()[-3000:]
    server.wait_for("is gone: no heartbeat", 5)
    hosts.heal(0)
    time.sleep(2.0)  # a snapshot after the last push (every 1 s)
    versions = [int(v) for v in re.findall(r"version (\d+)$", server.text(), re.M)]
    server.proc.kill()  # the serve's host goes down: no last snapshot at shutdown
    server.finish(10)
    restarted = serve(hosts, 0, *args, timeout=5.0)
    resumed = int(restarted.wait_for("resumed at version", 1).split("resumed at version ")[1].rstrip(")"))
    assert resumed == versions[-1] > 0, (resumed, versions)
    again = service_worker(hosts, 1, servers, tmp_path / "again.json", "--steps", "20", *common)
    assert again.finish(60) == 0, again.text()[-3000:]
    assert json.loads((tmp_path / "again.json").read_text())["metrics"]["pushes"] == 20
    restarted.wait_for(f"version {resumed + 20}", 5)  # the new run trained on the resumed shards
