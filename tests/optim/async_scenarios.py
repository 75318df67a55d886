"""AsyncLAMB in real gloo processes (run by tests/optim/test_async_lamb.py through tests.ps.harness).

The scenarios use a large ``sync_every`` and call ``exchange()`` themselves, so that each worker can record
the exact delta it pushes (x_local − x_pulled) right before the exchange; automatic exchanges every H steps
are tested in-process.
"""

from __future__ import annotations

import random
import time
from typing import Any

import torch
import torch.distributed as dist

from ivyplug.optim import AsyncLAMB
from ivyplug.ps import PSConfig

MANUAL = 10**6  # sync_every: never exchange automatically


def mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def local_steps(model: torch.nn.Module, opt: AsyncLAMB, rank: int, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed * 101 + rank)
    for _ in range(steps):
        x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])


def sync_mean_of_deltas(rank: int, world: int) -> dict[str, Any]:
    """sync: after an exchange the global copy is x_pulled + mean(Δ_0, Δ_1); a non-finite Δ merges as 0."""
    model = mlp(seed=rank)  # different initial weights: the servers' copy (rank 0's) wins
    opt = AsyncLAMB(model.parameters(), lr=0.05, sync_every=MANUAL)
    client = opt.start_ps(PSConfig(mode="sync", timeout=30.0), list(model.named_parameters()))
    out: dict[str, Any] = {"x0": flat(model)}
    local_steps(model, opt, rank, 3, seed=1)
    out["local"] = flat(model)
    opt.exchange()
    out["after"] = flat(model)
    local_steps(model, opt, rank, 2, seed=2)
    if rank == 1:  # a worker whose local copy went bad: its delta is replaced by zero
        with torch.no_grad():
            next(model.parameters())[0, 0] = float("nan")
    out["local2"] = flat(model)
    opt.exchange()
    out["after2"] = flat(model)
    out["exchanges"], out["discarded"] = opt.exchanges, opt.discarded_exchanges
    client.close()
    return out


def async_nothing_lost(rank: int, world: int) -> dict[str, Any]:
    """async, merge_rate 1/2, no staleness scaling, random timing: global = x0 + ½ Σ every pushed Δ."""
    model = mlp(seed=0)
    opt = AsyncLAMB(model.parameters(), lr=0.02, sync_every=MANUAL)
    cfg = PSConfig(mode="async", staleness_scaling="none", timeout=30.0)
    client = opt.start_ps(cfg, list(model.named_parameters()))
    x0 = flat(model)
    dist.barrier()  # nobody pushes before everyone pulled the initial copy
    pushed = torch.zeros_like(x0)
    rng = random.Random(rank + 5)
    for round_ in range(8):
        local_steps(model, opt, rank, 1 + rng.randrange(3), seed=10 + round_)
        pushed += flat(model) - torch.cat([s.reshape(-1).double() for s in opt.delta.snapshot])
        time.sleep(rng.random() * 0.01)
        opt.exchange()
    dist.barrier()  # every push applied (each exchange waited for its reply)
    client.sync()
    out = {"x0": x0, "pushed": pushed, "final": flat(model), "exchanges": opt.exchanges}
    client.close()
    return out


def session(rank: int, world: int) -> dict[str, Any]:
    return {"sync": sync_mean_of_deltas(rank, world), "async": async_nothing_lost(rank, world)}
