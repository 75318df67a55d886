"""Rendezvous ports for the tests: each pytest worker draws from a range of its own, below the ephemeral range.

The usual way to find a free port, ``bind(("", 0))`` and close, hands out a port from the kernel's ephemeral
range and frees it again; by the time a spawned rank 0 has imported torch and binds it (seconds on a loaded
machine), a gloo group or TCPStore in the other pytest-xdist worker may have drawn the same port from the same
range, and rank 0 dies with EADDRINUSE. Ports below that range are never handed out by the kernel, so a range
per worker there is free of that race; torch's stores listen with ``SO_REUSEADDR``, so a port whose earlier
connections linger in TIME_WAIT is reused safely.
"""

from __future__ import annotations

import itertools
import os
import random
import socket
from pathlib import Path

_FIRST = 20000
_SPAN = 1000  # ports per pytest worker


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default, and where this cannot be read the race is the OS's to avoid


def _worker_index() -> int:
    """0 without xdist, 1 + N in xdist worker ``gwN``."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "")
    return int(name[2:]) + 1 if name.startswith("gw") and name[2:].isdigit() else 0


def _range_start() -> int:
    """This worker's first port, or 0 where no range fits below the ephemeral one (the kernel then chooses)."""
    slots = max(1, (_ephemeral_start() - _FIRST) // _SPAN)
    first = _FIRST + (_worker_index() % slots) * _SPAN
    return first if first + _SPAN <= _ephemeral_start() else 0


def _ports(first: int) -> itertools.cycle[int]:
    if first == 0:
        return itertools.cycle([0])
    # a random start: a test's own subprocess that draws ports too begins elsewhere in the range
    start = random.randrange(_SPAN)
    return itertools.cycle([first + (start + i) % _SPAN for i in range(_SPAN)])


_RANGE_START = _range_start()
_PORTS = _ports(_RANGE_START)


def free_port() -> int:
    """A port nothing listens on now, from this worker's range (bound and released on every interface)."""
    for _ in range(_SPAN):
        port = next(_PORTS)
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("", port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise RuntimeError(f"no free port in this test worker's range {_RANGE_START}..{_RANGE_START + _SPAN - 1}")


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports."""
    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports
