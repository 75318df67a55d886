"""``wire_dtype="int8"`` / ``"int4"``: the block codec against a float64 reference and an independent decoder,
error feedback (its bound over many rounds, and the control without it that drifts), the option's refusals,
and a real gloo wire (an ivyplug serve) where the servers apply exactly the decoded push, pulls are bf16 and
the bytes shrink as documented.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from ivyplug.optim import LocalUpdates
from ivyplug.ps import PSConfig
from ivyplug.ps.wire.codecs import BLOCK, PULL_BITS, BlockCodec
from tests.ps.test_wire_dtype import _half_ulp_bf16, _serve_run, ref_bf16

pytestmark = pytest.mark.usefixtures("one_thread")  # small tensors: no OpenMP spin-waits

QMAX = {8: 127, 4: 7}


def ref_decode(words: np.ndarray, numel: int, quantized: int, bits: int, block: int = BLOCK) -> np.ndarray:
    """An independent decoder of the documented layout (scales, packed integers, plain fp32 tail), in numpy."""
    blocks = -(-quantized // block)
    qbytes = blocks * block if bits == 8 else blocks * block // 2
    tail = numel - quantized
    words = np.asarray(words, dtype=np.float32)
    scales = words[:blocks].astype(np.float64)
    raw = words[blocks : len(words) - tail].view(np.uint8)[:qbytes]
    if bits == 8:
        q = raw.view(np.int8).astype(np.float64)
    else:
        q = np.stack([raw & 0x0F, raw >> 4], axis=1).reshape(-1).astype(np.float64) - 8.0
    assert np.all(np.abs(q) <= QMAX[bits])
    deq = (q.reshape(blocks, block) * scales[:, None]).reshape(-1)[:quantized]
    return np.concatenate([deq, words[len(words) - tail :].astype(np.float64)])


def ref_bound(x: np.ndarray, quantized: int, bits: int, block: int = BLOCK) -> np.ndarray:
    """Per value, half a quantization step of its block in float64: max|x| over the block / (2 qmax)."""
    padded = np.zeros(-(-quantized // block) * block)
    padded[:quantized] = np.abs(x[:quantized].astype(np.float64))
    step = padded.reshape(-1, block).max(axis=1) / QMAX[bits]
    return np.repeat(step / 2, block)[:quantized]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(("numel", "quantized"), [(1000, 700), (BLOCK * 3, BLOCK * 3), (37, 0), (301, 300)])
def test_codec_against_a_float64_reference(bits: int, numel: int, quantized: int) -> None:
    gen = torch.Generator().manual_seed(bits * 1000 + numel)
    # blocks of very different magnitudes, a zero block and a lone large value
    flat = torch.randn(numel, generator=gen) * torch.logspace(-6, 3, numel).flip(0)
    if quantized >= 2 * BLOCK:
        flat[BLOCK : 2 * BLOCK] = 0.0
        flat[5] = 1e4
    codec = BlockCodec(numel, quantized, bits)
    words = codec.encode(flat, feedback=False)
    assert words.dtype == torch.float32 and words.numel() == codec.words
    blocks = -(-quantized // BLOCK)
    assert codec.words == blocks + -(-blocks * BLOCK * bits // 32) + numel - quantized
    back = codec.decode(words)
    # the codec's decoder and an independent one agree exactly (q * scale is exact in float64, and an fp32
    # product is that value correctly rounded)
    expect = ref_decode(words.numpy(), numel, quantized, bits).astype(np.float32)
    torch.testing.assert_close(back, torch.from_numpy(expect), rtol=0, atol=0)
    # the quantized part is within half a step of its block, the tail exact
    x = flat.double().numpy()
    err = np.abs(back.double().numpy()[:quantized] - x[:quantized])
    bound = ref_bound(x, quantized, bits) * (1 + 1e-6) + 1e-30
    assert (err <= bound).all(), float((err / bound).max())
    assert torch.equal(back[quantized:], flat[quantized:])
    if quantized >= 2 * BLOCK:
        assert torch.equal(back[BLOCK : 2 * BLOCK], torch.zeros(BLOCK))  # a zero block decodes to exact zeros
        assert float(back[5]) == pytest.approx(1e4, rel=1e-6)  # a block's largest value is exact (q = ±qmax)
    with pytest.raises(ValueError, match=f"encodes {numel} values"):
        codec.encode(flat[:-1])
    with pytest.raises(ValueError, match=f"has {codec.words} words"):
        codec.decode(words[:-1])


def test_integer_bits_in_the_tail_travel_exactly() -> None:
    grads = torch.randn(300)
    ints = torch.tensor([2**40 + 3, -7], dtype=torch.int64)
    flat = torch.cat([grads, ints.view(torch.float32)])
    for bits in (8, 4):
        codec = BlockCodec(flat.numel(), 300, bits)
        back = codec.decode(codec.encode(flat))
        assert torch.equal(back[300:].clone().view(torch.int64), ints)


def test_bad_arguments_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="bits must be 8 or 4, got 2"):
        BlockCodec(10, 10, 2)
    with pytest.raises(ValueError, match=r"quantized must be in \[0, numel=10\], got 11"):
        BlockCodec(10, 11, 8)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("feedback", [True, False])
def test_error_feedback_keeps_the_accumulated_error_below_one_step(bits: int, feedback: bool) -> None:
    """200 pushes of the same vector (rounding errs the same way each time): with feedback the decoded pushes
    sum to the true sum less the carried error, at most half a step of the last push's block; without it (the
    control) the error grows with every push, far past that bound."""
    rounds, numel = 200, 1000
    gen = torch.Generator().manual_seed(7 + bits)
    x = torch.randn(numel, generator=gen) * 0.01
    codec = BlockCodec(numel, numel, bits)
    total = np.zeros(numel)
    for _ in range(rounds):
        total += ref_decode(codec.encode(x, feedback=feedback).numpy(), numel, numel, bits)
    err = np.abs(total - rounds * x.double().numpy())
    # the last push encoded x + e with |e| <= half a step: its step is at most max|x| (1 + 1/(2 qmax)) / qmax
    bound = ref_bound(x.double().numpy(), numel, bits) * (1 + 1 / QMAX[bits]) + rounds * 1e-9
    if feedback:
        assert (err <= bound).all(), float((err / bound).max())
        assert codec.residual is not None
        torch.testing.assert_close(
            torch.from_numpy(rounds * x.double().numpy() - total), codec.residual.double(), rtol=0, atol=1e-6
        )
    else:
        assert (err > 10 * bound).mean() > 0.5, float(np.median(err / bound))
        assert codec.residual is None


@pytest.mark.parametrize("wire", ["int8", "int4"])
def test_the_option_is_accepted_and_refused_with_early_pushes(wire: str) -> None:
    assert PSConfig(wire_dtype=wire).wire_dtype == wire
    with pytest.raises(ValueError, match=f"overlap_backward=True cannot be combined with wire_dtype='{wire}'"):
        PSConfig(wire_dtype=wire, overlap_backward=True)


def _quantized(codec: BlockCodec, x: np.ndarray) -> np.ndarray:
    """``x`` encoded by ``codec`` (no feedback), decoded by the reference (a zero 2-word tail)."""
    n = codec.quantized
    flat = torch.cat([torch.from_numpy(x.reshape(-1).astype(np.float32)), torch.zeros(codec.numel - n)])
    return ref_decode(codec.encode(flat, feedback=False).numpy(), codec.numel, n, codec.bits)[:n].astype(np.float32)


# -- a real wire: a worker of this process against ivyplug serve (test_wire_dtype's _serve_run) ---------------
@pytest.mark.timeout(120)
def test_against_ivyplug_serve_the_server_applies_the_decoded_push_with_error_feedback() -> None:
    """An fp32 worker, then an int8 and an int4 worker continuing the job: the servers' master steps by exactly
    the decoded push (the gradient plus the error carried from the worker's earlier pushes), the first pull
    (``pull_initial``) is the master's bf16 rounding and each later one the copy moved by the int8 difference from
    it, the integer buffer is exact, pushes shrink to about 1/3.9 and 1/7.5 and the steps' pulls to about 1/3.9
    (int8 differences)."""
    from tests.ps.service_harness import serve

    gen = torch.Generator().manual_seed(12)
    shape = (200, 100)
    init = torch.randn(shape, generator=gen)
    runs: dict[str, tuple[list[torch.Tensor], torch.Tensor | None, dict[str, Any]]] = {}
    with serve("--shards", "1", "--workers", "1", "--token", "t0ken") as s:
        for wire in ("float32", "int8", "int4"):
            grads = [torch.randn(shape, generator=gen) for _ in range(3)]
            later = None if wire == "float32" else torch.randn(shape, generator=gen)
            start = init if wire == "float32" else torch.zeros(shape)
            runs[wire] = (grads, later, _serve_run(s.address, wire, start, grads, later))
    master = init.numpy().astype(np.float32)
    for wire, (grads, later, run) in runs.items():
        if wire == "float32":
            expect = [master]
            for g in grads:
                master = (master - g.numpy()).astype(np.float32)
                expect.append(master)
        else:
            bits = 8 if wire == "int8" else 4
            n = init.numel()
            pushes = functools.partial(_quantized, BlockCodec(n + 2, n, bits))
            pulls = functools.partial(_quantized, BlockCodec(n + 2, n, PULL_BITS))  # int8, whatever the pushes
            copy = ref_bf16(master)  # pull_initial: a step's first pull, whole in bf16; both ends keep it
            expect = [copy]
            carried = np.zeros(n, dtype=np.float32)
            for g in grads:  # the reference worker: encode g + e, keep e <- g + e - decoded
                x = g.numpy().reshape(-1) + carried
                decoded = pushes(x)
                carried = (x - decoded).astype(np.float32)
                master = (master - decoded.reshape(shape)).astype(np.float32)
                # then the quantized difference from the copy, which both ends move by it
                copy = (copy + pulls((master - copy).astype(np.float32)).reshape(shape)).astype(np.float32)
                expect.append(copy)
            # sync()'s pull is the master, exact; neither end moves its copy for it, so the next step's pull is
            # the difference from the copy held before it
            torch.testing.assert_close(run["synced"], torch.from_numpy(master), rtol=0, atol=0, msg=f"{wire} sync")
            assert later is not None
            x = later.numpy().reshape(-1) + carried
            master = (master - pushes(x).reshape(shape)).astype(np.float32)
            copy = (copy + pulls((master - copy).astype(np.float32)).reshape(shape)).astype(np.float32)
            torch.testing.assert_close(run["pulled_later"], torch.from_numpy(copy), rtol=0, atol=0, msg=wire)
        for step, (got, want) in enumerate(zip(run["pulled"], expect, strict=True)):
            torch.testing.assert_close(got, torch.from_numpy(want), rtol=0, atol=0, msg=f"{wire} pull {step}")
        assert run["counter"] == 2**40 + 3
    fp32 = runs["float32"][2]["traffic"]
    for wire, (low, high) in (("int8", (0.25, 0.27)), ("int4", (0.13, 0.15))):
        sent = runs[wire][2]["traffic"]["bytes_sent"] / fp32["bytes_sent"]
        received = runs[wire][2]["traffic"]["bytes_received"] / fp32["bytes_received"]
        assert low <= sent <= high, (wire, sent)
        # the steps' three pulls: int8 differences, as small as int8 pushes (the first, whole in bf16, came before)
        assert 0.25 <= received <= 0.27, (wire, received)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("wire", ["int8", "int4"])
def test_averaged_deltas_through_a_quantized_wire_sum_to_the_true_deltas(wire: str) -> None:
    """outer="average" at rate 1 against an ivyplug serve, 40 merges of the same delta: the servers' copy moves
    by the deltas' true sum less at most one quantization step of the last delta (error feedback)."""
    from tests.ps.service_harness import serve

    bits, rounds = (8 if wire == "int8" else 4), 40
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(30, 20), nn.Tanh(), nn.Linear(20, 4))
    opt = LocalUpdates(torch.optim.SGD(model.parameters(), lr=0.1), sync_every=10**6, merge_rate=1.0)
    with serve("--shards", "1", "--workers", "1", "--token", "t0ken") as s:
        cfg = PSConfig(mode="async", servers=s.address, token="t0ken", wire_dtype=wire, timeout=60.0)
        client = opt.start_ps(cfg, list(model.named_parameters()))
        try:
            x0 = [p.detach().double().numpy().copy() for p in model.parameters()]
            gen = torch.Generator().manual_seed(5)
            delta = [torch.randn(p.shape, generator=gen) * 0.01 for p in model.parameters()]
            for _ in range(rounds):
                with torch.no_grad():
                    for p, d in zip(model.parameters(), delta, strict=True):
                        p.add_(d)
                opt.exchange()
            client.sync()
        finally:
            client.close()
    largest = float(torch.stack([d.abs().max() for d in delta]).max())  # (finite random deltas)
    step = largest * (1 + 1 / QMAX[bits]) / QMAX[bits]
    for p, a, d in zip(model.parameters(), x0, delta, strict=True):
        applied = p.detach().double().numpy() - a
        true = rounds * d.double().numpy()
        # the first pull is the master's bf16 rounding (half a bf16 unit), the last one the copy the worker keeps,
        # within half an int8 step of the last difference, whose values are at most a delta and the last pull's
        # error: (largest + step / 2) / 127 / 2 (without error feedback the rounding of 40 merges and 40 pulls would add
        # up to far more: 40 half-steps each)
        pulled = (largest + step / 2) * (1 + 1 / QMAX[PULL_BITS]) / QMAX[PULL_BITS] / 2
        slack = rounds * 2.0**-24 * (np.abs(a) + np.abs(true) + 1e-3) + _half_ulp_bf16(a) + pulled
        assert (np.abs(applied - true) <= step / 2 + slack).all()
