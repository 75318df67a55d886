"""The training loader of ``async``/``ssp`` runs: batches handed out by the PS to whichever worker asks.

Lightning has already injected its ``DistributedSampler`` (one fixed slice of the data per rank)
when ``strategy.process_dataloader`` runs; that slice would make a fast worker wait for a slow one
at epoch end. :class:`DispatchBatchSampler` instead orders the whole data set once per epoch (the
same permutation on every rank: seed + epoch, like ``DistributedSampler``) and cuts it into global
batches. Worker r first takes batch r (every worker gets at least one, so every worker reaches the
end-of-epoch validation), then asks the PS for the next index of the shared queue (batches
``world_size..n-1``) until it is empty. Every sample is seen exactly once per epoch, and a worker twice as
fast trains about twice as many batches.

Workers that are lost (async/ssp with servers outside the workers). Every request tells the queue how many
of its batches this worker has trained and pushed (:class:`DispatchEpochEnd` counts them at each optimizer
step), and after its last batch the worker says that its epoch is over. A lost worker's unfinished batches,
its reserved one included, are handed to the next worker that asks; a worker that finds the queue empty
while another still trains waits for it (the wait it would otherwise have at the epoch-end
synchronisation), so every sample is still trained at least once per epoch. The exception: a worker lost
in its very last batches after every other worker was told the epoch is over; the servers report those
batches (``ivyplug serve`` logs them).

Lightning may build this loader before the strategy has started its PS client: a ``configure_optimizers``
that reads ``trainer.estimated_stepping_batches`` loads the training data inside ``strategy.setup``. So the
loader reaches the client through :class:`ClientDispatcher`, which looks it up when an epoch starts, and
its iterator starts only at the first batch (a ``DataLoader`` with worker processes draws indices as soon
as it is iterated).

Length. How many batches a worker takes is decided while the epoch runs, so the sampler's length is an upper
bound: n for n batches (a worker takes every batch if every other worker is lost). Lightning uses it as the
epoch's batch limit, which therefore never cuts a worker short, and ``estimated_stepping_batches`` is
``ceil(n / accumulate_grad_batches) * max_epochs``. Each worker steps its own LR scheduler once per
optimizer step of its own, so a step-count schedule sized from that estimate
(``OneCycleLR(total_steps=...)``) never runs past its end, but a worker gets through only its share of it:
with W equally fast workers each reaches about 1/W of the schedule by the end of the fit, a fast worker
further than a slow one (and every push carries the pushing worker's learning rate). Schedules stepped per
epoch (``interval="epoch"``) advance identically on every worker. ``limit_train_batches`` caps each worker's
batches (a fraction is of the upper bound), and the progress bar's total is the bound (or that cap) while it
counts this worker's batches.

Step limit. Workers take different numbers of steps, so ``Trainer(max_steps=N)`` ends the fit for every worker
when the first one has taken N optimizer steps: the queue then hands out no more batches, each worker ends
that epoch after the batch it is training, validates there (a DDP fit stopped mid-epoch by ``max_steps`` does
not) and stops at its end. No worker takes more than N steps, so a schedule sized by ``max_steps`` never runs
past its end.

A worker's epoch usually ends before that length, where Lightning, given a length, would neither validate
nor step epoch-interval schedulers (it validates at batch number ``len`` and otherwise ends the epoch at
``StopIteration``). The sampler therefore asks the queue one batch ahead (as Lightning's own prefetch did
for a loader without length) and :class:`DispatchEpochEnd` marks the batch after which the queue is empty
as the epoch's last, so validation and epoch-end schedulers run there, once per epoch on every worker (Lightning
steps epoch-interval schedulers only at a batch it knows to be the last before it runs; one learnt to be the last
after it was trained gets them stepped by :class:`DispatchEpochEnd`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from ivyplug.integrations.lightning.lightning_internals import insert_first, sampler_inside
from ivyplug.integrations.lightning.share_sampler import loader_settings
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import CombinedLoader, rank_zero_warn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)


class BatchDispatcher(Protocol):
    """What the sampler needs from the PS client."""

    def start_epoch(self, epoch: int, num_batches: int, reserved: int = 0) -> None: ...

    def next_batch(self, finished: int = 0) -> int | None: ...

    def end_epoch(self) -> None: ...

    def stop_epoch(self) -> None: ...


class ClientDispatcher:
    """The PS client's queue, looked up when an epoch starts: the loader may be built before the client exists."""

    def __init__(self, client: Callable[[], BatchDispatcher | None]) -> None:
        self._client = client
        self._bound: BatchDispatcher | None = None

    def start_epoch(self, epoch: int, num_batches: int, reserved: int = 0) -> None:
        client = self._client()
        if client is None:
            raise RuntimeError(
                "the async/ssp training loader was iterated without a PS client: IvyPSStrategy starts the client in "
                "its setup() during trainer.fit, and the loader hands out batches only inside that fit"
            )
        self._bound = client
        client.start_epoch(epoch, num_batches, reserved=reserved)

    def next_batch(self, finished: int = 0) -> int | None:
        return self._client_of("next_batch").next_batch(finished)

    def end_epoch(self) -> None:
        self._client_of("end_epoch").end_epoch()

    def stop_epoch(self) -> None:
        self._client_of("stop_epoch").stop_epoch()

    def _client_of(self, call: str) -> BatchDispatcher:
        if self._bound is None:
            raise RuntimeError(f"{call}() before start_epoch(): the dispatch loader starts every epoch itself")
        return self._bound


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


