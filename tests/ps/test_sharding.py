from __future__ import annotations

import random

import pytest

from ivyplug.ps.sharding import AUTO_PIECES_PER_SHARD, MASTER_ITEMSIZE, TensorSpec, auto_max_shard_bytes, build_plan


def random_model(rng: random.Random, n: int) -> list[TensorSpec]:
    """Weights of random layer shapes, most with a bias (realistic mixes of big and tiny tensors)."""
    specs: list[TensorSpec] = []
    while len(specs) < n:
        out, inp = rng.choice([8, 16, 32, 64, 128, 256, 512, 1024]), rng.choice([8, 16, 32, 64, 128, 256, 512])
        specs.append(TensorSpec(f"w{len(specs)}", (out, inp)))
        if rng.random() < 0.7 and len(specs) < n:
            specs.append(TensorSpec(f"b{len(specs)}", (out,)))
    return specs


def covered(plan) -> dict[int, list[tuple[int, int]]]:
    rows: dict[int, list[tuple[int, int]]] = {}
    for shard, pieces in enumerate(plan.pieces):
        offset = 0
        for p in pieces:
            assert p.shard == shard and p.offset == offset
            offset += p.numel
            rows.setdefault(p.index, []).append((p.row_start, p.row_end))
    return rows


def test_every_tensor_placed_once_and_plan_is_deterministic() -> None:
    rng = random.Random(0)
    for _ in range(50):
        specs = random_model(rng, rng.randrange(1, 40))
        m = rng.randrange(1, 6)
        a, b = build_plan(specs, m), build_plan(list(specs), m)
        assert a.pieces == b.pieces and a.signature() == b.signature()
        rows = covered(a)
        assert sorted(rows) == list(range(len(specs)))
        assert all(r == [(0, specs[i].shape[0])] for i, r in rows.items())
        assert a.total_bytes == sum(s.numel for s in specs) * MASTER_ITEMSIZE


def optimal_largest_shard(sizes: list[int], m: int) -> int:
    """Exact optimum of the largest shard by dynamic programming over shard loads (small cases only)."""
    states = {(0,) * m}
    for size in sorted(sizes, reverse=True):
        nxt = set()
        for loads in states:
            for k in range(m):
                new = list(loads)
                new[k] += size
                nxt.add(tuple(sorted(new)))
        states = nxt
    return min(max(loads) for loads in states)


def test_balance_within_15_percent_of_the_best_whole_tensor_plan() -> None:
    """>= 4 tensors per server: largest shard <= 1.15 x the optimum (brute force) and the plan reports it."""
    rng = random.Random(1)
    for case in range(48):
        m = 3 if case % 8 == 0 else 2
        specs = random_model(rng, 4 * m + (rng.randrange(0, 4) if m == 2 else 0))
        plan = build_plan(specs, m)
        best = optimal_largest_shard([s.numel * MASTER_ITEMSIZE for s in specs], m)
        assert max(plan.shard_bytes()) <= 1.15 * best, (plan.report(), best)
        assert plan.report()["balance"] == pytest.approx(max(plan.shard_bytes()) / plan.ideal_bytes)
        assert plan.lower_bound_bytes <= best


def test_balance_within_15_percent_of_ideal_when_no_tensor_dominates() -> None:
    """With every piece <= ideal/4 (row splitting via max_shard_bytes), largest shard <= 1.15 x ideal."""
    rng = random.Random(2)
    for _ in range(200):
        m = rng.choice([2, 3, 4, 8])
        specs = random_model(rng, 4 * m + rng.randrange(0, 4 * m))
        ideal = sum(s.numel for s in specs) * MASTER_ITEMSIZE / m
        plan = build_plan(specs, m, max_shard_bytes=int(ideal / 4))
        assert plan.balance <= 1.15, plan.report()


def test_equal_tensors_balance_exactly() -> None:
    plan = build_plan([TensorSpec(f"t{i}", (10, 10)) for i in range(12)], 4)
    assert plan.balance == 1.0


