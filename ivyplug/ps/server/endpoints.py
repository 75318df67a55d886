"""How a worker (or another shard) talks to a shard: one interface, an in-process and a wire endpoint.

:class:`ShardEndpoint` is what the client loops over. :class:`InProcessEndpoint` calls a :class:`Shard` of
this process (a co-located worker's own shard: gloo cannot send to itself); :class:`WireEndpoint` sends the
same requests as fixed-header messages (wire/messages.py) to the rank that serves the shard, whose server loop
decodes them into the same shard calls. Both answer ``push_pull`` and ``pull`` with a :class:`PendingReply`
whose ``result(timeout)`` blocks until the reply is there (no polling), so a step posts every shard's
request first and then collects the replies. ``push_data`` sends a push's data ahead (from backward's gradient
hooks, worker/early_push.py); the ``push_pull`` without data that follows applies it.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ivyplug.ps.server.shard import Reply, Shard, load_state_bytes
from ivyplug.ps.wire import shared_region, typed_state
from ivyplug.ps.wire.codecs import Bf16Codec, BlockCodec, PulledCopy
from ivyplug.ps.wire.messages import (
    BLOCK_FLAGS,
    Flag,
    Header,
    Kind,
    Status,
    arg_float,
    bytes_to_words,
    message_bytes,
    words_to_bytes,
)
from ivyplug.ps.wire.segments import Segment, views
from ivyplug.ps.wire.transport import Channel, PSProtocolError, PSTimeoutError, wait_work

log = logging.getLogger(__name__)


class PSServerError(PSProtocolError):
    """A server answered a request with an error; ``text`` is what it said."""

    def __init__(self, message: str, text: str) -> None:
        super().__init__(message)
        self.text = text


class PendingReply(Protocol):
    def result(self, timeout: float) -> Reply: ...


#: a push's fp32 data: one flat tensor, or its parts cut as the endpoint's segments
Payload = torch.Tensor | list[torch.Tensor]
#: per segment, the tensor its part of a reply is received into in place, or None (the reply buffer)
Targets = list[torch.Tensor | None]


class ShardEndpoint(Protocol):
    """One shard as the client sees it, wherever it runs."""

    shard: int
    #: the cut its fp32 payloads travel in (wire/segments.py); None where they do not travel split (a shard in this
    #: process, a bf16 wire). With a cut, a push's ``data`` is one tensor per segment, and ``into`` may name,
    #: per segment, a tensor the reply's part is received into in place (None: the reply buffer).
    segments: list[Segment] | None

    def push_data(self, worker: int, data: torch.Tensor) -> None: ...

    def push_pull(
        self, worker: int, data: Payload | None, hyper: torch.Tensor, into: Targets | None = None
    ) -> PendingReply: ...

    def pull(self, worker: int, into: Targets | None = None, exact: bool = False) -> PendingReply:
        """The shard's values; ``exact``: in fp32 even over a bf16 or quantized wire (a pull that no later one
        replaces: the values a worker saves or returns)."""
        ...

    def idle(self, worker: int) -> None: ...

    def state(self) -> bytes: ...

    def load(self, state: dict[str, Any]) -> None: ...


@dataclass
class WireStats:
    """Traffic and waiting of one worker's wire endpoints (its PS metrics)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    wait_seconds: float = 0.0
    remote_stop: bool = False


class _LocalReply:
    def __init__(self, fut: Future[Reply], shard: Shard, worker: int, stats: WireStats) -> None:
        self._fut, self._shard, self._worker, self._stats = fut, shard, worker, stats

    def result(self, timeout: float) -> Reply:
        t0 = time.monotonic()
        try:
            return self._fut.result(timeout)
        except FutureTimeout:
            raise PSTimeoutError(self._shard.describe_wait(self._worker, timeout)) from None
        finally:
            self._stats.wait_seconds += time.monotonic() - t0


