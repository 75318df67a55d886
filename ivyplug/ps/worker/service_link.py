"""How a worker joins an ``ivyplug serve`` (``PSConfig(servers="host:port", token=...)``).

:func:`connect` meets the service at its store, proves the token (wire/auth.py) and forms this worker's two-rank
gloo group with it; it learns the service's shard count, from which the worker builds its plan.
From then on a :class:`Heartbeat` thread bumps a counter in the service's store (on a connection of its own)
every :func:`heartbeat_every` seconds: a worker that computes for a long time sends no request, and a
service cannot tell it from one whose link is cut, so the service drops a member whose counter stopped
(server/service.py), instead of letting its silence stall the others.
:func:`join` then sends the job description and this worker's initial values (server/job_description.py): the
first worker of a job creates the shards from them, a later one is checked against them.
"""

from __future__ import annotations

import atexit
import json
import threading
import time
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ivyplug.ps.config import PSConfig, parse_address
from ivyplug.ps.server.endpoints import PSServerError, WireEndpoint, WireStats
from ivyplug.ps.wire import auth, gloo_net, typed_state
from ivyplug.ps.wire.messages import Kind, bytes_to_words
from ivyplug.ps.wire.transport import Channel, PSProtocolError, PSTimeoutError


class PSJoinRefused(ValueError):
    """An ``ivyplug serve`` refused a worker's job (another model or optimizer, no free slot)."""


def heartbeat_every(timeout: float) -> float:
    """Seconds between two heartbeats of a worker whose timeout is ``timeout``: often enough that a service
    with that timeout notices a silent member well before a waiting worker's own timeout (server/service.py)."""
    return max(0.1, min(1.0, timeout / 10))


class Heartbeat(threading.Thread):
    """Bumps ``prefix``/beat in the service's store every :func:`heartbeat_every` seconds until stopped.

    Its own store connection: the store client serialises its operations, so a wait of the worker's on
    ``link.store`` would delay the beats. A beat that fails (a cut link: the store client's timeout) is
    retried on a new connection; the counter is only ever ``add``-ed, so a late answer cannot confuse it.
    """

    def __init__(self, host: str, port: int, prefix: str, timeout: float) -> None:
        super().__init__(name="ivyplug-heartbeat", daemon=True)
        self.host, self.port, self.key, self.timeout = host, port, f"{prefix}/{auth.HEARTBEAT_KEY}", timeout
        self.every = heartbeat_every(timeout)
        self.stopped = threading.Event()
        self.beats = 0

    def run(self) -> None:
        store: Any = None
        while not self.stopped.is_set():
            try:
                if store is None:
                    store = dist.TCPStore(
                        self.host, self.port, is_master=False, timeout=timedelta(seconds=self.timeout)
                    )
                store.add(self.key, 1)
                self.beats += 1
            except (RuntimeError, OSError):  # the service is unreachable now: try again on a new connection
                store = None
            self.stopped.wait(self.every)

    def start(self) -> None:
        _running.add(self)
        super().start()

    def stop(self) -> None:
        self.stopped.set()


#: heartbeats not stopped yet: stopped at interpreter exit (see _stop_heartbeats)
_running: weakref.WeakSet[Heartbeat] = weakref.WeakSet()


@atexit.register
def _stop_heartbeats() -> None:
    """Stop every heartbeat and let a beat in progress finish before the interpreter finalizes: a daemon thread
    that returns from the store client's C++ code after that aborts the process ("terminate called")."""
    beats = list(_running)
    for beat in beats:
        beat.stop()
    deadline = time.monotonic() + 0.5  # a beat takes milliseconds; one on a cut link would hold the exit
    for beat in beats:
        beat.join(max(0.0, deadline - time.monotonic()))


@dataclass
class ServiceLink:
    """This worker's connection to an ``ivyplug serve``."""

    address: str
    store: Any
    group: Any
    channel: Channel
    num_shards: int
    member: int
    slot: int = -1
    num_workers: int = 0
    created: bool = False
    #: the services that hold the job's shards: address, first shard, shard count (this one first)
    services: list[dict[str, Any]] = field(default_factory=list)
    heartbeat: Heartbeat | None = None


def _store(cfg: PSConfig, within: float | None = None) -> tuple[Any, str]:
    """A store client of the service at ``cfg.servers`` within ``within`` seconds (default ``cfg.timeout``),
    else PSTimeoutError naming the address and why (refused, unreachable, silent)."""
    assert cfg.servers is not None
    host, port = parse_address(cfg.servers, "servers")
    limit = cfg.timeout if within is None else within
    deadline = time.monotonic() + limit

    def failed(first: str) -> PSTimeoutError:
        why = gloo_net.why_unreachable(host, port)
        seen = "" if first in why else f" ({first})"
        return PSTimeoutError(f"no ivyplug serve answered at {cfg.servers} within {limit:g} s: {why}{seen}")

    problem = gloo_net.reach(host, port, deadline)
    if problem is not None:
        raise failed(problem)
    done: dict[str, Any] = {}

    def build() -> None:  # reachable a moment ago; the client's own wait (and retry) is bounded below
        try:
            done["store"] = dist.TCPStore(
                host, port, is_master=False, timeout=timedelta(seconds=max(0.1, deadline - time.monotonic()))
            )
        except BaseException as exc:  # handed to the caller below
            done["error"] = exc

    t = threading.Thread(target=build, name="ivyplug-store-connect", daemon=True)
    t.start()
    t.join(max(0.1, deadline - time.monotonic()) + 0.5)
    if "store" in done:
        return done["store"], host
    exc = done.get("error")
    text = str(exc).strip() if exc is not None else ""
    raise failed(text.splitlines()[0] if text else "its store did not answer") from exc


