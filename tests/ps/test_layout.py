"""FlatLayout: packing a shard's gradients and buffers, unpacking a reply; through one staged flat buffer
(the CUDA path, forced here on the CPU by ``force_staging``) exactly as piece by piece."""

from __future__ import annotations

import pytest
import torch

from ivyplug.ps.sharding import build_plan, tensor_specs
from ivyplug.ps.worker.layout import FlatLayout
from tests.ps.introspection import force_staging


def _model(seed: int) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    params = [
        ("w", torch.nn.Parameter(torch.randn(40, 30, generator=g))),
        ("big", torch.nn.Parameter(torch.randn(64, 50, generator=g))),  # cut into row blocks across shards
        ("b", torch.nn.Parameter(torch.randn(30, generator=g))),
        ("unused", torch.nn.Parameter(torch.randn(7, generator=g))),  # no gradient
        ("scalar", torch.nn.Parameter(torch.randn((), generator=g))),
    ]
    for name, p in params:
        if name != "unused":
            p.grad = torch.randn(p.shape, generator=g)
    buffers = [("mean", torch.randn(30, generator=g)), ("steps", torch.tensor(2**40 + 3))]
    return params, buffers


def _layouts() -> tuple[FlatLayout, FlatLayout]:
    (p1, b1), (p2, b2) = _model(0), _model(0)
    plan = build_plan(tensor_specs(p1, b1), 2, max_shard_bytes=4 * 64 * 20)
    assert plan.split_tensors()  # the row blocks of "big" are on both shards
    return force_staging(FlatLayout(plan, p1, b1), False), force_staging(FlatLayout(plan, p2, b2), True)


@pytest.mark.parametrize("clip", [1.0, 0.5])
def test_a_staged_pack_equals_the_piece_by_piece_pack(clip: float) -> None:
    plain, staged = _layouts()
    for s in range(plain.plan.num_shards):
        assert plain.staging_device(s) is None and staged.staging_device(s) == torch.device("cpu")
        a, b = plain.pack(s, clip).clone(), staged.pack(s, clip)
        assert torch.equal(a, b)
        assert b.data_ptr() == staged.packed(s).data_ptr()  # the shard's reused host buffer
        sent = staged.payload(s, clip, split=True)  # staged: the one copy off the device (the endpoint cuts it)
        assert isinstance(sent, torch.Tensor) and sent.data_ptr() == staged.packed(s).data_ptr()
        assert torch.equal(sent, a)


def test_a_staged_unpack_equals_the_piece_by_piece_unpack() -> None:
    plain, staged = _layouts()
    g = torch.Generator().manual_seed(5)
    for s in range(plain.plan.num_shards):
        reply = torch.randn(plain.plan.shard_numel(s), generator=g)
        for p in plain.plan.pieces[s]:
            if not p.is_float:  # integer words: the bits of an int64
                reply[p.offset : p.offset + p.numel] = torch.tensor([2**41 + s], dtype=torch.int64).view(torch.float32)
        plain.unpack(s, reply)
        staged.unpack(s, reply.clone())
    for (_, a), (_, b) in zip(plain.params + plain.buffers, staged.params + staged.buffers, strict=True):
        assert torch.equal(a, b)
    assert int(plain.buffers[1][1]) in (2**41, 2**41 + 1)  # exact: travelled as bits


def test_the_default_stages_only_cuda_tensors() -> None:
    params, buffers = _model(1)
    layout = FlatLayout(build_plan(tensor_specs(params, buffers), 1), params, buffers)
    assert layout.staging_device(0) is None
    assert not layout.host_buffer(10, 0).is_pinned()
