"""Keras tests share one TensorFlow runtime: split the CPU into 2 logical devices before TF starts,
so MirroredStrategy has two replicas on this 2-core machine. ``keras_backend`` parametrizes a test over
Keras's backends (the other backends run in fresh interpreters: ``backend_runner``)."""

from __future__ import annotations

import contextlib
import itertools
import os

import pytest

from tests.integrations.keras.backend_runner import BACKENDS

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

tf = pytest.importorskip("tensorflow")

_cpus = tf.config.list_physical_devices("CPU")
# RuntimeError: TF was already initialised by an earlier import in this process.
with contextlib.suppress(RuntimeError):
    tf.config.set_logical_device_configuration(_cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)


_key_bases = itertools.count(1)


@pytest.fixture
def mirrored() -> object:
    """A fresh MirroredStrategy over the two logical CPUs (skips if TF initialised too early).

    Every MirroredStrategy starts its collective keys at the same numbers and TF remembers each key's
    tensor shape for the whole process, so a second strategy whose first all-reduce has another shape
    aborts ("Shape mismatch in the collective instance"). Each strategy made here gets keys of its own.
    """
    logical = tf.config.list_logical_devices("CPU")
    if len(logical) < 2:
        pytest.skip("TensorFlow was initialised before the logical-CPU split")

    class _OwnKeys(tf.distribute.MirroredStrategy):  # type: ignore[misc,name-defined]
        _collective_key_base = 10_000_000 * next(_key_bases)

    return _OwnKeys([d.name for d in logical[:2]])


@pytest.fixture(params=BACKENDS)
def keras_backend(request: pytest.FixtureRequest) -> str:
    """The ``KERAS_BACKEND`` a test checks (as Keras's own suite parametrizes it); Keras fixes its backend at
    import, so a test runs JAX and PyTorch in fresh interpreters (``backend_runner``)."""
    return str(request.param)