class InProcessEndpoint:
    """A shard of this process, called directly."""

    def __init__(self, shard: Shard, stats: WireStats | None = None) -> None:
        self.target = shard
        self.shard = shard.shard
        self._stats = stats if stats is not None else WireStats()
        self._held: dict[int, torch.Tensor] = {}  # worker -> the data of its next push (push_data)
        self.segments: list[Segment] | None = None  # nothing travels: the shard reads the push's buffer

    def push_data(self, worker: int, data: torch.Tensor) -> None:
        self._held[worker] = data

    def push_pull(
        self, worker: int, data: Payload | None, hyper: torch.Tensor, into: Targets | None = None
    ) -> PendingReply:
        held = self._held.pop(worker, None)
        if data is None:
            if held is None:
                raise PSProtocolError(f"shard {self.shard}: a push without data, and no data sent before it")
            data = held
        if not isinstance(data, torch.Tensor):
            raise TypeError(f"shard {self.shard} is in this process: a push is one flat tensor, not {len(data)} parts")
        return _LocalReply(self.target.push_pull(worker, data, hyper), self.target, worker, self._stats)

    def pull(self, worker: int, into: Targets | None = None, exact: bool = False) -> PendingReply:
        return _LocalReply(self.target.pull(worker), self.target, worker, self._stats)

    def idle(self, worker: int) -> None:
        self.target.idle(worker)

    def state(self) -> bytes:
        return self.target.state()

    def load(self, state: dict[str, Any]) -> None:
        self.target.load(state)


class WireReply:
    """The reply to one request of a :class:`WireEndpoint`, received when asked for (its receives are posted)."""

    def __init__(
        self,
        endpoint: WireEndpoint,
        hbuf: torch.Tensor,
        works: list[Any],
        out: torch.Tensor | None,
        what: str,
        into: Targets | None = None,
    ):
        # weak: the endpoint keeps its last reply (to drain it), and a cycle would keep a dropped client's pair
        # group open until the garbage collector runs (its server would not see it go)
        self._endpoint_ref = weakref.ref(endpoint)
        self._hbuf, self._works, self._out, self._what = hbuf, works, out, what
        self._into = into
        self._header: Header | None = None
        self._parts: list[Any] | None = None  # a split reply's posted part receives
        self._value: torch.Tensor | None = None  # a bf16 or difference reply, decoded (once: it moves the copy)
        #: the whole reply has been received (or it was an error, which carries nothing more)
        self.done = False

    @property
    def _endpoint(self) -> WireEndpoint:
        ep = self._endpoint_ref()
        if ep is None:
            raise PSProtocolError(f"the endpoint of {self._what} is gone (its client was closed)")
        return ep

    def header(self, timeout: float) -> Header:
        if self._header is None:
            try:
                self._header = self._endpoint.finish(self._hbuf, self._works, self._what, timeout)
            except PSServerError:
                self.done = True
                raise
            self.done = not self._header.flags & Flag.SPLIT
        return self._header

    def drain(self, timeout: float) -> None:
        """Receive what is left of this reply into the reply buffer, so that the next request's receives on
        this stream match the next reply (a step that failed on another shard left this one unread)."""
        if not self.done:
            try:
                self.header(timeout)
            except PSServerError:
                return
            if not self.done:
                self._receive_parts(None, timeout)
        if self._header is not None and self._header.flags & (Flag.DIFF | Flag.KEEP):
            self._decode(self._header)  # the pulled copy follows every reply the server sent, read or not

    def _receive_parts(self, into: Targets | None, timeout: float) -> None:
        ep = self._endpoint
        assert ep.segments is not None and self._out is not None
        if self._parts is None:
            into = into if into is not None else [None] * len(ep.segments)
            parts = [v if t is None else t for t, v in zip(into, views(self._out, ep.segments), strict=True)]
            self._parts = ep.channel.post_reply_parts(ep.dst, parts, ep.shard + 1)
        t0 = time.monotonic()
        for w in self._parts:
            wait_work(w, timeout, f"rank {ep.dst}'s reply to {self._what}")
        ep._stats.wait_seconds += time.monotonic() - t0
        self.done = True

    def _decode(self, h: Header) -> torch.Tensor:
        """The reply's fp32 values, decoded once into the endpoint's reused buffer."""
        if self._value is None:
            ep = self._endpoint
            assert self._out is not None and ep.bf16 is not None
            if h.flags & (Flag.DIFF | Flag.KEEP):
                if ep.pulled is None:
                    raise PSProtocolError(f"shard {ep.shard}: a pulled-copy reply to an endpoint that keeps none")
                decode = ep.pulled.decode if h.flags & Flag.DIFF else ep.pulled.decode_whole
                self._value = decode(self._out, ep.decoded())
            else:
                self._value = ep.bf16.decode(self._out, ep.decoded())
        return self._value

    def payload(self, timeout: float) -> tuple[Header, torch.Tensor | None]:
        """The reply's header and fp32 payload (for requests whose payload is not a shard snapshot)."""
        return self.header(timeout), self._out

    def result(self, timeout: float) -> Reply:
        h = self.header(timeout)
        assert self._out is not None
        ep = self._endpoint
        if ep.bf16 is not None and h.flags & Flag.BF16:  # a bf16 or difference reply: decode into the fp32 buffer
            return Reply(self._decode(h), h.arg1, h.arg0, h.arg2, arg_float(h.arg3))
        placed: tuple[int, ...] = ()
        if h.flags & Flag.SPLIT:  # its parts follow the OK header, some straight into the worker's tensors
            self._receive_parts(self._into, timeout)
            placed = tuple(i for i, t in enumerate(self._into or []) if t is not None)
        return Reply(self._out, h.arg1, h.arg0, h.arg2, arg_float(h.arg3), placed)


