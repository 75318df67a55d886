"""The training loader of ``async``/``ssp`` runs: batches handed out by the PS to whichever worker asks.

Lightning has already injected its ``DistributedSampler`` (one fixed slice of the data per rank)
when ``strategy.process_dataloader`` runs; that slice would make a fast worker wait for a slow one
at epoch end. :class:`DispatchBatchSampler` instead orders the whole data set once per epoch (the
same permutation on every rank: seed + epoch, like ``DistributedSampler``) and cuts it into global
batches. Worker r first takes batch r (every worker gets at least one, so every worker reaches the
end-of-epoch validation), then asks the PS for the next index of the shared queue (batches
``world_size..n-1``) until it is empty. Every sample is seen exactly once per epoch, and a worker twice as
fast trains about twice as many batches.

The sampler has no length, so the loader has none: Lightning shows a progress bar without a total,
``trainer.estimated_stepping_batches`` is infinite (step-count LR schedules such as ``OneCycleLR``
need an explicit total), and validation runs when the queue is exhausted.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler


class BatchDispatcher(Protocol):
    """What the sampler needs from the PS client."""

    def start_epoch(self, epoch: int, num_batches: int, reserved: int = 0) -> None: ...

    def next_batch(self) -> int | None: ...


class EpochOrder:
    """The epoch's global index order; Lightning finds it as ``batch_sampler.sampler`` and calls ``set_epoch``."""

    def __init__(self, dataset_size: int, shuffle: bool, seed: int) -> None:
        self.dataset_size = dataset_size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self) -> list[int]:
        """This epoch's order of dataset indices (identical on every rank, like ``DistributedSampler``)."""
        if not self.shuffle:
            return list(range(self.dataset_size))
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.dataset_size, generator=generator).tolist()

    def __iter__(self) -> Iterator[int]:
        return iter(self.order())

    def __len__(self) -> int:
        return self.dataset_size


class DispatchBatchSampler:
    """Yields lists of dataset indices for the global batches the PS assigns to this worker."""

    def __init__(
        self,
        dispatcher: BatchDispatcher,
        dataset_size: int,
        batch_size: int,
        *,
        shuffle: bool,
        seed: int = 0,
        drop_last: bool = False,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        if dataset_size <= 0:
            raise ValueError(f"dataset_size must be > 0, got {dataset_size}")
        if batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, got {batch_size}")
        self.dispatcher = dispatcher
        self.dataset_size = dataset_size
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.rank = rank
        self.world_size = world_size
        self.sampler = EpochOrder(dataset_size, shuffle, seed)
        self.served: list[int] = []  # global batch indices this worker got in the current epoch

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    @property
    def num_batches(self) -> int:
        if self.drop_last:
            return self.dataset_size // self.batch_size
        return math.ceil(self.dataset_size / self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        """Batch ``rank`` first (so no worker ends an epoch empty-handed), then whatever the queue hands out.

        A worker without a single batch would skip Lightning's end-of-epoch validation and leave the others
        waiting at its collectives; reserving one batch per worker rules that out.
        """
        order = self.sampler.order()
        total = self.num_batches
        if total < self.world_size:
            raise ValueError(
                f"an async/ssp PS epoch needs at least one batch per worker: {total} batches for "
                f"{self.world_size} workers (use a smaller batch_size or mode='sync')"
            )
        self.served = []
        self.dispatcher.start_epoch(self.epoch, total - self.world_size, reserved=1)
        index: int | None = self.rank
        while index is not None:
            if not 0 <= index < total:
                raise RuntimeError(f"the PS dispatched batch {index} but this epoch has {total} batches")
            self.served.append(index)
            yield order[index * self.batch_size : (index + 1) * self.batch_size]
            queued = self.dispatcher.next_batch()
            index = None if queued is None else self.world_size + queued


def _shuffle_and_seed(sampler: Any) -> tuple[bool, int]:
    if isinstance(sampler, DistributedSampler) and type(sampler) is DistributedSampler:
        return bool(sampler.shuffle), int(sampler.seed)
    if isinstance(sampler, RandomSampler):  # use_distributed_sampler=False: seed as Lightning would
        return True, int(os.environ.get("PL_GLOBAL_SEED", 0))
    if isinstance(sampler, SequentialSampler):
        return False, 0
    raise ValueError(
        f"IvyPSStrategy(mode='async'/'ssp') hands out batches itself and needs a plain sampler, got "
        f"{type(sampler).__name__}; use shuffle=True/False (and the default use_distributed_sampler=True) "
        "or mode='sync'"
    )


def make_dispatch_loader(
    dataloader: DataLoader, dispatcher: BatchDispatcher, rank: int = 0, world_size: int = 1
) -> DataLoader:
    """Rebuild ``dataloader`` (same dataset, collate, workers) around a :class:`DispatchBatchSampler`."""
    if isinstance(dataloader.dataset, IterableDataset):
        raise ValueError(
            "IvyPSStrategy(mode='async'/'ssp') needs a map-style training dataset (it hands out index batches); "
            "got an IterableDataset: use mode='sync'"
        )
    batch_size = dataloader.batch_size
    drop_last = dataloader.drop_last
    if batch_size is None:
        inner = dataloader.batch_sampler
        batch_size = getattr(inner, "batch_size", None)
        drop_last = bool(getattr(inner, "drop_last", False))
        if not isinstance(batch_size, int):
            raise ValueError(
                "IvyPSStrategy(mode='async'/'ssp') needs a training DataLoader with a fixed batch_size, got a custom "
                f"batch_sampler {type(inner).__name__}"
            )
    shuffle, seed = _shuffle_and_seed(dataloader.sampler)
    batch_sampler = DispatchBatchSampler(
        dispatcher,
        len(dataloader.dataset),  # type: ignore[arg-type]
        batch_size,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
        rank=rank,
        world_size=world_size,
    )
    kwargs: dict[str, Any] = {
        "num_workers": dataloader.num_workers,
        "collate_fn": dataloader.collate_fn,
        "pin_memory": dataloader.pin_memory,
        "timeout": dataloader.timeout,
        "worker_init_fn": dataloader.worker_init_fn,
        "multiprocessing_context": dataloader.multiprocessing_context,
        "generator": dataloader.generator,
        "persistent_workers": dataloader.persistent_workers,
        "pin_memory_device": dataloader.pin_memory_device,
    }
    if dataloader.num_workers > 0:
        kwargs["prefetch_factor"] = dataloader.prefetch_factor
    return DataLoader(dataloader.dataset, batch_sampler=batch_sampler, **kwargs)  # type: ignore[arg-type]
