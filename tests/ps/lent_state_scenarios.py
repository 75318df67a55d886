"""Runs inside the spawned workers of test_lent_state.py: a co-located 2-rank fit whose shards lend their
state to replies; reports how often a write found the state lent and what the server kept of its replies."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from ivyplug.ps import PSClient, PSConfig
from tests.ps.introspection import held_buffers, local_shard
from tests.ps.scenarios import batch, mlp

STEPS = 8


def _kept_replies(client: PSClient, within: float = 10.0) -> dict[str, int]:
    """The replies this rank's server keeps, per worker and stream, once it keeps any (up to ``within`` s): the
    other worker can read a reply as soon as its sends are posted, a moment before the server thread files it."""
    channel = client.topo.channel
    assert channel is not None
    deadline = time.monotonic() + within
    while True:
        with channel._send_lock:
            kept = {f"{dst}/{stream}": len(v) for (dst, stream), v in channel._replies.items()}
        if kept or time.monotonic() > deadline:
            return kept
        time.sleep(0.01)


def fit(rank: int, world: int, mode: str, cfg: dict[str, Any] | None = None) -> dict[str, Any]:
    """``STEPS`` steps; async in turns (rank 0's step, then rank 1's), so that rank 1's reply from shard 0
    is still unread by the server's bookkeeping (rank 1 has sent no request since) when rank 0 pushes.
    ``cfg``: further PSConfig options (a bf16 wire, pushes from backward's hooks)."""
    model = mlp(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    # replies lend the state only on the gloo wire (a shared-memory reply is a copy into the worker's region)
    config = PSConfig(mode=mode, timeout=60.0, shared_memory=False, **(cfg or {}))
    client = PSClient.start(config, list(model.named_parameters()), [], opt)
    try:
        client.pull_initial()
        dist.barrier()
        for step in range(STEPS):
            x, y = batch(step * world + rank, 8)
            model.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            if mode == "sync":
                client.step(8)
            else:
                for turn in range(world):
                    if turn == rank:
                        client.step(8)
                    dist.barrier()
        dist.barrier()  # both ranks have their last replies: each server has sent the other's (and keeps it)
        shard = local_shard(client)
        assert client.topo.channel is not None
        moves, buffers = shard.flat.moves, held_buffers(shard.flat)
        kept = _kept_replies(client)
        client.sync()  # every push landed, then both ranks pull the same version
        return {
            "moves": moves,
            "buffers": buffers,
            "kept_replies": kept,
            "params": [p.detach().clone() for p in model.parameters()],
        }
    finally:
        client.close()