class WireEndpoint:
    """A shard served by PS-group rank ``dst``, reached over ``channel`` (this process's rank ``sender``)."""

    def __init__(self, channel: Channel, dst: int, shard: int, numel: int, stats: WireStats | None = None) -> None:
        self.channel = channel
        self.dst = dst
        self.shard = shard
        self.numel = numel
        self._stats = stats if stats is not None else WireStats()
        self._reply_buf: torch.Tensor | None = None  # reused: a reply is unpacked before the next request
        self._decoded: torch.Tensor | None = None
        self._open: WireReply | None = None  # the last reply asked for, until it is received whole
        self._seq = 0
        #: set (PSConfig.wire_dtype other than "float32", not in shared memory): pushes and pulls travel as bf16
        #: (wire/codecs.py)
        self.bf16: Bf16Codec | None = None
        #: set with :attr:`bf16` (wire_dtype "int8"/"int4"): pushes travel block-quantized with error feedback
        #: (wire/codecs.py BlockCodec)
        self.block: BlockCodec | None = None
        #: set with :attr:`block`: pulls travel as the quantized difference from the copy both ends keep
        #: (wire/codecs.py PulledCopy), the first one in bf16 (an exact pull, ``pull(exact=True)``, leaves it alone)
        self.pulled: PulledCopy | None = None
        #: set (fp32 wire): pushes and pulls travel cut so, large tensors in place (wire/segments.py)
        self.segments: list[Segment] | None = None
        #: set (:meth:`share`): the shared-memory region pushes and pulls of this shard live in; only their
        #: headers travel (wire/shared_region.py)
        self.shared: torch.Tensor | None = None
        #: allocates the fp32 buffer a reply lands in (the client's: pinned where its tensors are on CUDA)
        self.host_buffer: Callable[[int], torch.Tensor] = lambda numel: torch.empty(numel, dtype=torch.float32)

    def decoded(self) -> torch.Tensor:
        """The reused fp32 buffer a bf16 reply is decoded into."""
        if self._decoded is None:
            self._decoded = self.host_buffer(self.numel)
        return self._decoded

    # -- plumbing shared by every request ---------------------------------------------------------
    def request(
        self,
        kind: int,
        data: Payload | None = None,
        hyper: torch.Tensor | None = None,
        reply_numel: int = 0,
        what: str = "",
        into: Targets | None = None,
        exact: bool = False,
        **args: int,
    ) -> WireReply:
        """Send a request of ``kind``; its reply, received when asked for. ``exact`` (a PULL): the reply in fp32,
        whole, whatever this endpoint's wire (the server's copy of what this worker holds, for a wire that pulls
        differences, is left as it was: so is this endpoint's)."""
        if self._open is not None:  # the last reply on this stream, left unread by a step that failed elsewhere
            self._open.drain(self.channel.timeout)
        self._seq += 1
        split = False
        shm = kind in (Kind.PUSH_PULL, Kind.PULL) and self.shared is not None
        if shm:
            out: torch.Tensor | None = self.shared  # the server writes the reply there: no receive to post
            args["flags"] = Flag.SHM
            if data is not None:
                self._into_region(data)
                data = None  # nothing but the header travels
        elif kind == Kind.PULL and exact and self.bf16 is not None:
            out = self.decoded()  # fp32 and whole: no flag asks for another form
        elif kind in (Kind.PUSH_PULL, Kind.PULL):
            if self._reply_buf is None:
                words = self.bf16.words if self.bf16 is not None else self.numel
                self._reply_buf = self.host_buffer(words)
            out = self._reply_buf
            if self.bf16 is not None:
                args["flags"] = Flag.BF16
                if self.pulled is not None:  # the reply: the difference from the copy held, or a whole one to keep
                    diff = self.pulled.held
                    args["flags"] |= Flag.DIFF if diff else Flag.KEEP
                    out = out[: self.pulled.block.words] if diff else out
                if data is not None:
                    assert isinstance(data, torch.Tensor), "a bf16 or quantized push is one flat tensor"
                    if self.block is not None:
                        args["flags"] |= BLOCK_FLAGS[self.block.bits]
                        data = self.block.encode(data)
                    else:
                        data = self.bf16.encode(data)
            elif self.segments is not None:
                split = True
                args["flags"] = Flag.SPLIT
                if isinstance(data, torch.Tensor) and data.numel() == self.numel:
                    data = views(data, self.segments)  # (a payload of another size travels whole, to be refused)
                if isinstance(data, list) and len(data) != len(self.segments):
                    cut = len(self.segments)
                    raise ValueError(f"shard {self.shard}: a push in {len(data)} parts; its cut has {cut}")
        else:
            out = torch.empty(reply_numel, dtype=torch.float32) if reply_numel else None
        hbuf, works = self.channel.post_reply(self.dst, None if shm else out, self.shard + 1, split=split)
        h = Header(kind=kind, sender=self.channel.rank, shard=self.shard, seq=self._seq, **args)
        self._stats.bytes_sent += self.channel.send(self.dst, h, data, hyper, wait=False)
        self._open = WireReply(self, hbuf, works, out, what or f"a kind-{kind} request for shard {self.shard}", into)
        return self._open

    def _into_region(self, data: Payload) -> None:
        """Put a push's data into the shared region (nothing to copy when it was packed there); counted as
        sent: the bytes a push moves, whichever way they travel."""
        assert self.shared is not None
        if not isinstance(data, torch.Tensor) or data.numel() != self.numel:
            got = f"a tensor of {data.numel()} values" if isinstance(data, torch.Tensor) else f"{len(data)} parts"
            raise ValueError(
                f"shard {self.shard}: a shared-memory push is one flat tensor of {self.numel} values, got {got}"
            )
        if data.data_ptr() != self.shared.data_ptr():
            self.shared.copy_(data)
        self._stats.bytes_sent += 4 * self.numel

    def share(self, region: shared_region.Region) -> bool:
        """Ask the server to map ``region`` for this worker's pushes and pulls of the shard; True if it did
        (from then on only headers travel), False where it could not (another host): the wire stays gloo."""
        path = region.path.encode()
        a, b = region.nonce_args
        reply = self.request(Kind.SHM_ATTACH, bytes_to_words(path), arg0=len(path), arg1=a, arg2=b)
        try:
            if reply.header(self.channel.timeout).arg0 != 1:
                return False
        except PSServerError as exc:  # a server that refused the request: it stays on gloo
            log.info("ivyplug PS: payloads of shard %d stay on gloo: %s", self.shard, exc.text)
            return False
        self.shared = region.tensor
        return True

    def finish(self, hbuf: torch.Tensor, works: list[Any], what: str, timeout: float) -> Header:
        t0 = time.monotonic()
        h = self.channel.wait_reply(hbuf, works, f"rank {self.dst}'s reply to {what}", timeout)
        self._stats.wait_seconds += time.monotonic() - t0
        if h.status != Status.OK:
            try:
                text = self.channel.recv_error_text(self.dst, h.arg3, self.shard + 1)
            except (PSProtocolError, PSTimeoutError) as exc:
                text = f"(its error text could not be received: {exc})"
            text = text or "no details"
            raise PSServerError(f"PS server on rank {self.dst} failed while answering {what}: {text}", text)
        if h.flags & Flag.STOP:
            self._stats.remote_stop = True
        self._stats.bytes_received += message_bytes(self.numel if h.flags & Flag.SHM else h.numel)
        return h

    def send(self, kind: int, data: torch.Tensor | None = None, hyper: torch.Tensor | None = None, **args: int) -> None:
        """A message without a reply (waits until it left)."""
        h = Header(kind=kind, sender=self.channel.rank, shard=self.shard, **args)
        self._stats.bytes_sent += self.channel.send(self.dst, h, data, hyper, wait=True)

    # -- the shard interface ------------------------------------------------------------------------
    def push_data(self, worker: int, data: torch.Tensor) -> None:
        """Send a push's data without waiting (kept alive until the channel's flush).

        Like every request on this stream, only once the last reply is read whole: the server takes this
        request as the sign that the reply's sends are done (a failed pull may have left one unread)."""
        if self._open is not None:
            self._open.drain(self.channel.timeout)
        flags = 0
        wire: torch.Tensor | None = data
        if self.shared is not None:
            self._into_region(data)
            flags, wire = Flag.SHM, None
        elif self.block is not None:  # PSConfig refuses early pushes with these: they would carry errors twice
            raise ValueError(f"shard {self.shard}: a block-quantized push is sent whole, at the step")
        elif self.bf16 is not None:
            flags, wire = Flag.BF16, self.bf16.encode(data)
        h = Header(kind=Kind.PUSH_DATA, sender=self.channel.rank, shard=self.shard, flags=flags)
        self._stats.bytes_sent += self.channel.send(self.dst, h, wire, wait=False)

    def push_pull(
        self, worker: int, data: Payload | None, hyper: torch.Tensor, into: Targets | None = None
    ) -> PendingReply:
        return self.request(Kind.PUSH_PULL, data, hyper, what=f"the push/pull of shard {self.shard}", into=into)

    def pull(self, worker: int, into: Targets | None = None, exact: bool = False) -> PendingReply:
        return self.request(Kind.PULL, what=f"the pull of shard {self.shard}", into=into, exact=exact)

    def idle(self, worker: int) -> None:
        self.send(Kind.IDLE)

    def state(self) -> bytes:
        timeout = self.channel.timeout
        nbytes = self.request(Kind.STATE_SIZE).header(timeout).arg0
        _, words = self.request(Kind.STATE_FETCH, reply_numel=(nbytes + 3) // 4).payload(timeout)
        return words_to_bytes(words, nbytes) if words is not None else b""

    def load(self, state: dict[str, Any]) -> None:
        blob = typed_state.encode(state)
        self.request(Kind.LOAD, bytes_to_words(blob), arg0=len(blob)).header(self.channel.timeout)


__all__ = [
    "InProcessEndpoint",
    "PendingReply",
    "ShardEndpoint",
    "WireEndpoint",
    "WireReply",
    "WireStats",
    "load_state_bytes",
]
