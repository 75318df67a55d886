"""How a worker and an ``ivyplug serve`` prove the shared token to each other before any gloo traffic.

The handshake runs over the server's ``TCPStore`` (the rendezvous every torch.distributed job already
uses), as a challenge-response on random nonces, in both directions; the token itself is never sent:

1. the worker takes a member number ``m`` (``store.add``) and writes ``hello/m``: its wire version and a nonce;
2. the server answers ``challenge/m``: its wire version, its nonce, and HMAC(token, "server" | both nonces);
3. the worker checks that proof (a server with another token is refused here) and writes ``proof/m`` =
   HMAC(token, "worker" | both nonces);
4. the server checks it and writes ``verdict/m``: either a refusal with its reason, or acceptance with what
   the worker needs to build its shard plan.

Only then do the two form a two-rank gloo group, under a store prefix derived from the token and both
nonces (HMAC(token, "pair" | ...)), which a peer without the token cannot compute. Why not over gloo
itself: gloo aborts the receiving process when a message is longer than the posted receive, so an
unauthenticated peer must never reach a gloo pair of the server. Everything in the store is JSON; nothing
is unpickled. Without a token both sides use the empty key (a loopback-only server, see ``ivyplug serve``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ivyplug.ps.wire import gloo_net
from ivyplug.ps.wire.messages import WIRE_VERSION
from ivyplug.ps.wire.transport import PSProtocolError, PSTimeoutError

PREFIX = "ivyplug-serve"
MEMBER_COUNTER = f"{PREFIX}/members"
INFO_KEY = f"{PREFIX}/info"
#: the store key (under a member's secret pair prefix) its worker's heartbeat counter lives at
HEARTBEAT_KEY = "beat"


class PSAuthError(PermissionError):
    """The token (or the wire version) of a peer does not match."""


#: a verdict's ``kind`` when the server refused a worker for an address that cannot connect the two
ADDRESS_REFUSAL = "address"


def mac(token: str | None, *parts: bytes) -> str:
    return hmac.new((token or "").encode(), b"|".join(parts), hashlib.sha256).hexdigest()


def _key(kind: str, member: int) -> str:
    return f"{PREFIX}/{kind}/{member}"


def _get(store: Any, key: str, timeout: float, what: str) -> dict[str, Any]:
    try:
        store.wait([key], timedelta(seconds=timeout))
        raw = store.get(key)
    except RuntimeError as exc:
        msg = str(exc)
        if "imeout" in msg or "timed out" in msg.lower():
            raise PSTimeoutError(f"timed out after {timeout:g} s waiting for {what}") from exc
        raise PSProtocolError(f"the rendezvous store failed while waiting for {what}: {msg}") from exc
    try:
        value = json.loads(bytes(raw).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PSProtocolError(f"{what} is not valid JSON") from exc
    if not isinstance(value, dict):
        raise PSProtocolError(f"{what} is not a JSON object")
    return value


def _left(deadline: float) -> float:
    return max(0.1, deadline - time.monotonic())


def _put(store: Any, key: str, value: dict[str, Any]) -> None:
    store.set(key, json.dumps(value))


def _nonce(value: Any, what: str) -> bytes:
    bad = PSProtocolError(f"{what}: a nonce must be 32 hex digits, got {str(value)[:40]!r}")
    if not isinstance(value, str) or len(value) != 32:
        raise bad
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise bad from None


def session_prefix(token: str | None, server_nonce: bytes, worker_nonce: bytes, member: int) -> str:
    """The store prefix of the member's gloo pair (unguessable without the token)."""
    return f"{PREFIX}/pair/{member}/{mac(token, b'pair', server_nonce, worker_nonce)[:32]}"


