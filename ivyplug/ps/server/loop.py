"""The server loop of a rank that serves a shard (or rank 0's batch queue): decodes requests into calls.

It reads a fixed-size header from any source, then the payloads from that sender (see wire/messages.py), and
hands each request to the handler of its kind (a table, :attr:`ServerLoop._handlers`), which makes the same call
an in-process endpoint makes on the shard (shard.py) or on the coordinator (coordinator.py: the batch queue, the
stop flag, the rendezvous). A reply that must wait is a pending future on the shard; its callback sends the
reply from whichever thread resolves it, after the shard released its lock. The loop ends after a BYE from every
peer rank, so closing is a natural rendezvous: no rank tears down while another may still ask it.
"""

from __future__ import annotations

import logging
import sys
import threading
import traceback
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Protocol

import torch

from ivyplug.ps.server.batch_queue import BatchQueue
from ivyplug.ps.server.coordinator import Coordinator, Rendezvous
from ivyplug.ps.server.shard import Reply, Shard, load_state_bytes
from ivyplug.ps.wire import shared_region
from ivyplug.ps.wire.codecs import PULL_BITS, PulledCopy
from ivyplug.ps.wire.messages import (
    MAX_ERROR_TEXT,
    BatchAsk,
    Flag,
    Header,
    Kind,
    Status,
    bytes_to_words,
    float_arg,
    message_bytes,
    words_to_bytes,
)
from ivyplug.ps.wire.segments import Segment, views
from ivyplug.ps.wire.transport import Channel, PSProtocolError, Releasable, payload_parts

_WANTS_REPLY = (
    Kind.PUSH_PULL,
    Kind.PULL,
    Kind.NEXT_BATCH,
    Kind.STATE_SIZE,
    Kind.STATE_FETCH,
    Kind.LOAD,
    Kind.EPOCH,
    Kind.GATHER,
    Kind.GATHER_FETCH,
    Kind.SHM_ATTACH,
)
#: requests a worker sends on a shard's endpoint only once it has read that endpoint's last reply: their
#: arrival frees what that reply kept (Channel.reap), a shard's lent state among it
_REAPS = (Kind.PUSH_PULL, Kind.PUSH_DATA, Kind.PULL, Kind.STATE_SIZE, Kind.STATE_FETCH, Kind.LOAD)
_NEEDS_SHARD = (
    Kind.PUSH_PULL, Kind.PUSH_DATA, Kind.PULL, Kind.NORM, Kind.TRUST_SUMS, Kind.STATE_SIZE, Kind.STATE_FETCH, Kind.LOAD,
)  # fmt: skip
#: kinds whose fp32 payload is a push's data (received into the sender's reused buffer for that shard)
_PUSHES = (Kind.PUSH_PULL, Kind.PUSH_DATA)
#: largest state or description blob a member may announce (a LOAD carries one shard's state)
MAX_BLOB_BYTES = 1 << 34
#: largest payloads (fp32 values, fp64 hyperparameters) a member may announce at all
MAX_PAYLOAD = MAX_BLOB_BYTES // 4
MAX_HYPER = 1 << 24
#: longest path a SHM_ATTACH may name
MAX_PATH = 4096

log = logging.getLogger(__name__)


#: a request handler: its header, fp32 payload (or None) and fp64 hyperparameters (or None)
_Handler = Callable[[Header, "torch.Tensor | None", "torch.Tensor | None"], None]


class Traffic(Protocol):
    """Counts a server's traffic (``ivyplug serve``'s status line)."""

    def count(self, pushes: int, bytes_in: int, bytes_out: int) -> None: ...


