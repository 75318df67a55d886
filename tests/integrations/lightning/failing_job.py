"""A popen-launched 2-rank fit whose ``training_step`` raises on one rank; each rank writes what ``fit`` raised.

``python failing_job.py OUT MODE RANK``: MODE ``sync`` or ``async``; RANK the rank that raises, at its batch 3.
Each rank that gets to its ``except`` writes OUT/raised_rank{r}.json:
the type and text of the exception ``fit`` raised and the seconds from the failing batch to there.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from ivyplug.integrations.lightning import IvyPSStrategy

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from tests.integrations.lightning.digits import DigitsMLP

FAIL_AT = 3
TIMEOUT_S = 60.0


class UserBug(DigitsMLP):
    """``training_step`` raises a ``ValueError`` at batch :data:`FAIL_AT` on rank ``failing``."""

    failed_at = 0.0

    def __init__(self, failing: int) -> None:
        super().__init__(lr=0.05)
        self.failing = failing

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if batch_idx == FAIL_AT and self.global_rank == self.failing:
            UserBug.failed_at = time.monotonic()
            raise ValueError(f"a user's bug on rank {self.global_rank}")
        return super().training_step(batch, batch_idx)


def main() -> None:
    out, mode, failing = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    pl.seed_everything(0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=IvyPSStrategy(mode=mode, timeout=TIMEOUT_S),
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    try:
        trainer.fit(UserBug(failing))
    except BaseException as exc:
        seconds = time.monotonic() - UserBug.failed_at if UserBug.failed_at else None
        raised = {"type": type(exc).__name__, "text": str(exc), "seconds": seconds}
        (out / f"raised_rank{trainer.global_rank}.json").write_text(json.dumps(raised))
        raise


if __name__ == "__main__":
    main()
