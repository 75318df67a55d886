"""Dedicated CPU servers (``PSConfig(num_servers=k)``): an ``ivyplug serve`` that rank 0 starts for its job.

Rank 0 starts one server process on its host, holding the k shards (service.py), with a fresh random token
that the workers receive through their own group; every worker then joins it as it would join any
``ivyplug serve`` (one two-rank gloo group per worker, worker/service_link.py). So a worker that dies leaves the
others serving, exactly as with an external service. The process ends by itself once every worker of the
job has left, is terminated when rank 0's interpreter exits without closing the PS (a daemonic child), and
exits if rank 0 dies (a parent watchdog).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import sys
import threading
import time
from typing import Any

from ivyplug.settings import PS_HOST_ENV as HOST_ENV


def ps_host() -> str:
    """Address at which workers reach rank 0's servers: $IVYPLUG_PS_HOST, $MASTER_ADDR or loopback."""
    return os.environ.get(HOST_ENV) or os.environ.get("MASTER_ADDR") or "127.0.0.1"


def check_ps_host(host: str, world_size: int) -> None:
    """PSAddressError at once where rank 0's servers at ``host`` cannot be reached from this worker: a loopback
    ``host`` while rank 0 (``$MASTER_ADDR``) is on another host."""
    from ivyplug.ps.wire import gloo_net

    master = os.environ.get("MASTER_ADDR")
    if world_size < 2 or not master or not gloo_net.is_loopback(host) or gloo_net.is_local(master):
        return
    setting = f"{HOST_ENV}={os.environ[HOST_ENV]}" if os.environ.get(HOST_ENV) else f"the default {host}"
    raise gloo_net.PSAddressError(
        f"the job's dedicated servers listen on the loopback address {host} ({setting}) of rank 0's host "
        f"(MASTER_ADDR={master}), which this worker on host {socket.gethostname()!r} cannot reach: set {HOST_ENV} "
        "to an address of rank 0's host that every worker reaches (for example MASTER_ADDR's)"
    )


def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            print("[ivyplug.ps] dedicated server: rank 0 is gone, exiting", file=sys.stderr, flush=True)
            os._exit(1)


def _log(line: str) -> None:
    """Only what a user must see reaches stderr (a lost worker, a refusal), not every join and clean leave."""
    if " is gone" in line or "refused" in line or "ended" in line:
        print(f"[ivyplug.ps] {line}", file=sys.stderr, flush=True)


def serve(host: str, num_shards: int, num_workers: int, token: str, timeout: float, parent_pid: int, conn: Any) -> None:
    """Main of the server process: report the port to rank 0, serve until every worker has left."""
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    from ivyplug.ps.server.service import ListenError, PSService

    try:
        service = PSService(
            num_shards,
            host=host,
            port=0,
            token=token,
            num_workers=num_workers,
            timeout=timeout,
            status_every=None,
            log=_log,
        )
    except ListenError as exc:
        raise ListenError(f"{exc}: the job's dedicated servers listen on ${HOST_ENV}, else $MASTER_ADDR") from None
    conn.send_bytes(str(service.port).encode())  # bytes, not a pickled object
    conn.close()
    service.emptied.wait()
    print("[ivyplug.ps] dedicated server: every worker of its job has left, exiting", file=sys.stderr, flush=True)
    service.close()
    # Nothing is left to do; skip the interpreter's teardown, where destroying the members' gloo groups and the
    # store aborted the process (SIGABRT: "terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch(host: str, num_shards: int, num_workers: int, token: str, timeout: float) -> tuple[Any, int]:
    """Start the server process (on rank 0); returns it and the port its store listens on."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(
        target=serve,
        args=(host, num_shards, num_workers, token, timeout, os.getpid(), child),
        name="ivyplug-ps-server",
        # daemonic: if rank 0's interpreter exits without close() (an exception in user code), its
        # multiprocessing atexit hook terminates the server; a non-daemon child would be joined there forever
        daemon=True,
    )
    proc.start()
    child.close()
    try:
        if not parent.poll(timeout):
            raise TimeoutError(f"the dedicated server process did not start within {timeout:g} s")
        port = int(parent.recv_bytes(64).decode())
    except (EOFError, OSError, ValueError) as exc:
        proc.join(5)
        raise RuntimeError(f"the dedicated server process failed to start (exit code {proc.exitcode})") from exc
    except BaseException:
        proc.kill()
        proc.join(5)
        raise
    return proc, port
