"""Running Lightning fits in tests: quiet Trainers, a hard deadline, and no process left behind."""

from __future__ import annotations

import copy
import multiprocessing
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from ivyplug.integrations.lightning.launchers import destroy_default_group
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DDPStrategy
from typing_extensions import override

from ivyplug.ps.server import dedicated
from tests.ps.diffs import max_abs_diff as _max_abs_diff


def quiet_trainer(strategy: Any, devices: int, **kwargs: Any) -> Trainer:
    kwargs.setdefault("logger", False)
    kwargs.setdefault("enable_checkpointing", False)
    return Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **kwargs,
    )


class SpawnedDDP(DDPStrategy):
    """Lightning's DDP as the tests' control, for spawned workers (``start_method="spawn"``): each destroys gloo's
    default group when its stage ends. Lightning leaves it to the interpreter's teardown, which now and then
    aborts the worker (SIGABRT, "terminate called without an active exception") after its fit succeeded;
    ivyplug's strategies destroy theirs the same way."""

    @override
    def teardown(self) -> None:
        super().teardown()
        destroy_default_group()


@contextmanager
def reaped_children() -> Iterator[None]:
    """End every child process this block started, even when it fails or times out."""
    before = {p.pid for p in multiprocessing.active_children()}
    servers_before = set(dedicated._started)
    try:
        yield
    finally:
        for server in set(dedicated._started) - servers_before:  # a dedicated server process of this block's rank 0
            server.kill()
            server.join(5)
        for p in multiprocessing.active_children():
            if p.pid not in before:
                p.terminate()
                p.join(5)
                if p.is_alive():
                    p.kill()
                    p.join(5)


def params_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest ``|a[k] - b[k]|`` over every entry, in float64; NaN if any entry's difference is NaN."""
    assert a.keys() == b.keys()
    return _max_abs_diff([a[k] for k in a], [b[k] for k in a])


def reference_training(
    model: torch.nn.Module,
    make_optimizer: Callable[[Any], tuple[torch.optim.Optimizer, Any]],
    x: torch.Tensor,
    y: torch.Tensor,
    epochs: int,
    batch_size: int,
    world_size: int,
    clip: float | None = None,
    seed: int = 0,
    clip_value: float | None = None,
) -> dict[str, torch.Tensor]:
    """Single-process training on the concatenation of every rank's batch (what sync PS and DDP must equal).

    The order is Lightning's: a DistributedSampler (shuffle, seed + epoch) gives rank r the indices
    perm[r::world_size]; step i combines batch i of every rank, each rank's loss a mean over its batch.
    """
    ref = copy.deepcopy(model)
    opt, sched = make_optimizer(ref)
    n = len(x)
    assert n % world_size == 0
    for epoch in range(epochs):
        g = torch.Generator()
        g.manual_seed(seed + epoch)
        perm = torch.randperm(n, generator=g)
        shards = [perm[r::world_size] for r in range(world_size)]
        steps = -(-len(shards[0]) // batch_size)
        for i in range(steps):
            opt.zero_grad()
            loss = sum(
                torch.nn.functional.cross_entropy(
                    ref(x[s[i * batch_size : (i + 1) * batch_size]]), y[s[i * batch_size : (i + 1) * batch_size]]
                )
                for s in shards
            )
            (loss / world_size).backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            if clip_value is not None:
                torch.nn.utils.clip_grad_value_(ref.parameters(), clip_value)
            opt.step()
        if sched is not None:
            sched.step()
    return params_of(ref)
