"""Runs inside the spawned workers of test_shared_region.py: each fit with payloads in shared memory and again
over gloo alone (``PSConfig.shared_memory=False``), plus the fallbacks where a region cannot be used."""

from __future__ import annotations

import errno
import glob
import math
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist

from ivyplug.ps import PSClient, PSConfig
from ivyplug.ps.server.endpoints import WireEndpoint
from ivyplug.ps.wire import shared_region
from tests.ps.scenarios import batch, mlp

STEPS = 5
SIZES = [6, 10]


def _leftovers() -> list[str]:
    return glob.glob(os.path.join(shared_region.SHM_DIR, f"ivyplug-ps-{os.getpid()}-*"))


def fit(
    rank: int,
    shared: bool,
    mode: str = "sync",
    turns: bool = False,
    nan_at: int | None = None,
    clip: float | None = None,
    **cfg: Any,
) -> dict[str, Any]:
    """``turns``: the workers step one after the other (async pushes land in a fixed order). ``nan_at``: rank
    1's push of that step holds a NaN. ``clip``: the step's ``max_grad_norm``."""
    model = mlp(seed=rank + 5, bn=True)
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.05)
    config = PSConfig(mode=mode, timeout=60.0, shared_memory=shared, **cfg)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        client = PSClient.start(config, list(model.named_parameters()), list(model.named_buffers()), opt)
    wires = [ep for ep in client.topo.endpoints.values() if isinstance(ep, WireEndpoint)]
    leftovers = _leftovers()
    try:
        client.pull_initial()
        dist.barrier()
        for step in range(STEPS):
            model.zero_grad()
            x, y = batch(step * 2 + rank, SIZES[rank])
            torch.nn.functional.mse_loss(model(x), y).backward()
            if nan_at == step and rank == 1:
                model[0].weight.grad[0, 0] = math.nan
            for r in range(2 if turns else 1):
                if r == rank or not turns:
                    client.step(SIZES[rank], max_grad_norm=clip)
                if turns:
                    dist.barrier()
        client.sync()
        refused = None
        if wires and wires[0].shared is not None:  # a push of another size is refused before anything is sent
            try:
                wires[0].push_pull(client.rank, torch.zeros(3), torch.zeros(1, dtype=torch.float64))
            except ValueError as exc:
                refused = str(exc)
        return {
            "params": [p.detach().clone() for p in model.parameters()],
            "buffers": [b.detach().clone() for b in model.buffers()],
            "shared": sum(ep.shared is not None for ep in wires),
            "wires": len(wires),
            "segments": sum(ep.segments is not None for ep in wires),
            "leftovers": leftovers,
            "refused": refused,
            "warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
            **client.metrics(),
        }
    finally:
        client.close()


def _no_space(numel: int) -> shared_region.Region:
    raise OSError(errno.ENOSPC, "No space left on device")


def _not_here(path: str, numel: int, nonce: bytes) -> torch.Tensor:
    raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)


#: each fitted with shared memory and over gloo alone (the fit's options)
CASES: dict[str, dict[str, Any]] = {
    "sync": {},
    "sync_overlap": {"overlap_backward": True},
    "async_turns": {"mode": "async", "turns": True},
    "ssp_turns": {"mode": "ssp", "staleness": 1, "turns": True},
    "nan": {"nan_at": 2},
    "clip_async_turns": {"mode": "async", "turns": True, "clip": 0.05},  # pushes scaled as they are packed
    "dedicated": {"num_servers": 1},  # one server process of the job's own: both ranks' shards across the wire
    "dedicated_async_turns": {"mode": "async", "turns": True, "num_servers": 1},
    "dedicated_overlap": {"num_servers": 1, "overlap_backward": True},
}


def session(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, kw in CASES.items():
        out[name] = {shared: fit(rank, shared, **kw) for shared in (True, False)}
    create, attach = shared_region.create, shared_region.attach
    try:
        shared_region.attach = _not_here  # the server finds no such file: another host, another /dev/shm
        out["not_mapped"] = fit(rank, True)
        shared_region.attach = attach
        if rank == 1:  # only rank 1 cannot make its region: rank 0 still shares its pushes to shard 1
            shared_region.create = _no_space
        out["no_space"] = fit(rank, True)
    finally:
        shared_region.create, shared_region.attach = create, attach
    return out
