"""``wire_dtype="bfloat16"``: the codec against an integer-arithmetic bf16 reference, the option's refusals,
error feedback on deltas (its bound, and the control without it), the overflow rule, and a real gloo wire
(an ivyplug serve) where the servers apply exactly the bf16-rounded gradient and bytes halve.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from ivyplug.optim import LocalUpdates
from ivyplug.ps import PSClient, PSConfig
from ivyplug.ps.wire.codecs import BF16_OVERFLOW, Bf16Codec
from ivyplug.ps.worker.client import PSNonFiniteError

MANUAL = 10**6  # sync_every: the tests call exchange() themselves


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: no OpenMP spin-waits


def ref_bf16(x: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 -> fp32 by round-to-nearest-even on the bits (NaN stays NaN), independent of torch."""
    x = np.asarray(x, dtype=np.float32)
    bits = x.view(np.uint32).astype(np.uint64)
    lsb = (bits >> 16) & 1
    out = (((bits + 0x7FFF + lsb) >> 16) << 16).astype(np.uint32).view(np.float32)
    return np.where(np.isnan(x), np.float32("nan"), out)


# -- the codec ------------------------------------------------------------------------------------
def test_codec_rounds_floats_to_nearest_even_and_keeps_integer_bits() -> None:
    gen = torch.Generator().manual_seed(1)
    floats = torch.randn(13, generator=gen) * torch.logspace(-30, 30, 13)
    floats[0], floats[1], floats[2] = float("nan"), float("inf"), -0.0
    floats[3] = BF16_OVERFLOW  # rounds to Inf
    floats[4] = float(np.nextafter(np.float32(BF16_OVERFLOW), np.float32(0)))  # the largest fp32 that stays finite
    ints = torch.tensor([2**40 + 3, -7, 2**62 + 1], dtype=torch.int64)
    # layout of a shard with an integer buffer between float pieces (odd total: a padded payload)
    flat = torch.cat([floats[:5], ints.view(torch.float32), floats[5:]])
    codec = Bf16Codec(flat.numel(), [(0, 5), (11, 19)])
    words = codec.encode(flat)
    assert words.dtype == torch.float32 and words.numel() == codec.words == math.ceil((13 + 2 * 6) / 2)
    back = codec.decode(words)
    expect = ref_bf16(flat.numpy())
    torch.testing.assert_close(back[:5], torch.from_numpy(expect[:5]), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(back[11:], torch.from_numpy(expect[11:]), rtol=0, atol=0, equal_nan=True)
    assert torch.equal(back[5:11].clone().view(torch.int64), ints)
    assert math.isinf(float(back[3])) and math.isfinite(float(back[4]))
    assert str(float(back[2])) == "-0.0"
    with pytest.raises(ValueError, match="encodes 19 values"):
        codec.encode(flat[:-1])


def test_codec_of_an_all_float_shard_is_half_the_words() -> None:
    codec = Bf16Codec(1000, [(0, 1000)])
    assert codec.words == 500 and codec.int_ranges == []


# -- the option -----------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["fp16", "bf16", "int2", None, 16])
def test_bad_wire_dtypes_are_refused_by_name(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"wire_dtype must be one of \('float32', 'bfloat16', 'int8', 'int4'\)"):
        PSConfig(wire_dtype=bad)


def test_the_strategy_refuses_a_bad_wire_dtype_before_spawning_and_reads_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ivyplug.integrations.lightning import IvyPSStrategy

    with pytest.raises(
        ValueError, match=r"^IvyPSStrategy: wire_dtype must be one of \('float32', 'bfloat16', 'int8', 'int4'\)"
    ):
        IvyPSStrategy(wire_dtype="half")
    assert IvyPSStrategy().ps_config.wire_dtype == "float32"
    monkeypatch.setenv("IVYPLUG_PS_WIRE_DTYPE", "bfloat16")
    assert IvyPSStrategy().ps_config.wire_dtype == "bfloat16"
    assert IvyPSStrategy(wire_dtype="float32").ps_config.wire_dtype == "float32"  # code wins
    monkeypatch.setenv("IVYPLUG_PS_WIRE_DTYPE", "int8")
    assert IvyPSStrategy().ps_config.wire_dtype == "int8"
    monkeypatch.setenv("IVYPLUG_PS_WIRE_DTYPE", "fp8")
    with pytest.raises(ValueError, match="wire_dtype"):
        IvyPSStrategy()


# -- error feedback on deltas ----------------------------------------------------------------------
def _averaging(wire: str, error_feedback: bool = True) -> tuple[nn.Module, LocalUpdates, PSClient]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2))
    opt = LocalUpdates(torch.optim.SGD(model.parameters(), lr=0.1), sync_every=MANUAL, merge_rate=1.0)
    opt.delta.error_feedback = error_feedback
    client = opt.start_ps(PSConfig(mode="async", wire_dtype=wire), list(model.named_parameters()))
    return model, opt, client


