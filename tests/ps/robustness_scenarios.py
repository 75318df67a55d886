"""Worker code for the PS robustness checks: non-finite pushes, unused parameters, integer buffers, resuming
a state written in another mode. One 2-process session runs them all (each spawn costs seconds)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ivyplug.ps import PSClient, PSConfig
from tests.ps.scenarios import batch, make_opt, mlp

SIZES = [4, 4]  # equal batches: DDP's equal-weight mean is then the PS's sample-weighted mean
NAN_STEP = 2


def _start(model: torch.nn.Module, opt: torch.optim.Optimizer, **cfg: Any) -> PSClient:
    client = PSClient.start(
        PSConfig(timeout=30.0, **cfg), list(model.named_parameters()), list(model.named_buffers()), opt
    )
    client.pull_initial()
    return client


def _slice(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch(step, sum(SIZES))
    lo = sum(SIZES[:rank])
    return x[lo : lo + SIZES[rank]], y[lo : lo + SIZES[rank]]


def nonfinite_sync(rank: int, name: str, steps: int = 4) -> dict[str, Any]:
    """Rank 1 pushes one NaN gradient element at NAN_STEP: the global model equals training on rank 0's
    batch alone at that step (rank 1 counts zero samples)."""
    model = mlp(seed=0)
    opt = make_opt(name, model.parameters())
    client = _start(model, opt, mode="sync")
    ref = mlp(seed=0)
    ref_opt = make_opt(name, ref.parameters())
    for step in range(steps):
        x, y = _slice(step, rank)
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if rank == 1 and step == NAN_STEP:
            next(model.parameters()).grad.view(-1)[3] = float("nan")
        client.step(SIZES[rank])
        counted = [0] if step == NAN_STEP else [0, 1]
        xs = torch.cat([_slice(step, r)[0] for r in counted])
        ys = torch.cat([_slice(step, r)[1] for r in counted])
        ref.zero_grad()
        torch.nn.functional.mse_loss(ref(xs), ys).backward()
        ref_opt.step()
    client.sync()
    out = {
        "params": [p.detach().clone() for p in model.parameters()],
        "ref": [p.detach().clone() for p in ref.parameters()],
        "skipped": client.metrics()["nonfinite_skipped"],
    }
    client.close()
    return out


def nonfinite_batchnorm(rank: int, mode: str, name: str) -> dict[str, Any]:
    """A NaN gradient at step 1 and a NaN BatchNorm running mean at step 3, both on rank 1: every global
    parameter and buffer stays finite."""
    model = mlp(seed=0, bn=True)
    client = _start(model, make_opt(name, model.parameters()), mode=mode)
    for step in range(5):
        x, y = _slice(step, rank)
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if rank == 1 and step == 1:
            next(model.parameters()).grad.view(-1)[0] = float("nan")
        if rank == 1 and step == 3:
            model[1].running_mean[0] = float("inf")
        client.step(SIZES[rank])
    client.sync()
    out = {
        "finite": all(bool(torch.isfinite(t.float()).all()) for t in [*model.parameters(), *model.buffers()]),
        "skipped": client.metrics()["nonfinite_skipped"],
    }
    client.close()
    return out


def nonfinite_async_sum(rank: int) -> dict[str, Any]:
    """async, SGD lr=1, no staleness scaling, integer gradients: the global change is exactly minus the sum
    of every finite push; rank 1's push with an Inf (in the second tensor only: the drop is whole) is not
    in it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    client = _start(model, opt, mode="async", staleness_scaling="none", max_shard_bytes=None)
    x0 = [p.detach().clone() for p in model.parameters()]
    dist.barrier()  # every rank read the initial copy before any pushes
    pushed = [torch.zeros_like(p) for p in model.parameters()]
    g = torch.Generator().manual_seed(rank)
    for step in range(5):
        grads = [torch.randint(-3, 4, p.shape, generator=g).float() for p in model.parameters()]
        drop = rank == 1 and step == NAN_STEP
        if drop:
            grads[2].view(-1)[0] = float("inf")
        for p, gr in zip(model.parameters(), grads, strict=True):
            p.grad = gr
        client.step(1)
        if not drop:
            for acc, gr in zip(pushed, grads, strict=True):
                acc += gr
    client.sync()
    out = {
        "x0": x0,
        "pushed": pushed,
        "final": [p.detach().clone() for p in model.parameters()],
        "skipped": client.metrics()["nonfinite_skipped"],
    }
    client.close()
    return out


