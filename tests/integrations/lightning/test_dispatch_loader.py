"""The async/ssp training loader: a shared batch queue, every sample once per epoch, an upper bound as length."""

from __future__ import annotations

import itertools
import random
import warnings
from types import SimpleNamespace

import pytest
import torch
from ivyplug.integrations.lightning.dispatch_loader import (
    DispatchBatchSampler,
    DispatchEpochEnd,
    make_dispatch_loader,
    process_async_loader,
)
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset, WeightedRandomSampler

from .helpers import reaped_children


class SharedQueue:
    """Stands in for the PS batch queue: one counter per epoch shared by every worker's sampler."""

    def __init__(self) -> None:
        self.epoch: int | None = None
        self.next = 0
        self.total = 0
        self.ended = 0

    def start_epoch(self, epoch: int, num_batches: int, reserved: int = 0) -> None:
        if self.epoch != epoch:  # the first 'reserved' indices are the workers' own
            self.epoch, self.next, self.total = epoch, reserved, num_batches

    def next_batch(self, finished: int = 0) -> int | None:
        if self.next >= self.total:
            return None
        self.next += 1
        return self.next - 1

    def end_epoch(self) -> None:
        self.ended += 1

    def stop_epoch(self) -> None:
        self.next = self.total


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


def test_make_dispatch_loader_keeps_dataset_and_collate() -> None:
    ds = TensorDataset(torch.arange(20).float(), torch.arange(20))
    original = DataLoader(ds, batch_size=6, sampler=DistributedSampler(ds, num_replicas=2, rank=0, shuffle=False))
    loader = make_dispatch_loader(original, SharedQueue())  # one worker: batch 0, then the queue
    assert loader.dataset is ds and loader.collate_fn is original.collate_fn
    assert len(loader) == 4  # one worker can take every batch
    batches = list(loader)
    assert [len(b[1]) for b in batches] == [6, 6, 6, 2]
    assert torch.equal(torch.cat([b[1] for b in batches]), torch.arange(20))  # shuffle=False kept


def _drain(workers: list[DispatchBatchSampler], pick: random.Random) -> dict[int, int]:
    """Run one epoch with the workers asking in a random interleaving; check each one's last batch is flagged."""
    iters = {r: iter(w) for r, w in enumerate(workers)}
    taken = dict.fromkeys(iters, 0)
    while iters:
        r = pick.choice(sorted(iters))
        if next(iters[r], None) is None:
            del iters[r]
            assert workers[r].is_last(taken[r] - 1) and not workers[r].is_last(taken[r] - 2)
        else:
            taken[r] += 1
    return taken


@pytest.mark.parametrize(
    ("n", "batch", "world", "drop_last"), [(103, 8, 2, False), (103, 8, 2, True), (40, 4, 3, False)]
)
def test_length_is_the_most_batches_one_worker_can_take(n: int, batch: int, world: int, drop_last: bool) -> None:
    """n: every batch, taken by one worker when every other is lost; never exceeded."""
    num_batches = n // batch if drop_last else -(-n // batch)
    pick = random.Random(0)
    for epoch in range(20):
        queue = SharedQueue()
        workers = [
            DispatchBatchSampler(queue, n, batch, shuffle=True, drop_last=drop_last, rank=r, world_size=world)
            for r in range(world)
        ]
        assert all(len(w) == num_batches for w in workers)
        for w in workers:
            w.set_epoch(epoch)
        taken = _drain(workers, pick)
        assert sum(taken.values()) == num_batches
        assert all(1 <= t <= len(workers[r]) for r, t in taken.items())
    queue = SharedQueue()  # the others take only their reserved batch: one worker takes the rest
    workers = [DispatchBatchSampler(queue, n, batch, shuffle=False, rank=r, world_size=world) for r in range(world)]
    assert len(list(workers[0])) == len(workers[0]) - world + 1
    assert all(len(list(w)) == 1 for w in workers[1:])
    assert DispatchBatchSampler(SharedQueue(), 4, 4, shuffle=False).__len__() == 1
    with pytest.raises(ValueError, match="at least one batch per worker"):
        len(DispatchBatchSampler(SharedQueue(), 4, 4, shuffle=False, rank=0, world_size=2))


