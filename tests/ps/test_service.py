"""``ivyplug serve`` with real worker processes that join it by address (service_worker.py)."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from ivyplug.ps import PSClient, PSConfig
from ivyplug.ps.server.endpoints import PSServerError
from ivyplug.ps.server.service import PSService
from ivyplug.ps.wire.transport import PSTimeoutError
from tests.ports import free_port
from tests.ps.service_harness import result, serve, workers

pytestmark = pytest.mark.timeout(240)

WAITING_LOGGER = "ivyplug.ps.wire.gloo_net"


def test_two_workers_train_then_a_new_run_continues_from_the_live_servers(tmp_path: Path) -> None:
    with serve("--shards", "2", "--workers", "2", "--status-every", "1") as s, workers(tmp_path) as w:
        # started together, and each trains for 3 s at least: the two are connected at once (a worker that left
        # frees its slot for the next), even where one's start is seconds slower than the other's
        a = w.start(s.address, "a", "--steps", "30", "--sleep", "0.1")
        b = w.start(s.address, "b", "--steps", "30", "--seed", "1", "--sleep", "0.1")
        for rc, text in w.wait():
            assert rc == 0, text
        ra, rb = result(a), result(b)
        assert sorted([ra["slot"], rb["slot"]]) == [0, 1]
        assert [ra["created"], rb["created"]].count(True) == 1  # one of them created the job
        first = ra if ra["created"] else rb
        for r in (ra, rb):
            assert r["metrics"]["pushes"] == 30
            assert r["end_loss"] < 0.5 * first["start_loss"]
        s.wait_for("worker 0 left")
        s.wait_for("worker 1 left")
        # a warm restart: every worker has left; a new run of the same model continues from the servers' state
        c = w.start(s.address, "c", "--steps", "2", "--seed", "7")
        for rc, text in w.wait():
            assert rc == 0, text
        rc_ = result(c)
        assert rc_["created"] is False
        assert rc_["start_loss"] < 0.5 * first["start_loss"]  # not the fresh model (control: first's start)
        line = s.wait_for("pushes/s")
        assert "workers connected" in line and "MB" in line


def test_a_wrong_token_or_another_model_is_refused_and_the_others_go_on(tmp_path: Path) -> None:
    with serve("--shards", "1", "--workers", "2", "--token", "s3cret") as s, workers(tmp_path) as w:
        good = w.start(s.address, "good", "--steps", "60", "--token", "s3cret", "--sleep", "0.02")
        s.wait_for("worker 0 joined")
        wrong = w.start(s.address, "wrong", "--token", "guess")
        none = w.start(s.address, "none")
        other = w.start(s.address, "other", "--token", "s3cret", "--hidden", "12")
        codes = w.wait()
        assert codes[0][0] == 0, codes[0][1]
        assert all(rc == 3 for rc, _ in codes[1:]), codes
        assert "PSAuthError" in result(wrong)["error"] and "token" in result(wrong)["error"]
        assert "PSAuthError" in result(none)["error"]
        err = result(other)["error"]
        assert "PSJoinRefused" in err and "(12, 8)" in err and "(16, 8)" in err, err
        assert result(good)["metrics"]["pushes"] == 60
        assert "wrong token" in s.log()


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_a_killed_worker_leaves_the_others_training(tmp_path: Path, mode: str) -> None:
    extra = ["--mode", mode] + (["--staleness", "1"] if mode == "ssp" else [])
    with serve("--shards", "2", "--workers", "2", "--timeout", "20") as s, workers(tmp_path) as w:
        alive = w.start(s.address, "alive", "--steps", "50", "--sleep", "0.02", *extra)
        w.start(s.address, "dies", "--steps", "50", "--die-at", "5", "--seed", "1", *extra)
        codes = w.wait()
        assert codes[0][0] == 0, codes[0][1]
        assert codes[1][0] == -signal.SIGKILL
        r = result(alive)
        assert r["metrics"]["pushes"] == 50  # ssp would block on the dead worker if it still counted
        assert r["end_loss"] < r["start_loss"]
        assert "is gone" in s.wait_for("is gone")


def test_sync_mode_a_killed_worker_ends_the_others_with_an_error_naming_it(tmp_path: Path) -> None:
    with serve("--shards", "1", "--workers", "2", "--timeout", "20") as s, workers(tmp_path) as w:
        w.start(s.address, "alive", "--steps", "50", "--mode", "sync", "--timeout", "20")
        w.start(s.address, "dies", "--steps", "50", "--die-at", "5", "--seed", "1", "--mode", "sync")
        (rc, text), (rc2, _) = w.wait()
        assert rc2 == -signal.SIGKILL
        assert rc != 0
        assert "is gone" in text and "worker" in text, text
        s.wait_for("is gone")


def test_a_frozen_worker_is_dropped_for_its_silence_and_refused_when_it_wakes(tmp_path: Path) -> None:
    """A worker frozen by SIGSTOP is silent with its connections open, as one behind a cut link: the serve drops
    it once its heartbeat has stopped for the bound (timeout 6 s: 4.5 s), and what it sends after SIGCONT is
    refused with that reason."""
    with serve("--shards", "2", "--workers", "2", "--timeout", "6") as s, workers(tmp_path) as w:
        w.start(s.address, "alive", "--steps", "80", "--sleep", "0.02", "--timeout", "6")
        w.start(s.address, "frozen", "--steps", "1000", "--sleep", "0.02", "--timeout", "60", "--seed", "1")
        s.wait_for("2 workers connected")
        frozen = w.procs[1][0]
        os.kill(frozen.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        line = s.wait_for("is gone: no heartbeat", 15)
        waited = time.monotonic() - stopped
        assert 4.5 - 1.0 <= waited <= 4.5 + 2.0, (waited, line)  # the bound, not the 60 s of its own timeout
        os.kill(frozen.pid, signal.SIGCONT)
        (rc, text), (rc2, text2) = w.wait(60)
        assert rc == 0, text
        assert rc2 != 0 and "was dropped by ivyplug serve" in text2 and "no heartbeat" in text2, text2[-3000:]


def test_a_dropped_worker_is_refused_every_request_not_only_the_first() -> None:
    """A worker may take a refused request for a fallback and go on (a refused SHM_ATTACH leaves its shard on
    gloo): its next request must be refused too, with the same reason, not left to wait for its timeout (a
    worker frozen while it attached its regions waited 60 s for a loop that had ended)."""
    lines: list[str] = []
    svc = PSService(2, port=0, num_workers=1, timeout=4, status_every=None, log=lines.append)
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        cfg = PSConfig(mode="async", servers=svc.address, timeout=4)
        client = PSClient.start(cfg, list(model.named_parameters()), [], torch.optim.SGD(model.parameters(), lr=0.1))
        try:
            client.pull_initial()
            assert client.topo.link is not None and client.topo.link.heartbeat is not None
            client.topo.link.heartbeat.stop()  # silent, its connection open: as a frozen or cut-off worker
            deadline = time.monotonic() + 10
            while not any("no heartbeat" in line for line in lines) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert any("no heartbeat" in line for line in lines), lines
            for _ in range(3):  # answered with the reason: before, the second waited out its timeout (PSTimeoutError)
                with pytest.raises(PSServerError, match="was dropped by ivyplug serve"):
                    client.pull_initial()
        finally:
            with contextlib.suppress(Exception):
                client.close()
    finally:
        svc.close()


def _lone_worker(address: str, timeout: float) -> PSClient:
    """A worker of a small linear model (SGD) that joins the serve at ``address`` on its own."""
    model = torch.nn.Linear(4, 2)
    cfg = PSConfig(mode="async", servers=address, timeout=timeout)
    return PSClient.start(cfg, list(model.named_parameters()), [], torch.optim.SGD(model.parameters(), lr=0.1))


def _close_all(clients: list[PSClient], svc: PSService) -> None:
    for c in clients:
        with contextlib.suppress(Exception):
            c.close()
    svc.close()


def test_lone_workers_of_one_serve_are_known_by_their_slots() -> None:
    """Two workers that join one serve each on their own are each rank 0 of a job of their own; ``worker`` (the
    index their metrics are logged under, ``ivy/rank{worker}/...``) is the slot the serve gave each."""
    svc = PSService(1, port=0, num_workers=2, timeout=10, status_every=None, log=lambda line: None)
    clients: list[PSClient] = []
    try:
        clients += [_lone_worker(svc.address, 10), _lone_worker(svc.address, 10)]
        assert [c.rank for c in clients] == [0, 0]
        assert [c.worker for c in clients] == [0, 1]
    finally:
        _close_all(clients, svc)


def _epoch(client: PSClient, epoch: int, num_batches: int, until: int | None = None) -> list[int]:
    """The indices ``client`` is handed in ``epoch`` (its reserved 0 first), at most ``until`` of them."""
    client.start_epoch(epoch, num_batches, reserved=1)
    return _more(client, [0], until)


def _more(client: PSClient, got: list[int], until: int | None = None) -> list[int]:
    while until is None or len(got) < until:
        index = client.next_batch(finished=len(got))
        if index is None:
            client.end_epoch()
            break
        got.append(index)
    return got


def test_lone_workers_of_one_serve_train_every_batch_of_their_own_epochs() -> None:
    """Two lone workers (each a job of its own, as with one torchrun per host) are at different epochs of their
    fits: neither one's start of an epoch may cut the other's short or hand it an index twice. Both shared the
    service's queue: a worker's epoch start restarted the other's epoch, which then lost its remaining batches."""
    svc = PSService(1, port=0, num_workers=2, timeout=10, status_every=None, log=lambda line: None)
    clients: list[PSClient] = []
    try:
        clients += [_lone_worker(svc.address, 10), _lone_worker(svc.address, 10)]
        a, b = clients
        assert _epoch(a, 0, 6) == list(range(6))
        half = _epoch(a, 1, 6, until=3)
        assert _epoch(b, 0, 6) == list(range(6))  # b starts its first epoch while a is in its second
        assert _more(a, half) == list(range(6))
        first_b = _epoch(b, 1, 6, until=2)
        assert _epoch(a, 2, 6) == list(range(6))
        assert _more(b, first_b) == list(range(6))
    finally:
        _close_all(clients, svc)


