"""Emulated hosts on one Linux machine, for tests that need traffic to cross a real network link.

Each host is a network namespace with its own address (``10.77.0.1``, ``10.77.0.2``, ...) on ``eth0``, its
own ``/dev/shm`` (a tmpfs in a mount namespace of its own: two processes on one emulated host share it, two
hosts do not, so shared-memory shortcuts between "hosts" cannot hide the link), its own hostname (a UTS
namespace) and, optionally, its own ``/etc/hosts``. The hosts' ``eth0`` links meet on a bridge in one more
namespace (the switch), so nothing is added to the machine's own network and traffic never leaves the
namespaces made here.

    with Hosts(2, rate="100mbit", hostname_maps_to="loopback") as hosts:
        serve = hosts.run(0, [sys.executable, "-m", "ivyplug", "serve", "--host", hosts[0].address, ...])
        worker = hosts.run(1, [...], env={"GLOO_SOCKET_IFNAME": "eth0"})
        hosts.cut(1)   # host 1's link goes down: its traffic is dropped silently, as on a pulled cable
        hosts.heal(1)

* ``rate``: a token-bucket limit (``tc qdisc ... tbf``) on every link, both directions; :meth:`Hosts.limit`
  changes it later (benchmarks measure several link speeds on one set of hosts).
* ``hostname_maps_to``: ``"loopback"`` writes ``/etc/hosts`` so that each host's own name resolves to
  ``127.0.1.1`` (as Debian and Ubuntu install machines), ``"address"`` to its routable address, ``None``
  leaves the machine's file. Every host's name (``hosts[i].hostname``) resolves to its address on the others.
* :meth:`Hosts.run` starts a command on a host in a process group of its own; at teardown every process in
  the hosts' namespaces is killed (also those the commands started), then the namespaces and their
  ``/etc/netns`` entries are removed — also when the test failed. :func:`remove_stale` removes what a
  session killed before its teardown left behind (the fixture calls it first).

Names are unique per process and instance (``ivyh<pid>x<n>...``), so concurrent test sessions do not
collide. Needs Linux, root, and the ``ip``, ``tc``, ``unshare``, ``nsenter`` and ``mount`` commands;
:func:`unavailable` says why they are missing (tests skip with that reason).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUBNET = "10.77.0"
DEVICE = "eth0"  # the link's name inside every host (GLOO_SOCKET_IFNAME=eth0)
NETNS_ETC = Path("/etc/netns")
TOOLS = ("ip", "tc", "unshare", "nsenter", "mount")
_counter = itertools.count()


def unavailable() -> str | None:
    """Why emulated hosts cannot be made here (None: they can)."""
    if not sys.platform.startswith("linux"):
        return f"emulated hosts need Linux network namespaces (this is {sys.platform})"
    if os.geteuid() != 0:
        return "emulated hosts need root (network namespaces, veth links, tmpfs mounts)"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return f"emulated hosts need the commands {missing} (iproute2, util-linux)"
    probe = f"ivyh{os.getpid()}probe"
    done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if done.returncode != 0:
        return f"`ip netns add` failed here: {done.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def remove_stale() -> list[str]:
    """Remove the namespaces (and their processes, /etc/netns entries) of emulated hosts whose creating process
    is gone (a test session killed before its teardown); those of live sessions stay. The names removed."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    removed = []
    for ns in (line.split()[0] for line in listed.splitlines() if line.strip()):
        match = re.fullmatch(r"ivyh(\d+)x\d+(?:sw|h\d+)", ns)
        if match is None or Path(f"/proc/{match.group(1)}").exists():
            continue
        _kill_netns_pids(ns)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
        removed.append(ns)
    return removed


def _sh(*cmd: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()}")


@dataclass
class Host:
    """One emulated host: its namespace, address, hostname and the process holding its mount namespace."""

    index: int
    netns: str
    address: str
    hostname: str
    port: str  # the switch's side of this host's link
    holder: subprocess.Popen[bytes] | None = None
    procs: list[subprocess.Popen[Any]] = field(default_factory=list)


