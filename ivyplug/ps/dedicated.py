"""Dedicated CPU server processes (``PSConfig(num_servers=k)``), for jobs whose workers are GPUs.

Rank 0 starts k server processes on its host. Workers and servers meet in a gloo group of their own,
``ProcessGroupGloo`` over a ``PrefixStore`` on a fresh ``TCPStore`` (``new_group`` only accepts ranks
of the default world, and the servers are not in it): workers are ranks ``0..W-1`` of that group,
server j is rank ``W + j`` and serves shard j. They speak the messages of messages.py; a server ends
after a BYE from every worker and every other server, is terminated when rank 0's interpreter exits
without closing the PS (daemonic children), and exits by itself if rank 0 dies (a parent watchdog).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ivyplug.ps.config import PSConfig
from ivyplug.ps.endpoints import WireEndpoint
from ivyplug.ps.messages import Header, Kind
from ivyplug.ps.mirror import OptimizerSpec
from ivyplug.ps.server_loop import ServerLoop
from ivyplug.ps.shard import Shard
from ivyplug.ps.sharding import TensorSpec, build_plan
from ivyplug.ps.transport import Channel, PSProtocolError

STORE_PREFIX = "ivyplug-ps"
HOST_ENV = "IVYPLUG_PS_HOST"


def ps_host() -> str:
    """Address at which workers reach rank 0's PS store: $IVYPLUG_PS_HOST, $MASTER_ADDR or loopback."""
    return os.environ.get(HOST_ENV) or os.environ.get("MASTER_ADDR") or "127.0.0.1"


def connect(host: str, port: int, rank: int, size: int, timeout: float, store: Any = None) -> tuple[Any, Any]:
    """Join the PS group (every worker and server calls this); returns (process group, store)."""
    if store is None:
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))
    group = dist.ProcessGroupGloo(dist.PrefixStore(STORE_PREFIX, store), rank, size, timedelta(seconds=timeout))
    return group, store


def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            print("[ivyplug.ps] dedicated server: rank 0 is gone, exiting", file=sys.stderr, flush=True)
            os._exit(1)


def serve(
    host: str,
    port: int,
    num_workers: int,
    shard: int,
    cfg: PSConfig,
    specs: list[TensorSpec],
    spec: OptimizerSpec,
    init: bytes,
    parent_pid: int,
) -> None:
    """Main of dedicated server ``shard`` (a spawned process)."""
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    k = cfg.num_servers
    me = num_workers + shard
    group, _store = connect(host, port, me, num_workers + k, cfg.timeout)
    channel = Channel(group, me, cfg.timeout)
    plan = build_plan(specs, k, cfg.max_shard_bytes)
    values = torch.frombuffer(bytearray(init), dtype=torch.float32) if init else torch.zeros(0)
    others = [s for s in range(k) if s != shard]

    def workers_done() -> None:
        for s in others:
            channel.send(num_workers + s, Header(kind=Kind.BYE, sender=me), wait=False)

    server = Shard(shard, plan, cfg, num_workers, spec, values)
    # the sync-mode norm exchange goes straight to the other servers' shards
    server.connect_peers(
        {s: WireEndpoint(channel, num_workers + s, s, plan.shard_numel(s)) for s in plan.nonempty_shards()}
    )
    loop = ServerLoop(
        channel,
        server,
        None,
        expect_bye=set(range(num_workers)) | {num_workers + s for s in others},
        stop=threading.Event(),
        workers=set(range(num_workers)),
        on_workers_done=workers_done,
    )
    loop.run()
    with contextlib.suppress(PSProtocolError):  # every peer said BYE: nothing pending matters any more
        channel.flush()
    if loop.error is not None:
        sys.exit(2)


def launch(
    host: str,
    port: int,
    num_workers: int,
    cfg: PSConfig,
    specs: list[TensorSpec],
    spec: OptimizerSpec,
    shard_values: list[torch.Tensor],
) -> list[Any]:
    """Start the k server processes (called on rank 0); they connect to the store at host:port."""
    ctx = mp.get_context("spawn")
    procs = []
    for j in range(cfg.num_servers):
        blob = shard_values[j].contiguous().view(torch.uint8).numpy().tobytes()
        p = ctx.Process(
            target=serve,
            args=(host, port, num_workers, j, cfg, list(specs), spec, blob, os.getpid()),
            name=f"ivyplug-ps-server-{j}",
            # daemonic: if rank 0's interpreter exits without close() (an exception in user code), its
            # multiprocessing atexit hook terminates the servers; a non-daemon child would be joined
            # there forever, since a server only ends after every worker's BYE
            daemon=True,
        )
        p.start()
        procs.append(p)
    return procs
