"""Which local address a gloo group of ivyplug binds, and refusing addresses that cannot work across hosts.

gloo's default device binds and advertises the address the machine's hostname resolves to; on a machine
whose hostname maps to ``127.0.0.1`` or ``127.0.1.1`` (a Debian or Ubuntu default) that is loopback, and a
peer on another host then connects to its own loopback and waits until the group's timeout. torch's own
process groups take ``GLOO_SOCKET_IFNAME`` instead when it is set. ivyplug's groups do the same, and without
it bind the address the routing table uses toward the peer's rendezvous address (:func:`route_address`:
a UDP socket ``connect()``-ed there, which sends nothing), so they work whatever the hostname resolves to.

For the process groups torch itself creates (the job's default group, ``new_group``), which read the
variable when they are built, :func:`interface_for` sets ``GLOO_SOCKET_IFNAME`` for the duration of their
creation to the interface that reaches the rendezvous host, when the variable is unset and that host is
not loopback.

An address that cannot work is refused at once with :class:`PSAddressError`, naming the address, the host
and the setting to change: loopback bound or advertised to a peer on another host.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import logging
import math
import os
import socket
import struct
import time
from collections.abc import Iterator
from typing import Any

IFNAME_ENV = "GLOO_SOCKET_IFNAME"
#: a wait for an ivyplug serve that has not answered for this long is said once (:func:`reach`)
SAY_WAITING_AFTER_S = 2.0

log = logging.getLogger(__name__)
_SIOCGIFADDR = 0x8915


class PSAddressError(ConnectionError):
    """An address that cannot connect the two sides (loopback across hosts, no route, no such interface)."""


def resolve(host: str) -> str:
    """``host`` as an IP address (the first that ``getaddrinfo`` gives)."""
    try:
        return str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])
    except (OSError, IndexError) as exc:
        raise PSAddressError(f"cannot resolve the host name {host!r}: {exc}") from exc


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) resolves to a loopback address."""
    try:
        return ipaddress.ip_address(resolve(host).split("%", 1)[0]).is_loopback
    except (PSAddressError, ValueError):
        return False


def is_wildcard(host: str) -> bool:
    return host in ("0.0.0.0", "::", "")


def is_local(host: str) -> bool:
    """Whether ``host`` is an address of this host (one a socket can bind here)."""
    try:
        ip = resolve(host)
    except PSAddressError:
        return False
    with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.bind((ip, 0))
        except OSError:
            return False
    return True


def route_address(peer: str) -> str:
    """The local address this host's routing table sends packets to ``peer`` from."""
    ip = resolve(peer)
    with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((ip, 9))  # a UDP connect only picks the route and the source address
        except OSError as exc:
            raise PSAddressError(
                f"this host has no route to {peer} ({ip}): {exc}; check its network, or name the interface to use "
                f"with {IFNAME_ENV}"
            ) from exc
        return str(s.getsockname()[0])


