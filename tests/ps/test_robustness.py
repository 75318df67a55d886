"""Two real gloo workers: a non-finite push never reaches the global model, unused parameters are not
stepped (as under DDP), integer buffers stay exact, a state written in another mode resumes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.ps import robustness_scenarios
from tests.ps.harness import run_workers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def session() -> list[dict[str, Any]]:
    return run_workers(robustness_scenarios.session, 2, timeout=200)


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_sync_nonfinite_push_is_dropped_and_its_worker_counts_zero_samples(session: list, name: str) -> None:
    for rank, result in enumerate(session):
        r = result[f"nonfinite_sync_{name}"]
        for got, want in zip(r["params"], r["ref"], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)  # NaN-aware: a NaN fails here
        assert r["skipped"] == (1.0 if rank == 1 else 0.0)


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_nonfinite_gradient_or_batchnorm_buffer_leaves_the_global_model_finite(
    session: list, mode: str, name: str
) -> None:
    for rank, result in enumerate(session):
        r = result[f"nonfinite_bn_{mode}_{name}"]
        assert r["finite"]
        assert r["skipped"] == (2.0 if rank == 1 else 0.0)


def test_async_nonfinite_push_is_dropped_whole_and_every_other_push_lands_once(session: list) -> None:
    r0, r1 = session[0]["nonfinite_async"], session[1]["nonfinite_async"]
    for i, x0 in enumerate(r0["x0"]):
        want = x0 - r0["pushed"][i] - r1["pushed"][i]  # a push missing or applied twice moves an element by >= 1
        torch.testing.assert_close(r0["final"][i], want, rtol=0, atol=1e-5)  # fp32 rounding of the running sum
        torch.testing.assert_close(r1["final"][i], want, rtol=0, atol=1e-5)
    assert (r0["skipped"], r1["skipped"]) == (0.0, 1.0)
    # control: the dropped push held finite values in its first tensor too; applying those would differ
    assert not torch.equal(r0["final"][0], r0["x0"][0] - r0["pushed"][0])


def test_sync_unused_parameters_match_ddp_find_unused_parameters(session: list) -> None:
    for result in session:
        r = result["unused_sync"]
        for name, ddp_value in r["ddp"].items():
            torch.testing.assert_close(r["ps"][name], ddp_value, rtol=0, atol=1e-5, msg=name)
        for name in ("never.weight", "never.bias"):  # AdamW's weight decay must not touch it
            torch.testing.assert_close(r["ps"][name], r["init"][name], rtol=0, atol=0)
        assert not torch.equal(r["ps"]["sometimes.weight"], r["init"]["sometimes.weight"])  # it did train


def test_async_unused_parameters_are_not_stepped(session: list) -> None:
    for result in session:
        r = result["unused_async"]
        for name in ("never.weight", "never.bias"):
            torch.testing.assert_close(r["ps"][name], r["init"][name], rtol=0, atol=0)
        assert not torch.equal(r["ps"]["sometimes.weight"], r["init"]["sometimes.weight"])


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_integer_buffers_stay_exact_beyond_2_to_the_24(session: list, mode: str) -> None:
    for result in session:
        r = result[f"ints_{mode}"]
        assert r["big"].dtype == torch.int64 and r["small"].dtype == torch.int32
        assert r["big"].tolist() == [2**40 + 7 + 6, -(2**35) - 1 + 6]  # rank 1's count (the max), exactly
        assert int(r["small"]) == 6


def test_a_state_written_in_async_resumes_in_sync_then_ssp(session: list) -> None:
    r0, r1 = session[0]["resume"], session[1]["resume"]
    for mode in ("sync", "ssp"):
        for got, want in zip(
            r0[f"{mode}_loaded"], r0["saved_params"] if mode == "sync" else r0["sync_after"], strict=True
        ):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        for a, b in zip(r0[f"{mode}_after"], r1[f"{mode}_after"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)  # both workers hold the same global model
        assert all(bool(torch.isfinite(p).all()) for p in r0[f"{mode}_after"])
    assert "mode 'ssp', 2 workers, 2 shards (one per worker)" in r0["refused"]
    assert "mode 'sync', 2 workers, 1 shards (num_servers=1)" in r0["refused"]
