"""LAMB tensors split across sync shards take their whole tensor's trust ratio (two in-process shards)."""

from __future__ import annotations

from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np
import pytest
import torch

from ivyplug.optim import LAMB
from ivyplug.ps import PSConfig
from ivyplug.ps.server.mirror import OptimizerSpec
from ivyplug.ps.server.shard import Reply, Shard, load_state_bytes
from ivyplug.ps.server.split_trust import combines_trust, holders
from ivyplug.ps.sharding import TensorSpec, build_plan
from ivyplug.ps.wire.push import hyper_prefix
from ivyplug.ps.worker.layout import FlatLayout
from tests.optim.reference import RefGroup, RefLamb

SHAPES = {"w": (12, 5), "zeros": (6, 4), "unused": (8, 3), "bias": (5,)}
LR, WEIGHT_DECAY = 0.05, 0.01


def _lamb(params: list[torch.Tensor]) -> LAMB:
    return LAMB(params, lr=LR, weight_decay=WEIGHT_DECAY)


def _params(gen: torch.Generator) -> list[tuple[str, torch.Tensor]]:
    out = []
    for name, shape in SHAPES.items():
        t = torch.zeros(shape) if name == "zeros" else torch.randn(shape, generator=gen)
        if name == "w":  # row blocks of very different sizes: a ratio per piece would differ from the tensor's
            t[:4] *= 100.0
        out.append((name, t.requires_grad_(True)))
    return out


def _job(
    gen: torch.Generator, mode: str = "sync", workers: int = 2, max_shard_bytes: int = 64
) -> tuple[list[Shard], FlatLayout, list[torch.Tensor]]:
    named = _params(gen)
    opt = _lamb([p for _, p in named])
    spec = OptimizerSpec.from_optimizer(opt, [p for _, p in named])
    plan = build_plan([TensorSpec(n, tuple(p.shape)) for n, p in named], 2, max_shard_bytes)
    layout = FlatLayout(plan, named, [])
    full = layout.flat_local()
    cfg = PSConfig(mode=mode, max_shard_bytes=max_shard_bytes)
    shards = [Shard(s, plan, cfg, workers, spec, layout.shard_values(full, s)) for s in range(2)]
    for sh in shards:  # the exchange goes shard to shard, here in-process
        sh.connect_peers({other.shard: other for other in shards})
    return shards, layout, [p for _, p in named]


def _hyper(
    shard: Shard, num_samples: int, has_grad: list[bool], clip: float, opt: LAMB, number: int = 0
) -> torch.Tensor:
    prefix = hyper_prefix(has_grad, num_samples, push_number=number, max_grad_norm=clip)
    return torch.cat([prefix, shard.spec.encode(opt)])


