"""The server loop of a rank that serves a shard (or rank 0's batch queue): decodes requests into calls.

It reads a fixed-size header from any source, then the payloads from that sender (see messages.py), and
turns each request into the same call an in-process endpoint makes on the shard (shard.py) or the batch
queue (dispatch.py). A reply that must wait is a pending future on the shard; its callback sends the reply
from whichever thread resolves it, after the shard released its lock. The loop ends after a BYE from every
peer rank, so closing is a natural rendezvous: no rank tears down while another may still ask it.
"""

from __future__ import annotations

import sys
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import Future

import torch

from ivyplug.ps.dispatch import BatchQueue
from ivyplug.ps.messages import MAX_ERROR_TEXT, Flag, Header, Kind, Status, bytes_to_words, words_to_bytes
from ivyplug.ps.shard import Reply, Shard, load_state_bytes
from ivyplug.ps.transport import Channel

_WANTS_REPLY = (Kind.PUSH_PULL, Kind.PULL, Kind.NEXT_BATCH, Kind.STATE_SIZE, Kind.STATE_FETCH, Kind.LOAD)
_NEEDS_SHARD = (Kind.PUSH_PULL, Kind.PULL, Kind.NORM, Kind.IDLE, Kind.STATE_SIZE, Kind.STATE_FETCH, Kind.LOAD)


