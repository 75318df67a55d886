"""``ivyplug serve``: shards that live in a process of their own, for workers that come and go.

The service holds a ``TCPStore`` at its address; a worker (``PSConfig(servers="host:port")``) meets it there:

* it proves the token (wire/auth.py, through the store: no byte of an unauthenticated peer reaches gloo);
* the two form a **two-rank gloo group of their own** under a secret store prefix. gloo groups have a fixed
  size, so a membership that changes cannot live in one group: one pair per worker lets a worker join, leave
  or die without touching the others, and a dead worker shows as its pair's closed connection (at once on
  one host, within ``timeout`` across hosts), never as a hang of everyone;
* its first message is JOIN (job_description.py): the first worker of a job creates the shards from its
  description and values; a later worker must describe the same job, or is refused with the difference;
* then the member's own server loop (loop.py) decodes its requests into calls on the shards;
* all along, the worker bumps a heartbeat counter in the store (the worker's service_link.Heartbeat). A member whose
  counter has not moved for :func:`silence_bound` seconds (a cut link, a host down: its packets vanish, its
  connection never closes) is dropped as if it had died: its batches go back to the queue, collectives go on
  without it, and in sync mode the step fails with its name, instead of everyone waiting on it until their
  own timeouts.

The job outlives its workers: when all have left, a new run of the same model joining continues from the
shards' state (a warm restart). With ``state_dir``, the shards are written there every ``snapshot_every``
seconds and at shutdown, and a new service started on that directory resumes from them. Every shard is in
this process; norms of sync-mode clipping go shard to shard in-process.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import math
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ivyplug.ps.config import DEFAULT_TIMEOUT_S, PSConfig
from ivyplug.ps.server import job_description
from ivyplug.ps.server.batch_queue import BatchQueue
from ivyplug.ps.server.coordinator import Coordinator, Rendezvous
from ivyplug.ps.server.loop import MAX_BLOB_BYTES, ServerLoop
from ivyplug.ps.server.mirror import OptimizerSpec
from ivyplug.ps.server.shard import Shard, load_state_bytes
from ivyplug.ps.sharding import ShardPlan
from ivyplug.ps.wire import auth, gloo_net, typed_state
from ivyplug.ps.wire.messages import Header, Kind, Status, bytes_to_words, words_to_bytes
from ivyplug.ps.wire.transport import Channel, PSProtocolError

LOOPBACK = ("127.0.0.1", "localhost", "::1")
JOB_FILE = "job.ivys"


#: never drop a member for less silence than this: a worker beats every second at most (its own timeout / 10 below
#: 10 s), so a serve with a timeout of a second or two would drop healthy workers between two beats
MIN_SILENCE = 2.5


def silence_bound(timeout: float) -> float:
    """Seconds without a heartbeat after which a service with ``timeout`` drops a member: a few seconds less
    than ``timeout``, so that a worker waiting on the silent one (a collective, the batch queue, a sync step)
    hears of it before its own wait of ``timeout`` ends; never less than :data:`MIN_SILENCE`."""
    return max(timeout - min(5.0, timeout / 4), MIN_SILENCE)


@dataclass
class _Member:
    """A member's liveness, watched by the service's watchdog thread."""

    key: str  # its heartbeat counter in the store
    peer: str | None  # where its gloo device listens (its host's address), as its hello said
    slot: int | None = None  # set once it joined a job
    loop: ServerLoop | None = None
    beats: int = 0  # the counter when last read
    heard: float = field(default_factory=time.monotonic)  # when the counter last moved


class Traffic:
    """Pushes and bytes since the last status line (its own lock: member loops count concurrently)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pushes = self._in = self._out = 0

    def count(self, pushes: int, bytes_in: int, bytes_out: int) -> None:
        with self._lock:
            self._pushes += pushes
            self._in += bytes_in
            self._out += bytes_out

    def take(self) -> tuple[int, int, int]:
        with self._lock:
            out = (self._pushes, self._in, self._out)
            self._pushes = self._in = self._out = 0
        return out


