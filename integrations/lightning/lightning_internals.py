"""Where ivyplug reaches past Lightning's public API, in one place, with the versions it was checked against.

Each function says what it relies on and why no public hook serves. The launchers (launchers.py) subclass
Lightning's own, and the PS strategy overrides ``DDPStrategy._configure_launcher`` (with
:func:`install_checked_launcher`); everything else that reads, writes or patches Lightning's private names is here:

* :func:`init_dist_connection`: Lightning's process-group set-up, called by the PS strategy's
  ``setup_distributed`` with a store of its own (torchrun restarts);
* :func:`patch_epoch_loop`: in async/ssp the ranks run different batch counts, so the training epoch loop's
  per-batch SIGTERM broadcast (a default-group collective) is replaced by the PS stop flag, and the strategy
  is told when a training batch runs (on-step ``sync_dist`` reduces then stay local);
* :func:`record_clipping`: the PS clips the combined gradient once, so the precision plugin's
  ``clip_gradients`` records the requested norm instead of clipping each worker's own gradient;
* :func:`take_ddp_comm_hook` / :func:`give_back_ddp_comm_hook`: a user's ``ddp_comm_hook`` on a
  ``DDPStrategy``, which the load balancer composes with its share-weighting hook (torch allows one per model);
* :func:`per_step_collective_problems`: the Trainer options and callbacks that run a collective per batch
  (some known only by private attributes), refused for async/ssp before any worker starts;
* :func:`install_checked_launcher`, :func:`init_process_group`: the PS strategy's launchers and process group,
  set where ``DDPStrategy`` sets its own (its ``_launcher``, ``_process_group_backend``, ``_timeout``);
* :func:`trainer_of`, :func:`sampler_inside`: a module's trainer before it is attached, and the sampler inside
  Lightning's ``DistributedSamplerWrapper`` (named in an error).

A Lightning version outside :data:`CHECKED_LIGHTNING` gets a warning, once, naming these.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import lightning
from ivyplug.integrations.lightning.launchers import CheckedMultiProcessingLauncher, CheckedSubprocessScriptLauncher
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
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


def install_checked_launcher(strategy: Any) -> None:
    """What ``DDPStrategy._configure_launcher`` does, with launchers that check the fit first (launchers.py)."""
    assert strategy.cluster_environment is not None
    if strategy._start_method == "popen":
        strategy._launcher = CheckedSubprocessScriptLauncher(
            strategy, strategy.cluster_environment, strategy.num_processes, strategy.num_nodes
        )
    else:
        strategy._launcher = CheckedMultiProcessingLauncher(strategy, start_method=strategy._start_method)


def init_process_group(strategy: Any, store_for: Callable[[int, timedelta], Any], interface: Any) -> None:
    """``DDPStrategy.setup_distributed``'s process group, with a store of the caller's (``store_for(world_size,
    timeout)``, or None for Lightning's own) and inside ``interface`` (a context that picks gloo's interface)."""
    warn_if_unchecked()
    strategy._process_group_backend = strategy._get_process_group_backend()
    kwargs: dict[str, Any] = {"timeout": strategy._timeout}
    if strategy.root_device.type != "cpu":
        kwargs["device_id"] = strategy.root_device
    with interface:  # first: a setting it refuses ends this rank before the others count it in (store_for)
        store = store_for(strategy.world_size, strategy._timeout or default_pg_timeout)
        if store is not None:
            kwargs["store"] = store
        _init_dist_connection(strategy.cluster_environment, strategy._process_group_backend, **kwargs)


def insert_first(trainer: Any, callback: Any) -> None:
    """Put ``callback`` before the user's callbacks, but after a tuner's own: ``Tuner.lr_find`` runs a fit with
    its callback alone and reads it back as ``trainer.callbacks[0]``."""
    callbacks = trainer.callbacks
    index = 0
    while index < len(callbacks) and type(callbacks[index]).__module__.startswith("lightning.pytorch.tuner"):
        index += 1
    callbacks.insert(index, callback)


def trainer_of(module: Any) -> Any:
    """The Trainer a LightningModule is attached to, or None (its ``trainer`` property raises before that)."""
    return getattr(module, "_trainer", None)


def sampler_inside(sampler: Any) -> Any:
    """The sampler a ``DistributedSamplerWrapper`` wraps (in its dataset's ``_sampler``), else None."""
    return getattr(getattr(sampler, "dataset", None), "_sampler", None)


def patch_epoch_loop(trainer: Any, in_batch: Callable[[bool], None], stop_requested: Callable[[bool], bool]) -> None:
    """Patch ``trainer``'s training epoch loop for ranks that are not in lockstep.

    ``in_batch(True)`` / ``in_batch(False)`` are called around each ``advance`` (one training batch).
    ``stop_requested(received_sigterm)`` replaces the loop's ``_broadcast_sigterm_tensor`` (a broadcast per
    batch): it tells the others when this rank received SIGTERM and says whether any rank did, and then the
    loop raises ``SIGTERMException`` as Lightning's broadcast would. :func:`unpatch_epoch_loop` undoes both.
    """
    warn_if_unchecked()
    epoch_loop = trainer.fit_loop.epoch_loop
    if hasattr(epoch_loop, "_broadcast_sigterm_tensor"):

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


def record_clipping(
    plugin: Any, record: Callable[[float], None], record_value: Callable[[float], None] | None = None
) -> None:
    """Make ``plugin.clip_gradients`` call ``record(norm)`` for norm clipping instead of clipping locally.

    Value clipping calls ``record_value(value)`` where given (sync: DDP clamps the averaged gradient, so the
    servers clamp the combined one), else it runs here, on this worker's gradient (async/ssp: each push).
    Lightning's ``configure_gradient_clipping`` (the module's hook, which a user may override) ends in this method,
    so a custom norm is recorded too. :func:`restore_clipping` undoes it.
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
        elif record_value is not None:
            record_value(float(clip_val))
        else:
            local_clip(optimizer, clip_val, gradient_clip_algorithm)

    plugin.clip_gradients = clip_gradients


def restore_clipping(plugin: Any) -> None:
    """Undo :func:`record_clipping`."""
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


def per_step_collective_problems(trainer: Any, model: Any = None) -> list[str]:
    """Human-readable reasons why ``trainer`` cannot run an async/ssp PS fit (empty when it can)."""
    from lightning.pytorch.callbacks import ModelCheckpoint, Timer
    from lightning.pytorch.callbacks.timer import Interval

    problems: list[str] = []
    if getattr(trainer, "_val_check_time_interval", None) is not None:
        problems.append("a time-based val_check_interval (validation must run at epoch end: use 1.0)")
    interval = getattr(trainer, "val_check_interval", 1.0)
    if isinstance(interval, bool) or not isinstance(interval, float) or interval != 1.0:
        problems.append(f"val_check_interval={interval!r} (validation must run once per epoch: use 1.0)")
    if getattr(trainer, "check_val_every_n_epoch", 1) is None:
        problems.append("check_val_every_n_epoch=None (batch-count validation; use an epoch interval)")
    for callback in getattr(trainer, "callbacks", []):
        if isinstance(callback, ModelCheckpoint):
            if getattr(callback, "_every_n_train_steps", 0):
                problems.append(
                    f"ModelCheckpoint(every_n_train_steps={callback._every_n_train_steps}) "
                    "(checkpoint per epoch instead: every_n_epochs)"
                )
            if getattr(callback, "_train_time_interval", None) is not None:
                problems.append("ModelCheckpoint(train_time_interval=...) (checkpoint per epoch instead)")
        if isinstance(callback, Timer) and getattr(callback, "_interval", None) == Interval.step:
            problems.append(
                "a Timer checked every step (Trainer(max_time=...) adds one): use Timer(duration, interval='epoch')"
            )
    fit_loop = getattr(trainer, "fit_loop", None)
    if getattr(trainer, "max_steps", -1) != -1 and (
        getattr(fit_loop, "min_steps", None) or getattr(fit_loop, "min_epochs", None)
    ):
        problems.append(
            "max_steps together with min_steps/min_epochs (the first worker to reach max_steps ends every "
            "worker's fit at that epoch's end, and a minimum would keep the others training without it)"
        )
    if getattr(getattr(trainer, "strategy", None), "_layer_sync", None) is not None:
        problems.append("sync_batchnorm=True (SyncBatchNorm all-reduces in every forward)")
    return problems
