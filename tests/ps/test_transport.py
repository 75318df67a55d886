"""A server channel's bookkeeping of its reply sends (``ivyplug.ps.wire.transport.Channel``), on a recording group.

gloo's send works report completion only to a wait, so a channel keeps each reply until the worker's next
request on that stream proves it read (``reap``), bounded on streams nobody reaps; a loan kept by a reply is
released when its wait succeeds, abandoned (its buffer retired) when it fails.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ivyplug.ps.server.lent_state import LentState
from ivyplug.ps.wire.messages import Header, Kind
from ivyplug.ps.wire.transport import _KEEP_REPLIES, Channel, PSProtocolError
from tests.ps.introspection import held_buffers

pytestmark = pytest.mark.timeout(60)


class _Work:
    def __init__(self, log: list[str], name: str, fails: bool) -> None:
        self.log, self.name, self.fails = log, name, fails

    def wait(self, timeout: Any = None) -> bool:
        self.log.append(self.name)
        if self.fails:
            raise RuntimeError("Connection closed by peer")
        return True


class _Group:
    """Records sends; a wait on a send to ``broken`` fails as a closed connection does."""

    def __init__(self, broken: int | None = None) -> None:
        self.sent: list[tuple[int, int]] = []
        self.waited: list[str] = []
        self.broken = broken

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> _Work:
        self.sent.append((dst, tag))
        return _Work(self.waited, f"{dst}/{tag}/{len(self.sent)}", dst == self.broken)


def _reply(channel: Channel, dst: int, stream: int, keep: Any = None) -> None:
    h = Header(kind=Kind.REPLY, sender=0, shard=stream - 1)
    channel.send(dst, h, torch.zeros(4), reply=True, wait=False, stream=stream, keep=keep)


def test_a_reply_is_kept_until_reaped_then_its_loan_is_released() -> None:
    group = _Group()
    channel = Channel(group, 0, timeout=1.0)
    state = LentState(torch.zeros(8))
    loan = state.lend()[1]
    _reply(channel, 1, 1, keep=loan)
    assert group.waited == [] and len(channel._replies[(1, 1)]) == 1  # never waited at send time
    assert state.writable() is True  # still lent: a write would move
    loan2 = state.lend()[1]
    _reply(channel, 1, 1, keep=loan2)
    assert channel.reap(1, 1) is None
    assert len(group.waited) == 4  # both replies' header and payload
    assert loan.released and loan2.released and (1, 1) not in channel._replies
    assert state.writable() is False


def test_a_stream_nobody_reaps_keeps_a_bounded_number_and_waits_for_the_oldest_first() -> None:
    group = _Group()
    channel = Channel(group, 0, timeout=1.0)
    for _ in range(_KEEP_REPLIES + 6):
        _reply(channel, 2, 0)
    channel.send_error_text(2, b"refused", 0)  # error texts count against the same bound
    assert len(channel._replies[(2, 0)]) == _KEEP_REPLIES
    assert len(group.waited) == 2 * 7  # the 7 oldest replies' header and payload works, in order
    assert group.waited == [f"2/{t}/{i + 1}" for i, t in enumerate([t for _, t in group.sent[:14]])]


def test_a_failed_wait_is_returned_and_abandons_the_loan_whose_buffer_is_never_written_again() -> None:
    group = _Group(broken=3)
    channel = Channel(group, 0, timeout=1.0)
    state = LentState(torch.arange(8.0))
    data, loan = state.lend()
    _reply(channel, 3, 1, keep=loan)
    error = channel.reap(3, 1)
    assert isinstance(error, PSProtocolError) and "gone" in str(error)
    assert loan.released  # no longer counted as lent ...
    assert state.writable() is True  # ... but retired: the next write moves off it ...
    state.data.fill_(-1.0)
    torch.testing.assert_close(data, torch.arange(8.0), rtol=0, atol=0)  # ... and it keeps what was sent
    assert held_buffers(state) == 1  # and it is not kept for reuse
    used = set()
    for _ in range(3):
        _, held = state.lend()
        state.writable()
        used.add(state.data.data_ptr())
        held.release()
    assert data.data_ptr() not in used


def test_flush_forgets_every_reply_then_raises_the_first_failure() -> None:
    group = _Group(broken=3)
    channel = Channel(group, 0, timeout=1.0)
    state = LentState(torch.zeros(8))
    loans = [state.lend()[1] for _ in range(2)]
    _reply(channel, 3, 1, keep=loans[0])  # to a peer that is gone
    _reply(channel, 4, 2, keep=loans[1])
    with pytest.raises(PSProtocolError, match="gone"):
        channel.flush(replies=True)
    assert channel._replies == {}  # the reply to the live peer was waited for and released too
    assert all(loan.released for loan in loans)


class _RecvGroup(_Group):
    """Also records receives (posted, any-source or not)."""

    def __init__(self) -> None:
        super().__init__()
        self.received: list[tuple[int | None, int]] = []

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> _Work:
        self.received.append((src, tag))
        return _Work(self.waited, f"recv{src}", False)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> _Work:
        self.received.append((None, tag))
        tensors[0].copy_(Header(kind=Kind.IDLE, sender=0).encode())  # what arrives: any valid request
        return _Work(self.waited, "recv-any", False)


def test_a_channel_with_a_reverse_group_sends_each_direction_on_its_own_group() -> None:
    """Rank 1 of 3: to rank 2 (up) on the group, to rank 0 (down) on the reverse one; from rank 0 on the group, from
    rank 2 on the reverse one; any-source receives listen to the side asked for."""
    up, down = _RecvGroup(), _RecvGroup()
    channel = Channel(up, 1, 1.0, reverse=down)
    channel.send(2, Header(kind=Kind.IDLE, sender=1))
    channel.send(0, Header(kind=Kind.IDLE, sender=1))
    assert [dst for dst, _ in up.sent] == [2] and [dst for dst, _ in down.sent] == [0]
    channel.post_reply(2, None)
    channel.post_reply(0, None)
    assert [src for src, _ in up.received] == [0] and [src for src, _ in down.received] == [2]
    channel.recv_request_header(lower=True)
    channel.recv_request_header(lower=False)
    assert up.received[-1][0] is None and down.received[-1][0] is None
    # without a reverse group everything travels on the one group
    one = _RecvGroup()
    plain = Channel(one, 1, 1.0)
    plain.send(0, Header(kind=Kind.IDLE, sender=1))
    plain.send(2, Header(kind=Kind.IDLE, sender=1))
    assert [dst for dst, _ in one.sent] == [0, 2]