class _Branches(torch.nn.Module):
    """``used`` always runs; ``sometimes`` only on rank 0 at even steps; ``never`` is never called."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.used = torch.nn.Linear(6, 3)
        self.sometimes = torch.nn.Linear(6, 3)
        self.never = torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, use_sometimes: bool) -> torch.Tensor:
        out = self.used(x)
        return out + self.sometimes(x) if use_sometimes else out


def unused_params(rank: int, mode: str) -> dict[str, Any]:
    """AdamW (weight decay) on the PS against DDP(find_unused_parameters=True) in the same job."""
    steps = 5
    ps_model, ddp_inner = _Branches(), _Branches()
    opt = torch.optim.AdamW(ps_model.parameters(), lr=0.01, weight_decay=0.1)
    client = _start(ps_model, opt, mode=mode)
    ddp = DistributedDataParallel(ddp_inner, find_unused_parameters=True)
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=0.01, weight_decay=0.1)
    for step in range(steps):
        x, y = _slice(step, rank)
        use = rank == 0 and step % 2 == 0
        ps_model.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(ps_model(x, use), y).backward()
        client.step(SIZES[rank])
        if mode == "sync":
            ddp_opt.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(ddp(x, use), y).backward()
            ddp_opt.step()
    client.sync()
    out = {
        "ps": {k: v.detach().clone() for k, v in ps_model.named_parameters()},
        "ddp": {k: v.detach().clone() for k, v in ddp_inner.named_parameters()},
        "init": {k: v.detach().clone() for k, v in _Branches().named_parameters()},
    }
    client.close()
    return out


class _Counters(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.register_buffer("big", torch.tensor([2**40 + 7, -(2**35) - 1], dtype=torch.int64))
        self.register_buffer("small", torch.tensor(3, dtype=torch.int32))


def integer_buffers(rank: int, mode: str) -> dict[str, Any]:
    """int64 counters beyond 2**24 travel and merge exactly (max rule); int32 keeps its dtype."""
    model = _Counters()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    client = _start(model, opt, mode=mode)
    base = model.big.clone()
    dist.barrier()  # every rank read the initial count before any pushes
    for step in range(3):
        # absolute counts (a pull hands back the servers' max): rank 1 counts faster, its last is the max
        model.big.copy_(base + (step + 1) * (1 + rank))
        model.small.fill_(3 + step + 1)
        model.lin.weight.grad = torch.ones(2, 2)
        model.lin.bias.grad = torch.ones(2)
        client.step(1)
    client.sync()
    out = {"big": model.big.clone(), "small": model.small.clone()}
    client.close()
    return out


def resume_in_another_mode(rank: int) -> dict[str, Any]:
    """async (rank 0 pushes more than rank 1: clocks differ) -> sync -> ssp, and a refused plan change."""
    out: dict[str, Any] = {}
    model = mlp(seed=0)
    opt = make_opt("adamw", model.parameters())
    client = _start(model, opt, mode="async")
    for step in range(4 if rank == 0 else 2):
        x, y = _slice(step, rank)
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        client.step(SIZES[rank])
    client.sync()
    saved = client.state_dict()
    saved_params = [p.detach().clone() for p in model.parameters()]
    client.close()
    for mode, extra in (("sync", {}), ("ssp", {"staleness": 1})):
        torch.manual_seed(99)
        fresh = mlp(seed=7)
        fresh_opt = make_opt("adamw", fresh.parameters())
        client = _start(fresh, fresh_opt, mode=mode, **extra)
        client.load_state_dict(saved)
        out[f"{mode}_loaded"] = [p.detach().clone() for p in fresh.parameters()]
        dist.barrier()  # every rank pulled the loaded state before any pushes
        for step in range(3):  # async -> sync failed here: "worker 0 pushed twice in step 4"
            x, y = _slice(step, rank)
            fresh.zero_grad()
            torch.nn.functional.mse_loss(fresh(x), y).backward()
            client.step(SIZES[rank])
        client.sync()
        out[f"{mode}_after"] = [p.detach().clone() for p in fresh.parameters()]
        saved = client.state_dict()  # sync -> ssp next
        client.close()
    other = mlp(seed=0)
    client = _start(other, make_opt("adamw", other.parameters()), mode="sync", num_servers=1)
    try:
        client.load_state_dict(saved)
    except ValueError as exc:
        out["refused"] = str(exc)
    client.close()
    out["saved_params"] = saved_params
    return out


def session(rank: int, world: int) -> dict[str, Any]:
    assert world == 2
    results: dict[str, Any] = {}
    for name in ("sgd", "adamw"):
        results[f"nonfinite_sync_{name}"] = nonfinite_sync(rank, name)
        for mode in ("sync", "async"):
            results[f"nonfinite_bn_{mode}_{name}"] = nonfinite_batchnorm(rank, mode, name)
    results["nonfinite_async"] = nonfinite_async_sum(rank)
    for mode in ("sync", "async"):
        results[f"unused_{mode}"] = unused_params(rank, mode)
        results[f"ints_{mode}"] = integer_buffers(rank, mode)
    results["resume"] = resume_in_another_mode(rank)
    dist.barrier()
    return results
