"""Where ivyplug reaches past Lightning's public API, in one place, with the versions it was checked against.

Each function says what it relies on and why no public hook serves. The launchers (launchers.py) subclass
Lightning's own; everything else that touches Lightning's private names or patches one of its objects is here:

* :func:`init_dist_connection`: Lightning's process-group set-up, called by the PS strategy's
  ``setup_distributed`` with a store of its own (torchrun restarts);
* :func:`patch_epoch_loop`: in async/ssp the ranks run different batch counts, so the training epoch loop's
  per-batch SIGTERM broadcast (a default-group collective) is replaced by the PS stop flag, and the strategy
  is told when a training batch runs (on-step ``sync_dist`` reduces then stay local);
* :func:`record_norm_clipping`: the PS clips the combined gradient once, so the precision plugin's
  ``clip_gradients`` records the requested norm instead of clipping each worker's own gradient;
* :func:`take_ddp_comm_hook` / :func:`give_back_ddp_comm_hook`: a user's ``ddp_comm_hook`` on a
  ``DDPStrategy``, which the load balancer composes with its share-weighting hook (torch allows one per model).

A Lightning version outside :data:`CHECKED_LIGHTNING` gets a warning, once, naming these.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import lightning
from lightning.fabric.utilities.distributed import _init_dist_connection
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.exceptions import SIGTERMException

log = logging.getLogger(__name__)

#: Lightning versions whose epoch loop, precision plugins and DDP strategy were checked for what this module uses.
CHECKED_LIGHTNING = ("2.4.", "2.5.", "2.6.")

_warned = False


def warn_if_unchecked() -> None:
    """Warn once where the installed Lightning is not one of :data:`CHECKED_LIGHTNING`."""
    global _warned
    if _warned or lightning.__version__.startswith(CHECKED_LIGHTNING):
        return
    _warned = True
    log.warning(
        "ivyplug: lightning %s was not checked for the internals ivyplug relies on (the epoch loop's per-batch "
        "SIGTERM broadcast, the precision plugin's clip_gradients, DDPStrategy's comm hook); tested: %s",
        lightning.__version__,
        ", ".join(v + "x" for v in CHECKED_LIGHTNING),
    )


def init_dist_connection(cluster_environment: Any, backend: str, **kwargs: Any) -> None:
    """Lightning's default process-group set-up (``lightning.fabric.utilities.distributed``)."""
    _init_dist_connection(cluster_environment, backend, **kwargs)


def patch_epoch_loop(
    trainer: Any, in_batch: Callable[[bool], None], stop_requested: Callable[[bool], bool] | None
) -> None:
    """Patch ``trainer``'s training epoch loop for ranks that are not in lockstep.

    ``in_batch(True)`` / ``in_batch(False)`` are called around each ``advance`` (one training batch).
    ``stop_requested(received_sigterm)`` replaces the loop's ``_broadcast_sigterm_tensor`` (a broadcast per
    batch): it tells the others when this rank received SIGTERM and says whether any rank did, and then the
    loop raises ``SIGTERMException`` as Lightning's broadcast would. :func:`unpatch_epoch_loop` undoes both.
    """
    warn_if_unchecked()
    epoch_loop = trainer.fit_loop.epoch_loop
    if stop_requested is not None and hasattr(epoch_loop, "_broadcast_sigterm_tensor"):

        def broadcast_sigterm_via_ps() -> None:
            if stop_requested(bool(getattr(trainer, "received_sigterm", False))):
                raise SIGTERMException()

        epoch_loop._broadcast_sigterm_tensor = broadcast_sigterm_via_ps
    original_advance = epoch_loop.advance

    def advance(*args: Any, **kwargs: Any) -> Any:
        in_batch(True)
        try:
            return original_advance(*args, **kwargs)
        finally:
            in_batch(False)

    epoch_loop.advance = advance


def unpatch_epoch_loop(trainer: Any) -> None:
    """Undo :func:`patch_epoch_loop` (the Trainer may run validate, test or another fit afterwards)."""
    epoch_loop = trainer.fit_loop.epoch_loop
    vars(epoch_loop).pop("advance", None)
    vars(epoch_loop).pop("_broadcast_sigterm_tensor", None)


def record_norm_clipping(plugin: Any, record: Callable[[float], None]) -> None:
    """Make ``plugin.clip_gradients`` call ``record(norm)`` for norm clipping instead of clipping locally.

    Value clipping is element-wise, local by nature: it still runs. Lightning's ``configure_gradient_clipping``
    (the module's hook, which a user may override) ends in this method, so a custom norm is recorded too.
    :func:`restore_clipping` undoes it.
    """
    warn_if_unchecked()
    local_clip = type(plugin).clip_gradients.__get__(plugin)

    def clip_gradients(
        optimizer: Any, clip_val: float = 0.0, gradient_clip_algorithm: Any = GradClipAlgorithmType.NORM
    ) -> None:
        if clip_val is None or clip_val <= 0:
            return
        if gradient_clip_algorithm == GradClipAlgorithmType.NORM:
            record(float(clip_val))
        else:
            local_clip(optimizer, clip_val, gradient_clip_algorithm)

    plugin.clip_gradients = clip_gradients


def restore_clipping(plugin: Any) -> None:
    """Undo :func:`record_norm_clipping`."""
    vars(plugin).pop("clip_gradients", None)


def take_ddp_comm_hook(strategy: Any, comm_hook: str) -> tuple[tuple[Any, Any], tuple[Any, Any]] | None:
    """Take a user's ``ddp_comm_hook`` from a DDP strategy, to run after the share weighting (torch allows one hook).

    Returns ``((hook as wrapped, its state), (hook, wrapper) as given)``, or ``None`` where the strategy has none;
    ``comm_hook="refuse"`` raises instead. Lightning must then not register it: the share hook calls it.
    """
    warn_if_unchecked()
    hook = getattr(strategy, "_ddp_comm_hook", None)
    if hook is None:
        return None
    if comm_hook == "refuse":
        raise ValueError(
            "IvyLoadBalancer weights each rank's gradient by its share through a DDP communication hook and "
            f"torch allows one hook per model, but the strategy already has ddp_comm_hook={hook!r}; remove it, or "
            "use IvyLoadBalancer(comm_hook='compose') to run it after the share weighting"
        )
    wrapper = getattr(strategy, "_ddp_comm_wrapper", None)
    taken = ((wrapper(hook) if wrapper is not None else hook, strategy._ddp_comm_state), (hook, wrapper))
    strategy._ddp_comm_hook = None
    strategy._ddp_comm_wrapper = None
    return taken


def give_back_ddp_comm_hook(strategy: Any, taken: tuple[Any, Any]) -> None:
    """Put a hook :func:`take_ddp_comm_hook` took back on the strategy (a later fit may reuse it)."""
    strategy._ddp_comm_hook, strategy._ddp_comm_wrapper = taken
