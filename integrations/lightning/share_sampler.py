"""Per-rank batches of a global batch split by shares, rebuilt into the user's loader each epoch.

:class:`ShareBatchSampler` orders the data set with exactly the permutation Lightning's
``DistributedSampler`` uses (``torch.randperm`` seeded with ``seed + epoch``), cuts it into global
steps and splits each step across ranks by the shares (:func:`ivyplug.load.plan_epoch`): every rank
gets the same number of batches, none empty, and every sample is used once per epoch.

A ``DataLoader`` refuses a new ``batch_sampler`` after construction, so :func:`rebuild_loader` makes
a new plain ``DataLoader`` with the same dataset, workers, collate function and memory settings.
:func:`why_unsupported` names the loaders this cannot reproduce faithfully (iterable data sets,
custom samplers or DataLoader subclasses, and across ranks a loader Lightning did not split): those are left
alone.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from ivyplug.load.balancer import BalancerCore
from ivyplug.load.batch_plan import EpochPlan, plan_epoch


@dataclass(frozen=True)
class LoaderSpec:
    """What the user's loader says about ordering: per-rank batch size, shuffle, seed, drop_last."""

    batch_size: int
    shuffle: bool
    seed: int
    drop_last: bool


def why_unsupported(loader: object, world: int = 1) -> str | None:
    """A reason this loader cannot get a share sampler, or ``None`` when it can (``world``: the ranks)."""
    if not isinstance(loader, DataLoader):
        return f"the training loader is a {type(loader).__name__}, not a torch DataLoader"
    if type(loader) is not DataLoader:
        return f"the training loader is a DataLoader subclass ({type(loader).__name__}) that cannot be rebuilt"
    if isinstance(loader.dataset, IterableDataset):
        return "the training data set is an IterableDataset (no indices to share out)"
    if type(loader.batch_sampler) is not BatchSampler:
        return f"the training loader uses a custom batch sampler ({type(loader.batch_sampler).__name__})"
    if type(loader.sampler) not in (RandomSampler, SequentialSampler, DistributedSampler):
        return f"the training loader uses a custom sampler ({type(loader.sampler).__name__})"
    if world > 1 and not isinstance(loader.sampler, DistributedSampler):
        # Lightning did not split the data (use_distributed_sampler=False): each rank's loader may hold a part of
        # its own, or all of it, and shares of one global B over its indices would train another epoch than DDP's
        return (
            "the training loader has no DistributedSampler (use_distributed_sampler=False): each rank's data is its "
            "own, which shares of one batch across ranks cannot cut"
        )
    return None


def loader_spec(loader: DataLoader, default_seed: int) -> LoaderSpec:
    """Read ordering settings from a supported loader (see :func:`why_unsupported`)."""
    batch_sampler = loader.batch_sampler
    assert isinstance(batch_sampler, BatchSampler)
    sampler = loader.sampler
    if isinstance(sampler, DistributedSampler):
        return LoaderSpec(batch_sampler.batch_size, bool(sampler.shuffle), int(sampler.seed), batch_sampler.drop_last)
    return LoaderSpec(
        batch_sampler.batch_size, isinstance(sampler, RandomSampler), default_seed, batch_sampler.drop_last
    )


def epoch_order(num_samples: int, epoch: int, seed: int, shuffle: bool) -> list[int]:
    """The permutation ``DistributedSampler`` uses for this epoch (identity without shuffle)."""
    if not shuffle:
        return list(range(num_samples))
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(num_samples, generator=g).tolist()


class ShareBatchSampler:
    """Yields this rank's index lists for one epoch of a share plan (see the module docstring)."""

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        shares: Sequence[int],
        rank: int,
        epoch: int,
        seed: int,
        shuffle: bool,
        drop_last: bool = False,
    ) -> None:
        if not 0 <= rank < len(shares):
            raise ValueError(f"rank must be in [0, {len(shares)}), got {rank}")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.shares = list(shares)
        self.rank = rank
        self.epoch = epoch
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        # the plan is built here, on every rank, so bad shares fail now rather than mid-epoch; the per-step
        # sizes and weights are plain lists so the callback's per-batch hooks only index them
        self._plan: EpochPlan = self._build_plan()
        self._plan_epoch = epoch
        self.steps = self._plan.steps
        self.local_sizes: list[int] = [len(b) for b in self._plan.batches[rank]]
        self.step_sizes: list[int] = list(self._plan.step_sizes)  # the global batch of each step
        self.weights: list[float] = [n / size for n, size in zip(self.local_sizes, self._plan.step_sizes, strict=True)]

    def _build_plan(self) -> EpochPlan:
        order = epoch_order(self.num_samples, self.epoch, self.seed, self.shuffle)
        return plan_epoch(order, self.batch_size, self.shares, self.drop_last)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def plan(self) -> EpochPlan:
        """This epoch's plan (built once per epoch: step sizes and weights do not depend on the epoch)."""
        if self._plan_epoch != self.epoch:
            self._plan = self._build_plan()
            self._plan_epoch = self.epoch
        return self._plan

    def local_size(self, step: int) -> int:
        """This rank's number of samples at ``step``."""
        return self.local_sizes[step]

    def weight(self, step: int) -> float:
        """This rank's share of the step's global batch (b_i / B for that step)."""
        return self.weights[step]

    def __iter__(self) -> Iterator[list[int]]:
        yield from self.plan().for_worker(self.rank)

    def __len__(self) -> int:
        return self.steps


def loader_settings(loader: DataLoader) -> dict[str, Any]:
    """The keyword arguments that rebuild ``loader`` around another batch sampler: how it loads, collates and
    pins, not what it draws (the balancer's share loader and the PS's dispatch loader both rebuild one)."""
    kwargs: dict[str, Any] = {
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator,
        "persistent_workers": loader.persistent_workers,
        "pin_memory_device": loader.pin_memory_device,
    }
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    return kwargs


def rebuild_loader(loader: DataLoader, batch_sampler: ShareBatchSampler) -> DataLoader:
    """A new ``DataLoader`` like ``loader`` but drawing batches from ``batch_sampler``."""
    kwargs = loader_settings(loader)
    kwargs["batch_sampler"] = batch_sampler
    if hasattr(loader, "in_order"):
        kwargs["in_order"] = loader.in_order
    return DataLoader(loader.dataset, **kwargs)


def share_loader(
    loader: object, core: BalancerCore, world: int, rank: int, epoch: int, seed: int | None
) -> tuple[object, ShareBatchSampler | str]:
    """``loader`` rebuilt with the core's B and shares (B taken from it the first time) and its sampler, or
    ``loader`` as it is and why it cannot be rebuilt (:func:`why_unsupported`)."""
    reason = why_unsupported(loader, world)
    if reason is not None:
        return loader, reason
    assert isinstance(loader, DataLoader)
    spec = loader_spec(loader, seed if seed is not None else int(os.environ.get("PL_GLOBAL_SEED", 0)))
    core.start(spec.batch_size * world, world)
    assert core.batch_size is not None and core.shares is not None
    sampler = ShareBatchSampler(
        num_samples=len(loader.dataset),  # type: ignore[arg-type]
        batch_size=core.batch_size,
        shares=core.shares,
        rank=rank,
        epoch=epoch,
        seed=seed if seed is not None else spec.seed,
        shuffle=spec.shuffle,
        drop_last=spec.drop_last,
    )
    return rebuild_loader(loader, sampler), sampler
