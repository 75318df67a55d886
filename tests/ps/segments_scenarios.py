"""Runs inside the spawned workers of test_segments.py: each fit with the fp32 wire cut into segments (large
tensors sent from ``.grad`` and received into the parameter) and again with every payload as one message."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from ivyplug.ps import PSClient, PSConfig
from ivyplug.ps.server.endpoints import WireEndpoint
from ivyplug.ps.wire.segments import DIRECT_MIN

SIZES = [3, 5]
STEPS = 4


class Wide(torch.nn.Module):
    """Tensors on both sides of the in-place threshold: ``hidden.weight`` (1.13M elements, whole), ``wide.weight``
    (2M, cut by ``max_shard_bytes`` into row blocks of 1280 rows, in place, and 768, packed), ``extra`` (1.13M,
    used at even steps only), small layers and BatchNorm's buffers (an integer one among them)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.first = torch.nn.Linear(16, 1100)
        self.hidden = torch.nn.Linear(1100, 1024)
        self.bn = torch.nn.BatchNorm1d(1024)
        self.wide = torch.nn.Linear(1024, 2048)
        self.last = torch.nn.Linear(2048, 3)
        self.extra = torch.nn.Parameter(torch.randn(1100, 1024) * 0.01)

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        z = self.hidden(h)
        if use_extra:
            z = z + h @ self.extra
        return self.last(torch.tanh(self.wide(torch.tanh(self.bn(z)))))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(sum(SIZES), 16, generator=g), torch.randn(sum(SIZES), 3, generator=g)
    lo = sum(SIZES[:rank])
    return x[lo : lo + SIZES[rank]], y[lo : lo + SIZES[rank]]


def fit(rank: int, split: bool, turns: bool = False, nan_at: int | None = None, **cfg: Any) -> dict[str, Any]:
    """``split=False``: every wire endpoint sends and receives its shard as one message (the cut is off).
    ``turns``: the workers step one after the other (async pushes land in a fixed order). ``nan_at``: rank 1's
    push of that step holds a NaN in a gradient that travels in place."""
    model = Wide(seed=rank + 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    config = PSConfig(timeout=120.0, max_shard_bytes=5 * 2**20, shared_memory=False, **cfg)  # the gloo wire's cut
    client = PSClient.start(config, list(model.named_parameters()), list(model.named_buffers()), opt)
    wires = [ep for ep in client.topo.endpoints.values() if isinstance(ep, WireEndpoint)]
    if not split:
        for ep in wires:
            ep.segments = None
    client.pull_initial()
    dist.barrier()  # every worker's initial pull before the first push
    placed = 0
    bumped = False
    pointers = [p.data_ptr() for p in model.parameters()]
    try:
        for step in range(STEPS):
            model.zero_grad()  # set_to_none: ``extra`` has no gradient at odd steps
            x, y = _batch(step, rank)
            torch.nn.functional.mse_loss(model(x, use_extra=step % 2 == 0), y).backward()
            if step == 1:  # a gradient that cannot travel in place: packed instead
                g = model.hidden.weight.grad
                model.hidden.weight.grad = g.t().contiguous().t()
            if nan_at == step and rank == 1:
                model.wide.weight.grad[5, 7] = math.nan
            if step == 3:  # a pull left unread (as by a step that failed on another shard): the next step must
                for ep in wires:  # first take in the rest of it, or its receives would get this reply's parts
                    ep.pull(client.rank).header(60.0)  # answered (seen by the server), its parts left unread
                dist.barrier()  # both pulls answered before any push of this step (async: the same staleness)
            version = model.hidden.weight._version
            if split and step == 2:  # sentinels: only what is packed or unpacked overwrites them
                for ep in wires:
                    client.layout._push_bufs[ep.shard].fill_(math.nan)
                    if ep._reply_buf is not None:
                        ep._reply_buf.fill_(math.nan)
            for r in range(len(SIZES) if turns else 1):
                if r == rank or not turns:
                    client.step(SIZES[rank])
                if turns:
                    dist.barrier()
            bumped = model.hidden.weight._version > version  # autograd sees the parameter change, even in place
            if split and step == 2:
                for ep in wires:
                    assert ep.segments is not None
                    for seg in ep.segments:
                        if seg.piece is not None:
                            sent = client.layout._push_bufs[ep.shard][seg.start : seg.end]
                            got = ep._reply_buf[seg.start : seg.end] if ep._reply_buf is not None else None
                            # sent from .grad and received in place: neither buffer was touched ...
                            placed += int(bool(sent.isnan().all()) and got is not None and bool(got.isnan().all()))
        client.sync()
        out = {
            "params": [p.detach().clone() for p in model.parameters()],
            "buffers": [b.detach().clone() for b in model.buffers()],
            "pointers_kept": pointers == [p.data_ptr() for p in model.parameters()],
            "placed": placed,
            "version_bumped": bumped,
            "direct": sum(seg.piece is not None for ep in wires for seg in ep.segments or []),
            "wire_shards": len(wires),
            **client.metrics(),
        }
    finally:
        client.close()
    return out


class Deep(torch.nn.Module):
    """20 layers of 16x16: with the threshold lowered to 256 elements, every weight is a segment of its own and
    every bias a run between two of them, so each shard travels in about 20 messages."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp = torch.nn.Linear(16, 16)
        self.layers = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(19)])

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        return self.layers(torch.tanh(self.inp(x)))[:, :3]


def many_segments(rank: int, split: bool) -> dict[str, Any]:
    """More segments per shard than a channel keeps sends before it waits for the oldest (16): a server's reply
    parts leave only once their worker posts its receives, so no send may wait for them."""
    from ivyplug.ps.wire import segments

    saved, segments.DIRECT_MIN = segments.DIRECT_MIN, 256
    try:
        model = Deep(seed=rank)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        config = PSConfig(mode="sync", timeout=60.0, shared_memory=False)  # the gloo wire's cut
        client = PSClient.start(config, list(model.named_parameters()), [], opt)
        if not split:
            for ep in client.topo.endpoints.values():
                ep.segments = None
        cuts = [len(ep.segments or []) for ep in client.topo.endpoints.values() if isinstance(ep, WireEndpoint)]
        client.pull_initial()
        try:
            for step in range(STEPS):
                model.zero_grad()
                x, y = _batch(step, rank)
                torch.nn.functional.mse_loss(model(x, False), y).backward()
                client.step(SIZES[rank])
            client.sync()
            return {"params": [p.detach().clone() for p in model.parameters()], "cuts": cuts}
        finally:
            client.close()
    finally:
        segments.DIRECT_MIN = saved


def session(rank: int, world: int) -> dict[str, Any]:
    assert DIRECT_MIN <= 1100 * 1024 and DIRECT_MIN <= 1280 * 1024 < 2 * DIRECT_MIN  # the cut described in Wide
    cases: dict[str, dict[str, Any]] = {
        "sync": {"mode": "sync"},
        "async": {"mode": "async", "turns": True},
        "dedicated": {"mode": "sync", "num_servers": 1},
        "nan": {"mode": "sync", "nan_at": 1},
    }
    out: dict[str, Any] = {
        name: {split: fit(rank, split, **case) for split in (True, False)} for name, case in cases.items()
    }
    out["many"] = {split: many_segments(rank, split) for split in (True, False)}
    return out
