"""A PS peer that dies: the survivors get a clear error naming it and still exit; orphaned servers end.

Real processes. A co-located peer killed by SIGKILL (no teardown) is detected by gloo as a closed
connection, at once or within ``timeout``; dedicated server processes whose rank 0 is SIGKILLed end by
themselves through their parent watchdog (their any-source receive has no timeout of ours).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
import torch
import torch.multiprocessing as mp

from tests.ports import free_port
from tests.ps.failure_scenarios import killed_peer, parked_push_refused
from tests.ps.harness import run_workers

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 3.0


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.timeout(200)
def test_killed_colocated_peer_fails_the_step_naming_it_and_the_survivor_exits(tmp_path: Path) -> None:
    """async, 2 workers; rank 1 is SIGKILLed: rank 0's step and close raise PSProtocolError naming rank 1
    within the timeout, and rank 0 then exits by itself with code 0 (its server thread is a daemon)."""
    out = tmp_path / "rank0.pt"
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [
        ctx.Process(target=killed_peer, args=(r, 2, port, "async", TIMEOUT_S, str(out)), daemon=False) for r in range(2)
    ]
    try:
        for p in procs:
            p.start()
        procs[0].join(150)
        assert procs[0].exitcode == 0, f"rank 0 did not exit cleanly (exit code {procs[0].exitcode})"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
    assert procs[1].exitcode == -signal.SIGKILL
    result = torch.load(out, weights_only=False)
    for what in ("step", "close"):
        assert result[what]["type"] == "PSProtocolError", result
        assert "PS rank 1 is gone" in result[what]["error"], result
        assert result[what]["seconds"] <= TIMEOUT_S + 2.0, result
    assert result["destroy_seconds"] < 10.0


@dataclass
class Job:
    """A one-worker dedicated-server job in a subprocess (tests.ps.failure_scenarios)."""

    proc: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)  # stdout up to the SERVERS line
    servers: list[int] = field(default_factory=list)
    stderr: list[str] = field(default_factory=list)  # complete once every holder of the pipe exited


@contextmanager
def dedicated_job(*args: str) -> Iterator[Job]:
    """Start the job, wait for its server pids; on the way out kill whatever is left (also on failure)."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.ps.failure_scenarios", *args],
        cwd=REPO,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # the server joins its process group: one killpg cleans up on failure
    )
    job = Job(proc)
    reader = threading.Thread(target=lambda: job.stderr.append(proc.stderr.read() if proc.stderr else ""))
    reader.daemon = True
    reader.start()
    try:
        deadline = time.monotonic() + 150
        line = ""
        while time.monotonic() < deadline and proc.stdout is not None:
            line = proc.stdout.readline()
            job.lines.append(line)
            if not line or line.startswith("SERVERS"):
                break
        assert line.startswith("SERVERS"), f"the job did not start its server: {job.lines}"
        job.servers = [int(x) for x in line.split()[1:]]
        assert len(job.servers) == 1 and not _gone(job.servers[0])
        yield job
        reader.join(10)  # every holder of the stderr pipe (the job, its server) is gone: EOF
    finally:
        for pid in job.servers:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _wait_gone(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not all(_gone(p) for p in pids):
        time.sleep(0.1)
    return all(_gone(p) for p in pids)


@pytest.mark.timeout(200)
def test_dedicated_servers_exit_when_rank0_is_killed() -> None:
    """num_servers=1: SIGKILL the job's rank 0 (no teardown); its server process ends within a few
    seconds, saying why on stderr. Before that, a push the server refuses fails at once with its error."""
    with dedicated_job() as job:
        # the refused push came back as an error reply at once (not a PSTimeoutError after 60 s)
        refused = json.loads(next(x for x in job.lines if x.startswith("ERROR_REPLY")).split(" ", 1)[1])
        assert refused["type"] in ("PSProtocolError", "PSServerError"), refused  # PSServerError: a PSProtocolError
        assert "failed while answering the push/pull of shard 0" in refused["error"], refused
        assert "push from worker 0 has 3 values, expected" in refused["error"], refused  # the server's own text
        assert refused["seconds"] < 30, refused
        os.kill(job.proc.pid, signal.SIGKILL)
        job.proc.wait(10)
        assert _wait_gone(job.servers, 10.0), "a dedicated server outlived its rank 0"
    # it saw its only worker's connection close (or, as a backstop, its watchdog saw rank 0 gone)
    err = "".join(job.stderr)
    assert ("worker 0 is gone" in err and "exiting" in err) or "dedicated server: rank 0 is gone, exiting" in err, err


@pytest.mark.timeout(200)
def test_rank0_that_fails_before_close_still_exits_and_ends_its_servers() -> None:
    """Rank 0 raises without calling close(): its interpreter exits (the servers are daemonic children,
    terminated at exit, not joined while they wait for a BYE that never comes) and no server is left."""
    with dedicated_job("without-close") as job:
        assert job.proc.stdin is not None
        job.proc.stdin.write("fail now\n")  # only now: until here the server must be alive
        job.proc.stdin.flush()
        assert job.proc.wait(60) == 1
        assert _wait_gone(job.servers, 10.0), "a dedicated server outlived its rank 0"
    assert "user code failed before close()" in "".join(job.stderr)


@pytest.mark.timeout(120)
def test_a_failing_shard_answers_parked_pushes_at_once() -> None:
    """A push parked on a shard that then fails gets an error reply, not a wait of ``timeout`` (30 s)."""
    r0, r1 = run_workers(parked_push_refused, 2, timeout=90)
    assert r0["type"] in ("PSProtocolError", "PSServerError"), r0
    assert r1["type"] in ("PSProtocolError", "PSServerError"), r1
    assert "failed while answering" in r1["error"]
    assert r1["seconds"] < 15.0, r1  # about 1 s of rank 0's sleep; a timeout would take 30 s