class Hosts:
    """``n`` emulated hosts (see the module docstring); a context manager that always cleans up."""

    def __init__(self, n: int, rate: str | None = None, hostname_maps_to: str | None = "address") -> None:
        if n < 1:
            raise ValueError(f"need at least one host, got {n}")
        if hostname_maps_to not in ("loopback", "address", None):
            raise ValueError(f"hostname_maps_to must be 'loopback', 'address' or None, got {hostname_maps_to!r}")
        self.n, self.rate, self.hostname_maps_to = n, rate, hostname_maps_to
        self.prefix = f"ivyh{os.getpid()}x{next(_counter)}"
        self.switch = f"{self.prefix}sw"
        self.hosts = [
            Host(i, f"{self.prefix}h{i}", f"{SUBNET}.{i + 1}", f"{self.prefix}-host{i}", f"h{i}") for i in range(n)
        ]
        self._made: list[str] = []

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __len__(self) -> int:
        return self.n

    def __enter__(self) -> Hosts:
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- making and removing -------------------------------------------------------------------------
    def _create(self) -> None:
        _sh("ip", "netns", "add", self.switch)
        self._made.append(self.switch)
        _sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", self.switch, "link", "set", "br0", "up")
        for h in self.hosts:
            _sh("ip", "netns", "add", h.netns)
            self._made.append(h.netns)
            _sh(
                "ip", "-n", self.switch, "link", "add", h.port, "type", "veth", "peer", "name", DEVICE, "netns", h.netns
            )
            _sh("ip", "-n", self.switch, "link", "set", h.port, "master", "br0", "up")
            _sh("ip", "-n", h.netns, "addr", "add", f"{h.address}/24", "dev", DEVICE)
            _sh("ip", "-n", h.netns, "link", "set", DEVICE, "up")
            _sh("ip", "-n", h.netns, "link", "set", "lo", "up")
            self._write_hosts_file(h)
            self._start_holder(h)
        if self.rate is not None:
            self.limit(self.rate)

    def _write_hosts_file(self, h: Host) -> None:
        if self.hostname_maps_to is None:
            return
        own = "127.0.1.1" if self.hostname_maps_to == "loopback" else h.address
        lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost", f"{own} {h.hostname}"]
        lines += [f"{o.address} {o.hostname}" for o in self.hosts if o is not h]
        (NETNS_ETC / h.netns).mkdir(parents=True, exist_ok=True)
        (NETNS_ETC / h.netns / "hosts").write_text("\n".join(lines) + "\n")

    def _start_holder(self, h: Host) -> None:
        """A sleeping process whose mount and UTS namespaces are the host's (its /dev/shm, hosts file, name)."""
        script = (
            f"mount -t tmpfs -o size=1g,mode=1777 ivyshm /dev/shm && hostname {h.hostname} && echo ready && "
            "exec sleep 86400"
        )
        cmd = ["ip", "netns", "exec", h.netns, "unshare", "--mount", "--uts", "--propagation", "private"]
        h.holder = subprocess.Popen([*cmd, "sh", "-c", script], stdout=subprocess.PIPE, start_new_session=True)
        assert h.holder.stdout is not None
        line = h.holder.stdout.readline()
        if line.strip() != b"ready":
            raise RuntimeError(f"could not set up host {h.index}'s mount namespace (exit code {h.holder.wait(10)})")

    def close(self) -> None:
        """Kill every process on the hosts, remove the namespaces and /etc/netns entries. Idempotent."""
        for h in self.hosts:
            for p in h.procs:
                _kill_group(p)
        for ns in self._made:  # whatever the commands started in the namespaces (torchrun's workers, ...)
            _kill_netns_pids(ns)
        for h in self.hosts:
            if h.holder is not None:
                _kill_group(h.holder)
                h.holder = None
            for p in h.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(10)
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made = []
        for h in self.hosts:
            shutil.rmtree(NETNS_ETC / h.netns, ignore_errors=True)

    # -- using them ----------------------------------------------------------------------------------
    def command(self, i: int, cmd: Sequence[str], cwd: str | os.PathLike[str] | None = None) -> list[str]:
        """``cmd`` wrapped to run on host ``i`` (its network, mount and UTS namespaces) in ``cwd`` (default:
        this process's working directory; entering a mount namespace would otherwise start at /)."""
        holder = self.hosts[i].holder
        assert holder is not None, "the hosts are not set up (use them in a with block)"
        wd = os.fspath(cwd) if cwd is not None else os.getcwd()
        return ["nsenter", "-t", str(holder.pid), "-m", "-u", "-n", f"--wd={wd}", "--", *cmd]

    def run(
        self, i: int, cmd: Sequence[str], env: Mapping[str, str] | None = None, **popen: Any
    ) -> subprocess.Popen[Any]:
        """Start ``cmd`` on host ``i`` in a process group of its own (killed at :meth:`close`).

        ``env`` is added to this process's environment; other keyword arguments go to ``subprocess.Popen``
        (default: stdout and stderr together into a text pipe).
        """
        popen.setdefault("stdout", subprocess.PIPE)
        popen.setdefault("stderr", subprocess.STDOUT)
        popen.setdefault("text", True)
        cwd = popen.pop("cwd", None)
        proc = subprocess.Popen(
            self.command(i, cmd, cwd), env={**os.environ, **(env or {})}, start_new_session=True, **popen
        )
        self.hosts[i].procs.append(proc)
        return proc

    def kill(self, proc: subprocess.Popen[Any]) -> None:
        """End a command started with :meth:`run`: SIGKILL its process group (what it started in other groups
        goes at :meth:`close`)."""
        _kill_group(proc)

    def check(self, i: int, cmd: Sequence[str], timeout: float = 30) -> str:
        """Run ``cmd`` on host ``i`` to completion; its output (RuntimeError if it fails)."""
        done = subprocess.run(self.command(i, cmd), capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{cmd} on host {i} failed ({done.returncode}): {done.stderr.strip()}")
        return done.stdout

    def cut(self, i: int) -> None:
        """Take host ``i``'s link down at the switch: its packets vanish silently (no reset, no error)."""
        _sh("ip", "-n", self.switch, "link", "set", self.hosts[i].port, "down")

    def heal(self, i: int) -> None:
        """Bring host ``i``'s link back up."""
        _sh("ip", "-n", self.switch, "link", "set", self.hosts[i].port, "up")

    def limit(self, rate: str | None) -> None:
        """Limit every link, both directions, to ``rate`` (``tc`` units: ``"100mbit"``, ``"1gbit"``); ``None``
        lifts the limit. A token bucket (``tbf``, burst 64 kB, 400 ms of queue): this kernel has no netem."""
        for h in self.hosts:
            for ns, dev in ((h.netns, DEVICE), (self.switch, h.port)):
                tc = ["ip", "netns", "exec", ns, "tc", "qdisc"]
                if rate is None:
                    subprocess.run([*tc, "del", "dev", dev, "root"], capture_output=True)  # absent: already unlimited
                else:
                    _sh(*tc, "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", "64kb", "latency", "400ms")
        self.rate = rate

    def link_bytes(self, i: int) -> tuple[int, int]:
        """Bytes host ``i`` has sent and received over its link (its ``eth0`` counters)."""
        base = Path("/sys/class/net") / DEVICE / "statistics"
        out = self.check(i, ["cat", str(base / "tx_bytes"), str(base / "rx_bytes")])
        tx, rx = out.split()
        return int(tx), int(rx)


def _kill_group(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)


def _kill_netns_pids(ns: str) -> None:
    """SIGKILL every process in namespace ``ns`` (until none is left, at most a few seconds)."""
    for _ in range(20):
        done = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
        pids = [int(p) for p in done.stdout.split()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