class ServerLoop(threading.Thread):
    """Background thread serving shards (and, on rank 0, the batch queue) to the peers of one channel."""

    def __init__(
        self,
        channel: Channel,
        shards: Shard | Mapping[int, Shard] | None,
        coordinator: Coordinator,
        expect_bye: set[int],
        workers: set[int] | None = None,
        member: int | None = None,
        traffic: Traffic | None = None,
        lower: bool = True,
    ) -> None:
        """``coordinator``: the batch queue (if this rank holds it), the stop flag and the rendezvous (an
        ``ivyplug serve``'s) that the loop serves next to its shards. ``expect_bye``: ranks whose BYE ends the loop;
        ``workers``: the ranks whose BYE also idles them on the shards (co-located: every other worker).
        ``member``: the loop serves one worker over a two-rank group (``ivyplug serve``): every request is that
        worker slot's, received from rank 1, and a request that breaks the protocol ends this member only, never
        a shard. ``lower``: the loop takes requests from the ranks below this one (else above it): a channel with a
        reverse group (wire/transport.py) receives from each side on its own group, so each side has a loop of its
        own (``expect_bye`` and ``workers`` name the ranks of that side)."""
        super().__init__(name=f"ivyplug-ps-server-{channel.rank}{'' if lower else '-up'}", daemon=True)
        self.lower = lower
        self.channel = channel
        if isinstance(shards, Shard):
            shards = {shards.shard: shards}
        self.shards: dict[int, Shard] = dict(shards or {})
        self.coordinator = coordinator
        self.expect_bye = set(expect_bye)
        self.workers = set(workers or ())
        self.member = member
        self.traffic = traffic
        self.bye_from: set[int] = set()
        self.error: BaseException | None = None
        #: set (to why) when an ``ivyplug serve`` dropped this member for its silence: each request it sends
        #: later that wants a reply is refused with that text, the others (a STOP, data sent ahead, an IDLE) are
        #: ignored, until it leaves (BYE), its connection breaks, or it stays silent for the timeout after a
        #: request (a worker may take a refused request for a fallback, as a refused SHM_ATTACH is, and send
        #: another: that one is refused too). A member that never sends again holds the loop's wait for the next
        #: request, as before the drop (a receive that timed out would close the pair).
        self.dropped: str | None = None
        self._state_blob = b""
        # (sender, shard) -> the buffer its pushes are received into. Reuse is safe: a shard takes a push
        # (sync keeps a copy) before its reply goes out, and a worker sends its next push to a shard only
        # after that reply.
        self._push_bufs: dict[tuple[int, int], torch.Tensor] = {}
        # (sender, shard) -> the flags of a PUSH_DATA waiting for its PUSH_PULL; its data is in _push_bufs
        self._held: dict[tuple[int, int], int] = {}
        # (sender, shard) -> the sender's shared-memory region for that shard (wire/shared_region.py): its pushes
        # and their replies with Flag.SHM live there, not on the wire
        self._shared: dict[tuple[int, int], torch.Tensor] = {}
        # (sender, shard) -> the copy of the shard that sender holds, for pulls sent as differences from it
        self._pulled: dict[tuple[int, int], PulledCopy] = {}
        #: what a request of each kind calls (with its header, fp32 payload and fp64 hyperparameters)
        self._handlers: dict[int, _Handler] = {
            Kind.PUSH_DATA: self._on_push_data,
            Kind.PUSH_PULL: self._on_push_pull,
            Kind.PULL: self._on_pull,
            Kind.SHM_ATTACH: self._on_shm_attach,
            Kind.IDLE: self._on_idle,
            Kind.NORM: self._on_norm,
            Kind.TRUST_SUMS: self._on_trust_sums,
            Kind.STATE_SIZE: self._on_state_size,
            Kind.STATE_FETCH: self._on_state_fetch,
            Kind.LOAD: self._on_load,
            Kind.NEXT_BATCH: self._on_next_batch,
            Kind.EPOCH: self._on_epoch,
            Kind.GATHER: self._on_gather,
            Kind.GATHER_FETCH: self._on_gather_fetch,
            Kind.STOP: self._on_stop,
            Kind.BYE: self._on_bye,
        }

    @property
    def shard(self) -> Shard | None:
        """The shard of a loop that serves one (co-located, dedicated), else None."""
        return next(iter(self.shards.values())) if len(self.shards) == 1 else None

    @property
    def byes(self) -> int:
        return len(self.bye_from)

    def _flags(self) -> int:
        return Flag.STOP if self.coordinator.stop.is_set() else 0

    def _reply(
        self,
        to: int,
        request: Header,
        data: torch.Tensor | list[torch.Tensor] | None = None,
        keep: Releasable | None = None,
        **args: int,
    ) -> None:
        """Send an OK reply; ``keep`` (a shard state's loan) stays alive until its sends are done."""
        flags = self._flags() | (request.flags & (Flag.BF16 | Flag.SPLIT | Flag.SHM | Flag.DIFF | Flag.KEEP))
        h = Header(kind=Kind.REPLY, sender=self.channel.rank, shard=request.shard, seq=request.seq, flags=flags, **args)
        if self.traffic is not None:  # before the send: its worker may read the reply before the send returns
            numel = sum(t.numel() for t in payload_parts(data)) + self._shared_words(request)  # into a region too
            self.traffic.count(0, 0, message_bytes(numel))
        self.channel.send(to, h, data, reply=True, wait=False, stream=request.shard + 1, keep=keep)

    def _reply_error(self, to: int, request: Header, text: str | None = None) -> None:
        """An ERROR reply carrying a zero payload of the size the requester posted a receive for, so that
        its receive completes and it fails at once (not after ``timeout``) and nothing stays posted; then
        the error's text (``text``, else the shard's recorded error), which the requester raises with."""
        if text is None:
            target = self.shards.get(request.shard)
            text = (target.error if target is not None else None) or "unknown error"
        blob = f"rank {self.channel.rank}: {text}".encode()[:MAX_ERROR_TEXT]
        h = Header(
            kind=Kind.REPLY,
            sender=self.channel.rank,
            seq=request.seq,
            status=Status.ERROR,
            flags=self._flags(),
            arg3=len(blob),
        )
        stream = request.shard + 1
        # a split request's receiver posts the payload's receives only after an OK header (wire/transport.py); a
        # shared-memory one posts none
        zeros = None if request.flags & (Flag.SPLIT | Flag.SHM) else torch.zeros(self._reply_numel(request))
        self.channel.send(to, h, zeros, reply=True, wait=False, stream=stream)
        self.channel.send_error_text(to, blob, stream)

    def _reply_numel(self, request: Header) -> int:
        """fp32 elements of the reply payload a request of this kind expects (see worker/client.py)."""
        target = self.shards.get(request.shard)
        if request.kind in (Kind.PUSH_PULL, Kind.PULL) and target is not None:
            if request.flags & Flag.DIFF and request.flags & Flag.BF16:
                return target.block[PULL_BITS].words
            return target.bf16.words if request.flags & Flag.BF16 else target.n_total
        if request.kind == Kind.STATE_FETCH:
            return (len(self._state_blob) + 3) // 4
        if request.kind == Kind.GATHER_FETCH:  # the worker posted a receive of the size it was told (arg0)
            return (max(0, min(request.arg0, MAX_BLOB_BYTES)) + 3) // 4
        return 0

    def run(self) -> None:
        peer = 1 if self.member is not None else None
        while not self.expect_bye <= self.bye_from:
            refusal: str | None = None
            try:
                # once dropped, a member silent for the timeout after a request ends the loop
                wait = self.channel.timeout if self.dropped is not None else None
                header = self.channel.recv_request_header(peer, wait, self.lower)
                if self.member is not None:
                    header.sender = 1  # the pair's other rank, whatever its header says
                    refusal = self._check_sizes(header)
                if header.kind in _REAPS and header.shard in self.shards:  # it has read its last reply there
                    failed = self.channel.reap(header.sender, header.shard + 1)
                    if failed is not None:
                        print(f"[ivyplug.ps] {self._who(header)}: {failed}", file=sys.stderr, flush=True)
                key = (header.sender, header.shard)
                into = self._push_bufs.get(key) if header.kind in _PUSHES else None
                data, hyper = self.channel.recv_request_payload(header, into, self._segments(header))
                # kept for reuse only for a push the loop will take (a refused one may name any shard or size)
                if header.kind in _PUSHES and data is not None and refusal is None and header.shard in self.shards:
                    self._push_bufs[key] = data
                if self.traffic is not None:
                    numel = header.numel + (self._shared_words(header) if header.kind in _PUSHES else 0)
                    nbytes = message_bytes(numel, header.n_hyper)
                    self.traffic.count(int(header.kind == Kind.PUSH_PULL), nbytes, 0)
            except BaseException as exc:  # the group is unusable (or, for a member, it broke the protocol)
                self.error = exc if self.dropped is None else PSProtocolError(self.dropped)
                if self.member is None:
                    print(
                        f"[ivyplug.ps] server loop on rank {self.channel.rank} ended: {exc}",
                        file=sys.stderr,
                        flush=True,
                    )
                    for shard in self.shards.values():
                        shard.fail(exc)
                return
            if self.dropped is not None:  # it was silent too long and left; the others went on without it
                self.error = PSProtocolError(self.dropped)
                if header.kind == Kind.BYE:
                    return
                if header.kind in _WANTS_REPLY:
                    try:
                        self._reply_error(header.sender, header, self.dropped)
                    except Exception as reply_exc:  # it is gone after all
                        self._unanswered(header.sender, reply_exc)
                        return
                continue
            try:
                if refusal is not None:
                    raise PSProtocolError(refusal)
                self._handle(header, data, hyper)
            except BaseException as exc:
                print(
                    f"[ivyplug.ps] rank {self.channel.rank} failed on a kind-{header.kind} request from "
                    f"{self._who(header)}:\n{traceback.format_exc()}",
                    file=sys.stderr,
                    flush=True,
                )
                if self.member is None:  # a member's bad request is refused; it never fails a shard
                    for shard in self.shards.values():
                        shard.fail(exc)
                if header.kind in _WANTS_REPLY:
                    try:
                        self._reply_error(header.sender, header, f"{type(exc).__name__}: {exc}")
                    except Exception as reply_exc:  # the requester is gone too: keep serving the others
                        print(
                            f"[ivyplug.ps] rank {self.channel.rank} could not send the error reply to "
                            f"{self._who(header)}: {reply_exc}",
                            file=sys.stderr,
                            flush=True,
                        )

    def _segments(self, h: Header) -> list[Segment] | None:
        """The cut a split request's payload travels in (its shard's), None for one message: only a payload of
        the shard's size is cut (a wrong-sized one travels whole and is refused as before)."""
        if not h.flags & Flag.SPLIT or h.numel == 0:
            return None
        target = self.shards.get(h.shard)
        if h.kind != Kind.PUSH_PULL or target is None or h.flags & Flag.BF16:
            raise PSProtocolError(
                f"{self._who(h)} sent a split kind-{h.kind} payload for shard {h.shard}: only fp32 pushes to a "
                f"shard this server holds ({sorted(self.shards)}) travel split"
            )
        return target.segments if h.numel == target.n_total else None

    def _who(self, h: Header) -> str:
        return f"worker {self.member}" if self.member is not None else f"rank {h.sender}"

    def _check_sizes(self, h: Header) -> str | None:
        """Whether a member's request announces exactly the payload its kind carries: None, or why not.

        Checked before any payload is received: gloo aborts the process on a message longer than the posted
        receive (see wire/auth.py). A wrong but bounded size is still received as announced (then refused with
        an error reply); a kind or size outside the bounds ends the member (PSProtocolError)."""
        numel, n_hyper = 0, 0
        if h.numel < 0 or h.n_hyper < 0 or h.numel > MAX_PAYLOAD or h.n_hyper > MAX_HYPER:
            raise PSProtocolError(f"worker {self.member} announced a payload of {h.numel} + {h.n_hyper} values")
        allowed = (
            Kind.PUSH_PULL, Kind.PUSH_DATA, Kind.PULL, Kind.IDLE, Kind.BYE, Kind.NEXT_BATCH, Kind.STOP,
            Kind.STATE_SIZE, Kind.STATE_FETCH, Kind.LOAD, Kind.EPOCH, Kind.GATHER, Kind.GATHER_FETCH, Kind.SHM_ATTACH,
        )  # fmt: skip
        if h.kind not in allowed:
            raise PSProtocolError(f"worker {self.member} sent a message of kind {h.kind}, which members may not send")
        if h.kind in (*_PUSHES, Kind.PULL, Kind.STATE_SIZE, Kind.STATE_FETCH, Kind.LOAD, Kind.IDLE, Kind.SHM_ATTACH):
            target = self.shards.get(h.shard)
            if target is None:
                return f"worker {self.member} asked for shard {h.shard}; this server has {sorted(self.shards)}"
            words = _payload_words(target, h.flags)
            shared = bool(h.flags & Flag.SHM)  # the payload is in the member's region: nothing follows
            if h.kind == Kind.PUSH_PULL:  # the data inline, or ahead in a PUSH_DATA
                numel, n_hyper = (0 if h.numel == 0 or shared else words), target.n_hyper
            elif h.kind == Kind.PUSH_DATA:
                numel = 0 if shared else words
        else:
            h.shard = -1  # requests of the service itself: their replies come back on stream 0
        if h.kind in (Kind.LOAD, Kind.GATHER):
            if not 0 <= h.arg0 <= MAX_BLOB_BYTES:
                return f"worker {self.member} announced {h.arg0} bytes"
            numel = (h.arg0 + 3) // 4
        if h.kind == Kind.SHM_ATTACH:
            if not 0 < h.arg0 <= MAX_PATH:
                return f"worker {self.member} announced a path of {h.arg0} bytes"
            numel = (h.arg0 + 3) // 4
        if h.kind in _PUSHES and (h.numel, h.n_hyper) != (numel, n_hyper):
            return (
                f"shard {h.shard}: push from worker {self.member} has {h.numel} values, expected {numel} (and "
                f"{h.n_hyper} hyperparameters, expected {n_hyper})"
            )
        if (h.numel, h.n_hyper) != (numel, n_hyper):
            return (
                f"worker {self.member}'s kind-{h.kind} request to shard {h.shard} announces {h.numel} + {h.n_hyper} "
                f"values; it must carry {numel} + {n_hyper}"
            )
        return None

    def _answer_number(self, to: int, request: Header, fut: Future[int]) -> None:
        """Send a reply whose ``arg0`` is the number ``fut`` resolves to (a batch index, a gathered length)."""
        try:
            exc = fut.exception()
            if exc is not None:
                self._reply_error(to, request, f"{type(exc).__name__}: {exc}")
            else:
                self._reply(to, request, None, arg0=fut.result())
        except Exception as send_exc:  # the requester is gone: the loop notices at its next receive
            self._unanswered(to, send_exc)

    def _unanswered(self, to: int, exc: Exception) -> None:
        print(f"[ivyplug.ps] rank {self.channel.rank} could not answer rank {to}: {exc}", file=sys.stderr, flush=True)

    def _answer(self, to: int, request: Header, fut: Future[Reply]) -> None:
        """Send a push's or pull's reply once its future is resolved (on the resolving thread)."""
        try:
            exc = fut.exception()
            if exc is not None:
                self._reply_error(to, request, f"{type(exc).__name__}: {exc}")
                return
            r = fut.result()
            target = self.shards[request.shard]
            snapshot: torch.Tensor | list[torch.Tensor] | None = r.snapshot
            loan = r.loan  # the shard's state, lent: kept until the reply's sends are done
            if request.flags & Flag.SHM:  # the reply goes into the worker's region; only its header travels
                self._shared_data(request).copy_(r.snapshot)
                r.release()
                snapshot, loan = None, None
            elif request.flags & Flag.BF16:
                copy = self._pulled_copy(request, target)
                if copy is None:
                    snapshot = target.bf16.encode(r.snapshot)
                elif request.flags & Flag.DIFF:
                    snapshot = copy.encode(r.snapshot)
                else:
                    snapshot = copy.encode_whole(r.snapshot)
                r.release()  # the encoded copy is what travels
                loan = None
            elif request.flags & Flag.SPLIT:
                snapshot = views(r.snapshot, target.segments)
            self._reply(
                to,
                request,
                snapshot,
                keep=loan,
                arg0=r.staleness,
                arg1=r.version,
                arg2=r.clock,
                arg3=float_arg(r.grad_sq),
            )
        except Exception as send_exc:  # the requester is gone: the loop notices at its next receive
            self._unanswered(to, send_exc)

    def _pulled_copy(self, request: Header, target: Shard) -> PulledCopy | None:
        """The copy of ``target`` that a KEEP or DIFF request's sender holds (wire/codecs.py PulledCopy), made
        for KEEP; None for a plain bf16 request. Only this request's reply touches it: a worker asks a shard
        again only after reading its reply."""
        if not request.flags & (Flag.DIFF | Flag.KEEP):
            return None
        key = (request.sender, request.shard)
        copy = self._pulled.get(key)
        if copy is None:
            copy = self._pulled[key] = PulledCopy(target.block[PULL_BITS], target.bf16)
        return copy

    def _attach(self, h: Header, data: torch.Tensor | None) -> bool:
        """Map the region a SHM_ATTACH names for its sender and shard; False (staying on gloo) where it cannot
        be: another host or another ``/dev/shm`` (no such file), or a file that is not the one announced."""
        target = self.shards.get(h.shard)
        if target is None or data is None or not 0 < h.arg0 <= MAX_PATH:
            return False
        path = words_to_bytes(data, h.arg0).decode("utf-8", errors="replace")
        try:
            region = shared_region.attach(path, target.n_total, shared_region.nonce_bytes(h.arg1, h.arg2))
        except (OSError, ValueError) as exc:
            log.info("ivyplug PS: rank %d's payloads to shard %d stay on gloo: %s", h.sender, h.shard, exc)
            return False
        self._shared[(h.sender, h.shard)] = region
        return True

    def _shared_words(self, h: Header) -> int:
        """fp32 words a shared-memory request's payload (or its reply's) moved through its region, for the
        traffic count (as they would count on gloo); 0 for any other request."""
        region = self._shared.get((h.sender, h.shard)) if h.flags & Flag.SHM else None
        return 0 if region is None else region.numel()

    def _shared_data(self, h: Header) -> torch.Tensor:
        """The region a request with ``Flag.SHM`` keeps its payload in (mapped by its SHM_ATTACH)."""
        region = self._shared.get((h.sender, h.shard))
        if region is None:
            raise PSProtocolError(
                f"{self._who(h)} sent a shared-memory kind-{h.kind} request for shard {h.shard} without a "
                "region mapped for it"
            )
        return region

    def _shard_for(self, h: Header) -> Shard:
        shard = self.shards.get(h.shard)
        if shard is None:
            raise RuntimeError(
                f"a kind-{h.kind} request for shard {h.shard} reached rank {self.channel.rank}, which serves "
                f"{sorted(self.shards) or 'no shard'}"
            )
        return shard

    def _handle(self, h: Header, data: torch.Tensor | None, hyper: torch.Tensor | None) -> None:
        """Call the handler of the request's kind (:attr:`_handlers`): a shard's, the coordinator's, the loop's."""
        handler = self._handlers.get(h.kind)
        if handler is None:
            raise RuntimeError(f"unknown message kind {h.kind} from {self._who(h)}")
        if h.kind in _NEEDS_SHARD:
            self._shard_for(h)  # refused before anything else if this rank does not hold it
        if h.kind in (*_PUSHES, Kind.PULL) and h.flags & Flag.SHM:
            data = self._shared_data(h)  # the sender's region (refused now if it has none, not at the reply)
        handler(h, data, hyper)

    def _worker(self, h: Header) -> int:
        """The worker a request is from: the member's slot (``ivyplug serve``), else the sending rank."""
        return self.member if self.member is not None else h.sender

    # ---------------------------------------------------------------- the shards'
    def _on_push_data(self, h: Header, data: torch.Tensor | None, hyper: torch.Tensor | None) -> None:
        """Data sent ahead of its PUSH_PULL (from backward's hooks): applied with it; a later one replaces it."""
        self._held[(h.sender, h.shard)] = h.flags

    def _on_push_pull(self, h: Header, data: torch.Tensor | None, hyper: torch.Tensor | None) -> None:
        if self._refused_difference(h):
            return
        assert hyper is not None
        shard = self._shard_for(h)
        held = self._held.pop((h.sender, h.shard), None)
        flags = h.flags
        if data is None:  # the data came ahead, in a PUSH_DATA
            if held is None:
                raise PSProtocolError(
                    f"shard {h.shard}: a push without data from {self._who(h)}, and no data sent before it"
                )
            data, flags = self._push_bufs[(h.sender, h.shard)], held
        bits = _block_bits(flags)
        if bits:
            data = shard.block[bits].decode(data)
        elif flags & Flag.BF16:
            data = shard.bf16.decode(data)
        to = h.sender
        shard.push_pull(self._worker(h), data, hyper).add_done_callback(lambda f: self._answer(to, h, f))

    def _on_pull(self, h: Header, data: torch.Tensor | None, hyper: torch.Tensor | None) -> None:
        if self._refused_difference(h):
            return
        to = h.sender
        self._shard_for(h).pull(self._worker(h)).add_done_callback(lambda f: self._answer(to, h, f))

    def _refused_difference(self, h: Header) -> bool:
        """A pull asked as a difference from a copy this server does not hold is refused, before its push applies."""
        copy = self._pulled.get((h.sender, h.shard))
        if not h.flags & Flag.DIFF or (copy is not None and copy.held):
            return False
        self._reply_error(
            h.sender,
            h,
            f"shard {h.shard}: {self._who(h)} asked for its pull as a difference from the copy it holds, and this "
            "server keeps no copy of it (was the server restarted under a running worker?)",
        )
        return True

    def _on_shm_attach(self, h: Header, data: torch.Tensor | None, hyper: torch.Tensor | None) -> None:
        self._reply(h.sender, h, None, arg0=int(self._attach(h, data)))

    def _on_idle(self, h: Header, data: torch.Tensor | None, hyper: torch.Tensor | None) -> None:
        if h.shard in self.shards:
            self.shards[h.shard].idle(self._worker(h))

    def _on_norm(self, h: Header, data: torch.Tensor | None, hyper: torch.Tensor | None) -> None:
        assert hyper is not None
        self._shard_for(h).norm(h.arg0, h.arg1, float(hyper[0]))

    def _on_trust_sums(self, h: Header, data: torch.Tensor | None, hyper: torch.Tensor | None) -> None:
        assert hyper is not None
        self._shard_for(h).trust_sums((h.arg2, h.arg0), h.arg1, hyper.tolist())

    def _on_state_size(self, h: Header, data: torch.Tensor | None, hyper: torch.Tensor | None) -> None:
        self._state_blob = self._shard_for(h).state()
        self._reply(h.sender, h, None, arg0=len(self._state_blob))

    def _on_state_fetch(self, h: Header, data: torch.Tensor | None, hyper: torch.Tensor | None) -> None:
        self._reply(h.sender, h, bytes_to_words(self._state_blob), arg0=len(self._state_blob))

    def _on_load(self, h: Header, data: torch.Tensor | None, hyper: torch.Tensor | None) -> None:
        assert data is not None
        self._shard_for(h).load(load_state_bytes(words_to_bytes(data, h.arg0)))
        self._reply(h.sender, h, None)

    # ---------------------------------------------------------------- the coordinator's
    def _queue(self) -> BatchQueue:
        queue = self.coordinator.queue
        if queue is None:
            raise RuntimeError(f"rank {self.channel.rank} holds no batch queue (ask rank 0)")
        return queue

    def _on_next_batch(self, h: Header, data: torch.Tensor | None, hyper: torch.Tensor | None) -> None:
        queue, to, w = self._queue(), h.sender, self._worker(h)
        if h.arg2 == BatchAsk.END:  # the worker's epoch is over: it trained every batch it got
            queue.finish(w, h.arg0)
            self._reply(to, h, None, arg0=-1)
        elif h.arg2 == BatchAsk.STOP:  # the worker reached the fit's step limit: no more batches this epoch
            queue.stop(w, h.arg0)
            self._reply(to, h, None, arg0=-1)
        else:  # with WAIT, answered when the queue resolves it (another worker's batches may come back)
            taken = queue.take(w, h.arg0, max(0, h.arg1), wait=h.arg2 == BatchAsk.WAIT)
            taken.add_done_callback(lambda f: self._answer_number(to, h, f))

    def _on_epoch(self, h: Header, data: torch.Tensor | None, hyper: torch.Tensor | None) -> None:
        self._queue().reset(h.arg0, h.arg1, h.arg2)
        self._reply(h.sender, h, None)

    def _rendezvous(self) -> tuple[Rendezvous, int]:
        rendezvous = self.coordinator.rendezvous
        if rendezvous is None or self.member is None:
            raise RuntimeError(f"rank {self.channel.rank} runs no collectives (an ivyplug serve does)")
        return rendezvous, self.member

    def _on_gather(self, h: Header, data: torch.Tensor | None, hyper: torch.Tensor | None) -> None:
        rendezvous, member = self._rendezvous()
        assert data is not None or h.arg0 == 0
        blob = words_to_bytes(data, h.arg0) if data is not None else b""
        to = h.sender
        rendezvous.gather(member, h.arg1, blob).add_done_callback(lambda f: self._answer_number(to, h, f))

    def _on_gather_fetch(self, h: Header, data: torch.Tensor | None, hyper: torch.Tensor | None) -> None:
        result = self._rendezvous()[0].result(h.arg1)
        self._reply(h.sender, h, bytes_to_words(result), arg0=len(result))

    def _on_stop(self, h: Header, data: torch.Tensor | None, hyper: torch.Tensor | None) -> None:
        self.coordinator.stop.set()

    # ---------------------------------------------------------------- the loop's own
    def _on_bye(self, h: Header, data: torch.Tensor | None, hyper: torch.Tensor | None) -> None:
        to, w = h.sender, self._worker(h)
        self.bye_from.add(to)
        self._pulled = {key: c for key, c in self._pulled.items() if key[0] != to}
        if self.member is None and w in self.workers:
            for s in self.shards.values():
                s.idle(w)


def _block_bits(flags: int) -> int:
    """The bits of a block-quantized push's payload (wire_codec.BlockCodec), 0 for none."""
    return 8 if flags & Flag.INT8 else 4 if flags & Flag.INT4 else 0


def _payload_words(shard: Shard, flags: int) -> int:
    """fp32 words of a push payload to ``shard`` sent with ``flags``."""
    bits = _block_bits(flags)
    if bits:
        return shard.block[bits].words
    return shard.bf16.words if flags & Flag.BF16 else shard.n_total
