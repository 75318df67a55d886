"""The async/ssp training loader: a shared batch queue, every sample once per epoch, no length."""

from __future__ import annotations

import itertools

import pytest
import torch
from ivyplug.integrations.lightning.dispatch_loader import DispatchBatchSampler, make_dispatch_loader
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset, WeightedRandomSampler


class SharedQueue:
    """Stands in for the PS batch queue: one counter per epoch shared by every worker's sampler."""

    def __init__(self) -> None:
        self.epoch: int | None = None
        self.next = 0
        self.total = 0

    def start_epoch(self, epoch: int, num_batches: int, reserved: int = 0) -> None:
        if self.epoch != epoch:
            self.epoch, self.next, self.total = epoch, 0, num_batches

    def next_batch(self) -> int | None:
        if self.next >= self.total:
            return None
        self.next += 1
        return self.next - 1


@pytest.mark.parametrize("drop_last", [False, True])
def test_interleaved_workers_see_every_sample_once_per_epoch(drop_last: bool) -> None:
    queue = SharedQueue()
    n, batch = 103, 8
    workers = [
        DispatchBatchSampler(queue, n, batch, shuffle=True, seed=5, drop_last=drop_last, rank=r, world_size=2)
        for r in range(2)
    ]
    orders = []
    for epoch in range(3):
        for w in workers:
            w.set_epoch(epoch)
        iters = [iter(w) for w in workers]
        got: dict[int, list[list[int]]] = {0: [], 1: []}
        # worker 0 takes three batches for each of worker 1's (a 3x faster worker)
        for r in itertools.cycle([0, 0, 0, 1]):
            if all(it is None for it in iters):
                break
            it = iters[r]
            if it is None:
                continue
            b = next(it, None)
            if b is None:
                iters[r] = None
            else:
                got[r].append(b)
        seen = sorted(i for r in got for b in got[r] for i in b)
        expected = list(range(n)) if not drop_last else sorted(workers[0].sampler.order()[: (n // batch) * batch])
        assert seen == expected
        assert len(got[0]) > 2 * len(got[1])
        assert workers[0].served[0] == 0 and workers[1].served[0] == 1  # each worker's reserved first batch
        orders.append(workers[0].sampler.order())
    assert orders[0] != orders[1]  # set_epoch reshuffles, like DistributedSampler
    g = torch.Generator()
    g.manual_seed(5 + 2)
    assert orders[2] == torch.randperm(n, generator=g).tolist()


def test_make_dispatch_loader_keeps_dataset_and_collate_and_has_no_length() -> None:
    ds = TensorDataset(torch.arange(20).float(), torch.arange(20))
    original = DataLoader(ds, batch_size=6, sampler=DistributedSampler(ds, num_replicas=2, rank=0, shuffle=False))
    loader = make_dispatch_loader(original, SharedQueue())  # one worker: batch 0, then the queue
    assert loader.dataset is ds and loader.collate_fn is original.collate_fn
    with pytest.raises(TypeError):
        len(loader)
    batches = list(loader)
    assert [len(b[1]) for b in batches] == [6, 6, 6, 2]
    assert torch.equal(torch.cat([b[1] for b in batches]), torch.arange(20))  # shuffle=False kept


def test_make_dispatch_loader_refuses_what_it_cannot_dispatch() -> None:
    class Stream(IterableDataset):
        def __iter__(self):  # type: ignore[no-untyped-def]
            yield from range(3)

    with pytest.raises(ValueError, match="map-style"):
        make_dispatch_loader(DataLoader(Stream(), batch_size=2), SharedQueue())
    ds = TensorDataset(torch.zeros(4))
    weighted = DataLoader(ds, batch_size=2, sampler=WeightedRandomSampler([1.0] * 4, 4))
    with pytest.raises(ValueError, match="WeightedRandomSampler"):
        make_dispatch_loader(weighted, SharedQueue())
    with pytest.raises(ValueError, match="batch_size must be > 0"):
        DispatchBatchSampler(SharedQueue(), 4, 0, shuffle=False)
    too_few = DispatchBatchSampler(SharedQueue(), 4, 4, shuffle=False, rank=0, world_size=2)
    with pytest.raises(ValueError, match="at least one batch per worker"):
        next(iter(too_few))
