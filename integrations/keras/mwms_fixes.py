"""Version-guarded fixes that let ``model.fit`` train under ``MultiWorkerMirroredStrategy`` in Keras 3.15.

Keras 3.15.1 (TensorFlow 2.21 backend) fails in two places with MultiWorkerMirroredStrategy (MWMS); both
were reproduced with 2 worker processes on 127.0.0.1 (``tests/integrations/keras/test_mwms.py``):

1. ``symbolic_build`` — ``TensorFlowTrainer.fit`` calls ``_maybe_symbolic_build``
   (``keras/src/backend/tensorflow/trainer.py``), which takes the first distributed batch and calls
   ``strategy.reduce("MEAN", batch, axis=None)`` on the whole ``(x, y)`` tuple of ``PerReplica`` values.
   MWMS's ``CollectiveAllReduceExtended._reduce_to`` → ``cross_device_ops.reduce`` →
   ``_make_tensor_into_per_replica`` → ``convert_to_tensor`` raises
   ``ValueError: Attempt to convert a value (PerReplica:{...}) with an unsupported type`` (upstream
   keras#20585). The build only needs shapes and dtypes, so the fix builds from the first local replica's
   batch: no reduction (and no collective) at all.
2. ``metric_reduction`` — each training step reduces its logs with ``reduce_per_replica(outputs, strategy,
   reduction="auto")`` (same module); under MWMS "auto" means "mean" and Keras calls
   ``strategy.reduce("MEAN", v, axis=0)`` on every value, including the scalar loss and metric results.
   Tracing the train function then fails with ``ValueError: Invalid reduction dimension 0 for input with 0
   dimensions`` (``Sum`` op, from ``reduce_per_replica._reduce``). The fix reduces rank-0 values with
   ``strategy.reduce("MEAN", v, axis=None)`` (the cross-replica mean Keras intends; every worker makes the
   same collective call) and leaves every other value to Keras.

The fixes are applied explicitly (:func:`apply_mwms_fixes`), idempotently, and only to Keras versions
whose code they were checked against (``3.15.x``); for other versions they are skipped with a
``RuntimeWarning`` unless ``force=True``. :func:`remove_mwms_fixes` restores Keras's own functions.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

#: Keras versions (major, minor) whose trainer code the fixes were written against.
CHECKED_VERSIONS: tuple[tuple[int, int], ...] = ((3, 15),)
#: Names of the fixes, in the order fit() meets the failures.
FIXES: tuple[str, ...] = ("symbolic_build", "metric_reduction")
_MARK = "__ivyplug_fix__"
_originals: dict[str, tuple[Any, str, Callable[..., Any]]] = {}


def _keras_version() -> tuple[int, int]:
    import keras

    major, minor = (int(part) for part in keras.__version__.split(".")[:2])
    return major, minor


def needs_fixes() -> bool:
    """Whether the installed Keras is a version the fixes were checked against."""
    return _keras_version() in CHECKED_VERSIONS


def _first_local(strategy: Any, value: Any) -> Any:
    import tensorflow as tf

    if isinstance(value, tf.distribute.DistributedValues):
        return strategy.experimental_local_results(value)[0]
    return value


def _fixed_symbolic_build(original: Callable[..., Any]) -> Callable[..., Any]:
    def _maybe_symbolic_build(self: Any, iterator: Any = None, data_batch: Any = None) -> Any:
        if self._distribute_strategy is None or iterator is None:
            return original(self, iterator=iterator, data_batch=data_batch)
        from keras.src import tree

        strategy = self.distribute_strategy
        for _, _, it in iterator:
            batch = next(it)
            data_batch = tree.map_structure(lambda v: _first_local(strategy, v), batch)
            break
        return original(self, iterator=None, data_batch=data_batch)

    setattr(_maybe_symbolic_build, _MARK, True)
    return _maybe_symbolic_build


def _fixed_reduce_per_replica(original: Callable[..., Any]) -> Callable[..., Any]:
    def reduce_per_replica(values: Any, strategy: Any, reduction: str) -> Any:
        import tensorflow as tf
        from keras.src import tree

        if reduction not in ("auto", "mean") or not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
            return original(values, strategy, reduction)

        def _reduce(v: Any) -> Any:
            local = strategy.experimental_local_results(v)
            if all(getattr(t, "shape", None) is not None and t.shape.rank == 0 for t in local):
                # A cross-replica mean of a scalar: what Keras intends, without its axis=0.
                return strategy.reduce("MEAN", v, axis=None)
            return original(v, strategy, reduction)

        return tree.map_structure(_reduce, values)

    setattr(reduce_per_replica, _MARK, True)
    return reduce_per_replica


def _patch(key: str, owner: Any, attr: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> bool:
    current = getattr(owner, attr)
    if getattr(current, _MARK, False):
        return False
    _originals[key] = (owner, attr, current)
    setattr(owner, attr, make(current))
    return True


def apply_mwms_fixes(fixes: tuple[str, ...] = FIXES, force: bool = False) -> tuple[str, ...]:
    """Install the fixes; returns the names of those installed by this call (empty when already applied).

    Call it once before ``model.fit`` in every worker (it touches Keras's module globals, not the model).
    ``fixes`` selects a subset of :data:`FIXES` (the tests use it to reproduce each failure).
    """
    unknown = [f for f in fixes if f not in FIXES]
    if isinstance(fixes, str) or unknown:
        raise ValueError(f"fixes must be a tuple of names from {FIXES}, got {fixes!r}")
    if not force and not needs_fixes():
        import keras

        warnings.warn(
            f"ivyplug MWMS fixes were checked against Keras {CHECKED_VERSIONS} only; Keras {keras.__version__} "
            "is left unpatched (pass force=True to patch anyway)",
            RuntimeWarning,
            stacklevel=2,
        )
        return ()
    from keras.src.backend.tensorflow import trainer

    targets = {
        "symbolic_build": (trainer.TensorFlowTrainer, "_maybe_symbolic_build", _fixed_symbolic_build),
        "metric_reduction": (trainer, "reduce_per_replica", _fixed_reduce_per_replica),
    }
    applied = []
    for name in FIXES:
        if name in fixes and _patch(name, *targets[name]):
            applied.append(name)
    return tuple(applied)


def remove_mwms_fixes() -> tuple[str, ...]:
    """Restore Keras's own functions; returns the names of the fixes removed."""
    removed = []
    for key, (owner, attr, original) in list(_originals.items()):
        setattr(owner, attr, original)
        del _originals[key]
        removed.append(key)
    return tuple(removed)


def applied_fixes() -> tuple[str, ...]:
    """Names of the fixes currently installed."""
    return tuple(_originals)