def test_a_worker_waiting_for_a_serve_that_does_not_answer_says_so_once_then_names_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A refused connection is tried again until ``timeout`` (a serve being restarted is waited for): after a
    moment the worker says once that it is waiting, then the error names the reason, once."""
    address = f"127.0.0.1:{free_port()}"
    start = time.monotonic()
    expected = r"no ivyplug serve answered .* within 4 s: nothing listens"
    with caplog.at_level(logging.WARNING, logger=WAITING_LOGGER), pytest.raises(PSTimeoutError, match=expected) as err:
        _lone_worker(address, 4)
    assert 3.5 < time.monotonic() - start < 9
    waiting = [r.getMessage() for r in caplog.records if "yet" in r.getMessage()]
    assert len(waiting) == 1 and f"no ivyplug serve answers at {address} yet (connection refused)" in waiting[0]
    assert str(err.value).count("connection refused") == 1, err.value


def test_a_job_with_another_optimizer_is_refused_naming_the_optimizer() -> None:
    """The servers run LAMB; a worker of the same model with SGD is refused for its optimizer, not for the
    ``max_shard_bytes`` that ``"auto"`` derives from it (which differs too, and was named first)."""
    from ivyplug.optim import LAMB
    from ivyplug.ps.worker.service_link import PSJoinRefused

    svc = PSService(2, port=0, num_workers=2, timeout=10, status_every=None, log=lambda line: None)
    first: PSClient | None = None
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 2))
        cfg = PSConfig(mode="async", servers=svc.address, timeout=10)
        first = PSClient.start(cfg, list(model.named_parameters()), [], LAMB(model.parameters(), lr=0.01))
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(PSJoinRefused, match=r"its optimizer class is 'torch\.optim\.SGD', the servers' 'ivyplug"):
            PSClient.start(cfg, list(model.named_parameters()), [], sgd)
    finally:
        if first is not None:
            first.close()
        svc.close()


def test_an_aborted_worker_leaves_at_once_and_its_slot_is_freed_for_its_silence() -> None:
    """``abort()`` (a failed fit's close) says no goodbye and waits for nothing: it returns at once, its heartbeat
    stops, so the serve drops the worker for its silence and a new worker gets its slot; ``close()`` after it does
    nothing."""
    lines: list[str] = []
    svc = PSService(1, port=0, num_workers=1, timeout=4, status_every=None, log=lines.append)
    clients: list[PSClient] = []
    try:
        clients.append(_lone_worker(svc.address, 4))
        link = clients[0].topo.link
        assert link is not None and link.heartbeat is not None
        start = time.monotonic()
        clients[0].abort()
        assert time.monotonic() - start < 2.0
        assert clients[0].closed and link.heartbeat.stopped.is_set()
        clients[0].close()  # nothing left to do
        deadline = time.monotonic() + 15
        while not any("no heartbeat" in line for line in lines) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert any("worker 0 is gone: no heartbeat" in line for line in lines), lines
        clients.append(_lone_worker(svc.address, 4))
        assert clients[1].worker == 0  # the one slot, free again
    finally:
        _close_all(clients, svc)


def test_a_client_dropped_without_close_stops_its_heartbeat() -> None:
    """A client lost without close() (a failed caller) stops its heartbeat thread once collected; before, every
    such client kept a thread and a store connection for the life of the process (the fuzz test leaked one per
    example until the service's store ran out of descriptors)."""
    svc = PSService(1, port=0, num_workers=1, timeout=10, status_every=None, log=lambda line: None)
    try:
        model = torch.nn.Linear(4, 2)
        cfg = PSConfig(mode="async", servers=svc.address, timeout=10)
        client = PSClient.start(cfg, list(model.named_parameters()), [], torch.optim.SGD(model.parameters(), lr=0.1))
        assert client.topo.link is not None and client.topo.link.heartbeat is not None
        beat = client.topo.link.heartbeat
        assert beat.is_alive() and not beat.stopped.is_set()
        del client
        gc.collect()
        beat.join(5)
        assert beat.stopped.is_set() and not beat.is_alive()
    finally:
        svc.close()


def test_sigterm_ends_serve_cleanly_with_a_last_snapshot(tmp_path: Path) -> None:
    state = tmp_path / "state"
    args = ("--shards", "2", "--workers", "1", "--state-dir", str(state), "--snapshot-every", "600")
    with serve(*args) as s, workers(tmp_path) as w:
        w.start(s.address, "first", "--steps", "30")
        ((rc, text),) = w.wait()
        assert rc == 0, text
        assert not (state / "job.ivys").exists()  # no interval has passed: only the shutdown writes it
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(30) == 0
        assert (state / "job.ivys").exists()
    with serve(*args) as s:
        assert "resumed at version 30" in s.wait_for("listening on")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--shards", "1", "--host", "0.0.0.0"], "--token"),
        (["--shards", "0"], "--shards"),
        (["--shards", "1", "--snapshot-every", "5"], "--state-dir"),
    ],
)
def test_bad_options_are_refused_before_anything_listens(
    args: list[str], message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from ivyplug.cli import main

    monkeypatch.delenv("IVYPLUG_TOKEN", raising=False)
    assert main(["serve", "--port", "0", *args]) == 2
    out = capsys.readouterr()
    assert message in out.err and "listening" not in out.out


def test_a_killed_serve_ends_its_workers_naming_it_and_a_restart_from_its_state_dir_resumes(tmp_path: Path) -> None:
    from tests.ports import free_port

    state, port = tmp_path / "state", str(free_port())
    args = ("--shards", "2", "--workers", "1", "--state-dir", str(state), "--snapshot-every", "0.3")
    with serve(*args, port=port) as s, workers(tmp_path) as w:
        w.start(s.address, "victim", "--steps", "400", "--sleep", "0.02", "--timeout", "20")
        s.wait_for("worker 0 joined")
        deadline = time.monotonic() + 60
        while not (state / "job.ivys").exists() or not any(" pushes/s" in x and "version 0" not in x for x in s.lines):
            assert time.monotonic() < deadline, s.log()
            time.sleep(0.1)  # until it served pushes and snapshotted them
        time.sleep(0.5)
        os.kill(s.proc.pid, signal.SIGKILL)
        ((rc, text),) = w.wait(timeout=60)
        assert rc != 0
        assert f"ivyplug serve at {s.address}" in text and "gone" in text, text[-3000:]
        assert (state / "job.ivys").exists(), s.log()
        address = s.address
    with serve(*args, port=port) as s, workers(tmp_path) as w:
        assert "resumed at version" in s.wait_for("listening on") and s.address == address
        again = w.start(s.address, "again", "--steps", "1")
        ((rc, text),) = w.wait()
        assert rc == 0, text
    r = result(again)
    assert r["created"] is False and r["start_loss"] < 0.5 * 0.7  # trained state (a fresh model starts at ~0.7)


def test_two_services_hold_the_shards_of_one_job_and_resume_it_from_their_snapshots(tmp_path: Path) -> None:
    """Two services behind one address train one job; each snapshots its own shards; restarted (the later one
    at a new port, claiming its shards back), they serve the trained job to a new worker."""
    from ivyplug.ps.server.service import PSService

    first_dir, second_dir = tmp_path / "first", tmp_path / "second"
    snap = ("--snapshot-every", "0.3", "--token", "t")
    with serve("--shards", "1", "--workers", "2", "--state-dir", str(first_dir), *snap) as first:
        with pytest.raises(ValueError, match="refused this service: wrong token"):
            PSService(1, port=0, token="not-it", join=first.address, status_every=None, timeout=20)
        with serve("--shards", "2", "--join", first.address, "--state-dir", str(second_dir), *snap) as second:
            assert "shards 1..2 of the job served from" in second.wait_for("listening on")
            first.wait_for("holds shards 1..2")
            with workers(tmp_path) as w:
                a = w.start(first.address, "a", "--steps", "30", "--token", "t")
                b = w.start(first.address, "b", "--steps", "30", "--seed", "1", "--token", "t")
                for rc, text in w.wait():
                    assert rc == 0, text + first.log() + second.log()
            for r in (result(a), result(b)):
                assert r["num_shards"] == 3 and r["metrics"]["pushes"] == 30
                assert r["end_loss"] < 0.5 * 0.7
            assert second.log().count("joined") == 2 and first.log().count("joined") == 2
            time.sleep(1.0)  # a snapshot after the last push
            assert (first_dir / "job.ivys").exists() and (second_dir / "job.ivys").exists()
        address = first.address
    port = address.rsplit(":", 1)[1]
    with serve("--shards", "1", "--workers", "2", "--state-dir", str(first_dir), *snap, port=port) as first:
        assert "resumed at version" in first.wait_for("listening on")
        with serve("--shards", "2", "--join", first.address, "--state-dir", str(second_dir), *snap) as second:
            assert "resumed at version" in second.wait_for("listening on")
            first.wait_for("holds shards 1..2")  # the restarted holder took its shards back, at its new address
            with workers(tmp_path) as w:
                again = w.start(first.address, "again", "--steps", "1", "--token", "t")
                ((rc, text),) = w.wait()
                assert rc == 0, text + first.log() + second.log()
    r = result(again)
    assert r["created"] is False and r["num_shards"] == 3
    assert r["start_loss"] < 0.5 * 0.7  # every shard's trained state: a fresh model starts near 0.7