def _run(mode: str, clip: float, steps: int = 4) -> tuple[list[torch.Tensor], list[np.ndarray], list[np.ndarray]]:
    """Two workers' sync steps (async: one worker's pushes) on two shards, shard 1 first; returns the shards' tensors,
    a float64 LAMB of the whole tensors on the sample-weighted mean gradient, and the same LAMB with every piece a
    tensor of its own (a ratio per piece)."""
    gen = torch.Generator().manual_seed(11)
    samples = [3, 5] if mode == "sync" else [4]
    shards, layout, params = _job(gen, mode, len(samples))
    plan = shards[0].plan
    assert {plan.specs[t].name for t in holders(plan)} >= {"w", "zeros", "unused"}
    assert all(sh.split is not None and sh.split.peers == [1 - sh.shard] for sh in shards)
    x0 = [p.detach().double().numpy().copy() for p in params]
    opt = _lamb(params)
    has_grad = [name != "unused" for name in SHAPES]
    stepped = [t for t, has in enumerate(has_grad) if has]  # a tensor without any gradient is left alone
    group = RefGroup(stepped, lr=LR, weight_decay=WEIGHT_DECAY)
    whole = RefLamb(x0, [group], max_grad_norm=clip if clip >= 0 else None)
    # the control: each piece (row block) a tensor of its own
    cuts = {t: sorted((p.row_start, p.row_end) for s in range(2) for p in plan.pieces[s] if p.index == t)
            for t in range(len(params))}  # fmt: skip
    blocks = [x0[t][a:b] for t in range(len(params)) for a, b in cuts[t]]
    of_stepped = [k for k, (t, _) in enumerate((t, c) for t in range(len(params)) for c in cuts[t]) if has_grad[t]]
    per_piece = RefLamb(blocks, [RefGroup(of_stepped, lr=LR, weight_decay=WEIGHT_DECAY)],
                        max_grad_norm=clip if clip >= 0 else None)  # fmt: skip
    for step in range(steps):
        # a worker pushes zeros where it has no gradient (FlatLayout.pack)
        grads = [[torch.randn(p.shape, generator=gen) * has for p, has in zip(params, has_grad, strict=True)]
                 for _ in samples]  # fmt: skip
        pushes = []
        for w, n in enumerate(samples):
            for p, g in zip(params, grads[w], strict=True):
                p.grad = g
            pushes.append(
                [
                    (sh, layout.pack(sh.shard, 1.0).clone(), _hyper(sh, n, has_grad, clip, opt, 100 + step))
                    for sh in shards
                ]
            )
        replies = [sh.push_pull(w, data, hyper) for w, push in enumerate(pushes) for sh, data, hyper in reversed(push)]
        for reply in replies:
            reply.result(1.0).release()
        mean = [np.sum([n * grads[w][t].double().numpy() for w, n in enumerate(samples)], axis=0) / sum(samples)
                for t in range(len(params))]  # fmt: skip
        whole.step(mean)
        per_piece.step([mean[t][a:b] for t in range(len(params)) for a, b in cuts[t]])
    got = []
    for t, spec in enumerate(plan.specs):
        rows = sorted((p.row_start, sh.masters[sh.param_pieces.index(p)]) for sh in shards for p in sh.param_pieces
                      if p.index == t)  # fmt: skip
        got.append(torch.cat([m.detach().reshape(-1, *spec.shape[1:]) for _, m in rows]).reshape(spec.shape))
    glued = []
    k = 0
    for t in range(len(params)):
        n = len(cuts[t])
        glued.append(np.concatenate(per_piece.params[k : k + n]))
        k += n
    return got, whole.params, glued


