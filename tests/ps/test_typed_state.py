"""The typed state encoding: exact round trips, and a clear ValueError (never code) for anything else."""

from __future__ import annotations

import contextlib
import pickle
import random
import struct
from pathlib import Path, PurePosixPath

import numpy as np
import pytest
import torch

from ivyplug.ps.wire import typed_state


def _optimizer_state() -> dict:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01), betas=(0.9, 0.99), weight_decay=0.0)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return {
        "shard": 1,
        "version": 2**40 + 3,
        "clock": [1, 2],
        "params": [p.detach().clone() for p in model.parameters()],
        "buffers": torch.randn(7),
        "ints": torch.tensor([2**62, -5], dtype=torch.int64),
        "half": torch.randn(3, dtype=torch.bfloat16),
        "mask": torch.tensor([True, False]),
        "optimizer": opt.state_dict(),
        "odd": {"nan": float("nan"), "inf": float("-inf"), "none": None, "flag": True, "t": (1, 2.5, "x")},
        "empty": torch.zeros(0, 3),
    }


def _same(a: object, b: object) -> None:
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    elif isinstance(a, float) and a != a:
        assert isinstance(b, float) and b != b
    else:
        assert a == b


def test_round_trip_is_exact_for_an_optimizer_state_and_odd_values() -> None:
    state = _optimizer_state()
    _same(typed_state.decode(typed_state.encode(state)), state)


def test_paths_come_back_as_paths() -> None:
    got = typed_state.decode(typed_state.encode({"dir": Path("/runs/a"), "pure": PurePosixPath("b/c"), "s": "/x"}))
    assert got == {"dir": Path("/runs/a"), "pure": Path("b/c"), "s": "/x"} and isinstance(got["s"], str)
    doc = b'{"p":[1]}'
    bad = struct.pack("<4sIQ", b"IVYS", 1, len(doc)) + doc
    with pytest.raises(ValueError, match="malformed PS state path"):
        typed_state.decode(bad)


def test_numpy_arrays_and_scalars_come_back_as_numpy() -> None:
    rng = np.random.default_rng(0)
    value = {"a": rng.normal(size=(2, 3)), "i": np.arange(5, dtype=np.int8), "n": np.int64(2**40), "b": np.bool_(1)}
    value["f"], value["empty"] = np.float32(0.25), np.zeros((0, 4), dtype=np.float32)
    value["d"], value["nan"] = np.float64(rng.normal()), np.float64("nan")  # float64 is a Python float too
    got = typed_state.decode(typed_state.encode(value))
    for key, want in value.items():
        assert type(got[key]) is type(want) and got[key].dtype == want.dtype, key
        np.testing.assert_array_equal(got[key], want)
    for bad in (np.array(["x"]), np.complex64(1), np.array([object()])):
        with pytest.raises(ValueError, match="cannot encode a NumPy"):
            typed_state.encode(bad)


def test_a_pickle_or_a_torch_save_blob_is_refused() -> None:
    with pytest.raises(ValueError, match="not a PS state"):
        typed_state.decode(pickle.dumps({"a": 1}))
    with pytest.raises(ValueError, match="cannot encode a set"):
        typed_state.encode({"a": {1, 2}})


def test_malformed_blobs_raise_value_error_never_anything_else() -> None:
    good = typed_state.encode(_optimizer_state())
    rng = random.Random(0)
    bad = [good[:n] for n in (0, 3, 10, len(good) // 2, len(good) - 1)]
    bad.append(struct.pack("<4sIQ", b"IVYS", 99, 2) + b"{}")
    bad.append(struct.pack("<4sIQ", b"IVYS", 1, 30) + b'{"T":["float32",[1000],0,4000]}')
    bad.append(struct.pack("<4sIQ", b"IVYS", 1, 22) + b'{"T":["object",[1],0,8]}')
    bad.append(struct.pack("<4sIQ", b"IVYS", 1, 12) + b'{"d":[[{"l":[]},1]]}')
    for doc in (b'{"g":["int8",1000]}', b'{"g":["uint8",-1]}', b'{"g":["int64",1e300]}', b'{"N":{"p":"x"}}'):
        bad.append(struct.pack("<4sIQ", b"IVYS", 1, len(doc)) + doc)  # NumPy values that do not fit
    for _ in range(200):  # random byte flips in the JSON part
        blob = bytearray(good)
        for _ in range(3):
            blob[rng.randrange(16, min(len(blob), 400))] = rng.randrange(256)
        bad.append(bytes(blob))
    bad.append(struct.pack("<4sIQ", b"IVYS", 1, 40_000) + b'{"l":[' * 10_000 + b"]}" * 10_000)
    for blob in bad:
        with contextlib.suppress(ValueError):  # any other exception fails the test
            typed_state.decode(blob)