class _NotAsked:
    """The next batch was not asked for yet (distinct from None: there is none)."""


_NOT_ASKED = _NotAsked()


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
        fetches_in_step: bool = False,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        if dataset_size <= 0:
            raise ValueError(f"dataset_size must be > 0, got {dataset_size}")
        if batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, got {batch_size}")
        self.dispatcher = dispatcher
        #: the loader draws each index batch when Lightning asks for that batch (no worker processes ahead)
        self.fetches_in_step = fetches_in_step
        self.dataset_size = dataset_size
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.rank = rank
        self.world_size = world_size
        self.sampler = EpochOrder(dataset_size, shuffle, seed)
        self.served: list[int] = []  # global batch indices this worker got in the current epoch
        self.last_position: int | None = None  # position in ``served`` after which the queue was empty
        self.finished = 0  # how many of ``served`` are trained and pushed (set by DispatchEpochEnd)
        self._ended = True  # whether the queue was told that this worker's epoch is over
        #: ask for the next batch after training one (DispatchEpochEnd does), not before yielding it; set per
        #: epoch by DispatchEpochEnd where the loader has no worker processes and gradients are not accumulated
        self.ask_after_training = False
        #: the most batches this worker trains this epoch (Lightning's ``limit_train_batches``/``overfit_batches``;
        #: set per epoch by DispatchEpochEnd): it asks for no batch past them, which it would never train
        self.cap: int | None = None
        self._answer: int | _NotAsked | None = _NOT_ASKED

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

    def _checked_num_batches(self) -> int:
        total = self.num_batches
        if total < self.world_size:
            raise ValueError(
                f"an async/ssp PS epoch needs at least one batch per worker: {total} batches for "
                f"{self.world_size} workers (use a smaller batch_size or mode='sync')"
            )
        return total

    def __len__(self) -> int:
        """The most batches this worker can take in an epoch: all n (when every other worker is lost).

        An upper bound, so Lightning's per-epoch batch limit never stops a worker early and a step-count
        schedule sized by ``estimated_stepping_batches`` never runs past its end.
        """
        return self._checked_num_batches()

    def batch_done(self, position: int) -> None:
        """This epoch's batch number ``position`` (0-based) and every earlier one are trained and pushed."""
        self.finished = max(self.finished, position + 1)

    def end_epoch(self) -> None:
        """This worker trained its last batch of the epoch: tell the queue (once)."""
        if not self._ended:
            self._ended = True
            self.finished = len(self.served)
            self.dispatcher.end_epoch()

    def stop(self) -> None:
        """This worker reached the fit's step limit: the queue hands out no more batches this epoch, to anyone."""
        if not self._ended:
            self.dispatcher.stop_epoch()

    def is_last(self, position: int) -> bool:
        """Whether this epoch's batch number ``position`` (0-based) is the last this worker gets."""
        return self.last_position is not None and position == self.last_position

    def ask_after(self, position: int) -> bool:
        """Ask for the batch after this epoch's batch ``position``, just trained; whether there is none.

        Asked after training, a request holds no unfinished batch of this worker, so it may wait for the
        others' (the queue answers it when a lost worker's batches come back, or when none can any more):
        every sample is then trained at least once per epoch, whichever worker is lost and when.
        """
        if not self.ask_after_training or position != len(self.served) - 1 or self._answer is not _NOT_ASKED:
            return self.is_last(position)
        answer = self.dispatcher.next_batch(self.finished)
        self._answer = answer
        if answer is None:
            self.last_position = position
        return answer is None

    def __iter__(self) -> Iterator[list[int]]:
        """Batch ``rank`` first (so no worker ends an epoch empty-handed), then whatever the queue hands out.

        A worker without a single batch would skip Lightning's end-of-epoch validation and leave the others
        waiting at its collectives; reserving one batch per worker rules that out. The next index is asked for
        after the batch is trained (:meth:`ask_after`), or, where a loader's worker processes fetch ahead or
        gradients are accumulated, before it is yielded, so that the last batch is known when Lightning
        receives it.
        """
        order = self.sampler.order()
        total = self._checked_num_batches()
        self.served = []
        self.last_position = None
        self.finished = 0
        self.dispatcher.start_epoch(self.epoch, total, reserved=self.world_size)
        self._ended = False
        self._answer = _NOT_ASKED
        index: int | None = self.rank
        while index is not None:
            if not 0 <= index < total:
                raise RuntimeError(f"the PS dispatched batch {index} but this epoch has {total} batches")
            self.served.append(index)
            after = self.ask_after_training
            if not after:
                capped = self.cap is not None and len(self.served) >= self.cap
                following = None if capped else self.dispatcher.next_batch(self.finished)
                if following is None:
                    self.last_position = len(self.served) - 1
            yield order[index * self.batch_size : (index + 1) * self.batch_size]
            if after:
                answer, self._answer = self._answer, _NOT_ASKED
                following = self.dispatcher.next_batch(self.finished) if isinstance(answer, _NotAsked) else answer
            index = following


