"""Partitions of an ``ivyplug serve`` job across emulated hosts: a host's link cut (its packets dropped silently,
as on a pulled cable), not a process killed.

Lightning workers of one serve on host 0, one on host 0 and one on host 1, each a job of its own (they meet
through the serve's batch queue). A worker cut off for longer than the serve's bound is dropped by the serve
(its heartbeat stops), so the others are served on; in sync mode the step cannot complete without it, so every
worker ends with an error naming what is missing. A cut of the serve's own host ends every worker; a serve
restarted on its ``--state-dir`` afterwards resumes.
"""

from __future__ import annotations

import itertools
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from .helpers import ENV, SERVICE_WORKER, TOKEN, Output, serve

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

LIGHTNING_JOB = str(Path(__file__).with_name("lightning_job.py"))
TIMEOUT = 8.0  # the serve's and the workers' timeout


def _worker(hosts: Any, i: int, out: Path, mode: str, epochs: int, servers: str, hold: Path | None = None) -> Output:
    out.mkdir(exist_ok=True)
    cmd = [sys.executable, LIGHTNING_JOB, str(out), "--strategy", f"ivy_ps_{mode}", "--nodes", "1"]
    cmd += ["--servers", servers, "--timeout", str(TIMEOUT), "--epochs", str(epochs), "--sleep", "0.05"]
    cmd += ["--hold", str(hold)] if hold is not None else []
    # each worker is a one-process Lightning job with a store of its own: two of them starting at once on one
    # host must not draw the same free port (Lightning picks one when MASTER_PORT is unset; EADDRINUSE seen)
    port = str(next(_MASTER_PORTS))
    return Output(hosts.run(i, cmd, env={**ENV, "IVYPLUG_TOKEN": TOKEN, "MASTER_PORT": port}))


_MASTER_PORTS = itertools.count(29650)


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


def test_a_silent_worker_does_not_stall_the_serve_and_sync_says_who_is_missing(
    emulated_hosts: Any, tmp_path: Path
) -> None:
    """Two serves on host 0, one async and one sync, each with a Lightning worker on host 0 and one on host 1
    (side by side: their start-up dominates); host 1's link is cut for good while all train.

    async: host 0's worker reaches its epoch ends (where it waits on the batches the silent one holds) and must
    finish its fit. sync: a step needs every worker, so host 0's worker ends within timeout + 10 s naming the
    missing worker and its host. Every cut-off worker ends within timeout + 10 s naming its serve; none hangs.
    """
    hosts = emulated_hosts(2, hostname_maps_to="loopback")
    jobs = {}
    go = tmp_path / "go"  # every worker holds after its 4th batch until this exists: none is done at the cut
    for mode, port, epochs in (("async", 29600, 3), ("sync", 29601, 20)):
        server = serve(hosts, 0, "--shards", "2", "--workers", "2", timeout=TIMEOUT, port=port)
        servers = f"{hosts[0].address}:{port}"
        near = _worker(hosts, 0, tmp_path / f"{mode}-near", mode, epochs, servers, hold=go)
        far = _worker(hosts, 1, tmp_path / f"{mode}-far", mode, epochs, servers, hold=go)
        jobs[mode] = (server, servers, near, far)
    for _, _, near, far in jobs.values():
        near.wait_for("holding", 90)
        far.wait_for("holding", 60)
    go.touch()
    time.sleep(0.5)  # they train on
    hosts.cut(1)
    cut = time.monotonic()

    server, servers, near, far = jobs["sync"]
    near_error = _ended_within(near, cut, TIMEOUT + 10, "sync: the worker on the serve's host")
    assert re.search(r"worker \d is gone", near_error) and hosts[1].address in near_error, near_error
    assert servers in _ended_within(far, cut, TIMEOUT + 10, "sync: the cut-off worker")

    server, servers, near, far = jobs["async"]
    error = _ended_within(far, cut, TIMEOUT + 10, "async: the cut-off worker")
    assert servers in error and "Error" in error, error
    line = server.wait_for("is gone: no heartbeat", 1)  # the serve dropped it before its own timeout
    assert hosts[1].address in line, line
    dropped = next(t for t, text in server.lines if "is gone: no heartbeat" in text) - cut
    print(f"async: the serve dropped the silent worker {dropped:.1f} s after the cut")
    assert dropped <= TIMEOUT
    assert near.finish(90) == 0, near.text()[-3000:]
    near.wait_for("rank 0 done", 1)


def test_a_cut_of_the_serves_host_ends_its_worker_and_torchrun_restarts_it_into_the_resumed_serve(
    emulated_hosts: Any, tmp_path: Path
) -> None:
    """The serve's host is cut off and goes down: the worker on the other host (a PSClient under torchrun, one
    node per host) ends within timeout + 10 s naming the serve, which drops it. ``ivyplug serve --state-dir`` is
    started again once the link is back and resumes at the version it had saved; torchrun's restart of the
    worker joins it and trains on. (Lightning's and Keras's cut-off ends: test_training_across_hosts.py.)"""
    hosts = emulated_hosts(2, hostname_maps_to="loopback")
    timeout, steps = 5.0, 40
    state = tmp_path / "state"
    args = ("--shards", "2", "--workers", "1", "--state-dir", str(state), "--snapshot-every", "1")
    server = serve(hosts, 0, *args, timeout=timeout)
    servers = f"{hosts[0].address}:29600"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    cmd += ["--max-restarts", "6", SERVICE_WORKER, servers, str(tmp_path / "w.json"), "--token", TOKEN]
    cmd += ["--steps", str(steps), "--sleep", "0.2", "--timeout", str(timeout)]
    worker = Output(hosts.run(1, cmd, env=ENV))
    server.wait_for("version 3", 60)  # it trains
    hosts.cut(0)
    cut = time.monotonic()
    worker.wait_for(f"the ivyplug serve at {servers}: timed out after {timeout:g} s", timeout + 10)
    print(f"the worker cut off from the serve's host failed {time.monotonic() - cut:.1f} s after the cut")
    server.wait_for("is gone: no heartbeat", 5)
    time.sleep(1.5)  # a snapshot after the last push (every 1 s)
    versions = [int(v) for v in re.findall(r"version (\d+)$", server.text(), re.M)]
    server.proc.kill()  # the serve's host went down: no last snapshot at shutdown
    server.finish(10)
    hosts.heal(0)
    restarted = serve(hosts, 0, *args, timeout=timeout)
    resumed = int(restarted.wait_for("resumed at version", 1).split("resumed at version ")[1].rstrip(")"))
    assert resumed == versions[-1] > 0, (resumed, versions)
    assert worker.finish(90) == 0, worker.text()[-3000:]
    out = json.loads((tmp_path / "w.json").read_text())
    assert out["attempt"] >= 1 and out["metrics"]["pushes"] == steps, out
    restarted.wait_for(f"version {resumed + steps}", 5)  # the restarted worker trained on the resumed shards
    print(f"torchrun's attempt {out['attempt']} finished on the restarted serve")
