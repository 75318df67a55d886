"""int8/int4 pulls as differences from the copy a worker holds (wire/codecs.py ``PulledCopy``): the two ends stay
equal bit for bit, the copy tracks a moving master within half a step of the last difference (a float64
reference), a control that quantizes each move on its own drifts, and over a real wire (an ivyplug serve) a
worker whose copy the server does not hold is refused by name, and a restore pulls whole again.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from ivyplug.ps import PSClient, PSConfig
from ivyplug.ps.server.endpoints import PSServerError, WireEndpoint
from ivyplug.ps.wire.codecs import Bf16Codec, BlockCodec, PulledCopy
from tests.ps.test_block_codec import QMAX, ref_bound, ref_decode
from tests.ps.test_wire_dtype import ref_bf16

pytestmark = pytest.mark.usefixtures("one_thread")  # small tensors: no OpenMP spin-waits


def _ends(numel: int, quantized: int, bits: int) -> tuple[PulledCopy, PulledCopy]:
    """A server's and a worker's copy of one shard (float ranges: the parameters, then float buffers)."""

    def one() -> PulledCopy:
        return PulledCopy(BlockCodec(numel, quantized, bits), Bf16Codec(numel, [(0, numel)]))

    return one(), one()


@pytest.mark.parametrize("bits", [8, 4])
def test_both_ends_keep_one_copy_that_tracks_a_moving_master(bits: int) -> None:
    """300 pulls of a master that moves by a random step each time (and a buffer tail): the worker's values are
    the server's copy bit for bit, each within half a step of its difference's block (float64 reference), and
    the tracking error stays as small at the end as after the first pulls."""
    numel, quantized, rounds = 1000, 900, 300
    gen = torch.Generator().manual_seed(20 + bits)
    server, worker = _ends(numel, quantized, bits)
    master = torch.randn(numel, generator=gen)
    got = worker.decode_whole(server.encode_whole(master))
    torch.testing.assert_close(got, torch.from_numpy(ref_bf16(master.numpy())), rtol=0, atol=0)
    errors = []
    for _ in range(rounds):
        master[:quantized].add_(torch.randn(quantized, generator=gen) * 0.01)
        master[quantized:] = torch.randn(numel - quantized, generator=gen)  # buffers travel as they are
        assert server.values is not None
        diff = (master[:quantized] - server.values).double().numpy()
        words = server.encode(master)
        got = worker.decode(words)
        torch.testing.assert_close(worker.values, server.values, rtol=0, atol=0)
        torch.testing.assert_close(got[:quantized], worker.values, rtol=0, atol=0)
        torch.testing.assert_close(got[quantized:], master[quantized:], rtol=0, atol=0)
        # the reference: what the worker decodes is the difference within half a step of its block
        moved = ref_decode(words.numpy(), numel, quantized, bits)[:quantized]
        assert (np.abs(moved - diff) <= ref_bound(diff, quantized, bits) * (1 + 1e-6) + 1e-9).all()
        errors.append(float((master[:quantized] - got[:quantized]).abs().max()))
    step = 0.01 * 5 / QMAX[bits]  # half a step of a difference of about one move (|N(0, 1)| < 5 here)
    assert max(errors) <= step, (max(errors), step)
    assert np.median(errors[-50:]) <= 2 * np.median(errors[:50])  # nothing accumulates


@pytest.mark.parametrize("bits", [8, 4])
def test_control_quantizing_each_move_alone_drifts(bits: int) -> None:
    """The control: a worker that adds the quantized move of the master (not the difference from its copy)
    drifts with every pull, far past the copy's bound; the copy, on the same moves, stays within it."""
    numel, rounds = 1024, 300
    gen = torch.Generator().manual_seed(40 + bits)
    server, worker = _ends(numel, numel, bits)
    codec = BlockCodec(numel, numel, bits)
    master = torch.randn(numel, generator=gen)
    worker.decode_whole(server.encode_whole(master))
    naive = worker.values.clone() if worker.values is not None else None
    assert naive is not None
    move = torch.randn(numel, generator=gen) * 0.01  # the same move each time: rounding errs the same way
    for _ in range(rounds):
        master.add_(move)
        worker.decode(server.encode(master))
        naive.add_(codec.decode(codec.encode(move, feedback=False)))
    bound = float(ref_bound(move.double().numpy(), numel, bits).max()) * 2
    assert worker.values is not None
    assert float((master - worker.values).abs().max()) <= bound
    naive_err = (master - naive).abs().double().numpy()
    assert np.median(naive_err) > 10 * bound, float(np.median(naive_err))


