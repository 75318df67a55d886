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
from datetime import timedelta
from typing import Any

from ivyplug.ps.messages import WIRE_VERSION
from ivyplug.ps.transport import PSProtocolError, PSTimeoutError

PREFIX = "ivyplug-serve"
MEMBER_COUNTER = f"{PREFIX}/members"
INFO_KEY = f"{PREFIX}/info"


class PSAuthError(PermissionError):
    """The token (or the wire version) of a peer does not match."""


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


def client_handshake(store: Any, token: str | None, timeout: float, where: str) -> tuple[int, str, dict[str, Any]]:
    """The worker's side: returns (member number, pair prefix, what the server accepted with)."""
    member = int(store.add(MEMBER_COUNTER, 1)) - 1
    mine = secrets.token_bytes(16)
    _put(store, _key("hello", member), {"wire": WIRE_VERSION, "nonce": mine.hex()})
    challenge = _get(store, _key("challenge", member), timeout, f"ivyplug serve at {where} to answer")
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
    verdict = _get(store, _key("verdict", member), timeout, f"ivyplug serve at {where} to accept this worker")
    if not verdict.get("ok"):
        raise PSAuthError(f"ivyplug serve at {where} refused this worker: {verdict.get('reason', 'no reason given')}")
    return member, session_prefix(token, theirs, mine, member), verdict


def server_handshake(
    store: Any, member: int, token: str | None, timeout: float, accept: dict[str, Any]
) -> tuple[str | None, str]:
    """The server's side for member ``member`` (whose hello is in the store).

    Returns (refusal reason or None, pair prefix); the verdict (``accept`` on success) is written either way.
    """
    hello = _get(store, _key("hello", member), timeout, f"member {member}'s hello")
    mine = secrets.token_bytes(16)
    if hello.get("wire") != WIRE_VERSION:
        reason = f"it speaks wire version {hello.get('wire')!r}, this server speaks {WIRE_VERSION}"
        _put(store, _key("challenge", member), {"wire": WIRE_VERSION, "nonce": mine.hex(), "proof": ""})
        _put(store, _key("verdict", member), {"ok": False, "reason": reason})
        return reason, ""
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
        return reason, ""
    _put(store, _key("verdict", member), {"ok": True, **accept})
    return None, session_prefix(token, mine, theirs, member)


def pair_group(store: Any, prefix: str, rank: int, timeout: float, host: str) -> Any:
    """The two-rank gloo group of a worker and a service under ``prefix``; on a loopback ``host`` its
    sockets listen on loopback only (gloo's default device listens on the machine's own address)."""
    import torch.distributed as dist

    pg: Any = dist.ProcessGroupGloo
    opts = pg._Options()
    opts._timeout = timedelta(seconds=timeout)
    if host in ("127.0.0.1", "localhost", "::1"):
        opts._devices = [pg.create_device(hostname="::1" if host == "::1" else "127.0.0.1")]
    else:
        opts._devices = [pg.create_default_device()]
    return pg(dist.PrefixStore(prefix, store), rank, 2, opts)