def client_handshake(
    store: Any, token: str | None, timeout: float, where: str, address: str | None = None
) -> tuple[int, str, dict[str, Any]]:
    """The worker's side: returns (member number, pair prefix, what the server accepted with).

    ``address``: where this worker's gloo device will listen, told to the server so that it binds the address
    that reaches it (and refuses at once an address of its own that cannot).
    """
    deadline = time.monotonic() + timeout  # one bound for the whole handshake, not one per wait
    member = int(store.add(MEMBER_COUNTER, 1)) - 1
    mine = secrets.token_bytes(16)
    hello: dict[str, Any] = {"wire": WIRE_VERSION, "nonce": mine.hex()}
    if address is not None:
        hello["address"] = address
    _put(store, _key("hello", member), hello)
    challenge = _get(store, _key("challenge", member), _left(deadline), f"ivyplug serve at {where} to answer")
    if challenge.get("wire") != WIRE_VERSION:
        raise PSAuthError(
            f"ivyplug serve at {where} speaks wire version {challenge.get('wire')!r}, this worker speaks "
            f"{WIRE_VERSION}: run the same ivyplug version on both"
        )
    theirs = _nonce(challenge.get("nonce"), f"ivyplug serve at {where}")
    expected = mac(token, b"server", mine, theirs)
    if not hmac.compare_digest(str(challenge.get("proof", "")), expected):
        _put(store, _key("proof", member), {"proof": ""})  # the server then records a refusal too
        raise PSAuthError(
            f"ivyplug serve at {where} could not prove it holds this worker's token (a different token, or none "
            "on one side): pass the token the server was started with (token= or IVYPLUG_TOKEN)"
        )
    _put(store, _key("proof", member), {"proof": mac(token, b"worker", theirs, mine)})
    verdict = _get(store, _key("verdict", member), _left(deadline), f"ivyplug serve at {where} to accept this worker")
    if not verdict.get("ok") and verdict.get("kind") == ADDRESS_REFUSAL:
        raise gloo_net.PSAddressError(f"ivyplug serve at {where} cannot reach this worker: {verdict.get('reason')}")
    if not verdict.get("ok"):
        raise PSAuthError(f"ivyplug serve at {where} refused this worker: {verdict.get('reason', 'no reason given')}")
    return member, session_prefix(token, theirs, mine, member), verdict


def server_handshake(
    store: Any,
    member: int,
    token: str | None,
    timeout: float,
    accept: dict[str, Any],
    check_address: Callable[[str | None], str | None] | None = None,
) -> tuple[str | None, str, str | None]:
    """The server's side for member ``member`` (whose hello is in the store).

    ``check_address``: given the address the worker's device listens on (None if it did not say), the reason
    this server cannot connect to it, or None; asked once the worker proved the token.
    Returns (refusal reason or None, pair prefix, the worker's address); the verdict (``accept`` on success)
    is written either way.
    """
    hello = _get(store, _key("hello", member), timeout, f"member {member}'s hello")
    mine = secrets.token_bytes(16)
    if hello.get("wire") != WIRE_VERSION:
        reason = f"it speaks wire version {hello.get('wire')!r}, this server speaks {WIRE_VERSION}"
        _put(store, _key("challenge", member), {"wire": WIRE_VERSION, "nonce": mine.hex(), "proof": ""})
        _put(store, _key("verdict", member), {"ok": False, "reason": reason})
        return reason, "", None
    theirs = _nonce(hello.get("nonce"), f"member {member}")
    _put(
        store,
        _key("challenge", member),
        {"wire": WIRE_VERSION, "nonce": mine.hex(), "proof": mac(token, b"server", theirs, mine)},
    )
    proof = _get(store, _key("proof", member), timeout, f"member {member}'s proof of the token")
    if not hmac.compare_digest(str(proof.get("proof", "")), mac(token, b"worker", mine, theirs)):
        reason = "wrong token (its proof did not match this server's token)"
        _put(store, _key("verdict", member), {"ok": False, "reason": reason})
        return reason, "", None
    said = hello.get("address")
    address = said if isinstance(said, str) and 0 < len(said) <= 64 else None
    problem = check_address(address) if check_address is not None else None
    if problem is not None:
        _put(store, _key("verdict", member), {"ok": False, "kind": ADDRESS_REFUSAL, "reason": problem})
        return problem, "", address
    _put(store, _key("verdict", member), {"ok": True, **accept})
    return None, session_prefix(token, mine, theirs, member), address


def pair_group(store: Any, prefix: str, rank: int, timeout: float, host: str, peer: str | None = None) -> Any:
    """The two-rank gloo group of a worker (rank 1) and a service (rank 0) under ``prefix``.

    ``host``: the service's address (the store's host). Its device honours ``GLOO_SOCKET_IFNAME``; without it
    a loopback ``host`` listens on loopback only, and otherwise the device binds the address that routes to the
    peer (gloo_net.py): the worker's toward ``host``, the service's toward ``peer`` (the worker's address, as
    its hello said), else ``host`` itself, and on a wildcard ``host`` gloo's default.
    """
    import torch.distributed as dist

    pg: Any = dist.ProcessGroupGloo
    opts = pg._Options()
    opts._timeout = timedelta(seconds=timeout)
    if not gloo_net.env_interfaces() and gloo_net.is_loopback(host):
        opts._devices = [pg.create_device(hostname="::1" if host == "::1" else "127.0.0.1")]
    elif rank == 1:
        opts._devices = gloo_net.devices(host)
    elif peer is not None:
        opts._devices = gloo_net.devices(peer)
    elif gloo_net.is_wildcard(host):
        opts._devices = gloo_net.devices(None)
    else:
        opts._devices = [pg.create_device(hostname=host)] if not gloo_net.env_interfaces() else gloo_net.devices(host)
    return pg(dist.PrefixStore(prefix, store), rank, 2, opts)
