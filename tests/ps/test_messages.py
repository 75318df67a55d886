from __future__ import annotations

import math

import pytest
import torch

from ivyplug.ps.server.mirror import OptimizerSpec
from ivyplug.ps.wire.messages import (
    HEADER_LEN,
    MAGIC,
    Header,
    Kind,
    arg_float,
    bytes_to_words,
    float_arg,
    words_to_bytes,
)


def test_header_round_trip_and_fixed_size() -> None:
    h = Header(kind=Kind.PUSH_PULL, sender=3, shard=2, numel=10, n_hyper=4, seq=7, flags=1, arg0=-1, arg1=2**40)
    t = h.encode()
    assert t.shape == (HEADER_LEN,) and t.dtype == torch.int64
    assert Header.decode(t) == h


def test_header_refuses_foreign_or_newer_messages() -> None:
    t = Header(kind=Kind.PULL, sender=0).encode()
    bad = t.clone()
    bad[0] = 12345
    with pytest.raises(RuntimeError, match="bad header magic"):
        Header.decode(bad)
    newer = t.clone()
    newer[1] = 99
    with pytest.raises(RuntimeError, match="wire version 99"):
        Header.decode(newer)
    assert int(t[0]) == MAGIC


@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 1001])
def test_bytes_travel_unchanged_in_fp32_words(n: int) -> None:
    blob = bytes((i * 37 + 11) % 256 for i in range(n))
    words = bytes_to_words(blob)
    assert words.dtype == torch.float32 and words.numel() == (n + 3) // 4
    assert words_to_bytes(words, n) == blob


def test_hyperparameters_encode_numbers_tuples_and_tensors() -> None:
    p = torch.zeros(2, requires_grad=True)
    opt = torch.optim.Adam([p], lr=torch.tensor(0.01), betas=(0.8, 0.9), weight_decay=0.0)
    spec = OptimizerSpec.from_optimizer(opt, [p])
    opt.param_groups[0]["betas"] = (0.5, 0.25)
    opt.param_groups[0]["lr"].fill_(0.125)
    values = spec.encode(opt)
    assert values.dtype == torch.float64
    server_opt, groups = spec.build({0: [torch.zeros(2, requires_grad=True)]})
    spec.decode_into(values, groups)
    g = server_opt.param_groups[0]
    assert g["betas"] == (0.5, 0.25) and float(g["lr"]) == 0.125 and g["amsgrad"] is False
    with pytest.raises(ValueError, match="expected"):
        spec.decode_into(values[:-1], groups)
    with pytest.raises(ValueError, match=r"torch.optim.Optimizer"):
        OptimizerSpec.from_optimizer(object(), [p])


def test_a_float_travels_bit_exact_in_a_header_field() -> None:
    values = [0.0, -0.0, 1.5e-300, 123.456, -(2.0**60), math.inf, -math.inf]
    for v in values:
        h = Header.decode(Header(kind=Kind.REPLY, sender=0, arg3=float_arg(v)).encode())
        back = arg_float(h.arg3)
        assert back == v and math.copysign(1.0, back) == math.copysign(1.0, v), v
    nan = Header.decode(Header(kind=Kind.REPLY, sender=0, arg3=float_arg(math.nan)).encode())
    assert math.isnan(arg_float(nan.arg3))
