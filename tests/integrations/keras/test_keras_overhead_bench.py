"""Smoke test of ``ivyplug bench keras_overhead``: the job's measurement in this process (TF is already split)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("tensorflow")
pytest.importorskip("sklearn")


def test_keras_overhead_measure_and_table(mirrored: Any) -> None:
    import tensorflow as tf
    from ivyplug.benchmarks import keras_overhead
    from ivyplug.benchmarks.keras_overhead_job import measure

    # The job builds its own MirroredStrategy: give it collective keys no other strategy here uses.
    tf.distribute.MirroredStrategy._collective_key_base += 100_000
    result = measure(epochs=2, rounds=1, samples=512)  # 2 steps per epoch: a smoke run
    assert set(result["modes"]) == {"single", "mirrored"}
    for mode, replicas in (("single", 1), ("mirrored", 2)):
        m = result["modes"][mode]
        assert m["replicas"] == replicas and m["measured_epochs"] == 1
        assert m["step_ms_median"] > 0 and m["epoch_s_with"] > 0 and m["epoch_s_without"] > 0
        for key in ("self_reported_median", "hooks_over_steps_median", "hooks_over_steps_max"):
            assert 0.0 < m[key] < 1.0, (mode, key, m[key])  # a share of the step time, never all of it
    result.update(loadavg_before=[1.0, 1.0, 1.0], loadavg_after=[1.0, 1.0, 1.0], target=0.01, within_target=True)
    table = keras_overhead.format_table(result)
    assert "hooks/steps %" in table and "mirrored" in table and "load average before" in table
    with pytest.raises(ValueError, match="epochs must be >= 2"):
        measure(epochs=1)