def test_no_move_sends_zeros_and_misuse_is_refused() -> None:
    server, worker = _ends(300, 256, 4)
    master = torch.randn(300)
    with pytest.raises(ValueError, match="the first pull travels whole"):
        server.encode(master)
    with pytest.raises(ValueError, match="a difference cannot be applied"):
        worker.decode(torch.zeros(server.block.words))
    worker.decode_whole(server.encode_whole(master))
    before = worker.values.clone() if worker.values is not None else None
    worker.decode(server.encode(master))  # the copy is already the master's bf16: its difference is tiny
    worker.decode(server.encode(master))
    assert worker.values is not None and server.values is not None
    torch.testing.assert_close(worker.values, server.values, rtol=0, atol=0)
    assert before is not None and float((worker.values - master[:256]).abs().max()) <= float(
        (before - master[:256]).abs().max()
    )
    worker.forget()
    assert not worker.held
    with pytest.raises(ValueError, match="encode one shard"):
        PulledCopy(BlockCodec(10, 10, 8), Bf16Codec(12, [(0, 12)]))


# -- a real wire: workers of this process against ivyplug serve -------------------------------------------
def _client(address: str, wire: str, w: nn.Parameter) -> PSClient:
    cfg = PSConfig(mode="async", servers=address, token="t0ken", wire_dtype=wire, timeout=30.0)
    return PSClient.start(cfg, [("w", w)], [], torch.optim.SGD([w], lr=1.0))


@pytest.mark.timeout(120)
def test_a_restore_pulls_whole_and_an_unknown_copy_is_refused_by_name() -> None:
    """int4 against a serve: after load_state_dict the pull is the restored master itself (a pull that stays
    travels in fp32, and the copy was dropped: the next step's pull travels whole); a worker that claims a copy
    the server never sent is refused with an error that says so, and its push is not applied."""
    from tests.ps.service_harness import serve

    gen = torch.Generator().manual_seed(3)
    init = torch.randn(64, 40, generator=gen)
    with serve("--shards", "1", "--workers", "1", "--token", "t0ken") as s:
        w = nn.Parameter(init.clone())
        client = _client(s.address, "int4", w)
        try:
            client.pull_initial()
            saved = client.state_dict()
            saved_w = w.detach().clone()
            for _ in range(3):
                w.grad = torch.randn(64, 40, generator=gen)
                client.step(1)
            assert not torch.equal(w.detach(), saved_w)
            client.load_state_dict(saved)
            torch.testing.assert_close(w.detach(), init, rtol=0, atol=0)
            w.grad = torch.randn(64, 40, generator=gen)
            client.step(1)  # and differences again afterwards
        finally:
            client.close()

        before = _master(s.address)
        w2 = nn.Parameter(torch.zeros(64, 40))
        other = _client(s.address, "int8", w2)
        try:
            (ep,) = [e for e in other.topo.endpoints.values() if isinstance(e, WireEndpoint)]
            assert ep.pulled is not None
            ep.pulled.values = torch.zeros(64 * 40)  # a copy the server never sent
            w2.grad = torch.ones(64, 40)
            with pytest.raises(PSServerError, match="keeps no copy of it"):
                other.step(1)
        finally:
            other.close()
        after = _master(s.address)
    torch.testing.assert_close(after, before, rtol=0, atol=0)  # the refused push moved nothing


def _master(address: str) -> torch.Tensor:
    """The serve's master, pulled whole in fp32."""
    w = nn.Parameter(torch.zeros(64, 40))
    client = _client(address, "float32", w)
    try:
        client.pull_initial()
    finally:
        client.close()
    return w.detach().clone()