def test_large_tensor_split_by_rows() -> None:
    specs = [TensorSpec("big", (100, 10)), TensorSpec("small", (10,)), TensorSpec("s", ())]
    plan = build_plan(specs, 3, max_shard_bytes=30 * 10 * MASTER_ITEMSIZE)
    rows = covered(plan)
    assert sorted(rows[0]) == [(0, 30), (30, 60), (60, 90), (90, 100)]
    assert rows[1] == [(0, 10)] and rows[2] == [(0, 1)]
    assert plan.split_tensors() == ["big"]
    # a single row larger than the limit stays one row per piece
    plan = build_plan([TensorSpec("wide", (3, 1000))], 2, max_shard_bytes=100)
    assert sorted(covered(plan)[0]) == [(0, 1), (1, 2), (2, 3)]


def test_buffers_are_never_split_and_follow_params_in_a_shard() -> None:
    specs = [TensorSpec("w", (64, 64)), TensorSpec("rm", (64,), "buffer"), TensorSpec("n", (), "buffer", False)]
    plan = build_plan(specs, 2, max_shard_bytes=16)
    for pieces in plan.pieces:
        kinds = [p.kind for p in pieces]
        assert kinds == sorted(kinds, key=lambda k: k != "param")
    assert plan.split_tensors() == ["w"]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_shards"):
        build_plan([TensorSpec("w", (2,))], 0)
    with pytest.raises(ValueError, match="max_shard_bytes"):
        build_plan([TensorSpec("w", (2,))], 1, max_shard_bytes=0)
    with pytest.raises(ValueError, match="kind"):
        build_plan([TensorSpec("w", (2,), "grad")], 1)


def test_auto_limit_bounds_every_plan_by_one_eighth_over_ideal() -> None:
    """ "auto" with an element-wise optimizer: largest shard <= (1 + 1/8) x ideal, any model, any shard count."""
    rng = random.Random(11)
    for _ in range(200):
        specs = random_model(rng, rng.randrange(1, 30))
        m = rng.randrange(2, 9)
        limit = auto_max_shard_bytes(specs, m, elementwise=True)
        plan = build_plan(specs, m, limit)
        total = sum(s.numel for s in specs) * MASTER_ITEMSIZE
        ideal = total / m
        largest = max(s.numel * MASTER_ITEMSIZE for s in specs)
        if limit is None:  # nothing needed splitting: every tensor is already <= ideal / 8
            assert largest <= -(-total // (m * AUTO_PIECES_PER_SHARD))
        else:
            assert all(p.nbytes <= limit or p.row_end - p.row_start == 1 for ps in plan.pieces for p in ps)
        single_rows = max(
            (p.nbytes for ps in plan.pieces for p in ps if p.row_end - p.row_start == 1), default=0
        )  # a single row cannot be split further
        bound = ideal * (1 + 1 / AUTO_PIECES_PER_SHARD) + single_rows
        assert max(plan.shard_bytes()) <= bound + 1e-9, (plan.report(), limit)


def test_auto_limit_keeps_whole_tensors_when_splitting_would_change_the_update() -> None:
    specs = [TensorSpec("w", (1024, 1024)), TensorSpec("b", (1024,)), TensorSpec("v", (10, 1024))]
    assert auto_max_shard_bytes(specs, 2, elementwise=False) is None  # LAMB: trust ratio per tensor
    assert auto_max_shard_bytes(specs, 1, elementwise=True) is None  # one shard: nothing to balance
    assert auto_max_shard_bytes([TensorSpec(f"t{i}", (4,)) for i in range(32)], 2, elementwise=True) is None
    limit = auto_max_shard_bytes(specs, 2, elementwise=True)
    total = (1024 * 1024 + 1024 + 10 * 1024) * MASTER_ITEMSIZE
    assert limit == -(-total // 16)
    plan = build_plan(specs, 2, limit)
    assert plan.split_tensors() == ["w"] and plan.balance <= 1.125
    assert build_plan(specs, 2, None).balance > 1.8  # whole tensors: one server holds 99% of one half


def test_elementwise_optimizer_classes() -> None:
    import torch

    from ivyplug.optim import LAMB
    from ivyplug.ps.mirror import is_elementwise

    assert all(is_elementwise(c) for c in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop))
    assert not is_elementwise(LAMB)
    assert not is_elementwise(torch.optim.LBFGS)
    assert not is_elementwise(type("MyAdam", (torch.optim.Adam,), {}))  # a subclass may add layer-wise terms
