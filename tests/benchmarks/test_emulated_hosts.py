"""The emulated hosts themselves: addresses, private /dev/shm and hostnames, links that cut, full cleanup."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(60)

CONNECT = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), 3).close()"
LISTEN = """import socket, sys, time
s = socket.socket()
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen(8)
print("up", flush=True)
c, _ = s.accept()
while c.recv(1 << 20):
    pass
c.close()
time.sleep(60)
"""
SEND = """import socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), 5)
block = bytes(1 << 20)
t = time.monotonic()
for _ in range(int(sys.argv[3])):
    s.sendall(block)
s.shutdown(socket.SHUT_WR)
s.recv(1)
print(time.monotonic() - t)
"""


def _listen(hosts: Any, i: int, address: str, port: int) -> subprocess.Popen[str]:
    proc = hosts.run(i, [sys.executable, "-c", LISTEN, address, str(port)])
    assert proc.stdout.readline().strip() == "up"
    return proc


def test_hosts_reach_each_other_have_own_shm_and_hostnames_and_clean_up(emulated_hosts: Any) -> None:
    hosts = emulated_hosts(3, hostname_maps_to="loopback")
    listener = _listen(hosts, 0, hosts[0].address, 7000)
    hosts.check(2, [sys.executable, "-c", CONNECT, hosts[0].address, "7000"])  # through the bridge
    # /dev/shm is the host's own: a file written on host 1 is seen on host 1 only
    hosts.check(1, ["sh", "-c", "echo x > /dev/shm/ivy-probe"])
    assert hosts.check(1, ["ls", "/dev/shm"]).split() == ["ivy-probe"]
    assert hosts.check(2, ["ls", "/dev/shm"]).split() == []
    # the hostname maps to loopback on its own host, to the routable address on the others
    name = hosts[1].hostname
    assert hosts.check(1, ["hostname"]).strip() == name
    assert hosts.check(1, ["getent", "hosts", name]).split()[0] == "127.0.1.1"
    assert hosts.check(0, ["getent", "hosts", name]).split()[0] == hosts[1].address
    tx, rx = hosts.link_bytes(2)
    assert tx > 0 and rx > 0
    child = hosts.run(2, ["sh", "-c", "sleep 300 & sleep 300"])  # with a grandchild
    netns = [h.netns for h in hosts.hosts] + [hosts.switch]
    hosts.close()
    assert child.poll() is not None and listener.poll() is not None
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(ns in listed for ns in netns), listed
    assert socket.gethostname() != name  # this machine's own name was never touched


def test_a_cut_link_is_silent_until_healed(emulated_hosts: Any) -> None:
    hosts = emulated_hosts(2)
    _listen(hosts, 0, "0.0.0.0", 7001)
    probe = [sys.executable, "-c", CONNECT, hosts[0].address, "7001"]
    hosts.check(1, probe)
    hosts.cut(1)
    t0 = time.monotonic()
    # no refusal, no reset: only a timeout notices (or, once ARP gives up on the neighbour, "no route")
    with pytest.raises(RuntimeError, match=r"timed out|No route to host"):
        hosts.check(1, probe)
    assert time.monotonic() - t0 >= 2.5
    hosts.heal(1)
    deadline = time.monotonic() + 15
    while True:  # a neighbour entry that failed during the cut is resolved again
        try:
            hosts.check(1, probe)
            break
        except RuntimeError:
            if time.monotonic() > deadline:
                raise


def _mbit(hosts: Any, port: int, mib: int) -> float:
    _listen(hosts, 0, "0.0.0.0", port)
    seconds = float(hosts.check(1, [sys.executable, "-c", SEND, hosts[0].address, str(port), str(mib)]))
    return mib * 8 * (1 << 20) / seconds / 1e6


def test_a_rate_limit_slows_the_link_and_can_be_changed_and_lifted(emulated_hosts: Any) -> None:
    hosts = emulated_hosts(2, rate="20mbit")
    mbit = _mbit(hosts, 7002, 5)
    assert 10 < mbit < 25, f"{mbit:.1f} Mbit/s over a 20mbit link"
    hosts.limit("60mbit")
    mbit = _mbit(hosts, 7003, 10)
    assert 35 < mbit < 70, f"{mbit:.1f} Mbit/s over a 60mbit link"
    hosts.limit(None)
    mbit = _mbit(hosts, 7004, 40)
    assert mbit > 150, f"{mbit:.1f} Mbit/s over an unlimited link"


def test_what_a_killed_session_left_behind_is_removed_and_live_sessions_are_not(emulated_hosts: Any) -> None:
    from ivyplug.benchmarks.emulated_hosts import NETNS_ETC, remove_stale

    live = emulated_hosts(1)
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"ivyh{dead.pid}x0h0"  # as a session with that (now finished) process id named its host
    subprocess.run(["ip", "netns", "add", stale], check=True)
    (NETNS_ETC / stale).mkdir(parents=True, exist_ok=True)
    try:
        assert remove_stale() == [stale]
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert stale not in listed and live[0].netns in listed
    assert not (NETNS_ETC / stale).exists()