class DispatchLoader(DataLoader):
    """A ``DataLoader`` whose iterator starts at the first batch, not at ``iter()``.

    With worker processes, ``DataLoader`` draws ``prefetch_factor * num_workers`` index batches as soon as it
    is iterated, and Lightning iterates the training loader while setting it up, possibly before the PS client
    exists. Deferring also makes every worker start the epoch's queue (a collective) at its first batch.
    """

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        return _DeferredIterator(self)


class _DeferredIterator:
    def __init__(self, loader: DispatchLoader) -> None:
        self._loader = loader
        self._iterator: Iterator[Any] | None = None

    def __iter__(self) -> _DeferredIterator:
        return self

    def __next__(self) -> Any:
        if self._iterator is None:
            self._iterator = DataLoader.__iter__(self._loader)
        return next(self._iterator)


def _dispatch_samplers(trainer: Any) -> tuple[list[DispatchBatchSampler], int]:
    """The dispatch samplers among the training loaders, and how many training loaders there are."""
    loaders = trainer.train_dataloader
    if loaders is None:
        return [], 0
    flat = [loaders] if isinstance(loaders, DataLoader) else CombinedLoader(loaders).flattened
    samplers = [
        dl.batch_sampler
        for dl in flat
        if isinstance(dl, DataLoader) and isinstance(dl.batch_sampler, DispatchBatchSampler)
    ]
    return samplers, len(flat)


