"""ElasticDataset: batches are a pure function of the step and the schedule, on every replica."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from ivyplug.integrations.keras.elastic import ElasticDataset  # noqa: E402


def _data(n: int = 40, features: int = 3) -> tuple[np.ndarray, np.ndarray]:
    x = np.arange(n * features, dtype=np.float32).reshape(n, features)
    return x, np.arange(n, dtype=np.int64)


def _reference_indices(ds: ElasticDataset, schedule: list[tuple[int, int]], step: int, r: int, R: int) -> np.ndarray:
    """Independent reference: walk the steps one by one, summing batch sizes (schedule: (from_step, size))."""
    position = 0
    size = schedule[0][1]
    for k in range(step + 1):
        for start, b in schedule:
            if start == k:
                size = b
        if k < step:
            position += size
    share = size // R
    positions = position + r * share + np.arange(share)
    return np.array([ds.permutation(p // ds.num_samples)[p % ds.num_samples] for p in positions])


def test_every_sample_once_per_pass_constant_batch() -> None:
    x, y = _data(40)
    ds = ElasticDataset(x, y, batch_size=8, seed=3)
    assert ds.steps_per_epoch == 5
    seen = np.concatenate([ds.indices(k) for k in range(ds.steps_per_epoch)])
    assert sorted(seen.tolist()) == list(range(40))
    second = np.concatenate([ds.indices(k) for k in range(5, 10)])
    assert sorted(second.tolist()) == list(range(40))
    assert not np.array_equal(seen, second)  # a fresh permutation each pass


def test_batch_size_not_dividing_n_still_covers_each_pass_once() -> None:
    x, y = _data(30)
    ds = ElasticDataset(x, y, batch_size=7, seed=1)
    stream = np.concatenate([ds.indices(k) for k in range(9)])  # 63 positions: passes 0, 1 and 3 of pass 2
    assert sorted(stream[:30].tolist()) == list(range(30))
    assert sorted(stream[30:60].tolist()) == list(range(30))


def test_indices_match_independent_reference_after_changes() -> None:
    rng = np.random.default_rng(0)
    x, y = _data(50)
    ds = ElasticDataset(x, y, batch_size=10, seed=int(rng.integers(1000)))
    schedule = [(0, 10)]
    for start, b in ((4, 6), (9, 16), (13, 2)):
        ds.set_batch_size(b, at_step=start)
        schedule.append((start, b))
    for k in range(18):
        assert ds.batch_size_at(k) == [b for s, b in schedule if s <= k][-1]
        for r, R in ((0, 1), (0, 2), (1, 2)):
            np.testing.assert_array_equal(ds.indices(k, r, R), _reference_indices(ds, schedule, k, r, R))


def test_same_seed_same_batches_and_shuffle_off_is_in_order() -> None:
    x, y = _data(20)
    a = ElasticDataset(x, y, batch_size=4, seed=9)
    b = ElasticDataset(x, y, batch_size=4, seed=9)
    for k in range(12):
        np.testing.assert_array_equal(a.indices(k), b.indices(k))
    plain = ElasticDataset(x, y, batch_size=4, shuffle=False)
    np.testing.assert_array_equal(plain.indices(6), [4, 5, 6, 7])


def test_pipeline_feeds_the_scheduled_batches() -> None:
    x, y = _data(24)
    ds = ElasticDataset(x, y, batch_size=6, seed=5, lag=3)
    it = iter(ds.tf_dataset())
    got = [next(it) for _ in range(2)]
    at = ds.earliest_change_step(consumed_steps=2)
    ds.set_batch_size(4, at_step=at)
    got += [next(it) for _ in range(at + 3 - 2)]
    for k, (xb, yb) in enumerate(got):
        expected = ds.indices(k)
        assert len(yb) == (6 if k < at else 4)
        np.testing.assert_array_equal(yb.numpy(), y[expected])
        np.testing.assert_array_equal(xb.numpy(), x[expected])


def test_refuses_a_step_already_produced() -> None:
    x, y = _data(24)
    ds = ElasticDataset(x, y, batch_size=6, lag=1)
    it = iter(ds.tf_dataset())
    for _ in range(3):
        next(it)
    with pytest.raises(RuntimeError, match="already produced batch"):
        ds.set_batch_size(4, at_step=1)


def test_bad_arguments_are_clear_errors() -> None:
    x, y = _data(10)
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        ElasticDataset(x, y, batch_size=0)
    with pytest.raises(ValueError, match="at most the number of samples"):
        ElasticDataset(x, y, batch_size=11)
    with pytest.raises(ValueError, match="same first dimension"):
        ElasticDataset(x, y[:5], batch_size=2)
    with pytest.raises(ValueError, match="lag must be a positive integer"):
        ElasticDataset(x, y, batch_size=2, lag=0)
    with pytest.raises(ValueError, match="shuffle must be True or False, got 'no'"):
        ElasticDataset(x, y, batch_size=2, shuffle="no")  # (it shuffled: a non-empty string is true)
    ds = ElasticDataset(x, y, batch_size=2)
    ds.set_batch_size(4, at_step=5)
    with pytest.raises(ValueError, match="at_step must be >= the latest scheduled change"):
        ds.set_batch_size(2, at_step=3)


def test_mirrored_replicas_get_their_slices(mirrored: object) -> None:
    x, y = _data(32)
    ds = ElasticDataset(x, y, batch_size=8, seed=2)
    with pytest.raises(ValueError, match="multiple of the number of replicas"):
        ElasticDataset(x, y, batch_size=7).tf_dataset(mirrored)
    with mirrored.scope(), pytest.raises(ValueError, match=r"outside strategy\.scope"):  # type: ignore[attr-defined]
        ElasticDataset(x, y, batch_size=8).tf_dataset(mirrored)
    it = iter(ds.tf_dataset(mirrored))
    with pytest.raises(ValueError, match="multiple of the number of replicas"):
        ds.set_batch_size(5, at_step=10)
    ds.set_batch_size(4, at_step=ds.earliest_change_step(0))
    for k in range(ds.lag + 2):
        _xb, yb = next(it)
        parts = mirrored.experimental_local_results(yb)  # type: ignore[attr-defined]
        assert len(parts) == 2
        for r, part in enumerate(parts):
            np.testing.assert_array_equal(part.numpy(), y[ds.indices(k, r, 2)])
            assert len(part) == ds.batch_size_at(k) // 2