def _merge_rounds(model: nn.Module, opt: LocalUpdates, deltas: list[list[torch.Tensor]]) -> list[np.ndarray]:
    """Move the local copy by each round's delta and exchange; returns Σ (x_local − x_pulled) in float64."""
    total = [np.zeros(tuple(p.shape)) for p in model.parameters()]
    for round_deltas in deltas:
        with torch.no_grad():
            for p, d in zip(model.parameters(), round_deltas, strict=True):
                p.add_(d)
        for t, s, p in zip(total, opt.delta.snapshot, model.parameters(), strict=True):
            t += p.detach().double().numpy() - s.double().numpy()
        opt.exchange()
    return total


def _half_ulp_bf16(x: np.ndarray) -> np.ndarray:
    """Half a bf16 unit in the last place at |x| (8 significant bits): one rounding's largest error."""
    mag = np.maximum(np.abs(x), np.finfo(np.float32).tiny)
    return 0.5 * np.exp2(np.floor(np.log2(mag)) - 7)


@pytest.mark.parametrize("error_feedback", [True, False])
def test_error_feedback_bounds_the_accumulated_rounding_of_deltas(error_feedback: bool) -> None:
    """outer="average" at rate 1, 60 merges of the same delta (so that rounding errs the same way each time):
    with error feedback the applied deltas sum to the true sum less at most one bf16 rounding of the last
    delta; without it (the control) the error grows with every merge, far past that bound."""
    rounds = 60
    model, opt, client = _averaging("bfloat16", error_feedback)
    try:
        x0 = [p.detach().double().numpy().copy() for p in model.parameters()]
        gen = torch.Generator().manual_seed(3)
        delta = [torch.randn(p.shape, generator=gen) * 0.01 for p in model.parameters()]
        true = _merge_rounds(model, opt, [delta] * rounds)
        last = [d.double().numpy() for d in delta]
        for p, a, t, d in zip(model.parameters(), x0, true, last, strict=True):
            applied = p.detach().double().numpy() - a  # the servers' copy (pulled) minus the start
            err = np.abs(applied - t)
            # fp32 slack: each merge rounds the fp32 master once (x ~ 1: 2**-24 per merge)
            slack = rounds * 2.0**-24 * (np.abs(a) + np.abs(t) + 1e-3)
            bound = _half_ulp_bf16(d) + slack
            if error_feedback:
                assert (err <= bound).all(), float((err - bound).max())
            else:
                assert (err > 10 * bound).mean() > 0.5, float(np.median(err / bound))
    finally:
        client.close()


def test_error_feedback_restarts_after_a_dropped_nonfinite_delta() -> None:
    model, opt, client = _averaging("bfloat16")
    try:
        gen = torch.Generator().manual_seed(4)
        good = [[torch.randn(p.shape, generator=gen) * 0.01 for p in model.parameters()] for _ in range(3)]
        _merge_rounds(model, opt, good)
        bad = [d.clone() for d in good[0]]
        bad[0][0, 0] = float("nan")
        with torch.no_grad():
            for p, d in zip(model.parameters(), bad, strict=True):
                p.add_(d)
        opt.exchange()  # dropped whole (nonfinite="skip"); the worker continues from the global copy
        assert opt.discarded_exchanges == 1 and opt.delta.residual is None
        x0 = [p.detach().double().numpy().copy() for p in model.parameters()]
        true = _merge_rounds(model, opt, good)
        for p, a, t, d in zip(model.parameters(), x0, true, good[-1], strict=True):
            applied = p.detach().double().numpy() - a
            assert np.isfinite(applied).all()
            assert (np.abs(applied - t) <= 3 * _half_ulp_bf16(d.double().numpy()) + 1e-6).all()
    finally:
        client.close()


def test_a_finite_gradient_beyond_bf16s_range_counts_as_nonfinite() -> None:
    for wire, refused in (("bfloat16", True), ("float32", False)):
        torch.manual_seed(0)
        model = nn.Linear(3, 2)
        opt = torch.optim.SGD(model.parameters(), lr=1e-40)
        client = PSClient.start(
            PSConfig(mode="async", wire_dtype=wire, nonfinite="raise"), list(model.named_parameters()), [], opt
        )
        try:
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
            model.weight.grad[0, 0] = 3.3962e38  # finite in fp32, Inf in bf16
            if refused:
                with pytest.raises(PSNonFiniteError, match="beyond bfloat16's range"):
                    client.step(1)
            else:
                client.step(1)
        finally:
            client.close()


