"""Point-to-point messaging over a gloo process group, with a timeout on every wait a worker makes.

The server loop's receive-from-any-source is the only wait without our timeout: on this torch/gloo a
timed-out any-source receive leaves the group broken (the next message aborts the process), so the loop
blocks until a message arrives and ends on BYE messages from every peer.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Protocol

import torch

from ivyplug.ps.wire.messages import (
    TAG_REPLY,
    TAG_REPLY_DATA,
    TAG_REPLY_TEXT,
    TAG_REQUEST,
    TAG_REQUEST_DATA,
    TAG_REQUEST_HYPER,
    Header,
    Status,
    bytes_to_words,
    empty_header,
    words_to_bytes,
)
from ivyplug.ps.wire.segments import Segment, views

#: how long a server may sit idle between requests (an any-source receive must never time out, see above)
IDLE_WAIT = timedelta(days=7)


#: replies kept per (worker, stream) before the oldest is waited for (see Channel.send)
_KEEP_REPLIES = 64


class Releasable(Protocol):
    """What a reply may keep until it is read (a shard's loan of the state it is a view of)."""

    def release(self) -> None: ...

    def abandon(self) -> None: ...


#: a server's reply kept until its worker's next request: its send works, its tensors, what it keeps
_KeptReply = tuple[list[Any], tuple[torch.Tensor, ...], Releasable | None]


class PSTimeoutError(TimeoutError):
    """A wait on the parameter server took longer than ``PSConfig.timeout``."""


class PSProtocolError(RuntimeError):
    """A peer sent something this process did not expect, or a server failed."""


def _peer_closed(msg: str) -> bool:
    return "Connection closed by peer" in msg or "Connection reset" in msg or "Broken pipe" in msg


def peer_error(peer: int, doing: str, exc: BaseException) -> PSProtocolError:
    """A PSProtocolError naming the PS rank that failed; a closed connection means the peer died."""
    msg = str(exc)
    if _peer_closed(msg):
        return PSProtocolError(f"PS rank {peer} is gone (its connection closed; did the process crash?) while {doing}")
    return PSProtocolError(f"communication with PS rank {peer} failed while {doing}: {msg}")


def wait_work(work: Any, timeout: float, what: str) -> None:
    """Wait for a torch.distributed Work with a deadline; raise PSTimeoutError naming ``what``."""
    try:
        work.wait(timeout=timedelta(seconds=timeout))
    except RuntimeError as exc:
        msg = str(exc)
        if "Timed out" in msg or "timed out" in msg or "Timeout" in msg:
            raise PSTimeoutError(f"timed out after {timeout:g} s waiting for {what}") from exc
        if _peer_closed(msg):
            raise PSProtocolError(
                f"a PS peer is gone (its connection closed; did the process crash?) while waiting for {what}"
            ) from exc
        raise PSProtocolError(f"communication failed while waiting for {what}: {msg}") from exc


def payload_parts(data: torch.Tensor | Sequence[torch.Tensor] | None) -> list[torch.Tensor]:
    """A message's fp32 payload as the tensors that travel: none, one, or its segments (segments.py)."""
    return [] if data is None else [data] if isinstance(data, torch.Tensor) else list(data)


def reply_tag(base: int, stream: int) -> int:
    """The tag of a reply on ``stream`` (a shard's index + 1; 0 for the batch queue and the service).

    Replies of different shards may come back from one rank in any order (an ``ivyplug serve`` holds every
    shard): gloo matches a message to the receives posted for its source and tag in order, so each shard's
    replies travel under a tag of their own.
    """
    return base + 1000 * stream


class Channel:
    """Sends and receives PS messages on one process group (``rank`` = this process's rank in it).

    ``reverse``: a second group over the same ranks for the messages from a higher rank to a lower one (``group``
    then carries those from lower to higher). A gloo pair moves one bulk message at a time over its connection: a
    send and a receive of 2.25 MB each way between two hosts took as long as 4.5 MB one way (367 ms against 188 at
    100 Mbit/s; 37 against 19 ms at 1 Gbit/s), and 211 ms over two pairs. With the directions on separate groups,
    the pushes of co-located workers to each other's shards (and the replies) cross the link both ways at once.
    Every message from one rank to another travels on one group, so each keeps its order.
    """

    def __init__(self, group: Any, rank: int, timeout: float, reverse: Any = None) -> None:
        self.group = group
        self.reverse = reverse if reverse is not None else group
        self.rank = rank
        self.timeout = timeout
        self._send_lock = threading.Lock()
        self._pending: deque[tuple[Any, tuple[torch.Tensor, ...], str]] = deque()
        # a server's replies, per (worker, stream): their parts leave only once the worker posts its receives
        # (after the reply's header), so sending never waits for them. They are kept (with what ``send(keep=)``
        # named: a shard's loan of the state they are views of) until the worker's next request on that
        # stream, which it sends only once it has read the whole reply: see reap(). (A gloo send's
        # is_completed() stays False until someone waits for it, so there is nothing to poll.)
        self._replies: dict[tuple[int, int], list[_KeptReply]] = {}

    # -- sending -------------------------------------------------------------------------------
    def _to(self, dst: int) -> Any:
        """The group that carries this rank's messages to ``dst``."""
        return self.group if self.rank < dst else self.reverse

    def _from(self, src: int) -> Any:
        """The group that carries ``src``'s messages to this rank."""
        return self.group if src < self.rank else self.reverse

    def _isend(self, tensor: torch.Tensor, dst: int, tag: int, what: str) -> Any:
        try:
            return self._to(dst).send([tensor], dst, tag)
        except RuntimeError as exc:  # gloo raises at once when the peer's connection is gone
            raise peer_error(dst, f"sending {what}", exc) from exc

    def _irecv(self, tensor: torch.Tensor, src: int, tag: int, what: str) -> Any:
        try:
            return self._from(src).recv([tensor], src, tag)
        except RuntimeError as exc:
            raise peer_error(src, f"posting a receive for {what}", exc) from exc

    def send(
        self,
        dst: int,
        header: Header,
        data: torch.Tensor | Sequence[torch.Tensor] | None = None,
        hyper: torch.Tensor | None = None,
        *,
        reply: bool = False,
        wait: bool = True,
        stream: int = 0,
        keep: Releasable | None = None,
    ) -> int:
        """Send header then payloads atomically w.r.t. other threads; returns bytes sent.

        ``data``: the fp32 payload, one tensor or its segments (segments.py), each its own message in order.
        With ``wait=False`` the tensors are kept alive until the sends are done (a reply's: until
        :meth:`reap`, which then releases ``keep``).
        """
        parts = payload_parts(data)
        header.numel = sum(t.numel() for t in parts)
        header.n_hyper = 0 if hyper is None else hyper.numel()
        h = header.encode()
        tensors: list[torch.Tensor] = [h]
        works = []
        with self._send_lock:
            what = f"a kind-{header.kind} message"
            works.append(self._isend(h, dst, reply_tag(TAG_REPLY, stream) if reply else TAG_REQUEST, what))
            data_tag = reply_tag(TAG_REPLY_DATA, stream) if reply else TAG_REQUEST_DATA
            for part in parts:
                if part.numel() > 0:
                    tensors.append(part)
                    works.append(self._isend(part, dst, data_tag, what))
            if hyper is not None and hyper.numel() > 0:
                if reply:
                    raise PSProtocolError("replies carry no fp64 payload")
                tensors.append(hyper)
                works.append(self._isend(hyper, dst, TAG_REQUEST_HYPER, what))
            old: list[_KeptReply] = []
            if not wait:
                if reply:
                    old = self._keep_reply(dst, stream, (works, tuple(tensors), keep))
                else:
                    self._pending += [(w, tuple(tensors), f"kind {header.kind} to rank {dst}") for w in works]
        self._forget(dst, old, f"rank {dst} to read a reply sent {_KEEP_REPLIES} replies ago")
        if wait:
            for w in works:
                wait_work(w, self.timeout, f"rank {dst} to accept a message (kind {header.kind})")
        elif not reply:
            self._prune()
        return sum(t.numel() * t.element_size() for t in tensors)

    def _keep_reply(self, dst: int, stream: int, entry: _KeptReply) -> list[_KeptReply]:
        """Keep a reply's sends until :meth:`reap` (send lock held); returns those beyond the bound, for a
        stream nobody reaps (the batch queue's, the service's): the oldest, which left long ago."""
        sent = self._replies.setdefault((dst, stream), [])
        sent.append(entry)
        old, sent[:] = sent[:-_KEEP_REPLIES], sent[-_KEEP_REPLIES:]
        return old

    def _forget(self, dst: int, sent: list[_KeptReply], what: str) -> BaseException | None:
        """Wait for ``sent`` (done by now, when the peer keeps the protocol), then release what they kept.
        Returns the error of a wait that failed instead of raising it: a broken peer must not end the server
        loop of the others. What such a reply kept is abandoned, not released (gloo may still read it)."""
        if not sent:
            return None
        error: BaseException | None = None
        for works, _, _ in sent:
            for w in works:
                if error is None:
                    try:
                        wait_work(w, self.timeout, what)
                    except (PSProtocolError, PSTimeoutError) as exc:
                        error = exc
        for _, _, keep in sent:
            if keep is not None:
                if error is None:
                    keep.release()
                else:
                    keep.abandon()
        return error

    def reap(self, dst: int, stream: int) -> BaseException | None:
        """Forget the replies sent to ``dst`` on ``stream`` and release what they kept (server loops: on
        ``dst``'s next request on that stream, which a worker sends only once it has read the last reply, so
        the waits here return at once). A worker that breaks that rule fails them after ``timeout``: the
        error is returned, not raised."""
        with self._send_lock:
            sent = self._replies.pop((dst, stream), [])
        return self._forget(dst, sent, f"rank {dst} to read its last reply before its next request")

    def _prune(self, limit: int = 16) -> None:
        """Bound the sends kept alive (each holds its tensors): wait for the oldest beyond ``limit``."""
        while True:
            with self._send_lock:
                if len(self._pending) <= limit:
                    return
                w, _, what = self._pending.popleft()
            wait_work(w, self.timeout, f"a peer to accept a message ({what})")

    def flush(self, replies: bool = False) -> None:
        """Wait for every request sent with ``wait=False``; with ``replies``, also for the replies a server of
        this process sent (before it drops a peer or closes: its last answers must have left)."""
        while True:
            with self._send_lock:
                if not self._pending:
                    break
                w, _, what = self._pending.popleft()
            wait_work(w, self.timeout, f"a peer to accept a message ({what})")
        failed: BaseException | None = None
        while replies:
            with self._send_lock:
                if not self._replies:
                    break
                dst, stream = next(iter(self._replies))
            error = self.reap(dst, stream)  # (always: it empties the stream, which ends the loop)
            failed = failed or error
        if failed is not None:  # every reply was forgotten first; the first failure is the caller's to see
            raise failed

    # -- receiving -----------------------------------------------------------------------------
    def recv_request_header(self, src: int | None = None, timeout: float | None = None, lower: bool = True) -> Header:
        """Block until a peer (``src``, else any of the lower ranks, or with ``lower=False`` of the higher ones:
        they reach this rank on different groups, see above) sends a request header (server loops only).

        ``timeout`` (seconds; from one source only) bounds the wait, else a server may sit idle for
        :data:`IDLE_WAIT`."""
        t = empty_header()
        if src is None:
            work = (self.group if lower else self.reverse).recv_anysource([t], TAG_REQUEST)
            work.wait(timeout=IDLE_WAIT)
        else:
            work = self._from(src).recv([t], src, TAG_REQUEST)
            wait_work(work, timeout if timeout is not None else IDLE_WAIT.total_seconds(), f"a request from rank {src}")
        return Header.decode(t)

    def recv_request_payload(
        self, header: Header, into: torch.Tensor | None = None, segments: Sequence[Segment] | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Receive the fp32 and fp64 payloads announced by ``header`` from its sender.

        ``into``: a buffer for the fp32 payload when its size matches (reused: a fresh multi-MB tensor per
        push costs a page fault per 4 KiB on first touch, about as much as the receive's own copy).
        ``segments``: the payload travels cut so (``Flag.SPLIT``), one message per segment, each received
        into its part of the buffer (they partition ``header.numel``: ``ServerLoop._segments`` cuts only a
        payload of its shard's size, and a cut has no empty segment)."""
        data = hyper = None
        works = []
        what = f"the payload of a kind-{header.kind}"
        if header.numel > 0:
            reuse = into is not None and into.numel() == header.numel and into.dtype == torch.float32
            data = into if reuse else torch.empty(header.numel, dtype=torch.float32)
            assert data is not None
            if segments is None:
                works.append(self._irecv(data, header.sender, TAG_REQUEST_DATA, what))
            else:
                works += [self._irecv(v, header.sender, TAG_REQUEST_DATA, what) for v in views(data, segments)]
        if header.n_hyper > 0:
            hyper = torch.empty(header.n_hyper, dtype=torch.float64)
            works.append(self._irecv(hyper, header.sender, TAG_REQUEST_HYPER, what))
        for w in works:
            wait_work(w, self.timeout, f"the payload of a kind-{header.kind} message from rank {header.sender}")
        return data, hyper

    def send_error_text(self, dst: int, text: bytes, stream: int = 0) -> None:
        """The text of an error reply, sent after it (its header announced the length); not waited for."""
        if text:
            words = bytes_to_words(text)
            with self._send_lock:
                work = self._isend(words, dst, reply_tag(TAG_REPLY_TEXT, stream), "an error text")
                old = self._keep_reply(dst, stream, ([work], (words,), None))
            self._forget(dst, old, f"rank {dst} to read a reply sent {_KEEP_REPLIES} replies ago")

    def recv_error_text(self, src: int, nbytes: int, stream: int = 0) -> str:
        """Receive the text of an error reply from ``src`` (empty when the header announced none)."""
        if nbytes <= 0:
            return ""
        words = torch.empty((nbytes + 3) // 4, dtype=torch.float32)
        work = self._irecv(words, src, reply_tag(TAG_REPLY_TEXT, stream), "an error text")
        wait_work(work, self.timeout, f"rank {src}'s error text")
        return words_to_bytes(words, nbytes).decode("utf-8", errors="replace")

    def post_reply(
        self, src: int, data: torch.Tensor | None, stream: int = 0, split: bool = False
    ) -> tuple[torch.Tensor, list[Any]]:
        """Post receives for a reply header (and fp32 payload into ``data``) from ``src`` before asking.

        ``split``: only the header's; its payload is received after it (:meth:`recv_reply_parts`), once the
        header says the reply is not an error (an error reply to a split request carries no payload, so an
        error never writes into tensors a reply is received into in place)."""
        h = empty_header()
        works = [self._irecv(h, src, reply_tag(TAG_REPLY, stream), "a reply")]
        if not split and data is not None and data.numel() > 0:
            works.append(self._irecv(data, src, reply_tag(TAG_REPLY_DATA, stream), "a reply"))
        return h, works

    def post_reply_parts(self, src: int, parts: Sequence[torch.Tensor], stream: int) -> list[Any]:
        """Post the receives of a split reply's payload from ``src``: one message into each of ``parts``."""
        return [self._irecv(t, src, reply_tag(TAG_REPLY_DATA, stream), "a reply") for t in parts]

    def wait_reply(self, h: torch.Tensor, works: list[Any], what: str, timeout: float | None = None) -> Header:
        """Wait for the reply header, then its payload; an error reply without payload returns at once
        (its status tells the caller to fail) instead of waiting ``timeout`` for data that never comes."""
        limit = self.timeout if timeout is None else timeout
        wait_work(works[0], limit, what)
        header = Header.decode(h)
        if header.status != Status.OK and header.numel == 0:
            return header
        for w in works[1:]:
            wait_work(w, limit, what)
        return header
