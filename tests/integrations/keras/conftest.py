"""Keras tests share one TensorFlow runtime: split the CPU into 2 logical devices before TF starts,
so MirroredStrategy has two replicas on this 2-core machine."""

from __future__ import annotations

import contextlib
import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

tf = pytest.importorskip("tensorflow")

_cpus = tf.config.list_physical_devices("CPU")
# RuntimeError: TF was already initialised by an earlier import in this process.
with contextlib.suppress(RuntimeError):
    tf.config.set_logical_device_configuration(_cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)


@pytest.fixture
def mirrored() -> object:
    """A MirroredStrategy over the two logical CPUs (skips if TF initialised too early)."""
    logical = tf.config.list_logical_devices("CPU")
    if len(logical) < 2:
        pytest.skip("TensorFlow was initialised before the logical-CPU split")
    return tf.distribute.MirroredStrategy([d.name for d in logical[:2]])
