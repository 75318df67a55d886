"""Accuracy of 2 Lightning workers on the digits MLP, in one popen-launched job (start-up paid once).

- Local updates with H = 16 (SGD in ``LocalUpdates``) reach >= 96% validation accuracy with each outer
  optimizer: ``average``, ``nesterov`` at its defaults and ``lamb`` at ``outer_lr=0.08`` in sync mode (the merges do not
  depend on timing, so the result is the same on a loaded machine); with asynchronous merges, whose
  order depends on timing, ``nesterov`` at its defaults (delayed momentum, one worker's delta per merge)
  and ``average`` reach >= 94%.
- ``wire_dtype="bfloat16"``: a gradient fit (the servers run SGD) and a Nesterov-merged local-update fit (bf16
  deltas with error feedback) end within 0.5 points of their fp32 twins, while the gradient fit's PS
  traffic halves.
- ``wire_dtype="int8"`` and ``"int4"``: the Nesterov-merged local-update fit (block-quantized deltas with error
  feedback, bf16 pulls) ends within 0.5 points of its fp32 twin while its pushes shrink to about 1/3.9 and 1/7.5.
- ``sync_every="auto"`` with rank 1 sleeping 20 ms a step: each rank chooses its own period, the slow one a
  shorter one, both logged as ``ivy/rank{r}/sync_every``, and the fit learns.
- Async LAMB on pushed gradients learns at least as well as the same LAMB in sync mode (DDP's math, one
  server step per global batch): the staleness factor scales the servers' learning rate per push, not the
  gradient (scaling the gradient left async LAMB 5-15 points behind). Async results depend on timing, so the
  median of three async fits is compared.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from .test_example import run_script

JOB = Path(__file__).with_name("averaging_job.py")
FITS = {
    "average": "local/async/average/float32/20",
    "average_sync": "local/sync/average/float32/20",
    "nesterov": "local/sync/nesterov/float32/15",
    "nesterov_async": "local/async/nesterov/float32/20",
    "nesterov_bf16": "local/sync/nesterov/bfloat16/15",
    "nesterov_int8": "local/sync/nesterov/int8/15",
    "nesterov_int4": "local/sync/nesterov/int4/15",
    "lamb": "local/sync/lamb@0.08/float32/25",
    "sgd": "grad/sync/sgd/float32/10",
    "sgd_bf16": "grad/sync/sgd/bfloat16/10",
    "lamb_async": "grad/async/lamb/float32/10",
    "lamb_async_2": "grad/async/lamb/float32/10",
    "lamb_async_3": "grad/async/lamb/float32/10",
    "lamb_sync": "grad/sync/lamb/float32/10",
    "auto_slow": "auto/async/average/float32/6",
}


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_outer_optimizers_and_bf16_wire_accuracy(tmp_path: Path) -> None:
    specs = list(FITS.values())
    returncode, out = run_script([str(JOB), str(tmp_path), *specs], tmp_path, timeout=380)
    assert returncode == 0, out[-4000:]
    runs: dict[str, list[dict]] = {}
    for i, name in enumerate(FITS):
        runs[name] = [json.loads((tmp_path / f"fit{i}-rank{r}.json").read_text()) for r in (0, 1)]
    acc = {name: ranks[0]["val_acc"] for name, ranks in runs.items()}
    print("validation accuracy:", acc)  # shown with -rA: the measured numbers, not only pass/fail
    for ranks in runs.values():  # both ranks validated the same global model
        assert ranks[0]["val_acc"] == ranks[1]["val_acc"], ranks
    for name in ("average", "average_sync", "nesterov", "nesterov_async", "lamb"):
        # sync merges are deterministic (the same numbers on every machine); async ones depend on which
        # worker's delta lands when. Async average: 0.9497-0.9749, median 0.9665, over 31 runs of this code
        # (two at 0.9497, one of them a CI failure at the old bound of 0.95); the code that set that bound,
        # interleaved with it: 0.9581-0.9777, median 0.9665, over 18. DDP: 0.975; an untrained model: ~0.1.
        assert acc[name] >= (0.96 if "/sync/" in FITS[name] else 0.94), acc
        # 1440 samples per epoch at batch 32: 45 steps between the 2 workers (23 each in sync mode; in
        # async the faster worker takes more), one exchange per 16 (+ each worker's flush at the end, rounding)
        epochs = int(FITS[name].rsplit("/", 1)[1])
        assert sum(r["pushes"] for r in runs[name]) <= 45 * epochs / 16 + 2 * 2, runs[name]
    assert abs(acc["nesterov_bf16"] - acc["nesterov"]) <= 0.005, acc
    assert abs(acc["sgd_bf16"] - acc["sgd"]) <= 0.005, acc
    for name, (low, high) in (("nesterov_int8", (0.24, 0.30)), ("nesterov_int4", (0.12, 0.18))):
        assert abs(acc[name] - acc["nesterov"]) <= 0.005, acc
        # the pushes shrink (sent by rank 1, whose shard is remote; rank 0's own shard is reached in-process)
        ratio = runs[name][1]["bytes_sent"] / runs["nesterov"][1]["bytes_sent"]
        assert low <= ratio <= high, (name, ratio)
    for r16, r32 in zip(runs["sgd_bf16"], runs["sgd"], strict=True):
        ratio = (r16["bytes_sent"] + r16["bytes_received"]) / (r32["bytes_sent"] + r32["bytes_received"])
        assert 0.45 <= ratio <= 0.56, (r16, r32)
    # sync LAMB is deterministic here (0.874); async, over 29 fits on an idle and a loaded machine: 0.908-0.969,
    # once 0.855 in a loaded CI run (a lone fit then failed this bound), hence a median of three
    lamb_async = statistics.median(acc[name] for name in ("lamb_async", "lamb_async_2", "lamb_async_3"))
    assert lamb_async >= acc["lamb_sync"] - 0.01, acc
    periods = runs["auto_slow"][0]["sync_every"]
    print("sync_every per rank (rank 1 slow):", periods)
    assert len(periods) == 2 and all(1 <= p <= 256 for p in periods), periods
    assert periods[1] < periods[0], f"the slow rank's period is not shorter: {periods}"
    assert acc["auto_slow"] >= 0.9, acc
