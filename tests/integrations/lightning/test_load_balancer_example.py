"""Smoke test of examples/lightning_load_balancer.py --quick (single process, in this interpreter)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "lightning_load_balancer.py"


def test_lightning_load_balancer_example_quick(capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("lightning_load_balancer_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.main(["--quick"])
    sizes = [(h["batch_size"], h["next_batch_size"]) for h in result["history"]]
    assert sizes == [(32, 64), (64, 64), (64, 32)]  # idle -> grow, band -> hold, memory pressure -> shrink
    assert result["metrics"]["ivy/batch_size"] == 32.0
    assert result["metrics"]["val_acc"] > 0.5
    out = capsys.readouterr().out
    assert "grow" in out and "shrink" in out and "validation accuracy" in out
