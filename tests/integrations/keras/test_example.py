"""Smoke test of examples/keras_load_balancer.py --quick (in this process: TF is already split in 2 CPUs)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

pytest.importorskip("tensorflow")
pytest.importorskip("sklearn")

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "keras_load_balancer.py"


def test_keras_load_balancer_example_quick(mirrored: object, capsys: pytest.CaptureFixture[str]) -> None:
    import tensorflow as tf

    # The example builds its own MirroredStrategy: give it collective keys no other strategy here uses
    # (strategies in one process otherwise share key bases and TF's cached per-instance shapes).
    tf.distribute.MirroredStrategy._collective_key_base += 100_000
    spec = importlib.util.spec_from_file_location("keras_load_balancer_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.main(["--quick"])
    out = capsys.readouterr().out
    assert "2 replicas" in out and "ivy/batch_size" in out and "RESULT " in out
    # The scripted trace: idle -> grow, cooldown, idle -> grow, memory 94 % -> shrink.
    assert result["batch_size"] == [64.0, 128.0, 128.0, 256.0, 128.0]
    assert result["lr_factor"] == pytest.approx([1.0, math.sqrt(2), math.sqrt(2), 2.0, math.sqrt(2)])
    assert result["val_accuracy"][-1] > 0.8