def interface_address(name: str) -> str:
    """The IPv4 address of network interface ``name`` (PSAddressError if it has none or does not exist)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError as exc:
            raise PSAddressError(
                f"{IFNAME_ENV}={os.environ.get(IFNAME_ENV, name)} names an interface {name!r} without an IPv4 "
                f"address on this host ({exc.strerror}); interfaces here: {[n for _, n in socket.if_nameindex()]}"
            ) from None
    return socket.inet_ntoa(packed[20:24])


def interface_of(address: str) -> str | None:
    """The name of the interface that holds IPv4 ``address`` (None if none does, or for IPv6)."""
    for _, name in socket.if_nameindex():
        with contextlib.suppress(PSAddressError):
            if interface_address(name) == address:
                return name
    return None


def why_unreachable(host: str, port: int, within: float = 0.5) -> str:
    """What a fresh TCP connection to ``host:port`` says, in words a user can act on."""
    try:
        socket.create_connection((host, port), timeout=within).close()
    except ConnectionRefusedError:
        return (
            f"nothing listens on {host}:{port} (connection refused): is ivyplug serve running there, started with "
            f"--port {port} and --host <an address of that host that this one reaches>? (a serve started with "
            "--host 127.0.0.1, the default, takes workers of its own host only)"
        )
    except OSError as exc:
        reason = "no answer" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
        return (
            f"{host}:{port} cannot be reached from host {socket.gethostname()!r} ({reason}): a host that is down, a "
            "link that is cut or a firewall in between"
        )
    return f"{host}:{port} accepts connections now but did not answer as an ivyplug serve in time"


def reach(host: str, port: int, deadline: float) -> str | None:
    """Try TCP connections to ``host:port`` until one is accepted (None) or ``deadline`` passed (why not).

    Before a store client: torch's TCPStore client tries a refused or unanswered connection once more after its
    timeout (printing its C++ frames), so on its own it names an unreachable service only after about twice the
    timeout, in a wait that Ctrl-C does not end. A wait that lasts is said once, after
    :data:`SAY_WAITING_AFTER_S`.
    """
    last = ""
    said_at = time.monotonic() + SAY_WAITING_AFTER_S
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return last or "no answer"
        try:
            socket.create_connection((host, port), timeout=min(left, 2.0)).close()
            return None
        except OSError as exc:  # refused (not started yet, or not listening there), no route, no answer
            last = "connection refused" if isinstance(exc, ConnectionRefusedError) else (exc.strerror or str(exc))
        if time.monotonic() >= said_at:  # a serve being restarted is waited for; a wait that lasts is said, once
            said_at = math.inf
            log.warning(
                "ivyplug: no ivyplug serve answers at %s:%d yet (%s); trying again for up to %.0f s more",
                host,
                port,
                last,
                max(0.0, deadline - time.monotonic()),
            )
        time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))


def env_interfaces() -> list[str]:
    """The interfaces ``GLOO_SOCKET_IFNAME`` names (comma-separated, as torch reads it); [] when unset."""
    return [n.strip() for n in os.environ.get(IFNAME_ENV, "").split(",") if n.strip()]


def bind_address(peer: str | None) -> tuple[str, str]:
    """The address a gloo device of ivyplug binds toward ``peer``, and the setting that chose it.

    ``GLOO_SOCKET_IFNAME`` (its first interface's address), else the route toward ``peer``; a wildcard or
    unknown peer (``None``) leaves gloo's own default (the hostname's address).
    """
    names = env_interfaces()
    if names:
        return interface_address(names[0]), f"{IFNAME_ENV}={os.environ[IFNAME_ENV]}"
    if peer is None or is_wildcard(peer):
        host = socket.gethostname()
        return resolve(host), f"the host name {host!r} (gloo's default)"
    return route_address(peer), f"the route to {peer}"


def check_reaches(bound: str, chosen_by: str, peer: str, peer_role: str, fix: str) -> None:
    """PSAddressError when ``bound`` is loopback but ``peer`` is not: the peer could never connect to it."""
    if is_loopback(bound) and not is_loopback(peer):
        raise PSAddressError(
            f"gloo would listen on the loopback address {bound} (chosen by {chosen_by}) on host "
            f"{socket.gethostname()!r}, which {peer_role} at {peer} on another host cannot reach: {fix}"
        )


def devices(peer: str | None) -> list[Any]:
    """gloo devices for a group of ivyplug whose peer is at ``peer`` (see :func:`bind_address`)."""
    import torch.distributed as dist

    pg: Any = dist.ProcessGroupGloo
    names = env_interfaces()
    if names:
        for name in names:
            interface_address(name)  # a clear error for a wrong name, before gloo's own
        return [pg.create_device(interface=name) for name in names]
    if peer is None or is_wildcard(peer):
        return [pg.create_default_device()]
    return [pg.create_device(hostname=route_address(peer))]


@contextlib.contextmanager
def interface_for(rendezvous_host: str | None) -> Iterator[str | None]:
    """While torch builds gloo groups: ``GLOO_SOCKET_IFNAME`` set to the interface that reaches
    ``rendezvous_host``, unless it is set already, the host is loopback or unknown, or no interface holds
    the route's address; restored afterwards. Yields the interface in effect (None: gloo's default).

    A ``GLOO_SOCKET_IFNAME`` that names a loopback interface while the rendezvous host is another host is
    refused (PSAddressError): the ranks elsewhere would connect to their own loopback and wait until timeout."""
    names = env_interfaces()
    if names and rendezvous_host and not is_wildcard(rendezvous_host) and not is_local(rendezvous_host):
        _check_env_reaches(names[0], rendezvous_host)
    if names or not rendezvous_host or is_wildcard(rendezvous_host) or is_loopback(rendezvous_host):
        yield os.environ.get(IFNAME_ENV) or None
        return
    try:
        name = interface_of(route_address(rendezvous_host))
    except PSAddressError:
        name = None  # torch's own error (or timeout) then says what failed
    if name is None:
        yield None
        return
    os.environ[IFNAME_ENV] = name
    try:
        yield name
    finally:
        if os.environ.get(IFNAME_ENV) == name:
            del os.environ[IFNAME_ENV]


def _check_env_reaches(name: str, rendezvous_host: str) -> None:
    """PSAddressError if interface ``name`` (from ``GLOO_SOCKET_IFNAME``) is loopback and ``rendezvous_host`` is
    not; an interface without an address is left to torch's own error."""
    try:
        bound = interface_address(name)
    except PSAddressError:
        return
    if not is_loopback(bound):  # the common case: nothing to refuse, no interface to look up for the message
        return
    try:
        better = interface_of(route_address(rendezvous_host))
    except PSAddressError:
        better = None
    instead = f" ({better} here reaches it)" if better is not None else ""
    check_reaches(
        bound,
        f"{IFNAME_ENV}={os.environ[IFNAME_ENV]}",
        rendezvous_host,
        "the job's rendezvous host (MASTER_ADDR)",
        f"set {IFNAME_ENV} to the interface that reaches {rendezvous_host}{instead}, or unset it",
    )