@pytest.mark.parametrize(("mode", "clip"), [("sync", -1.0), ("sync", 0.5), ("async", -1.0)])
def test_split_lamb_tensors_step_with_the_whole_tensors_ratio(mode: str, clip: float) -> None:
    """Against a float64 LAMB over whole tensors, with and without sync's global clipping (both exchanges), a zero
    tensor (ratio 1 on every piece) and a split tensor no worker has a gradient for (left alone)."""
    got, whole, per_piece = _run(mode, clip)
    for t, (g, want) in enumerate(zip(got, whole, strict=True)):
        torch.testing.assert_close(g.double(), torch.from_numpy(want), rtol=2e-5, atol=2e-6, msg=f"tensor {t}")
    assert torch.equal(got[2], _params(torch.Generator().manual_seed(11))[2][1].detach())  # "unused": untouched
    assert got[1].abs().sum() > 0  # the zero tensor moved (ratio 1)
    # the control: a ratio per piece gives another result on these inputs
    assert not np.allclose(got[0].double().numpy(), per_piece[0], rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(per_piece[3], whole[3])  # an unsplit tensor is the same either way


def test_a_split_step_waits_for_the_other_shards_sums_and_says_so() -> None:
    gen = torch.Generator().manual_seed(3)
    shards, layout, params = _job(gen)
    opt = _lamb(params)
    has_grad = [True] * len(params)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    replies = []
    for w in range(2):  # both workers push to shard 0 only: it waits for shard 1's sums
        replies.append(shards[0].push_pull(w, layout.pack(0, 1.0).clone(), _hyper(shards[0], 4, has_grad, -1.0, opt)))
    with pytest.raises(FutureTimeout):
        replies[0].result(0.05)
    assert "trust-ratio sums of step 0" in shards[0].sync_wait() and "[1]" in shards[0].sync_wait()
    for w in range(2):
        replies.append(shards[1].push_pull(w, layout.pack(1, 1.0).clone(), _hyper(shards[1], 4, has_grad, -1.0, opt)))
    for reply in replies:
        assert reply.result(1.0).version == 1


def test_only_lamb_combines() -> None:
    assert combines_trust(LAMB)
    assert not combines_trust(torch.optim.AdamW)


def test_async_pushes_in_other_orders_on_each_shard_all_finish_and_each_reply_waits_for_its_own_sums() -> None:
    """Worker 0 pushes to shard 0 and worker 1 to shard 1 first: each reply waits for the other shard's half of that
    push (never for another worker's), and nothing deadlocks whatever the order."""
    gen = torch.Generator().manual_seed(5)
    shards, layout, params = _job(gen, "async", workers=2)
    opt = _lamb(params)
    has_grad = [True] * len(params)

    def push(w: int, s: int, number: int) -> Future[Reply]:
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        return shards[s].push_pull(w, layout.pack(s, 1.0).clone(), _hyper(shards[s], 4, has_grad, -1.0, opt, number))

    first = [push(0, 0, 7), push(1, 1, 9)]
    for reply in first:
        with pytest.raises(FutureTimeout):
            reply.result(0.05)
    assert shards[0].split is not None and shards[0].split.waits(0) and not shards[0].split.waits(1)
    second = [push(1, 0, 9)]
    second[0].result(1.0).release()  # worker 1's push is complete on shard 0: both halves' sums are in
    with pytest.raises(FutureTimeout):
        first[0].result(0.05)
    second.append(push(0, 1, 7))
    for reply in [*first, second[1]]:
        reply.result(1.0).release()
    for sh in shards:
        assert sh.split is not None and not sh.split.waits(0) and not sh.split.waits(1)
        assert all(bool(torch.isfinite(m).all()) for m in sh.masters)


def test_a_split_step_after_a_restored_state_continues_exactly_and_follows_the_learning_rate() -> None:
    """Sync: two steps, a checkpoint of both shards, two more steps at a new learning rate; fresh shards loaded from
    the checkpoint end bit for bit where the first ones did (the split pieces read the loaded groups' lr)."""
    gen = torch.Generator().manual_seed(21)
    grads = [[torch.randn(shape) for shape in SHAPES.values()] for _ in range(4)]

    def steps(shards: list[Shard], layout: FlatLayout, params: list[torch.Tensor], which: range, lr: float) -> None:
        opt = _lamb(params)
        for group in opt.param_groups:
            group["lr"] = lr
        for k in which:
            for p, g in zip(params, grads[k], strict=True):
                p.grad = g
            hyper = [_hyper(sh, 4, [True] * len(params), -1.0, opt) for sh in shards]
            replies = [sh.push_pull(0, layout.pack(sh.shard, 1.0).clone(), hyper[sh.shard]) for sh in shards]
            for reply in replies:
                reply.result(1.0).release()

    shards, layout, params = _job(gen, "sync", workers=1)
    steps(shards, layout, params, range(2), LR)
    saved = [load_state_bytes(sh.state()) for sh in shards]
    steps(shards, layout, params, range(2, 4), LR / 10)
    fresh, fresh_layout, fresh_params = _job(torch.Generator().manual_seed(99), "sync", workers=1)
    for sh, state in zip(fresh, saved, strict=True):
        sh.load(state)
    steps(fresh, fresh_layout, fresh_params, range(2, 4), LR / 10)
    for a, b in zip(shards, fresh, strict=True):
        for m, n in zip(a.masters, b.masters, strict=True):
            assert torch.equal(m, n)
    # the control: the same two steps at the first learning rate end elsewhere
    other, other_layout, other_params = _job(torch.Generator().manual_seed(99), "sync", workers=1)
    for sh, state in zip(other, saved, strict=True):
        sh.load(state)
    steps(other, other_layout, other_params, range(2, 4), LR)
    w = next(i for i, p in enumerate(other[0].param_pieces) if p.index == 0)
    assert not torch.equal(other[0].masters[w], shards[0].masters[w])