# -- a real wire: a worker of this process against ivyplug serve ------------------------------------------
def _serve_run(
    address: str,
    wire: str,
    init: torch.Tensor,
    grads: list[torch.Tensor],
    later: torch.Tensor | None = None,
    rounded_sync: bool = False,
) -> dict[str, Any]:
    """Join the serve, pull, push ``grads`` (SGD lr 1 on the server), ``sync()``, then push ``later`` (if given);
    the pulls (``later``'s as ``pulled_later``), the buffer and the traffic up to the sync. ``rounded_sync``: a
    ``sync(exact=False)`` first (``synced_rounded``)."""
    w = nn.Parameter(init.clone())
    counter = torch.tensor([2**40 + 3], dtype=torch.int64)  # an integer buffer: must travel exactly
    cfg = PSConfig(mode="async", servers=address, token="t0ken", wire_dtype=wire, timeout=60.0)
    client = PSClient.start(cfg, [("w", w)], [("counter", counter)], torch.optim.SGD([w], lr=1.0))
    try:
        client.pull_initial()
        before = client.metrics()
        pulled = [w.detach().clone()]
        for g in grads:
            w.grad = g.clone()
            client.step(1)
            pulled.append(w.detach().clone())
        after = client.metrics()
        if rounded_sync:  # validation's: a meeting whose pull keeps the wire's form
            client.sync(exact=False)
        synced_rounded = w.detach().clone()
        client.sync()  # a pull that stays (a checkpoint, the returned model)
        synced = w.detach().clone()
        if later is not None:  # a step after it: its pull in the wire's form again
            w.grad = later.clone()
            client.step(1)
        pulled_later = w.detach().clone()
    finally:
        client.close()
    traffic = {k: after[k] - before[k] for k in ("bytes_sent", "bytes_received")}
    return {
        "pulled": pulled,
        "synced": synced,
        "synced_rounded": synced_rounded,
        "pulled_later": pulled_later,
        "counter": int(counter),
        "traffic": traffic,
    }


@pytest.mark.timeout(120)
def test_against_ivyplug_serve_the_server_applies_the_bf16_gradient_and_bytes_halve() -> None:
    """A serve started without any wire setting (the flag is per request): an fp32 worker, then a bf16 worker
    of the same job continuing from the servers' state; the servers' fp32 master steps by exactly the bf16
    gradient, each step's pull is exactly its bf16 rounding, the integer buffer is exact, and the traffic halves.
    The pull that stays, ``sync()``'s, is the fp32 master itself; the first (``pull_initial``) and
    ``sync(exact=False)``'s (validation's) are its bf16 rounding."""
    from tests.ps.service_harness import serve

    gen = torch.Generator().manual_seed(11)
    init = torch.randn(200, 100, generator=gen)
    grads32 = [torch.randn(200, 100, generator=gen) for _ in range(2)]
    grads16 = [torch.randn(200, 100, generator=gen) for _ in range(2)]
    with serve("--shards", "1", "--workers", "1", "--token", "t0ken") as s:
        r32 = _serve_run(s.address, "float32", init, grads32)
        later = torch.randn(200, 100, generator=gen)
        r16 = _serve_run(s.address, "bfloat16", torch.zeros_like(init), grads16, later, rounded_sync=True)
    master = init.numpy().astype(np.float32)
    expect32 = [master]
    for g in grads32:
        master = (master - g.numpy()).astype(np.float32)
        expect32.append(master)
    expect16 = [ref_bf16(master)]  # pull_initial: a step's, in bf16
    for g in grads16:
        master = (master - ref_bf16(g.numpy())).astype(np.float32)
        expect16.append(ref_bf16(master))
    for run, expect in ((r32, expect32), (r16, expect16)):
        for step, (got, want) in enumerate(zip(run["pulled"], expect, strict=True)):
            torch.testing.assert_close(got, torch.from_numpy(want), rtol=0, atol=0, msg=f"pull {step}")
        assert run["counter"] == 2**40 + 3
    torch.testing.assert_close(r16["synced"], torch.from_numpy(master), rtol=0, atol=0)
    torch.testing.assert_close(r16["synced_rounded"], torch.from_numpy(ref_bf16(master)), rtol=0, atol=0)
    assert not torch.equal(r16["pulled"][-1], r16["synced"])  # the control: a step's pull in bf16 is not the master
    after_sync = (master - ref_bf16(later.numpy())).astype(np.float32)  # and a step after sync() pulls bf16 again
    torch.testing.assert_close(r16["pulled_later"], torch.from_numpy(ref_bf16(after_sync)), rtol=0, atol=0)
    # the control: the same fp32 steps through the bf16 wire would not give the fp32 pulls
    assert not torch.equal(torch.from_numpy(ref_bf16(expect32[-1])), r32["pulled"][-1])
    for key in ("bytes_sent", "bytes_received"):
        ratio = r16["traffic"][key] / r32["traffic"][key]
        assert 0.49 <= ratio <= 0.52, (key, r16["traffic"], r32["traffic"])
