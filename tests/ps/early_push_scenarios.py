"""Runs inside the spawned workers of test_early_push.py: each fit twice, with and without overlap_backward."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ivyplug.ps import PSClient
from tests.ps.scenarios import batch, make_opt, mlp, start

SIZES = [3, 5]
STEPS = 4

#: what a worker does between its forward and its step: (model, client, rank, step) -> None
Between = Callable[[torch.nn.Module, PSClient, int, int], None]


def _loss(model: torch.nn.Module, rank: int, step: int) -> torch.Tensor:
    x, y = batch(step, sum(SIZES))
    lo = sum(SIZES[:rank])
    return torch.nn.functional.mse_loss(model(x[lo : lo + SIZES[rank]]), y[lo : lo + SIZES[rank]])


def _backward(model: torch.nn.Module, client: PSClient, rank: int, step: int) -> None:
    _loss(model, rank, step).backward()


def _edit_after_backward(model: torch.nn.Module, client: PSClient, rank: int, step: int) -> None:
    """In-place clipping of one gradient after backward (as a user's on_before_optimizer_step might)."""
    _loss(model, rank, step).backward()
    model[-1].weight.grad.mul_(0.25)


def _replace_after_backward(model: torch.nn.Module, client: PSClient, rank: int, step: int) -> None:
    """A new ``.grad`` tensor (not an in-place edit) after backward."""
    _loss(model, rank, step).backward()
    model[-1].bias.grad = model[-1].bias.grad * -2.0


def _replace_data_after_backward(model: torch.nn.Module, client: PSClient, rank: int, step: int) -> None:
    """New storage under the same ``.grad`` (``.data = ...``: no version bump)."""
    _loss(model, rank, step).backward()
    grad = model[-1].bias.grad
    grad.data = grad.data * -2.0


def _unfreeze_at_step_1(model: torch.nn.Module, client: PSClient, rank: int, step: int) -> None:
    """The first layer, frozen before the client started, trains from step 1 on (fine-tuning)."""
    if step == 1:
        model[0].requires_grad_(True)
    _loss(model, rank, step).backward()


def _accumulate(model: torch.nn.Module, client: PSClient, rank: int, step: int, hold: bool = True) -> None:
    """Two micro-batches per step; the first one's backward inside ``hold_pushes`` (when ``hold``)."""
    with client.hold_pushes() if hold else contextlib.nullcontext():
        _loss(model, rank, step).backward()
    _loss(model, rank, step + 100).backward()


def _nan_in_first_layer(model: torch.nn.Module, client: PSClient, rank: int, step: int) -> None:
    """Rank 1 at step 2: backward itself yields a NaN gradient for the first layer (computed last), after
    the shards holding the later layers were sent early with finite data."""
    handle = None
    if rank == 1 and step == 2:
        handle = model[0].weight.register_hook(lambda g: g * float("nan"))
    _loss(model, rank, step).backward()
    if handle is not None:
        handle.remove()


def fit(
    rank: int,
    overlap: bool,
    between: Between,
    opt: str = "adamw",
    turns: bool = False,
    max_grad_norm: float | None = None,
    frozen_first: bool = False,
    **cfg: Any,
) -> dict[str, Any]:
    """``turns``: the workers step one after the other (async/ssp pushes land in a fixed order);
    ``frozen_first``: the first layer does not require gradients when the client starts."""
    model = mlp(seed=rank + 3)
    if frozen_first:
        model[0].requires_grad_(False)
    client = start(model, make_opt(opt, model.parameters()), overlap_backward=overlap, timeout=60.0, **cfg)
    if turns:  # every worker's initial pull before the first push (else it may or may not see that push)
        dist.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out = _steps(model, client, rank, between, turns, max_grad_norm)
        finally:
            client.close()
    out["warnings"] = [str(w.message) for w in caught if "overlap_backward" in str(w.message)]
    return out


def _steps(
    model: torch.nn.Module, client: PSClient, rank: int, between: Between, turns: bool, max_grad_norm: float | None
) -> dict[str, Any]:
    for step in range(STEPS):
        model.zero_grad()
        between(model, client, rank, step)
        for r in range(len(SIZES) if turns else 0):
            if r == rank:
                client.step(SIZES[rank], max_grad_norm=max_grad_norm)
            dist.barrier()
        if not turns:
            client.step(SIZES[rank], max_grad_norm=max_grad_norm)
    client.sync()
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "shards": client.plan.num_shards,
        **client.metrics(),
    }


def session(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    cases: dict[str, tuple[Between, dict[str, Any]]] = {
        "sync": (_backward, {"mode": "sync"}),
        # whole tensors: the edited one lives in one shard, the other shard's early send stays good
        "edited": (_edit_after_backward, {"mode": "sync", "max_shard_bytes": None}),
        "replaced": (_replace_after_backward, {"mode": "sync", "max_shard_bytes": None}),
        "data_replaced": (_replace_data_after_backward, {"mode": "sync", "max_shard_bytes": None}),
        "unfrozen": (_unfreeze_at_step_1, {"mode": "sync", "frozen_first": True}),
        "accumulated": (_accumulate, {"mode": "sync"}),
        "accumulated_unheld": (lambda m, c, r, s: _accumulate(m, c, r, s, hold=False), {"mode": "sync"}),
        "nan": (_nan_in_first_layer, {"mode": "sync"}),
        "bf16": (_backward, {"mode": "sync", "wire_dtype": "bfloat16"}),
        "dedicated": (_backward, {"mode": "sync", "num_servers": 1}),
        "async": (_backward, {"mode": "async", "turns": True}),
        "ssp": (_edit_after_backward, {"mode": "ssp", "staleness": 1, "turns": True, "max_shard_bytes": None}),
        "async_clipped": (_backward, {"mode": "async", "turns": True, "max_grad_norm": 0.1}),
    }
    for name, (between, cfg) in cases.items():
        out[name] = {overlap: fit(rank, overlap, between, **cfg) for overlap in (True, False)}
    return out