class DispatchEpochEnd(Callback):
    """Ends each worker's epoch at its last dispatched batch; warns if an async/ssp fit trains without dispatch.

    Installed by ``IvyPSStrategy`` in async/ssp mode. Given a loader with a length, Lightning validates at
    batch number ``len`` and treats that batch as the epoch's last (epoch-interval LR schedulers step there);
    a dispatch loader's length is only an upper bound, so this callback marks the real last batch instead and
    lets validation run at it (``val_check_batch`` set to infinity, as Lightning does for a loader without
    length).
    """

    def __init__(self) -> None:
        self._sampler: DispatchBatchSampler | None = None
        self._warned = False
        self._begun: int | None = None  # the epoch whose start this callback saw
        #: Lightning's batch_idx of this epoch's first batch here: 0, or the batches a mid-epoch checkpoint had
        #: trained (the sampler's positions count from this run's first batch)
        self._offset = 0

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._warned = False  # once per fit
        self._begun = None

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self._begin(trainer, 0)

    def _begin(self, trainer: Any, offset: int) -> None:
        """Find this epoch's dispatch sampler; at the epoch's start, or at the first batch of an epoch resumed
        mid-way from a checkpoint (Lightning then skips ``on_train_epoch_start``)."""
        self._begun, self._offset = trainer.current_epoch, offset
        samplers, count = _dispatch_samplers(trainer)
        if samplers and count > 1:
            raise ValueError(
                f"IvyPSStrategy(mode='async'/'ssp') dispatches the batches of one training DataLoader, got {count}; "
                "combine them into one dataset or use mode='sync'"
            )
        self._sampler = samplers[0] if samplers else None
        if self._sampler is not None:
            trainer.val_check_batch = float("inf")  # validate after this worker's last batch, whenever it comes
            # asked after training, the epoch's last batch is known only once trained: with accumulated gradients
            # it must be known before (Lightning steps the partial accumulation at the last batch)
            self._sampler.ask_after_training = self._sampler.fetches_in_step and trainer.accumulate_grad_batches == 1
            limit = trainer.num_training_batches
            self._sampler.cap = int(limit) if math.isfinite(limit) and limit < len(self._sampler) else None
        elif count and not self._warned:
            self._warned = True
            rank_zero_warn(
                "IvyPSStrategy(mode='async'/'ssp') is training without batch dispatch: the training loader was not "
                "prepared in Lightning's training stage, so every worker trains a fixed slice and a fast worker "
                "waits for a slow one at epoch end (was trainer.estimated_stepping_batches first read outside "
                "configure_optimizers or the training hooks?)"
            )

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._begun != trainer.current_epoch:  # resumed mid-epoch: no epoch start was seen
            self._begin(trainer, batch_idx)
        if self._sampler is not None and self._sampler.is_last(batch_idx - self._offset):
            trainer.fit_loop.epoch_loop.batch_progress.is_last_batch = True

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Count the batches whose gradients were pushed; ask for the next batch; after the last, end the epoch."""
        sampler = self._sampler
        if sampler is None:
            return
        position = batch_idx - self._offset
        capped = batch_idx + 1 >= trainer.num_training_batches
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0 or capped or sampler.is_last(position):
            sampler.batch_done(position)
        last = capped or sampler.is_last(position)
        if not last and _step_limit_reached(trainer):
            # no worker takes another batch: every one ends this epoch after the batches it holds, validates as at
            # any epoch end (so all of them meet the same collectives) and learns at on_train_epoch_end to stop;
            # its epoch-interval schedulers step here, as the other workers' do where the queue runs dry
            sampler.stop()
            _end_epoch_at_this_batch(trainer)
            last = True
        if not last and not trainer.should_stop and sampler.ask_after(position):
            _end_epoch_at_this_batch(trainer)
            last = True
        if last or trainer.should_stop:
            sampler.end_epoch()

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        """End this worker's epoch at the queue; the first worker to reach ``max_steps`` ends every worker's fit."""
        if self._sampler is not None:  # an epoch ended otherwise (max_steps): no worker waits for this one
            self._sampler.end_epoch()
        if trainer.max_steps != -1:  # every worker is at this epoch's end: agree on whether the fit ends here
            reached = _step_limit_reached(trainer)
            if trainer.strategy.reduce_boolean_decision(reached, all=False) and not reached:
                trainer.should_stop = True


def _end_epoch_at_this_batch(trainer: Any) -> None:
    """The batch just trained is this worker's last of the epoch, learnt only after it was trained.

    Lightning steps epoch-interval LR schedulers (all but ``ReduceLROnPlateau``) inside the training batch,
    after the optimizer step and before ``on_train_batch_end``, and only when it already knows the batch is the
    epoch's last; its epoch-end call steps only plateau schedulers. So they are stepped here, as Lightning would
    have, before validation and the epoch's end: the next epoch's pushes then carry the scheduled values.
    """
    epoch_loop = trainer.fit_loop.epoch_loop
    epoch_loop.batch_progress.is_last_batch = True  # Lightning validates, ends the epoch
    epoch_loop.update_lr_schedulers("epoch", update_plateau_schedulers=False)


def _step_limit_reached(trainer: Any) -> bool:
    """Whether this worker's optimizer steps reached ``Trainer(max_steps=...)``."""
    return bool(trainer.max_steps != -1 and trainer.global_step >= trainer.max_steps)


