"""Where the shards run, and the endpoints a worker reaches them through.

* co-located (``num_servers=0``): worker rank r serves shard r in a server-loop thread and reaches the
  other shards over a gloo group of its own; its own shard through an in-process endpoint (gloo cannot
  send to itself).
* dedicated (``num_servers=k``): rank 0 starts a server process holding the k shards (an ``ivyplug serve``
  of the job's own, server/dedicated.py); every worker joins it as external.
* external (``servers="host:port"``): the shards and the batch queue of an ``ivyplug serve`` (server/service.py),
  reached over a two-rank group per worker (service_link.py).

Everything else (a step, sync, checkpoints) is the same loop over the endpoints in either topology.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ivyplug.ps.config import PSConfig, parse_address
from ivyplug.ps.server import job_description
from ivyplug.ps.server.batch_queue import BatchQueue
from ivyplug.ps.server.coordinator import Coordinator
from ivyplug.ps.server.dedicated import check_ps_host, launch, ps_host
from ivyplug.ps.server.endpoints import InProcessEndpoint, ShardEndpoint, WireEndpoint, WireStats
from ivyplug.ps.server.loop import ServerLoop
from ivyplug.ps.server.mirror import OptimizerSpec
from ivyplug.ps.server.peers import WirePeer
from ivyplug.ps.server.shard import Shard
from ivyplug.ps.sharding import ShardPlan
from ivyplug.ps.wire import gloo_net
from ivyplug.ps.wire.transport import Channel
from ivyplug.ps.worker import service_link
from ivyplug.ps.worker.layout import FlatLayout
from ivyplug.ps.worker.service_link import ServiceLink
from ivyplug.ps.worker.worker_group import WorkerGroup


@dataclass(frozen=True)
class WorkerJob:
    """A job as one worker sees it: what every topology builder needs to reach (or start) the shards."""

    cfg: PSConfig
    plan: ShardPlan
    spec: OptimizerSpec
    layout: FlatLayout
    rank: int
    world_size: int
    workers: WorkerGroup
    stop: threading.Event
    stats: WireStats


@dataclass
class Topology:
    """What a worker holds of the PS: endpoints per shard and what it runs itself."""

    endpoints: dict[int, ShardEndpoint]
    local: Shard | None = None  # the shard this process serves (co-located)
    channel: Channel | None = None
    p2p_groups: list[Any] = field(default_factory=list)  # the channel's groups
    loops: list[ServerLoop] = field(default_factory=list)  # this process's server loops (co-located: one per side)
    queue: BatchQueue | None = None  # rank 0's batch queue (async/ssp dispatch)
    queue_endpoint: WireEndpoint | None = None  # how other ranks reach it
    server_procs: list[Any] = field(default_factory=list)
    store: Any = None
    loop_ranks: list[int] = field(default_factory=list)  # other PS-group ranks that run a loop (STOP, BYE)
    owns_p2p_group: bool = True
    link: ServiceLink | None = None  # the connection to an ivyplug serve (external)
    others: list[ServiceLink] = field(default_factory=list)  # further services holding shards of the job


def colocated(job: WorkerJob) -> Topology:
    cfg, plan, layout, workers, stats = job.cfg, job.plan, job.layout, job.workers, job.stats
    rank, world_size = job.rank, job.world_size
    channel = None
    if world_size > 1:
        with gloo_net.interface_for(os.environ.get("MASTER_ADDR")):  # one group per direction (wire/transport.py)
            up, down = (dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.timeout)) for _ in range(2))
        channel = Channel(up, rank, cfg.timeout, reverse=down)
    full = layout.flat_local()
    workers.broadcast(full, "rank 0's parameters")
    local = Shard(rank, plan, cfg, world_size, job.spec, layout.shard_values(full, rank))
    # the own shard first: a step collects its reply first, so a wait that times out is the one that can
    # say what it waits for, before any wire receive times out (gloo closes a pair whose receive timed out)
    endpoints: dict[int, ShardEndpoint] = {}
    if rank in plan.nonempty_shards():
        endpoints[rank] = InProcessEndpoint(local, stats)
    for s in plan.nonempty_shards():
        if s != rank:
            assert channel is not None
            endpoints[s] = WireEndpoint(channel, s, s, plan.shard_numel(s), stats)
    # the sync-mode norm exchange: shard to shard, through the server side (server/peers.py)
    if channel is not None:
        local.connect_peers({s: WirePeer(channel, s) for s in endpoints if s != rank})
    groups = [channel.group, channel.reverse] if channel is not None else []
    topo = Topology(endpoints, local=local, channel=channel, p2p_groups=groups)
    topo.queue = BatchQueue(world_size) if rank == 0 else None
    if channel is not None:
        others = set(range(world_size)) - {rank}
        coordinator = Coordinator(topo.queue, job.stop)
        for lower in (True, False):  # requests from the ranks below and above arrive on different groups
            side = {r for r in others if (r < rank) == lower}
            if side:
                topo.loops.append(ServerLoop(channel, local, coordinator, side, workers=side, lower=lower))
        for loop in topo.loops:
            loop.start()
        topo.loop_ranks = sorted(others)
        if rank != 0:
            topo.queue_endpoint = WireEndpoint(channel, 0, -1, 0, stats)
        workers.barrier("every rank's PS server to start")
    return topo


def dedicated(job: WorkerJob) -> Topology:
    """Rank 0 starts the job's own ``ivyplug serve`` (server/dedicated.py); then every worker joins it (external)."""
    cfg, rank, workers = job.cfg, job.rank, job.workers
    host = ps_host()
    check_ps_host(host, job.world_size)
    port = torch.zeros(1, dtype=torch.int64)
    secret = torch.zeros(32, dtype=torch.uint8)
    procs: list[Any] = []
    if rank == 0:
        token = secrets.token_hex(16)
        proc, port[0] = launch(host, cfg.num_servers, job.world_size, token, cfg.timeout)
        procs.append(proc)
        secret.copy_(torch.frombuffer(bytearray(token.encode()), dtype=torch.uint8))
    try:
        workers.broadcast(port, "the dedicated servers' port")
        workers.broadcast(secret, "the dedicated servers' token")
        token = secret.numpy().tobytes().decode()
        where = dataclasses.replace(cfg, num_servers=0, servers=f"{host}:{int(port)}", token=token)
        link = service_link.connect(where)
        topo = external(job, link)
    except BaseException:
        for proc in procs:  # do not leave a half-started server behind
            proc.kill()
            proc.join(5)
        raise
    topo.server_procs = procs
    return topo