@dataclass
class ServedJob:
    """A job as an ``ivyplug serve`` holds it: what its first worker described, the shards built from it, and
    the coordinator its workers share (batch queue, rendezvous, stop flag)."""

    description: dict[str, Any]
    cfg: PSConfig
    plan: ShardPlan
    spec: OptimizerSpec
    num_workers: int
    shards: dict[int, Shard]
    coordinator: Coordinator


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


class PSService:
    """The shards of ``ivyplug serve`` and the members that reach them (see the module docstring).

    Args:
        num_shards: shards this service holds (the plan's shard count).
        host, port: where the store listens (``port=0``: a free one; see :attr:`address`).
        token: the shared secret workers must prove; required unless ``host`` is a loopback address.
        num_workers: worker slots of the job (sync: workers per step); 0 takes the first worker's job size.
        state_dir, snapshot_every: write the shards there every that many seconds (and at close) and
            resume from what is there at start.
        timeout: bound of every wait on a member (handshake, payloads).
        status_every: seconds between two status lines (``None`` or 0: none).
        log: where status lines go.
    """

    def __init__(
        self,
        num_shards: int,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        num_workers: int = 0,
        state_dir: str | os.PathLike[str] | None = None,
        snapshot_every: float | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        status_every: float | None = 60.0,
        log: Callable[[str], None] | None = None,
        join: str | None = None,
    ) -> None:
        check_options(num_shards, host, port, token, num_workers, state_dir, snapshot_every, timeout, status_every)
        self.num_shards = num_shards
        self.first = 0  # the global index of this service's first shard (a joined service: told by the first)
        #: the services of the job, this one first: address, first shard, shard count (the first service only)
        self.services: list[dict[str, Any]] = []
        self.host = host
        self.token = token or None
        self.num_workers = num_workers
        self.snapshot_error: str | None = None  # why the last snapshot, at close, could not be written
        self.state_dir = Path(state_dir) if state_dir is not None else None
        self.snapshot_every = snapshot_every
        self.timeout = timeout
        self.status_every = status_every or None  # 0: none
        self.log = log or (lambda line: print(line, flush=True))
        self.traffic = Traffic()
        self.closed = threading.Event()
        self.emptied = threading.Event()  # set when the last worker left (a dedicated service then ends)
        self._lock = threading.Lock()  # guards job, slots, members (membership; shards guard themselves)
        self.job: ServedJob | None = None
        self.slots: dict[int, int] = {}  # worker slot -> member number
        self.refused = 0
        self._members: dict[int, _Member] = {}  # member number -> its liveness (guarded by _lock)
        self._threads: list[threading.Thread] = []
        # the store listens on a socket bound here (given a port, TCPStore alone listens on every interface)
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
                sock.listen(256)
            except OSError as exc:  # a port in use, an address of another machine, a name that does not resolve
                raise ListenError(f"cannot listen on {host}:{port} ({exc.strerror or exc})") from None
            self.port = int(sock.getsockname()[1])
            self.store = dist.TCPStore(
                host,
                self.port,
                is_master=True,
                wait_for_workers=False,
                timeout=timedelta(seconds=timeout),
                master_listen_fd=sock.fileno(),
            )
        except BaseException:
            sock.close()
            raise
        # the store owns the descriptor now and closes it when it goes (from its own thread): a Python socket
        # closing it too would close whatever took that number in between (another thread's pipe, say)
        sock.detach()
        self.services = [{"address": self.address, "first": 0, "count": num_shards}]
        self.join = join
        saved = self._read_snapshot()
        if join is not None:  # a restarted service claims the shards it held before
            self.first = self._register(join, claim=None if saved is None else int(saved["first"]))
        if saved is not None:
            self._resume(saved)
        self._publish()
        for target, name in ((self._accept, "accept"), (self._tick, "status"), (self._watch, "watchdog")):
            t = threading.Thread(target=target, name=f"ivyplug-serve-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def describe(self) -> str:
        workers = self.num_workers or "the first job's"
        auth_text = "token required" if self.token else "no token (loopback only)"
        where = f", snapshots in {self.state_dir} every {self.snapshot_every:g} s" if self.state_dir else ""
        resumed = f", resumed at version {self.version()}" if self.job is not None else ""
        if self.join is not None:
            last = self.first + self.num_shards - 1
            resumed += f", shards {self.first}..{last} of the job served from {self.join}"
        return (
            f"ivyplug serve: listening on {self.address} ({self.num_shards} shards, {workers} worker slots, "
            f"{auth_text}{where}{resumed})"
        )

    def _publish(self) -> None:
        """What anyone may read before joining (auth.INFO_KEY): the shard count and the worker slots."""
        self.store.set(auth.INFO_KEY, json.dumps(self._info()))

    def _info(self) -> dict[str, Any]:
        """What a worker learns before joining: the job's shard count, worker slots, and every service."""
        job = self.job
        with self._lock:
            services = [dict(x) for x in self.services]
        total = sum(x["count"] for x in services) if self.join is None else self.num_shards
        workers = job.num_workers if job is not None else self.num_workers
        return {"shards": total, "workers": workers, "services": services, "first": self.first}

    def total_shards(self) -> int:
        with self._lock:
            return sum(x["count"] for x in self.services)

    # -- several services for one job -----------------------------------------------------------------
    def _register(self, primary: str, claim: int | None = None) -> int:
        """Join the service at ``primary`` as one more holder of the job's shards; returns the first index.

        ``claim``: the first shard this service held before a restart (from its snapshot): it takes that range
        back, at its new address, also while the job runs.
        """
        from ivyplug.ps.config import parse_address

        host, port = parse_address(primary, "--join")
        deadline = time.monotonic() + self.timeout
        if gloo_net.reach(host, port, deadline) is not None:  # torch's client alone waited twice --timeout, in C++
            raise ValueError(
                f"--join {primary}: no ivyplug serve answered within {self.timeout:g} s: "
                f"{gloo_net.why_unreachable(host, port)}"
            )
        left = max(1.0, deadline - time.monotonic())
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=left))
        n = int(store.add(f"{auth.PREFIX}/services", 1))
        wanted = -1 if claim is None else claim
        proof = auth.mac(
            self.token,
            b"service",
            self.address.encode(),
            str(self.num_shards).encode(),
            str(n).encode(),
            str(wanted).encode(),
        )
        record = {"address": self.address, "count": self.num_shards, "claim": wanted, "proof": proof}
        store.set(f"{auth.PREFIX}/service/{n}", json.dumps(record))
        key = f"{auth.PREFIX}/service/{n}/verdict"
        try:
            store.wait([key], timedelta(seconds=self.timeout))
        except RuntimeError as exc:
            raise ValueError(f"the ivyplug serve at {primary} did not answer this service's registration") from exc
        verdict = json.loads(bytes(store.get(key)).decode())
        if not verdict.get("ok"):
            raise ValueError(f"the ivyplug serve at {primary} refused this service: {verdict.get('reason')}")
        self._primary_store = store  # kept open for the life of this service
        return int(verdict["first"])

    def _admit_service(self, n: int) -> None:
        """A service asking to hold more of the job's shards (the first service only)."""
        raw = json.loads(bytes(self.store.get(f"{auth.PREFIX}/service/{n}")).decode())
        claim = raw.get("claim", -1)
        expected = auth.mac(
            self.token,
            b"service",
            str(raw.get("address")).encode(),
            str(raw.get("count")).encode(),
            str(n).encode(),
            str(claim).encode(),
        )
        reason = None
        first = -1
        if not hmac.compare_digest(str(raw.get("proof", "")), expected):
            reason = "wrong token"
        elif not isinstance(raw.get("count"), int) or raw["count"] < 1:
            reason = "a shard count must be an int >= 1"
        elif not isinstance(claim, int):
            reason = "a claimed first shard must be an int"
        elif self._loopback_among_hosts(str(raw.get("address"))):
            reason = (
                f"it listens on the loopback address {raw.get('address')}, which workers of this service (at "
                f"{self.address}, beyond loopback) on other hosts cannot reach: start it with --host <an address of "
                "its host that the workers reach>"
            )
        with self._lock:
            held = [x for x in self.services[1:] if x["first"] == claim and x["count"] == raw.get("count")]
            if reason is None and claim >= 0 and held:  # a restarted holder takes its shards back
                held[0]["address"] = raw["address"]
                first = claim
            elif reason is None and claim >= 0:
                reason = f"this job has no shards {claim}..{claim + raw['count'] - 1} held by another service"
            elif reason is None and self.job is not None:
                reason = "the job's shards are placed already (start every service before the first worker)"
            elif reason is None:
                first = sum(x["count"] for x in self.services)
                self.services.append({"address": raw["address"], "first": first, "count": raw["count"]})
        verdict = {"ok": False, "reason": reason} if reason else {"ok": True, "first": first}
        self.store.set(f"{auth.PREFIX}/service/{n}/verdict", json.dumps(verdict))
        if reason:
            self.log(f"ivyplug serve: refused service {raw.get('address')}: {reason}")
        else:
            self.log(f"ivyplug serve: service {raw['address']} holds shards {first}..{first + raw['count'] - 1}")
            self._publish()

    def version(self) -> int:
        job = self.job
        return min(s.versions()[0] for s in job.shards.values()) if job is not None else 0

    def members(self) -> int:
        with self._lock:
            return len(self.slots)

    # -- accepting members ----------------------------------------------------------------------------
    def _accept(self) -> None:
        service = 1
        taken = 0  # member numbers handed out so far (the store's counter, as last read)
        waiting: dict[int, float] = {}  # a taken member number whose hello is not in yet -> since when
        while not self.closed.is_set():
            if self.join is None and self.store.check([f"{auth.PREFIX}/service/{service}"]):
                try:
                    self._admit_service(service)
                except Exception as exc:  # a malformed registration never ends the service
                    self.log(f"ivyplug serve: a service registration failed: {type(exc).__name__}: {exc}")
                service += 1
                continue
            # non-blocking looks only (a store wait that times out logs a warning each time)
            now = time.monotonic()
            count = int(self.store.add(auth.MEMBER_COUNTER, 0))
            waiting.update((m, now) for m in range(taken, count))
            taken = max(taken, count)
            # each member in its own time: a worker writes its hello right after taking its number, and one that
            # never does (gone in between, or any client that bumped the counter) keeps no later worker waiting
            for member, since in sorted(waiting.items()):
                if self.store.check([f"{auth.PREFIX}/hello/{member}"]):
                    del waiting[member]
                    t = threading.Thread(
                        target=self._serve_member, args=(member,), name=f"ivyplug-member-{member}", daemon=True
                    )
                    t.start()
                elif now - since >= self.timeout:
                    del waiting[member]
                    self.log(f"ivyplug serve: member {member} sent no hello within {self.timeout:g} s: forgotten")
            time.sleep(0.05)

    def _store_client(self) -> Any:
        """A connection of its own to this service's store: a store client runs one operation at a time, so a
        wait on the service's own client (a member's handshake waiting for its proof) would hold up every other
        member's handshake and the accepting loop for as long as it waits."""
        host = "::1" if self.host == "::" else "127.0.0.1" if gloo_net.is_wildcard(self.host) else self.host
        return dist.TCPStore(host, self.port, is_master=False, timeout=timedelta(seconds=self.timeout))

    def _serve_member(self, member: int) -> None:
        slot: int | None = None
        group = None
        try:
            accept = self._info()
            store = self._store_client()  # its waits hold up no other member (see _store_client)
            reason, prefix, peer = auth.server_handshake(
                store, member, self.token, self.timeout, accept, self._address_problem
            )
            if reason is not None:
                with self._lock:
                    self.refused += 1
                self.log(f"ivyplug serve: refused member {member}: {reason}")
                return
            watched = _Member(f"{prefix}/{auth.HEARTBEAT_KEY}", peer)
            with self._lock:
                self._members[member] = watched
            group = auth.pair_group(store, prefix, 0, self.timeout, self.host, peer)
            channel = Channel(group, 0, self.timeout)
            slot, job = self._join(member, channel)
            if slot is None or job is None:
                return
            loop = ServerLoop(channel, job.shards, job.coordinator, {1}, member=slot, traffic=self.traffic)
            with self._lock:
                watched.slot, watched.loop = slot, loop
            loop.run()  # on this thread: ends at the member's BYE, or when its pair breaks
            if loop.error is not None:
                self._leave(slot, f"its connection broke ({loop.error})", member)
            else:
                self._leave(slot, None, member)
            slot = None
            with contextlib.suppress(PSProtocolError):
                channel.flush(replies=True)
        except Exception as exc:  # a member's failure never ends the service
            self.log(f"ivyplug serve: member {member} ended: {type(exc).__name__}: {exc}")
            if slot is not None:
                self._leave(slot, f"{type(exc).__name__}: {exc}", member)
        finally:
            with self._lock:
                self._members.pop(member, None)

    def _watch(self) -> None:
        """Drop every joined member whose heartbeat counter has not moved for :func:`silence_bound` seconds.

        Its own store connection (:meth:`_store_client`). Only members that beat at least once are watched: a worker of
        an ivyplug version without heartbeats is dropped only when its connection breaks, as before.
        """
        bound = silence_bound(self.timeout)
        store: Any = None
        while not self.closed.wait(min(0.25, bound / 8)):
            with self._lock:
                watched = list(self._members.items())
            if not watched:
                continue
            try:
                if store is None:
                    store = self._store_client()
                counts = [int(store.add(m.key, 0)) for _, m in watched]
            except (RuntimeError, OSError) as exc:  # its own store, on its own host: say so, try again
                self.log(f"ivyplug serve: the heartbeat watchdog could not read the store: {exc}")
                store = None
                continue
            now = time.monotonic()
            for (member, m), count in zip(watched, counts, strict=True):
                if count != m.beats:
                    m.beats, m.heard = count, now
                elif count > 0 and m.slot is not None and now - m.heard >= bound:
                    self._drop(member, m, now - m.heard)

    def _drop(self, member: int, m: _Member, silent: float) -> None:
        """Member ``member`` fell silent: it leaves (its loop refuses whatever it sends later) and is unwatched."""
        where = f"its host {m.peer}" if m.peer is not None else f"member {member}"
        reason = (
            f"no heartbeat from {where} for {silent:.1f} s (a cut link, a host down or a hung process; ivyplug "
            f"serve's --timeout {self.timeout:g} s sets this bound to {silence_bound(self.timeout):g} s)"
        )
        with self._lock:
            self._members.pop(member, None)
        if m.loop is not None:
            m.loop.dropped = f"this worker was dropped by ivyplug serve at {self.address}: {reason}"
        assert m.slot is not None
        self._leave(m.slot, reason, member)

    def _loopback_among_hosts(self, address: str) -> bool:
        """Whether ``address`` ("host:port") is loopback while this service listens beyond loopback."""
        host = address.rpartition(":")[0].strip("[]")
        return gloo_net.is_loopback(host) and not gloo_net.is_loopback(self.host)

    def _address_problem(self, peer: str | None) -> str | None:
        """Why this service's gloo device could not reach a worker whose device listens on ``peer`` (or None)."""
        if peer is None or gloo_net.is_loopback(self.host):
            return None  # a loopback service takes workers of its own host only: their store connection says so
        try:
            bound, chosen = gloo_net.bind_address(peer)
            gloo_net.check_reaches(
                bound,
                chosen,
                peer,
                "the worker",
                f"start ivyplug serve with {gloo_net.IFNAME_ENV} unset or naming the interface of --host {self.host}",
            )
        except gloo_net.PSAddressError as exc:
            return str(exc)
        return None

    def _join(self, member: int, channel: Channel) -> tuple[int | None, ServedJob | None]:
        """Receive the member's JOIN; create the job, or check it matches; give it a slot."""
        h = channel.recv_request_header(1, timeout=self.timeout)  # a member that pairs must JOIN at once
        if h.kind != Kind.JOIN or h.n_hyper != 0 or not 0 < h.arg0 <= MAX_BLOB_BYTES or h.numel != (h.arg0 + 3) // 4:
            raise PSProtocolError(f"member {member}'s first message must be a well-formed JOIN, got kind {h.kind}")
        data, _ = channel.recv_request_payload(h)
        assert data is not None
        try:
            blob = typed_state.decode(words_to_bytes(data, h.arg0))
            if not isinstance(blob, dict) or not isinstance(blob.get("job"), dict):
                raise ValueError("a JOIN carries {'job': description, 'values': [...]}")
            slot, created, job = self._admit(member, blob, h.arg1, h.arg2)
        except ValueError as exc:
            text = f"{exc}".encode()[:4000]
            reply = Header(kind=Kind.REPLY, sender=0, seq=h.seq, status=Status.ERROR, arg3=len(text))
            channel.send(1, reply, reply=True)
            channel.send_error_text(1, text)
            channel.flush(replies=True)
            with self._lock:
                self.refused += 1
            self.log(f"ivyplug serve: refused member {member}: {exc}")
            return None, None
        for shard in job.shards.values():
            shard.join(slot)
        job.coordinator.join_collectives(slot)
        channel.send(
            1,
            Header(kind=Kind.REPLY, sender=0, seq=h.seq, arg0=slot, arg1=int(created), arg2=job.num_workers),
            reply=True,
        )
        self.log(f"ivyplug serve: worker {slot} joined (member {member}; {self.members()} connected)")
        return slot, job

    def _admit(self, member: int, blob: dict[str, Any], want: int, job_size: int) -> tuple[int, bool, ServedJob]:
        """The slot for a joining worker, under the membership lock (ValueError: refused, with why)."""
        desc = blob["job"]
        with self._lock:
            created = False
            if self.job is None:
                workers = self.num_workers or max(1, int(job_size))
                total = sum(x["count"] for x in self.services) if self.join is None else int(blob["num_shards"])
                if int(blob.get("num_shards", total)) != total:
                    raise ValueError(f"the worker plans {blob['num_shards']} shards, the services hold {total}")
                self.job = self._build(desc, workers, blob.get("values"), total)
                created = True
            else:
                diff = job_description.difference(self.job.description, desc)
                if diff is not None:
                    raise ValueError(f"this worker's job differs from the one the servers hold: {diff}")
            job = self.job
            if not self.slots:  # a new run (all earlier workers left): its stop flag starts lowered
                job.coordinator.stop.clear()
            if want >= 0:
                if want >= job.num_workers:
                    raise ValueError(f"worker slot {want} asked for, the servers have slots 0..{job.num_workers - 1}")
                if want in self.slots:
                    raise ValueError(f"worker slot {want} is taken by a live worker")
                slot = want
            else:
                free = [s for s in range(job.num_workers) if s not in self.slots]
                if not free:
                    raise ValueError(
                        f"all {job.num_workers} worker slots are taken (start ivyplug serve with a larger --workers)"
                    )
                slot = free[0]
            self.slots[slot] = member
            job.coordinator.rejoin_queue(slot)
        if created:
            self._publish()
        return slot, created, job

    def _build(self, desc: dict[str, Any], num_workers: int, values: Any, total: int | None = None) -> ServedJob:
        """The shards this service holds of the job (all of them, or its range of a job on several services)."""
        total = self.num_shards if total is None else total
        if not self.first + self.num_shards <= total:
            raise ValueError(f"this service holds shards {self.first}..{self.first + self.num_shards - 1} of {total}")
        cfg, plan, spec = job_description.build(desc, total, self.timeout)
        shards: dict[int, Shard] = {}
        for s in range(self.first, self.first + self.num_shards):
            init = values[s] if isinstance(values, list) and len(values) == plan.num_shards else None
            if init is None:
                init = torch.zeros(plan.shard_numel(s))
            if not isinstance(init, torch.Tensor) or init.dtype != torch.float32 or init.dim() != 1:
                raise ValueError(f"initial values of shard {s} must be a flat float32 tensor")
            shards[s] = Shard(s, plan, cfg, num_workers, spec, init)
        for shard in shards.values():
            shard.connect_peers({s: other for s, other in shards.items() if s != shard.shard})  # in-process peers
        coordinator = Coordinator(BatchQueue(num_workers), rendezvous=Rendezvous())
        return ServedJob(desc, cfg, plan, spec, num_workers, shards, coordinator)

    def _leave(self, slot: int, reason: str | None, member: int | None = None) -> None:
        """Worker ``slot`` left (``reason=None``) or is gone. ``member``: only if the slot is still that member's
        (a member dropped for its silence whose connection breaks later, after another took its slot)."""
        with self._lock:
            if member is not None and self.slots.get(slot) != member:
                return
            self.slots.pop(slot, None)
            job = self.job
            left = len(self.slots)
        back: list[int] = []
        late: list[int] = []
        epoch = -1
        if job is not None:
            for shard in job.shards.values():
                shard.leave(slot, reason)
            back, late, epoch = job.coordinator.release(slot)
        if left == 0:
            self.emptied.set()
        how = "left" if reason is None else f"is gone: {reason}"
        self.log(f"ivyplug serve: worker {slot} {how} ({left} connected)")
        if back:
            self.log(f"ivyplug serve: batches {back} of epoch {epoch} go back to the queue")
        if late:
            self.log(
                f"ivyplug serve: batches {late} of epoch {epoch} stay untrained this epoch: every other "
                "worker had already ended it"
            )

    # -- snapshots and status -----------------------------------------------------------------------
    def snapshot(self) -> Path | None:
        """Write the job and this service's shards to ``state_dir`` (atomically, one file); its path.

        A job on several services: each snapshots its own shards (the first one also the list of services);
        the snapshots are taken independently, so after a restart of several services their shards may be
        from moments up to one interval apart.
        """
        job = self.job
        if self.state_dir is None or job is None:
            return None
        with self._lock:
            services = [dict(x) for x in self.services] if self.join is None else []
        blob = typed_state.encode(
            {
                "job": job.description,
                "num_workers": job.num_workers,
                "num_shards": self.num_shards,
                "first": self.first,
                "joined": int(self.join is not None),
                "total_shards": job.plan.num_shards,
                "services": json.dumps(services),
                "shards": [bytes_to_words(job.shards[s].state()) for s in sorted(job.shards)],
            }
        )
        path = self.state_dir / JOB_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(blob)
        os.replace(tmp, path)
        return path

    def _read_snapshot(self) -> dict[str, Any] | None:
        """The last snapshot in ``state_dir`` (checked against this service's options), or None."""
        if self.state_dir is None:
            return None
        self.state_dir.mkdir(parents=True, exist_ok=True)
        path = self.state_dir / JOB_FILE
        if not path.exists():
            return None
        try:
            saved = typed_state.decode(path.read_bytes())
            if not isinstance(saved, dict) or not {"job", "num_workers", "num_shards", "first", "shards"} <= set(saved):
                raise ValueError("it lacks a snapshot's entries")
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(
                f"{path} is not a snapshot of ivyplug serve ({exc}); move it away or start with another --state-dir"
            ) from None
        if self.num_workers and int(saved["num_workers"]) != self.num_workers:
            raise ValueError(
                f"{path} holds a job of {int(saved['num_workers'])} worker slots; start ivyplug serve with --workers "
                f"{int(saved['num_workers'])} (or 0: the snapshot's), or another --state-dir"
            )
        if saved["num_shards"] != self.num_shards:
            raise ValueError(
                f"{path} holds {saved['num_shards']} shards; start ivyplug serve with --shards {saved['num_shards']} "
                "(or another --state-dir)"
            )
        joined = bool(saved.get("joined", 0))  # a snapshot of an earlier version: of a job on one service
        if joined != (self.join is not None):
            was = "with --join (a later service of a job)" if joined else "as the first service of its job"
            raise ValueError(f"{path} was written by an ivyplug serve started {was}; start this one the same way")
        return saved

    def _resume(self, saved: dict[str, Any]) -> None:
        total = int(saved.get("total_shards", self.num_shards))
        services = json.loads(saved.get("services", "[]"))
        if self.join is None and services:  # the other services of the job, at their last known addresses
            with self._lock:
                self.services = [self.services[0], *services[1:]]
        job = self._build(saved["job"], int(saved["num_workers"]), None, total)
        for i, words in enumerate(saved["shards"]):
            job.shards[self.first + i].load(load_state_bytes(words_to_bytes(words, words.numel() * 4)))
        self.job = job

    def _tick(self) -> None:
        last_status = last_snapshot = time.monotonic()
        while not self.closed.wait(0.5):
            now = time.monotonic()
            if self.snapshot_every is not None and now - last_snapshot >= self.snapshot_every:
                last_snapshot = now
                try:
                    self.snapshot()
                except Exception as exc:  # a full disk must not end the service; say so every time
                    self.log(f"ivyplug serve: snapshot failed: {type(exc).__name__}: {exc}")
            if self.status_every is not None and now - last_status >= self.status_every:
                pushes, bytes_in, bytes_out = self.traffic.take()
                span = now - last_status
                last_status = now
                self.log(
                    f"ivyplug serve: {self.members()} workers connected, {pushes / span:.1f} pushes/s, "
                    f"in {_mb(bytes_in)}, out {_mb(bytes_out)} (last {span:.0f} s), version {self.version()}"
                )

    def close(self) -> Path | None:
        """Stop accepting, write a last snapshot, drop the members' groups; the snapshot's path (None: none was
        written: no state directory, no job, or closed already). Idempotent."""
        if self.closed.is_set():
            return None
        self.closed.set()
        try:
            return self.snapshot()
        except OSError as exc:  # the state directory went away, a full disk: said, not a traceback
            self.snapshot_error = f"{type(exc).__name__}: {exc}"
            self.log(f"ivyplug serve: the last snapshot failed: {self.snapshot_error}")
            return None
        finally:
            for t in self._threads:
                t.join(2.0)