def _pair_within(store: Any, prefix: str, cfg: PSConfig, host: str, within: float | None = None) -> Any:
    """The pair group with the service, or PSTimeoutError once ``within`` seconds (default ``cfg.timeout``) passed.

    gloo's own connect retries a failed attempt (up to three times), so its wait is not bounded by one timeout:
    the group is built on a helper thread and waited for here (a group that connects after the deadline is
    dropped with its thread).
    """
    done: dict[str, Any] = {}

    def build() -> None:
        try:
            done["group"] = auth.pair_group(store, prefix, 1, cfg.timeout, host)
        except BaseException as exc:  # handed to the caller below
            done["error"] = exc

    t = threading.Thread(target=build, name="ivyplug-pair-connect", daemon=True)
    t.start()
    t.join((cfg.timeout if within is None else within) + 1.0)
    if "group" in done:
        return done["group"]
    if "error" in done:
        exc = done["error"]
        if isinstance(exc, gloo_net.PSAddressError):
            raise exc
        raise PSTimeoutError(f"could not connect to ivyplug serve at {cfg.servers}: {exc}") from exc
    raise PSTimeoutError(
        f"could not connect to ivyplug serve at {cfg.servers} within timeout={cfg.timeout:g} s: its gloo connection "
        "did not form (an address on one side that the other cannot reach: set GLOO_SOCKET_IFNAME on that side to "
        "the interface the two reach each other through)"
    )


def own_address(servers: str) -> str | None:
    """Where this worker's gloo device toward the service at ``servers`` listens (PSAddressError: loopback
    toward a service on another host); None for a loopback service (the device then listens on loopback)."""
    host, _ = parse_address(servers, "servers")
    if gloo_net.is_loopback(host) and not gloo_net.env_interfaces():
        return None
    bound, chosen = gloo_net.bind_address(host)
    gloo_net.check_reaches(
        bound,
        chosen,
        host,
        "ivyplug serve",
        f"unset {gloo_net.IFNAME_ENV} or set it to the interface of this host that reaches {host}",
    )
    return bound


def worker_slots(cfg: PSConfig) -> int:
    """The worker slots of the service at ``cfg.servers`` (0 until a job's first worker sets them), read
    before joining: a delta-averaging worker builds its outer optimizer for that many workers."""
    store, _ = _store(cfg)
    try:
        store.wait([auth.INFO_KEY], timedelta(seconds=cfg.timeout))
        return int(json.loads(bytes(store.get(auth.INFO_KEY)).decode())["workers"])
    except (RuntimeError, ValueError, KeyError, TypeError) as exc:
        raise PSProtocolError(f"ivyplug serve at {cfg.servers} did not say how many workers it serves: {exc}") from exc


def connect(cfg: PSConfig) -> ServiceLink:
    """Meet the service at ``cfg.servers``, prove ``cfg.token``, form the pair group.

    An address that cannot connect the two (this worker's gloo device on loopback toward a service on
    another host, or the service's toward this worker) raises :class:`~ivyplug.ps.wire.gloo_net.PSAddressError` at
    once, naming the address and the setting to change.
    """
    assert cfg.servers is not None
    deadline = time.monotonic() + cfg.timeout  # the whole connection within one timeout, not one per wait
    address = own_address(cfg.servers)
    store, host = _store(cfg)
    left = max(0.1, deadline - time.monotonic())
    member, prefix, verdict = auth.client_handshake(store, cfg.token, left, cfg.servers, address)
    heartbeat = Heartbeat(host, parse_address(cfg.servers, "servers")[1], prefix, cfg.timeout)
    heartbeat.start()  # before the pair forms: the service counts a member's silence from its handshake
    try:
        group = _pair_within(store, prefix, cfg, host, within=max(0.1, deadline - time.monotonic()))
    except BaseException:
        heartbeat.stop()
        raise
    services = [dict(x) for x in verdict.get("services", [])]
    return ServiceLink(
        cfg.servers,
        store,
        group,
        Channel(group, 1, cfg.timeout),
        int(verdict["shards"]),
        member,
        services=services,
        heartbeat=heartbeat,
    )


def join(
    link: ServiceLink,
    description: dict[str, Any],
    values: list[torch.Tensor],
    slot: int,
    job_size: int,
    stats: WireStats,
) -> None:
    """Send JOIN; fills ``link.slot`` / ``num_workers`` / ``created`` (PSProtocolError if refused)."""
    blob = typed_state.encode({"job": description, "values": values, "num_shards": len(values)})
    ep = WireEndpoint(link.channel, 0, -1, 0, stats)
    words = bytes_to_words(blob)
    pending = ep.request(Kind.JOIN, words, arg0=len(blob), arg1=slot, arg2=job_size, what="this worker's JOIN")
    try:
        h = pending.header(link.channel.timeout)
    except PSServerError as exc:
        raise PSJoinRefused(f"ivyplug serve at {link.address} refused this worker: {exc.text}") from None
    link.slot, link.created, link.num_workers = h.arg0, bool(h.arg1), h.arg2


def close(link: ServiceLink) -> None:
    """Stop the heartbeat and drop the pair group (a group made outside ``init_process_group`` closes when it is
    released)."""
    if link.heartbeat is not None:
        link.heartbeat.stop()
    link.group = None