class ServerLoop(threading.Thread):
    """Background thread serving one rank's shard (and, on rank 0, the batch queue) to its peers."""

    def __init__(
        self,
        channel: Channel,
        shard: Shard | None,
        queue: BatchQueue | None,
        expect_bye: set[int],
        stop: threading.Event,
        workers: set[int] | None = None,
        on_workers_done: Callable[[], None] | None = None,
    ) -> None:
        """``expect_bye``: ranks whose BYE ends the loop; ``on_workers_done`` runs once every rank in
        ``workers`` said BYE (a dedicated server then says BYE to the other servers)."""
        super().__init__(name=f"ivyplug-ps-server-{channel.rank}", daemon=True)
        self.channel = channel
        self.shard = shard
        self.queue = queue
        self.expect_bye = set(expect_bye)
        self.workers = set(workers or ())
        self.on_workers_done = on_workers_done
        self.stop = stop
        self.bye_from: set[int] = set()
        self.error: BaseException | None = None
        self._state_blob = b""
        self._workers_done = False

    @property
    def byes(self) -> int:
        return len(self.bye_from)

    def _flags(self) -> int:
        return Flag.STOP if self.stop.is_set() else 0

    def _reply(self, to: int, request: Header, data: torch.Tensor | None = None, **args: int) -> None:
        shard = self.shard.shard if self.shard is not None else -1
        h = Header(kind=Kind.REPLY, sender=self.channel.rank, shard=shard, seq=request.seq, flags=self._flags(), **args)
        self.channel.send(to, h, data, reply=True, wait=False)

    def _reply_error(self, to: int, request: Header, text: str | None = None) -> None:
        """An ERROR reply carrying a zero payload of the size the requester posted a receive for, so that
        its receive completes and it fails at once (not after ``timeout``) and nothing stays posted; then
        the error's text (``text``, else the shard's recorded error), which the requester raises with."""
        if text is None:
            text = (self.shard.error if self.shard is not None else None) or "unknown error"
        blob = f"rank {self.channel.rank}: {text}".encode()[:MAX_ERROR_TEXT]
        h = Header(
            kind=Kind.REPLY,
            sender=self.channel.rank,
            seq=request.seq,
            status=Status.ERROR,
            flags=self._flags(),
            arg3=len(blob),
        )
        self.channel.send(to, h, torch.zeros(self._reply_numel(request)), reply=True, wait=False)
        self.channel.send_error_text(to, blob)

    def _reply_numel(self, request: Header) -> int:
        """fp32 elements of the reply payload a request of this kind expects (see client.py)."""
        if request.kind in (Kind.PUSH_PULL, Kind.PULL) and self.shard is not None:
            plan = self.shard.plan
            return plan.shard_numel(request.shard) if 0 <= request.shard < plan.num_shards else 0
        if request.kind == Kind.STATE_FETCH:
            return (len(self._state_blob) + 3) // 4
        return 0

    def run(self) -> None:
        while not self.expect_bye <= self.bye_from:
            try:
                header = self.channel.recv_request_header()
                data, hyper = self.channel.recv_request_payload(header)
            except BaseException as exc:  # the group is unusable: record and end
                self.error = exc
                print(f"[ivyplug.ps] server loop on rank {self.channel.rank} ended: {exc}", file=sys.stderr, flush=True)
                if self.shard is not None:
                    self.shard.fail(exc)
                return
            try:
                self._handle(header, data, hyper)
            except BaseException as exc:
                print(
                    f"[ivyplug.ps] rank {self.channel.rank} failed on a kind-{header.kind} request from rank "
                    f"{header.sender}:\n{traceback.format_exc()}",
                    file=sys.stderr,
                    flush=True,
                )
                if self.shard is not None:
                    self.shard.fail(exc)
                if header.kind in _WANTS_REPLY:
                    try:
                        self._reply_error(header.sender, header, f"{type(exc).__name__}: {exc}")
                    except Exception as reply_exc:  # the requester is gone too: keep serving the others
                        print(
                            f"[ivyplug.ps] rank {self.channel.rank} could not send the error reply to rank "
                            f"{header.sender}: {reply_exc}",
                            file=sys.stderr,
                            flush=True,
                        )

    def _answer(self, to: int, request: Header, fut: Future[Reply]) -> None:
        """Send a push's or pull's reply once its future is resolved (on the resolving thread)."""
        try:
            exc = fut.exception()
            if exc is not None:
                self._reply_error(to, request, f"{type(exc).__name__}: {exc}")
                return
            r = fut.result()
            self._reply(to, request, r.snapshot, arg0=r.staleness, arg1=r.version, arg2=r.clock)
        except Exception as send_exc:  # the requester is gone: the loop notices at its next receive
            print(
                f"[ivyplug.ps] rank {self.channel.rank} could not answer rank {to}: {send_exc}",
                file=sys.stderr,
                flush=True,
            )

    def _handle(self, h: Header, data: torch.Tensor | None, hyper: torch.Tensor | None) -> None:
        w = h.sender
        shard = self.shard
        if h.kind in _NEEDS_SHARD and shard is None:
            raise RuntimeError(f"rank {self.channel.rank} serves no shard but got a kind-{h.kind} request")
        if h.kind in (Kind.PUSH_PULL, Kind.PULL):
            assert shard is not None
            if h.shard != shard.shard:
                raise RuntimeError(f"a request for shard {h.shard} reached the server of shard {shard.shard}")
            if h.kind == Kind.PUSH_PULL:
                assert data is not None and hyper is not None
                fut = shard.push_pull(w, data, hyper)
            else:
                fut = shard.pull(w)
            fut.add_done_callback(lambda f: self._answer(w, h, f))
        elif h.kind == Kind.IDLE:
            assert shard is not None
            shard.idle(w)
        elif h.kind == Kind.NORM:
            assert shard is not None and hyper is not None
            shard.norm(h.arg0, h.arg1, float(hyper[0]))
        elif h.kind == Kind.NEXT_BATCH:
            if self.queue is None:
                raise RuntimeError(f"rank {self.channel.rank} holds no batch queue (ask rank 0)")
            self._reply(w, h, None, arg0=self.queue.take(w, h.arg0))
        elif h.kind == Kind.STOP:
            self.stop.set()
        elif h.kind == Kind.BYE:
            self.bye_from.add(w)
            if shard is not None and w in self.workers:
                shard.idle(w)
            if not self._workers_done and self.workers and self.workers <= self.bye_from:
                self._workers_done = True  # exactly once: a second BYE to a finished peer is never received
                if self.on_workers_done is not None:
                    self.on_workers_done()
        elif h.kind == Kind.STATE_SIZE:
            assert shard is not None
            self._state_blob = shard.state()
            self._reply(w, h, None, arg0=len(self._state_blob))
        elif h.kind == Kind.STATE_FETCH:
            self._reply(w, h, bytes_to_words(self._state_blob), arg0=len(self._state_blob))
        elif h.kind == Kind.LOAD:
            assert shard is not None and data is not None
            shard.load(load_state_bytes(words_to_bytes(data, h.arg0)))
            self._reply(w, h, None)
        else:
            raise RuntimeError(f"unknown message kind {h.kind} from rank {w}")
