"""Code of test_cuda.py that needs a CUDA device: a staged layout in this process, and 2-process fits whose
workers train on ``cuda:0`` against CPU servers."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ivyplug.ps import PSClient, PSConfig
from ivyplug.ps.server.endpoints import WireEndpoint
from ivyplug.ps.sharding import build_plan, tensor_specs
from ivyplug.ps.worker.layout import FlatLayout
from tests.ps.introspection import force_staging
from tests.ps.scenarios import batch, mlp

SIZES = [3, 5]
STEPS = 4


def staged_layout() -> dict[str, Any]:
    """Pack and unpack CUDA tensors (staged, pinned) and their CPU copies (per piece): the same bits."""
    model = mlp(seed=1, bn=True)
    x, y = batch(0, 8)
    torch.nn.functional.mse_loss(model(x), y).backward()
    gpu = mlp(seed=1, bn=True).cuda()
    for p, q in zip(model.parameters(), gpu.parameters(), strict=True):
        q.grad = p.grad.cuda()
    gpu.load_state_dict(model.state_dict())
    plan = build_plan(tensor_specs(list(model.named_parameters()), list(model.named_buffers())), 2)
    cpu_layout = FlatLayout(plan, list(model.named_parameters()), list(model.named_buffers()))
    gpu_layout = FlatLayout(plan, list(gpu.named_parameters()), list(gpu.named_buffers()))
    out: dict[str, Any] = {"device": gpu_layout.staging_device(0).type if gpu_layout.staging_device(0) else None}
    out["pack_equal"] = all(torch.equal(cpu_layout.pack(s, 1.0), gpu_layout.pack(s, 1.0)) for s in range(2))
    out["pinned_push"] = all(gpu_layout.packed(s).is_pinned() for s in range(2))
    out["pinned_reply"] = gpu_layout.host_buffer(16, 0).is_pinned()
    for s in range(2):
        reply = cpu_layout.pack(s, 1.0).clone() * 0.5  # any finite values, integer words halved too (as bits)
        cpu_layout.unpack(s, reply)
        gpu_layout.unpack(s, reply.clone())
    out["unpack_equal"] = all(
        torch.equal(a.cpu(), b) for a, b in zip(gpu.state_dict().values(), model.state_dict().values(), strict=True)
    )
    return out


def fit(rank: int, mode: str, device: str, per_piece: bool = False) -> dict[str, Any]:
    model = mlp(seed=rank + 3).to(device)
    # SGD: its update is linear in the gradient, so CPU and CUDA rounding stay as close as the gradients are
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    client = PSClient.start(
        PSConfig(mode=mode, timeout=60.0), list(model.named_parameters()), list(model.named_buffers()), opt
    )
    if per_piece:  # the CUDA tensors copied one by one, to compare the staged path against
        force_staging(client.layout, False)
    client.pull_initial()
    dist.barrier()
    try:
        for step in range(STEPS):
            model.zero_grad()
            x, y = batch(step, sum(SIZES))
            lo = sum(SIZES[:rank])
            xs, ys = x[lo : lo + SIZES[rank]].to(device), y[lo : lo + SIZES[rank]].to(device)
            torch.nn.functional.mse_loss(model(xs), ys).backward()
            for r in range(len(SIZES) if mode == "async" else 1):  # async: one after the other (a fixed order)
                if mode == "sync" or r == rank:
                    client.step(SIZES[rank])
                if mode == "async":
                    dist.barrier()
        client.sync()
        wires = [s for s, ep in client.topo.endpoints.items() if isinstance(ep, WireEndpoint)]
        return {
            "params": [p.detach().cpu().clone() for p in model.parameters()],
            "device": str(next(model.parameters()).device),
            "pinned": all(client.layout.packed(s).is_pinned() for s in wires),
        }
    finally:
        client.close()


def session(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in ("sync", "async"):
        out[mode] = {"staged": fit(rank, mode, "cuda:0"), "per_piece": fit(rank, mode, "cuda:0", per_piece=True)}
    out["sync"]["cpu"] = fit(rank, "sync", "cpu")
    return out