def _shuffle_and_seed(sampler: Any) -> tuple[bool, int]:
    """Whether ``sampler`` shuffles, and the seed: only for samplers whose order the dispatch reproduces (each
    index once per epoch, shuffled or in order); a subclass, a sampler with replacement or another number of
    samples would be trained in another order or amount, so it is refused."""
    if type(sampler) is DistributedSampler:
        return bool(sampler.shuffle), int(sampler.seed)
    whole = type(sampler) is RandomSampler and sampler.num_samples == len(sampler.data_source)  # type: ignore[arg-type]
    if whole and not sampler.replacement:
        return True, int(os.environ.get("PL_GLOBAL_SEED", 0))  # use_distributed_sampler=False: seed as Lightning
    if type(sampler) is SequentialSampler:
        return False, 0
    inner = sampler_inside(sampler)  # in Lightning's DistributedSamplerWrapper
    name = type(sampler).__name__ + (f" around a {type(inner).__name__}" if inner is not None else "")
    if type(sampler) is RandomSampler:
        name += " drawing with replacement" if sampler.replacement else f" of num_samples={sampler.num_samples}"
    raise ValueError(
        f"IvyPSStrategy(mode='async'/'ssp') hands out batches itself and needs a plain sampler, got {name}; "
        "use shuffle=True/False (and the default use_distributed_sampler=True) or mode='sync'"
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
    sampler = dataloader.sampler
    if batch_size is None:  # a batch_sampler given: only torch's own, whose batches are its sampler's in order
        inner = dataloader.batch_sampler
        if type(inner) is not BatchSampler:
            raise ValueError(
                "IvyPSStrategy(mode='async'/'ssp') hands out batches itself and needs a training DataLoader with a "
                f"batch_size (or torch's BatchSampler), got a custom batch_sampler {type(inner).__name__}, whose "
                "batches it cannot reproduce; use mode='sync'"
            )
        batch_size, drop_last, sampler = inner.batch_size, inner.drop_last, inner.sampler
    shuffle, seed = _shuffle_and_seed(sampler)
    batch_sampler = DispatchBatchSampler(
        dispatcher,
        len(dataloader.dataset),  # type: ignore[arg-type]
        batch_size,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
        rank=rank,
        world_size=world_size,
        fetches_in_step=dataloader.num_workers == 0,
    )
    settings = loader_settings(dataloader)
    return DispatchLoader(dataloader.dataset, batch_sampler=batch_sampler, **settings)  # type: ignore[arg-type]


def process_async_loader(
    trainer: Any,
    dataloader: object,
    client: Callable[[], BatchDispatcher | None],
    rank: int,
    world_size: int,
) -> object:
    """async/ssp: the training loader becomes a dispatch loader bound to ``client()`` lazily; others pass through.

    A training loader that can never be dispatched is refused (``ValueError``) rather than trained without
    dispatch; :class:`DispatchEpochEnd` is installed once per Trainer (it also warns if a fit trains on a
    loader that did not come through here in the training stage).
    """
    if not any(isinstance(c, DispatchEpochEnd) for c in trainer.callbacks):
        insert_first(trainer, DispatchEpochEnd())  # first, so other callbacks see the last batch marked
    if not trainer.training:
        return dataloader  # validation, test and predict loaders stay as Lightning prepared them
    if not isinstance(dataloader, DataLoader):
        raise ValueError(
            "IvyPSStrategy(mode='async'/'ssp') hands out the batches of a torch DataLoader, got a training loader of "
            f"type {type(dataloader).__name__}: return a DataLoader from train_dataloader() or use mode='sync'"
        )
    return make_dispatch_loader(dataloader, ClientDispatcher(client), rank=rank, world_size=world_size)
