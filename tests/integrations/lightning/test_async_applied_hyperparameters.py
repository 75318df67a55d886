"""async/ssp: the hyperparameters the servers apply to a push are the ones its worker had at that step.

Read back from the servers themselves: the model's optimizer is a recording subclass, so each co-located
server shard's mirror of it (built from the same class) records the hyperparameters of every step it takes.
Each worker records the values of its own optimizer at each of its steps. With staleness scaling off, the
steps a shard applied are exactly the workers' steps, value for value; an epoch schedule that sets the
learning rate to 0 from epoch 1 on leaves the global model where epoch 0 left it, although every push of the
later epochs is applied. All fits run in one popen-launched job (hyperparameters_job.py).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from .hyperparameters_job import EPOCHS, WORKERS, Values
from .test_example import run_script

pytestmark = [pytest.mark.slow]

JOB = Path(__file__).with_name("hyperparameters_job.py")
EPOCH_SCHEDULE = {mode: f"{mode}/sgd/zero_after_epoch_0" for mode in ("async", "ssp")}
STEP_SCHEDULE = {
    opt: f"{mode}/{opt}/one_cycle" for opt, mode in (("sgd", "async"), ("adamw", "ssp"), ("lamb", "async"))
}
SPECS = [*EPOCH_SCHEDULE.values(), *STEP_SCHEDULE.values()]


@pytest.fixture(scope="module")
def fits(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every fit of the job: (every worker step, each server shard's steps, rank 0's global models)."""
    out = tmp_path_factory.mktemp("hyperparameters")
    returncode, log = run_script([str(JOB), str(out), *SPECS], out, timeout=280)
    assert returncode == 0, log[-4000:]
    results = {}
    for i, spec in enumerate(SPECS):
        ranks = [json.loads((out / f"fit{i}-rank{r}.json").read_text()) for r in range(WORKERS)]
        worker_steps = [step for rank in ranks for step in rank["worker_steps"]]
        shards: dict[tuple[int, int], list[Any]] = {}
        for r, rank in enumerate(ranks):
            for opt_id, values in rank["server_steps"]:
                shards.setdefault((r, opt_id), []).append(values)
        results[spec] = (worker_steps, list(shards.values()), ranks[0]["global_at_validation"])
    return results


def _check_applied(applied: list[Values], worker_steps: list[Values]) -> None:
    """A shard's steps are the workers' steps, value for value, over the groups the shard holds."""
    held = {group[0] for values in applied for group in values}
    assert held, "a shard recorded steps without groups"
    expected = [[group for group in values if group[0] in held] for values in worker_steps]
    assert Counter(json.dumps(v) for v in applied) == Counter(json.dumps(v) for v in expected)


@pytest.mark.parametrize("mode", list(EPOCH_SCHEDULE))
def test_an_epoch_schedule_that_zeroes_the_lr_stops_the_global_model(mode: str, fits: dict[str, Any]) -> None:
    worker_steps, shards, global_models = fits[EPOCH_SCHEDULE[mode]]

    assert len(global_models) == EPOCHS
    later = [values for epoch, values in worker_steps if epoch > 0]
    assert later, "no worker stepped after epoch 0"
    assert all(lr == 0.0 for values in later for _, lr, _ in values), "a worker pushed a non-zero lr after epoch 0"
    assert shards, "no server shard recorded a step"
    for applied in shards:  # every push of every epoch applied, each with its worker's learning rate
        _check_applied(applied, [values for _, values in worker_steps])
    first = torch.tensor(global_models[0], dtype=torch.float64)
    for epoch, model in enumerate(global_models[1:], start=1):
        torch.testing.assert_close(
            torch.tensor(model, dtype=torch.float64), first, rtol=0, atol=0, msg=f"moved in epoch {epoch}"
        )


@pytest.mark.parametrize("optimizer", list(STEP_SCHEDULE))
def test_a_step_schedule_s_values_are_the_ones_the_servers_apply(optimizer: str, fits: dict[str, Any]) -> None:
    worker_steps, shards, _ = fits[STEP_SCHEDULE[optimizer]]

    values = [v for _, v in worker_steps]
    lrs = {lr for v in values for _, lr, _ in v}
    # each of the two workers steps its own copy of the schedule: a value comes at most twice (once per worker),
    # so when both took as many steps, there are exactly half as many values as steps
    assert len(lrs) >= len(values) // 2, "the one-cycle schedule did not move the workers' learning rate"
    assert len({second for v in values for _, _, second in v}) > 1, "momentum/beta1 was not cycled"
    assert shards, "no server shard recorded a step"
    for applied in shards:
        assert len(applied) == len(values)
        _check_applied(applied, values)