class ListenError(ValueError):
    """The service's address cannot be listened on (the caller names the setting that chose it)."""


def check_options(
    num_shards: object,
    host: object,
    port: object,
    token: object,
    num_workers: object,
    state_dir: object,
    snapshot_every: object,
    timeout: object,
    status_every: object,
) -> None:
    """ValueError naming the option and what is allowed (before anything listens)."""
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        raise ValueError(f"--shards must be an int >= 1, got {num_shards!r}")
    if not isinstance(host, str) or not host:
        raise ValueError(f"--host must be an address, got {host!r}")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
        raise ValueError(f"--port must be in 0..65535 (0: any free port), got {port!r}")
    if host not in LOOPBACK and not token:
        raise ValueError(
            f"--host {host} listens beyond this machine: give a --token (or IVYPLUG_TOKEN) that workers must prove"
        )
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(f"--workers must be an int >= 0 (0: the first job's size), got {num_workers!r}")
    if snapshot_every is not None:
        if state_dir is None:
            raise ValueError("--snapshot-every needs --state-dir (where the snapshots go)")
        if not _seconds(snapshot_every):
            raise ValueError(f"--snapshot-every must be a finite number of seconds > 0, got {snapshot_every!r}")
    if not _seconds(timeout):
        raise ValueError(f"--timeout must be a finite number of seconds > 0, got {timeout!r}")
    if status_every is not None and status_every != 0 and not _seconds(status_every):
        raise ValueError(
            f"--status-every must be a finite number of seconds > 0 (0: no status lines), got {status_every!r}"
        )


def _seconds(value: object) -> bool:
    """Whether ``value`` is a finite number of seconds > 0."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and 0 < value < math.inf


def run_forever(service: PSService, stop: threading.Event) -> None:
    """Serve until ``stop`` is set (the command's signal handlers set it), then close."""
    try:
        while not stop.wait(0.5):
            pass
    finally:
        wrote = service.close()
        print("ivyplug serve: stopped" + (f" (snapshot in {wrote.parent})" if wrote else ""), file=sys.stderr)
