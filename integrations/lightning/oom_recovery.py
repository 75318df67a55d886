"""Recover from an out-of-memory error in a training step by splitting the batch into micro-batches.

Installed on the LightningModule instance (``training_step``, ``optimizer_zero_grad``) and on the strategy
(``backward``). When the forward pass of ``training_step`` runs out of memory, the batch is split into 2, 4,
... micro-batches (up to ``max_parts``): all but the last are run forward and backward here (under the
strategy's ``block_backward_sync``: DDP's ``no_sync``, so one all-reduce still happens per step; on the PS, no
early push), each loss scaled by its fraction of the batch; the last is returned to Lightning, whose backward
completes the accumulation. The result is the gradient of the whole batch (for a loss that is a mean over
samples; ``loss_reduction="sum"`` for sums). Lightning zeroes gradients *after* ``training_step``, so a split
step zeroes them itself first and skips that one call. An OOM in ``backward`` (single-process strategies only:
under DDP some buckets may already be in flight) redoes the step split the same way. Once a batch size needed
splitting, the split is kept for the rest of the epoch.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from ivyplug.load.oom import OutOfMemoryRecoveryError, batch_length, is_oom_error, next_split, split_batch

log = logging.getLogger(__name__)


def _loss_of(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict):
        loss = output.get("loss")
        return loss if isinstance(loss, torch.Tensor) else None
    return None


def _with_loss(output: Any, loss: torch.Tensor) -> Any:
    if isinstance(output, dict):
        return {**output, "loss": loss}
    return loss


def _free_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class OOMRecovery:
    """Wraps one module's training step; ``on_oom`` is told about every OOM caught."""

    def __init__(self, trainer: Any, module: Any, max_parts: int, loss_reduction: str, on_oom: Callable[[], None]):
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        self.trainer, self.module, self.on_oom = trainer, module, on_oom
        self.max_parts, self.loss_reduction = max_parts, loss_reduction
        self.parts = 1  # the parts the current batch is split into (1: whole)
        self.split_steps = 0
        self._skip_zero_grad = False
        self._batch: tuple[Any, tuple[Any, ...], dict[str, Any]] | None = None
        self._orig_step = module.training_step
        self._orig_zero = module.optimizer_zero_grad
        self._orig_backward = trainer.strategy.backward
        module.training_step = self._training_step
        module.optimizer_zero_grad = self._optimizer_zero_grad
        trainer.strategy.backward = self._backward

    def remove(self) -> None:
        """Put the original methods back."""
        for obj, name in ((self.module, "training_step"), (self.module, "optimizer_zero_grad")):
            obj.__dict__.pop(name, None)
        self.trainer.strategy.__dict__.pop("backward", None)

    def new_epoch(self) -> None:
        self.parts = 1

    # ------------------------------------------------------------------ hooks installed on the module
    def _optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        if self._skip_zero_grad:
            self._skip_zero_grad = False
            return
        self._orig_zero(epoch, batch_idx, optimizer)

    def _training_step(self, batch: Any, *args: Any, **kwargs: Any) -> Any:
        self._batch = (batch, args, kwargs)
        self._skip_zero_grad = False
        if self.parts == 1:
            try:
                return self._orig_step(batch, *args, **kwargs)
            except Exception as exc:
                if not is_oom_error(exc):
                    raise
                self._caught(exc, "training_step")
                self.parts = next_split(1, batch_length(batch), self.max_parts)
        return self._split_step(batch, args, kwargs, finish_here=False)

    def _backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._orig_backward(closure_loss, optimizer, *args, **kwargs)
        except Exception as exc:
            if not is_oom_error(exc) or self._batch is None:
                raise
            if isinstance(self.trainer.strategy.model, DistributedDataParallel):
                raise OutOfMemoryRecoveryError(
                    "out of memory in backward under DDP: some gradient buckets may already be all-reduced, so the "
                    "step cannot be redone; lower the batch size (IvyLoadBalancer recovers OOMs in the forward pass)"
                ) from exc
            self._caught(exc, "backward")
            batch, step_args, step_kwargs = self._batch
            del closure_loss
            self.parts = next_split(self.parts, batch_length(batch), self.max_parts)
            self._split_step(batch, step_args, step_kwargs, finish_here=True)
            return None

    # ------------------------------------------------------------------ the split step
    def _caught(self, exc: BaseException, where: str) -> None:
        log.warning("ivyplug: out of memory in %s (%s); splitting the batch", where, type(exc).__name__)
        self.on_oom()
        _free_memory()

    def _block_backward_sync(self) -> contextlib.AbstractContextManager[Any]:
        """The strategy's own "this backward is not the step's yet" (DDP's ``no_sync``, the PS's held pushes)."""
        block = getattr(self.trainer.strategy, "block_backward_sync", None)
        return block() if block is not None else contextlib.nullcontext()

    def _zero_grads(self) -> None:
        optimizer = self.trainer.optimizers[0]
        self._orig_zero(self.trainer.current_epoch, self.trainer.fit_loop.epoch_loop.batch_idx, optimizer)

    def _split_step(self, batch: Any, args: tuple[Any, ...], kwargs: dict[str, Any], finish_here: bool) -> Any:
        """Forward+backward all micro-batches but the last (or all, when ``finish_here``)."""
        if self.trainer.accumulate_grad_batches != 1:
            raise OutOfMemoryRecoveryError(
                "out of memory with accumulate_grad_batches > 1: IvyLoadBalancer's micro-batch recovery needs "
                "accumulate_grad_batches=1 (it zeroes gradients itself)"
            )
        total = batch_length(batch)
        optimizer = self.trainer.optimizers[0]
        while True:
            try:
                self._zero_grads()
                result = self._run_parts(batch, args, kwargs, optimizer, total, finish_here)
                self._skip_zero_grad = not finish_here
                self.split_steps += 1
                return result
            except OutOfMemoryRecoveryError:
                raise
            except Exception as exc:
                if not is_oom_error(exc):
                    raise
                self._caught(exc, f"a micro-batch ({self.parts} parts)")
                self.parts = next_split(self.parts, total, self.max_parts)

    def _run_parts(
        self, batch: Any, args: tuple[Any, ...], kwargs: dict[str, Any], optimizer: Any, total: int, finish_here: bool
    ) -> Any:
        micro = split_batch(batch, min(self.parts, total))  # a split kept from a larger batch fits this one too
        seen = torch.zeros(())
        run_here = micro if finish_here else micro[:-1]
        for part in run_here:
            scale = batch_length(part) / total if self.loss_reduction == "mean" else 1.0
            loss = _loss_of(self._orig_step(part, *args, **kwargs))
            if loss is None:
                raise OutOfMemoryRecoveryError("training_step returned no loss for a micro-batch: cannot accumulate")
            context = (
                self._block_backward_sync() if not finish_here or part is not micro[-1] else contextlib.nullcontext()
            )
            with context:
                self._orig_backward(loss * scale, optimizer)
            seen = seen + loss.detach().cpu() * scale
        if finish_here:
            return None
        last = micro[-1]
        out = self._orig_step(last, *args, **kwargs)
        loss = _loss_of(out)
        if loss is None:
            raise OutOfMemoryRecoveryError("training_step returned no loss for a micro-batch: cannot accumulate")
        scale = batch_length(last) / total if self.loss_reduction == "mean" else 1.0
        return _with_loss(out, loss * scale + seen.to(loss.device, loss.dtype))
