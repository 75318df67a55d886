"""Shared-memory payloads between a worker and a server rank on the same host.

Over gloo's loopback TCP a push and its reply each cross two socket copies on the two processes' cores. A
worker and a server on one host can share the push's memory instead: the worker creates one
region per remote shard (a file in ``/dev/shm``, mapped by both, unlinked once both mapped it), packs its
push there, and the gloo header it sends says so (``Flag.SHM``); the server reads the push in place and
writes its reply into the same region before its header goes back. gloo still carries every header, so
ordering, timeouts and error replies are unchanged: a worker touches the region only between a reply and
its next request, the server only between that request and its reply.

The server maps only a file that names itself an ivyplug region in ``/dev/shm``, is a regular file of this
user, has the announced size and starts with the 16 random bytes the worker announced in the header (so a
rank on another host, or in another ``/dev/shm``, finds no such file and the pair stays on gloo).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
import stat
from dataclasses import dataclass

import torch

#: where regions live (a tmpfs on Linux); elsewhere there is none and every pair stays on gloo
SHM_DIR = "/dev/shm"
_NAME = re.compile(r"ivyplug-ps-[0-9]+-[0-9a-f]{16}")
#: fp32 words before the payload: the region's 16-byte nonce
NONCE_WORDS = 4


@dataclass
class Region:
    """A worker's region: ``tensor`` (the payload words) and what a server needs to map it."""

    path: str
    nonce: bytes
    tensor: torch.Tensor

    def unlink(self) -> None:
        """Remove the file (both mappings stay): once the server mapped it, or failed to."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    @property
    def nonce_args(self) -> tuple[int, int]:
        """The nonce as two int64 header arguments."""
        return (
            int.from_bytes(self.nonce[:8], "little", signed=True),
            int.from_bytes(self.nonce[8:], "little", signed=True),
        )


def nonce_bytes(a: int, b: int) -> bytes:
    """The nonce from its two header arguments (:attr:`Region.nonce_args`)."""
    return a.to_bytes(8, "little", signed=True) + b.to_bytes(8, "little", signed=True)


def _map(fd: int, nbytes: int) -> torch.Tensor:
    mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    # frombuffer keeps the mapping alive as long as a tensor uses it
    return torch.frombuffer(mm, dtype=torch.float32)


def create(numel: int) -> Region:
    """A new region of ``numel`` fp32 words (raises OSError where it cannot be made, e.g. a full /dev/shm).

    The file's blocks are allocated up front: a tmpfs that fills up later would kill the process with SIGBUS
    on first touch, where ``posix_fallocate`` fails cleanly with ENOSPC now."""
    nonce = secrets.token_bytes(16)
    path = os.path.join(SHM_DIR, f"ivyplug-ps-{os.getpid()}-{secrets.token_hex(8)}")
    nbytes = 4 * (NONCE_WORDS + numel)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, nbytes)
            words = _map(fd, nbytes)
        finally:
            os.close(fd)
    except BaseException:
        os.unlink(path)
        raise
    words[:NONCE_WORDS] = torch.frombuffer(bytearray(nonce), dtype=torch.float32)
    return Region(path, nonce, words[NONCE_WORDS:])


def attach(path: str, numel: int, nonce: bytes) -> torch.Tensor:
    """Map a worker's region of ``numel`` words (server side); raises ValueError or OSError naming why not."""
    if os.path.dirname(path) != SHM_DIR or not _NAME.fullmatch(os.path.basename(path)):
        raise ValueError(f"{path!r} is not an ivyplug shared-memory region")
    nbytes = 4 * (NONCE_WORDS + numel)
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            raise ValueError(f"{path!r} is not a regular file of this user")
        if info.st_size != nbytes:
            raise ValueError(f"{path!r} holds {info.st_size} bytes, expected {nbytes}")
        words = _map(fd, nbytes)
    finally:
        os.close(fd)
    if words[:NONCE_WORDS].view(torch.uint8).numpy().tobytes() != nonce:
        raise ValueError(f"{path!r} is not the region announced (its nonce differs)")
    return words[NONCE_WORDS:]