def external(job: WorkerJob, link: ServiceLink) -> Topology:
    """The shards of an ``ivyplug serve`` (server/service.py), reached over this worker's own pair group.

    Rank 0 joins first, so that a new job's shards start from rank 0's values; then the other ranks. A job
    of several ranks asks for slots 0..W-1 (its ranks) and shares the service's batch queue; a lone worker takes
    any free slot and dispatches its batches from a queue of its own (every batch of each of its epochs).
    """
    cfg, plan, layout, workers, stats = job.cfg, job.plan, job.layout, job.workers, job.stats
    rank, world_size = job.rank, job.world_size
    desc = job_description.describe(cfg, plan, job.spec)
    full = layout.flat_local()
    values = [layout.shard_values(full, s) for s in range(plan.num_shards)]
    want = rank if world_size > 1 else -1
    # the other services that hold shards of the job (ivyplug serve --join): a pair with each
    first_host, _ = parse_address(link.address, "servers")
    for svc in link.services[1:]:
        other_host, _ = parse_address(str(svc["address"]), "a service of the job")
        if gloo_net.is_loopback(other_host) and not gloo_net.is_loopback(first_host):
            raise gloo_net.PSAddressError(
                f"ivyplug serve at {link.address} says shards of the job are held by a service at {svc['address']}, "
                "a loopback address that a worker on another host cannot reach: start that service with --host "
                "<an address of its host that the workers reach>"
            )
    others = [service_link.connect(dataclasses.replace(cfg, servers=svc["address"])) for svc in link.services[1:]]
    if rank == 0:
        service_link.join(link, desc, values, want, world_size, stats)
    workers.barrier(f"rank 0 to join ivyplug serve at {link.address}")
    if rank != 0:
        service_link.join(link, desc, values, want, world_size, stats)
    for other in others:  # the same slot on every service
        service_link.join(other, desc, values, link.slot, link.num_workers, stats)
    if link.num_workers < world_size:
        raise ValueError(
            f"ivyplug serve at {link.address} has {link.num_workers} worker slots, this job has {world_size} workers "
            "(start it with --workers >= the job's size)"
        )
    holder: dict[int, ServiceLink] = {}
    for svc, held_by in zip(link.services or [{"first": 0, "count": plan.num_shards}], [link, *others], strict=True):
        for s in range(int(svc["first"]), int(svc["first"]) + int(svc["count"])):
            holder[s] = held_by
    endpoints: dict[int, ShardEndpoint] = {
        s: WireEndpoint(holder[s].channel, 0, s, plan.shard_numel(s), stats) for s in plan.nonempty_shards()
    }
    topo = Topology(
        endpoints, channel=link.channel, p2p_groups=[link.group], store=link.store, link=link, owns_p2p_group=False
    )
    topo.others = others
    topo.loop_ranks = [0]
    if world_size == 1:
        # a lone worker is a job of its own, with epochs of its own: the service's queue hands out the epochs of a
        # job of several ranks, and a lone worker's start of an epoch there would restart another's
        topo.queue = BatchQueue(1)
    else:
        topo.queue_endpoint = WireEndpoint(link.channel, 0, -1, 0, stats)
    workers.barrier(f"every worker to join ivyplug serve at {link.address}")
    return topo