def test_loader_binds_to_the_client_when_the_epoch_starts_not_when_built() -> None:
    """Lightning builds (and iterates) the loader in strategy.setup, before the PS client exists."""
    ds = TensorDataset(torch.arange(12))
    holder: dict[str, SharedQueue | None] = {"client": None}
    trainer = SimpleNamespace(callbacks=[], training=True)
    plain = DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, num_replicas=1, rank=0, shuffle=False))
    loader = process_async_loader(trainer, plain, lambda: holder["client"], rank=0, world_size=1)
    assert isinstance(loader, DataLoader) and len(loader) == 3
    assert [type(c) for c in trainer.callbacks] == [DispatchEpochEnd]
    process_async_loader(trainer, plain, lambda: holder["client"], rank=0, world_size=1)
    assert len(trainer.callbacks) == 1  # installed once per Trainer
    it = iter(loader)  # what Lightning does while setting up: nothing is asked of the PS yet
    with pytest.raises(RuntimeError, match="without a PS client"):
        next(it)
    holder["client"] = SharedQueue()
    assert [b[0].tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


def test_worker_processes_draw_no_index_before_the_first_batch() -> None:
    queue = SharedQueue()
    ds = TensorDataset(torch.arange(12))
    plain = DataLoader(ds, batch_size=4, num_workers=1, sampler=DistributedSampler(ds, num_replicas=1, rank=0))
    loader = make_dispatch_loader(plain, queue)
    it = iter(loader)
    assert queue.epoch is None  # a plain DataLoader iterator would have drawn indices (and started the epoch) here
    assert sorted(i for b in it for i in b[0].tolist()) == list(range(12))
    assert queue.epoch == 0


def test_refuses_a_training_loader_it_cannot_dispatch_and_passes_evaluation_loaders() -> None:
    trainer = SimpleNamespace(callbacks=[], training=True)
    with pytest.raises(ValueError, match="torch DataLoader, got a training loader of type list"):
        process_async_loader(trainer, [torch.zeros(2)], lambda: None, rank=0, world_size=1)
    evaluation = DataLoader(TensorDataset(torch.zeros(4)), batch_size=2)
    trainer.training = False
    assert process_async_loader(trainer, evaluation, lambda: None, rank=0, world_size=1) is evaluation


def _fit_stub(train_dataloader: object, accumulate: int = 1) -> SimpleNamespace:
    progress = SimpleNamespace(is_last_batch=False)
    stepped: list[tuple[str, bool]] = []  # the LR scheduler updates asked of the epoch loop

    def update_lr_schedulers(interval: str, update_plateau_schedulers: bool) -> None:
        stepped.append((interval, update_plateau_schedulers))

    epoch_loop = SimpleNamespace(batch_progress=progress, update_lr_schedulers=update_lr_schedulers, stepped=stepped)
    return SimpleNamespace(
        train_dataloader=train_dataloader,
        val_check_batch=19,
        fit_loop=SimpleNamespace(epoch_loop=epoch_loop),
        accumulate_grad_batches=accumulate,
        num_training_batches=len(train_dataloader),  # type: ignore[arg-type]
        should_stop=False,
        max_steps=-1,
        global_step=0,
        current_epoch=0,
    )


@pytest.mark.parametrize(("accumulate", "num_workers"), [(1, 0), (2, 0), (1, 1)])
def test_epoch_end_marks_the_last_dispatched_batch_and_validation_runs_there(accumulate: int, num_workers: int) -> None:
    """Asked after training where it can (no loader processes, no accumulation), else ahead of the batch."""
    ds = TensorDataset(torch.arange(12))
    queue = SharedQueue()
    loader = make_dispatch_loader(DataLoader(ds, batch_size=4, num_workers=num_workers), queue, rank=0, world_size=2)
    trainer = _fit_stub(loader, accumulate)
    callback = DispatchEpochEnd()
    callback.on_train_start(trainer, None)
    callback.on_train_epoch_start(trainer, None)
    assert trainer.val_check_batch == float("inf")  # validate at this worker's last batch, not at batch len()
    sampler = loader.batch_sampler
    assert isinstance(sampler, DispatchBatchSampler)
    assert sampler.ask_after_training == (accumulate == 1 and num_workers == 0)
    progress = trainer.fit_loop.epoch_loop.batch_progress
    marks = []
    with reaped_children():  # a loader process left by a failing loop would outlive the test
        batches = iter(loader)  # starts the loader process, if any
        for batch_idx in range(len(loader)):  # Lightning's loop: it ends at the batch marked last
            batch = next(batches)
            progress.is_last_batch = batch_idx + 1 >= len(loader)  # what Lightning's fetcher knows from the length
            callback.on_train_batch_start(trainer, None, batch, batch_idx)
            callback.on_train_batch_end(trainer, None, None, batch, batch_idx)
            marks.append(progress.is_last_batch)
            if progress.is_last_batch:
                break
    assert marks == [False, True]  # batch 0 (reserved), batch 2; batch 1 is the other worker's
    assert sampler.served == [0, 2] and sampler.finished == 2 and queue.ended == 1
    # epoch-interval LR schedulers: Lightning steps them at a batch it knows to be the last before it runs (asked
    # ahead); a last batch learnt only after it was trained gets them stepped by the callback, once
    asked_after = accumulate == 1 and num_workers == 0
    assert trainer.fit_loop.epoch_loop.stepped == ([("epoch", False)] if asked_after else [])


def test_epoch_end_warns_once_without_dispatch_and_refuses_several_training_loaders() -> None:
    callback = DispatchEpochEnd()
    plain = _fit_stub(DataLoader(TensorDataset(torch.zeros(4)), batch_size=2))
    callback.on_train_start(plain, None)
    with pytest.warns(UserWarning, match="training without batch dispatch"):
        callback.on_train_epoch_start(plain, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        callback.on_train_epoch_start(plain, None)  # once per fit
    assert plain.val_check_batch == 19
    ds = TensorDataset(torch.arange(12))
    two = {name: make_dispatch_loader(DataLoader(ds, batch_size=4), SharedQueue()) for name in ("a", "b")}
    with pytest.raises(ValueError, match="one training DataLoader, got 2"):
        callback.on_train_epoch_start(_fit_stub(two), None)


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


def test_samplers_whose_batches_it_cannot_reproduce_are_refused_not_replaced() -> None:
    """A custom BatchSampler (say, buckets by label), a sampler subclass with its own order, or a RandomSampler
    drawing with replacement or another number of samples were replaced by plain sequential batches, without a
    word; they are refused, naming what was given. torch's own samplers keep their order: a BatchSampler over a
    RandomSampler shuffles, over a SequentialSampler does not."""
    from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler

    ds = TensorDataset(torch.arange(16))

    class Buckets(BatchSampler):
        pass

    class Reversed(SequentialSampler):
        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter(range(len(self.data_source) - 1, -1, -1))

    refused = {
        "custom batch_sampler Buckets": DataLoader(ds, batch_sampler=Buckets(RandomSampler(ds), 4, False)),
        "got Reversed": DataLoader(ds, batch_size=4, sampler=Reversed(ds)),
        "RandomSampler drawing with replacement": DataLoader(ds, batch_size=4, sampler=RandomSampler(ds, True)),
        "RandomSampler of num_samples=8": DataLoader(ds, batch_size=4, sampler=RandomSampler(ds, num_samples=8)),
    }
    for name, loader in refused.items():
        with pytest.raises(ValueError, match=f"IvyPSStrategy\\(mode='async'/'ssp'\\) .*{name}"):
            make_dispatch_loader(loader, SharedQueue())
    for inner, shuffles in ((RandomSampler(ds), True), (SequentialSampler(ds), False)):
        made = make_dispatch_loader(DataLoader(ds, batch_sampler=BatchSampler(inner, 4, True)), SharedQueue())
        sampler = made.batch_sampler
        assert isinstance(sampler, DispatchBatchSampler)
        assert (sampler.sampler.shuffle, sampler.batch_size, sampler.drop_last) == (shuffles, 4, True)


def test_a_worker_capped_by_limit_train_batches_asks_for_no_batch_it_will_not_train() -> None:
    """With loader processes the sampler asks for the next batch before yielding one; at Lightning's cap
    (``limit_train_batches``, ``overfit_batches``) it asked for one more, which it never trained: lost for the
    epoch, so which batches a capped fit trained changed from epoch to epoch (overfit_batches=2 trained batches
    0, 1, 2 and then 5, 6 or 7). At the cap it asks for none and ends its epoch there."""
    ds = TensorDataset(torch.arange(32))
    queue = SharedQueue()
    workers = [
        make_dispatch_loader(DataLoader(ds, batch_size=4, num_workers=1), queue, rank=r, world_size=2) for r in (0, 1)
    ]
    callback = DispatchEpochEnd()
    trainers = []
    for loader in workers:
        trainer = _fit_stub(loader)
        trainer.num_training_batches = 2  # Lightning's limit_train_batches=2 (or overfit_batches=2)
        callback.on_train_start(trainer, None)
        trainers.append(trainer)
    trained: list[list[int]] = [[], []]
    with reaped_children():
        for r in (0, 1):  # each worker in turn, as far as its cap (the other has not asked yet: the worst case)
            callback.on_train_epoch_start(trainers[r], None)
            sampler = workers[r].batch_sampler
            assert isinstance(sampler, DispatchBatchSampler) and sampler.cap == 2
            for batch_idx, (batch,) in enumerate(workers[r]):
                trained[r] += batch.tolist()
                callback.on_train_batch_start(trainers[r], None, batch, batch_idx)
                callback.on_train_batch_end(trainers[r], None, None, batch, batch_idx)
                if batch_idx + 1 >= trainers[r].num_training_batches:
                    break
            assert sampler.served == ([0, 2] if r == 0 else [1, 3]), sampler.served
    assert sorted(trained[0] + trained[1]) == list(range(16))  # the first four batches, each once
    assert queue.next == 4  # no batch was handed out that nobody trained


def test_the_worker_that_reaches_max_steps_steps_its_epoch_schedulers_as_the_others_do() -> None:
    """At ``max_steps`` the first worker there stops the queue and ends its epoch after its batch; the others end
    theirs where the queue runs dry, stepping their epoch-interval schedulers (Lightning learnt only then that the
    batch was the last). The first one did not step them: the ranks ended with different learning rates."""
    ds = TensorDataset(torch.arange(32))
    loader = make_dispatch_loader(DataLoader(ds, batch_size=4), SharedQueue(), rank=0, world_size=2)
    trainer = _fit_stub(loader)
    trainer.max_steps, trainer.global_step = 1, 1
    callback = DispatchEpochEnd()
    callback.on_train_start(trainer, None)
    callback.on_train_epoch_start(trainer, None)
    batch = next(iter(loader))
    callback.on_train_batch_start(trainer, None, batch, 0)
    callback.on_train_batch_end(trainer, None, None, batch, 0)
    assert trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
    assert trainer.fit_loop.epoch_loop.stepped == [("epoch", False)]
