"""``ivyplug serve`` on one emulated host, workers on another: real processes, real gloo, a real link.

Every host's name resolves to loopback on that host (as Debian and Ubuntu install machines), where gloo's
default device would listen on 127.0.1.1 and the other host could never connect.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from .helpers import ENV, TOKEN, Output, serve, service_worker

pytestmark = [pytest.mark.timeout(90), pytest.mark.slow]


@pytest.mark.parametrize("ifname", ["eth0", None], ids=["GLOO_SOCKET_IFNAME", "route"])
def test_a_worker_on_another_host_trains_on_the_serve(emulated_hosts: Any, tmp_path: Path, ifname: str | None) -> None:
    hosts = emulated_hosts(2, hostname_maps_to="loopback")
    env = {"GLOO_SOCKET_IFNAME": ifname} if ifname else {}
    server = serve(hosts, 0, "--shards", "2", "--workers", "1", env=env)
    before = hosts.link_bytes(1)
    result = tmp_path / "w.json"
    worker = service_worker(hosts, 1, f"{hosts[0].address}:29600", result, "--steps", "20", "--timeout", "20", env=env)
    assert worker.finish(60) == 0, worker.text()
    out = json.loads(result.read_text())
    assert "error" not in out, out
    assert out["end_loss"] < 0.5 * out["start_loss"]
    assert out["metrics"]["pushes"] == 20
    sent = hosts.link_bytes(1)[0] - before[0]
    assert sent > out["metrics"]["bytes_sent"], "the pushes did not cross the link"
    server.wait_for("worker 0 left", 10)


def test_loopback_across_hosts_is_refused_at_once_on_either_side(emulated_hosts: Any, tmp_path: Path) -> None:
    hosts = emulated_hosts(2, hostname_maps_to="address")
    address = f"{hosts[0].address}:29600"
    # the worker's own device on loopback (GLOO_SOCKET_IFNAME=lo) toward a serve on another host
    serve(hosts, 0, "--shards", "1", "--timeout", "60")
    t0 = time.monotonic()
    worker = service_worker(hosts, 1, address, tmp_path / "a.json", "--timeout", "60", env={"GLOO_SOCKET_IFNAME": "lo"})
    assert worker.finish(30) == 3, worker.text()
    error = json.loads((tmp_path / "a.json").read_text())["error"]
    assert time.monotonic() - t0 < 20
    assert error.startswith("PSAddressError")
    for words in ("127.0.0.1", "GLOO_SOCKET_IFNAME=lo", hosts[1].hostname, address.split(":")[0]):
        assert words in error, error


def test_a_serve_whose_device_is_loopback_refuses_a_remote_worker_at_once(emulated_hosts: Any, tmp_path: Path) -> None:
    hosts = emulated_hosts(2, hostname_maps_to="address")
    server = serve(hosts, 0, "--shards", "1", "--timeout", "60", env={"GLOO_SOCKET_IFNAME": "lo"})
    t0 = time.monotonic()
    worker = service_worker(hosts, 1, f"{hosts[0].address}:29600", tmp_path / "b.json", "--timeout", "60")
    assert worker.finish(30) == 3, worker.text()
    error = json.loads((tmp_path / "b.json").read_text())["error"]
    assert time.monotonic() - t0 < 20
    assert error.startswith("PSAddressError")
    for words in ("cannot reach this worker", "127.0.0.1", "GLOO_SOCKET_IFNAME", hosts[0].hostname, hosts[1].address):
        assert words in error, error
    server.wait_for("refused member 0", 5)


def test_a_serve_on_loopback_is_named_by_a_worker_on_another_host(emulated_hosts: Any, tmp_path: Path) -> None:
    hosts = emulated_hosts(2, hostname_maps_to="address")
    serve(hosts, 0, "--shards", "1", host="127.0.0.1")  # the default: workers of its own host only
    worker = service_worker(hosts, 1, f"{hosts[0].address}:29600", tmp_path / "c.json", "--timeout", "5")
    assert worker.finish(30) == 3, worker.text()
    result = json.loads((tmp_path / "c.json").read_text())
    # PSClient.start's own wait (the interpreter's start-up and imports are not ivyplug's): within the timeout, not
    # the twice the timeout torch's TCPStore client takes alone (it retries a refused connect after its timeout)
    print("PSClient.start waited", result["start_s"], "s")  # shown with -rA
    assert result["start_s"] < 5 + 2, result
    error = result["error"]
    for words in ("connection refused", "--host", "127.0.0.1", f"{hosts[0].address}:29600"):
        assert words in error, error


def test_a_service_on_loopback_cannot_join_a_job_served_beyond_it(emulated_hosts: Any) -> None:
    hosts = emulated_hosts(2, hostname_maps_to="address")
    first = serve(hosts, 0, "--shards", "1")
    cmd = [sys.executable, "-m", "ivyplug", "serve", "--shards", "1", "--host", "127.0.0.1", "--port", "29601"]
    cmd += ["--token", TOKEN, "--timeout", "20", "--join", f"{hosts[0].address}:29600"]
    second = Output(hosts.run(0, cmd, env=ENV))
    assert second.finish(30) == 2, second.text()
    for words in ("refused this service", "127.0.0.1:29601", "loopback", "--host"):
        assert words in second.text(), second.text()
    first.wait_for("refused service 127.0.0.1:29601", 5)
