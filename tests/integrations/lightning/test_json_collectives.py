"""Byte-tensor collectives over the default group: typed broadcasts round-trip, a value only pickle could carry is
refused (the two-rank case runs in test_stages), and NCCL alone gets CUDA tensors."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from ivyplug.integrations.lightning import json_collectives

from tests.ports import free_port


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    """A one-rank default group; an in-process one-device fit earlier in this process keeps its own until exit (as
    Lightning's strategies do between stages), and that one serves as well."""
    if dist.is_initialized():
        assert dist.get_world_size() == 1, "a default group of several ranks is left over from another test"
        yield
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_typed_broadcast_keeps_types_and_values(one_rank_group: None) -> None:
    value = {"path": "/a/b.ckpt", 3: [1.5, None, True], "big": 2**70, "nan": float("nan"), "t": torch.arange(4.0)}
    got = json_collectives.broadcast_typed(value)
    assert got.keys() == value.keys() and isinstance(got[3], list) and got["big"] == 2**70
    torch.testing.assert_close(got["t"], value["t"])
    assert got["nan"] != got["nan"] and got[3] == [1.5, None, True] and got["path"] == "/a/b.ckpt"
    assert json_collectives.broadcast_json({"x": [1, 2.5]}) == {"x": [1, 2.5]}
    assert json_collectives.all_gather_json("me", 1) == ["me"]


def test_typed_broadcast_refuses_what_only_pickle_carries(one_rank_group: None) -> None:
    with pytest.raises(ValueError, match="cannot broadcast a set from rank 0 without pickle"):
        json_collectives.broadcast_typed({1, 2})
    assert json_collectives.broadcast_typed(("after", 1)) == ("after", 1)  # the group is still in step


def test_nccl_alone_takes_cuda_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist, "get_backend", lambda: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert json_collectives._device() == torch.device("cuda", 1)
    monkeypatch.setattr(dist, "get_backend", lambda: "cpu:gloo,cuda:nccl")
    assert json_collectives._device() == torch.device("cpu")
