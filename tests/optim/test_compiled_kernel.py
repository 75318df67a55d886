"""The compiled LAMB kernel: against the float64 reference and the torch kernels, its threading, its edge cases,
its build cache, and the pure-torch fallback when no compiler is at hand."""

from __future__ import annotations

import logging
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from ivyplug.optim import LAMB, compiled_kernel, lamb
from ivyplug.optim import functional as F
from ivyplug.optim.lamb_hyper import LambHyper
from tests.optim.reference import RefGroup, RefLamb

NO_COMPILER = compiled_kernel._compiler() is None
needs_compiler = pytest.mark.skipif(
    NO_COMPILER, reason="no C compiler (CC, or cc/gcc/clang on PATH): the compiled LAMB kernel cannot be built here"
)
#: Odd sizes: not multiples of any thread count, block or vector width; one element; empty.
SHAPES = [(13, 17), (1,), (7,), (1031,), (64, 3), (0,), (5, 1, 3)]
HYPER = dict(lr=0.02, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.03, max_trust_ratio=10.0, min_trust_ratio=0.0)


@pytest.fixture
def split(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> tuple[int, int, int]:
    """(threads, block, keep): the compiled kernel's threading shrunk to these small tensors."""
    threads, block, keep = request.param
    monkeypatch.setattr(F, "_kernel_threads", lambda: threads)
    monkeypatch.setattr(F, "COMPILED_SPLIT_ELEMENTS", 2)
    monkeypatch.setattr(F, "COMPILED_PARALLEL_ELEMENTS", 0)
    monkeypatch.setattr(F, "COMPILED_BLOCK_ELEMENTS", block)
    monkeypatch.setattr(F, "COMPILED_KEEP_ELEMENTS", keep)
    return threads, block, keep


SPLITS = [(1, 16384, 1 << 18), (2, 5, 1 << 18), (3, 7, 0), (3, 64, 300), (4, 1, 1 << 18)]


@pytest.fixture
def no_kernel(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """No usable compiler and an empty cache; the loaded kernel is forgotten before and after."""
    compiled_kernel.reset()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(compiled_kernel, "_cache_dirs", lambda: [tmp_path / "cache" / "ivyplug"])
    yield
    compiled_kernel.reset()


def _state(seed: int, shapes: list[tuple[int, ...]] = SHAPES) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen) * (0.5 + i) for i, s in enumerate(shapes)]
    params[1].zero_()  # ‖x‖ = 0: ratio 1
    return [params, [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]]


def _grads(gen: torch.Generator, params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.randn(p.shape, generator=gen) * (0.1 + torch.rand(p.shape, generator=gen)) for p in params]


def _clone(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.clone() for t in tensors]


@needs_compiler
@pytest.mark.parametrize("split", SPLITS, indirect=True)
@pytest.mark.parametrize("exclude", [False, True])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_matches_float64_reference(split: tuple[int, int, int], exclude: bool, bias_correction: bool) -> None:
    """Fresh random inputs, 20 steps: parameters within float32 rounding of the float64 reference."""
    params, m, v = _state(3)
    steps = [torch.zeros(()) for _ in params]
    group = RefGroup(list(range(len(params))), lr=HYPER["lr"], weight_decay=HYPER["weight_decay"],
                     bias_correction=bias_correction, exclude_from_layer_adaptation=exclude)  # fmt: skip
    ref = RefLamb([p.double().numpy() for p in params], [group])
    gen = torch.Generator().manual_seed(4)
    for _ in range(20):
        grads = _grads(gen, params)
        ratios = lamb(params, grads, m, v, steps, kernel="compiled", bias_correction=bias_correction,
                      exclude_from_layer_adaptation=exclude, **HYPER)  # type: ignore[arg-type]  # fmt: skip
        ref.step([g.double().numpy() for g in grads])
        for i, r in enumerate(ratios):
            assert r == pytest.approx(ref.ratios[i], rel=1e-5), f"trust ratio of tensor {i}"
    for i, p in enumerate(params):
        expected = torch.from_numpy(ref.params[i])
        scale = float(expected.abs().amax()) if expected.numel() else 0.0  # NaN propagates: assert_close fails on it
        torch.testing.assert_close(
            p.double(), expected, rtol=1e-5, atol=1e-6 * (scale if scale > 1e-3 else 1e-3), msg=f"tensor {i}"
        )
    assert all(s.item() == 20 for s in steps)


@needs_compiler
@pytest.mark.parametrize("split", SPLITS, indirect=True)
@pytest.mark.parametrize("grad_scale", [1.0, 0.37])
def test_matches_torch_kernel(split: tuple[int, int, int], grad_scale: float) -> None:
    """One step from the same state: parameters, both moments and the ratios agree with the torch kernel."""
    params, m, v = _state(5)
    gen = torch.Generator().manual_seed(6)
    for t in m + v:  # a state that is not the first step's
        t.copy_(torch.rand(t.shape, generator=gen))
    grads = _grads(gen, params)
    runs = {}
    for kernel in ("compiled", "torch"):
        state = [_clone(params), _clone(m), _clone(v), [torch.full((), 6.0) for _ in params]]
        ratios = lamb(state[0], grads, state[1], state[2], state[3], kernel=kernel, grad_scale=grad_scale, **HYPER)  # type: ignore[arg-type]
        runs[kernel] = (state, ratios)
    (got, got_ratios), (want, want_ratios) = runs["compiled"], runs["torch"]
    for name, a, b in zip(("params", "exp_avgs", "exp_avg_sqs", "steps"), got, want, strict=True):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            torch.testing.assert_close(
                x, y, rtol=1e-6, atol=1e-7, msg=lambda msg, i=i, name=name: f"{name}[{i}]: {msg}"
            )
    assert [float(r) for r in want_ratios] == pytest.approx(got_ratios, rel=1e-6)


@needs_compiler
@pytest.mark.parametrize("split", [(3, 5, 1 << 18)], indirect=True)
def test_results_are_deterministic(split: tuple[int, int, int]) -> None:
    """Blocks are claimed in whatever order the threads get to them, yet the sums are combined in block order:
    the same inputs give bit-identical results, run after run."""
    outs = []
    for _ in range(4):
        params, m, v = _state(7)
        grads = _grads(torch.Generator().manual_seed(8), params)
        lamb(params, grads, m, v, [torch.zeros(()) for _ in params], kernel="compiled", **HYPER)  # type: ignore[arg-type]
        outs.append(params)
    for other in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0], other, strict=True))


@needs_compiler
@pytest.mark.parametrize("split", [(3, 5, 1 << 18), (2, 7, 0)], indirect=True)
def test_openmp_team_and_own_threads_agree(split: tuple[int, int, int]) -> None:
    """The kernel runs on torch's OpenMP team where the process has one, else on pthreads of its own; from a
    thread that is not the main one it gets a team of its own. Every way gives bit-identical results (the block
    lengths follow from the threads asked for, not from the team), the gradient norm included."""
    lib = compiled_kernel.load(required=True)
    assert lib is not None
    if "parallel backend: OpenMP" in torch.__config__.parallel_info():
        assert lib.openmp_threads(), "torch runs on OpenMP here: the kernel should find its runtime"

    def run() -> tuple[list[torch.Tensor], list[float | torch.Tensor], float]:
        params, m, v = _state(11)
        grads = _grads(torch.Generator().manual_seed(12), params)
        ratios = lamb(params, grads, m, v, [torch.zeros(()) for _ in params], kernel="compiled", **HYPER)  # type: ignore[arg-type]
        return params + m + v, ratios, float(F.global_grad_norm(grads, kernel="compiled"))

    outs = [run()]
    other: list[tuple[list[torch.Tensor], list[float | torch.Tensor], float]] = []
    worker = threading.Thread(target=lambda: other.append(run()))
    worker.start()
    worker.join()
    outs += other
    lib.allow_openmp(False)
    try:
        assert not lib.openmp_threads()
        outs.append(run())
    finally:
        lib.allow_openmp(True)
    assert len(outs) == 3
    for tensors, ratios, norm in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0][0], tensors, strict=True))
        assert ratios == outs[0][1] and norm == outs[0][2]


@needs_compiler
@pytest.mark.parametrize("split", [(3, 4, 1 << 18)], indirect=True)
def test_zero_grads_and_zero_weights(split: tuple[int, int, int]) -> None:
    """Zero gradients at the first step: u = λx, so ‖x‖/‖u‖ = 1/λ, clipped to max_trust_ratio; zero weights with
    zero gradients do not move (ratio 1); all as the torch kernel."""
    params = [torch.randn(37), torch.zeros(11), torch.randn(1)]
    for kernel in ("compiled", "torch"):
        state = [_clone(params), [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]]
        ratios = lamb(state[0], [torch.zeros_like(p) for p in params], state[1], state[2],
                      [torch.zeros(()) for _ in params], kernel=kernel, **HYPER)  # type: ignore[arg-type]  # fmt: skip
        assert [float(r) for r in ratios] == [10.0, 1.0, 10.0]  # 1/0.03 > 10
        torch.testing.assert_close(state[0][0], params[0] * (1 - HYPER["lr"] * 10.0 * HYPER["weight_decay"]))
        assert torch.equal(state[0][1], params[1])


@needs_compiler
@pytest.mark.parametrize("split", [(3, 4, 1 << 18)], indirect=True)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 1e30])
def test_nonfinite_or_overflowing_gradient_skips_everything(split: tuple[int, int, int], bad: float) -> None:
    """A NaN/Inf (or a gradient whose squares leave float32) in the last block of the last tensor: the optimizer
    skips the whole step on the compiled path too, nothing written anywhere."""
    gen = torch.Generator().manual_seed(9)
    params = [nn.Parameter(torch.randn(s, generator=gen)) for s in [(9, 7), (5,), (33,)]]
    opt = LAMB([{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}], lr=0.01)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    before = [p.detach().clone() for p in params]
    moments = [opt.state[p]["exp_avg"].clone() for p in params]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    params[2].grad[-1] = bad  # type: ignore[index]
    opt.step()
    assert opt.skipped_steps == 1
    assert all(torch.equal(p, q) for p, q in zip(params, before, strict=True))
    assert all(torch.equal(opt.state[p]["exp_avg"], q) for p, q in zip(params, moments, strict=True))
    assert all(opt.state[p]["step"].item() == 1 for p in params)


@needs_compiler
def test_none_grads_empty_groups_and_empty_lists() -> None:
    """Parameters without a gradient are left alone (no state either); a group with none, or no tensors at all,
    is a no-op."""
    a, b = nn.Parameter(torch.randn(6, 5)), nn.Parameter(torch.randn(5))
    opt = LAMB([{"params": [a, b]}, {"params": []}], lr=0.1)
    a.grad = torch.randn(6, 5)
    before = b.detach().clone()
    opt.step()
    assert torch.equal(b, before) and b not in opt.state and opt.state[a]["step"].item() == 1
    assert lamb([], [], [], [], [], kernel="compiled", **HYPER) == []  # type: ignore[arg-type]


@needs_compiler
def test_compiled_path_is_the_one_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default (``auto``) sends contiguous float32 CPU tensors to the compiled kernel, gradient norm included;
    ``torch`` and tensors it cannot address (float64, non-contiguous) do not reach it."""
    monkeypatch.delenv(compiled_kernel.KERNEL_ENV, raising=False)
    calls: list[tuple[str, int]] = []
    real_lamb, real_sumsq = compiled_kernel.CompiledKernel.lamb, compiled_kernel.CompiledKernel.sumsq

    def spy_lamb(self: compiled_kernel.CompiledKernel, params: list[torch.Tensor], *a: object, **k: object) -> object:
        calls.append(("lamb", len(params)))
        return real_lamb(self, params, *a, **k)  # type: ignore[arg-type]

    def spy_sumsq(self: compiled_kernel.CompiledKernel, tensors: list[torch.Tensor], **k: int) -> float:
        calls.append(("sumsq", len(tensors)))
        return real_sumsq(self, tensors, **k)

    monkeypatch.setattr(compiled_kernel.CompiledKernel, "lamb", spy_lamb)
    monkeypatch.setattr(compiled_kernel.CompiledKernel, "sumsq", spy_sumsq)
    w, b = nn.Parameter(torch.randn(8, 4)), nn.Parameter(torch.randn(4))
    w64 = nn.Parameter(torch.randn(3, 3, dtype=torch.float64))
    opt = LAMB([w, b, w64], lr=0.01)
    w.grad, b.grad, w64.grad = torch.randn(8, 4), torch.randn(4), torch.randn(3, 3, dtype=torch.float64)
    before = w._version
    opt.step()
    assert calls == [("sumsq", 2), ("lamb", 2)]
    assert w._version > before, "autograd must see the in-place update"
    w.grad = torch.randn(4, 8).t()  # non-contiguous: the torch kernel
    calls.clear()
    opt.step()
    assert calls == [("sumsq", 1), ("lamb", 1)]
    monkeypatch.setenv(compiled_kernel.KERNEL_ENV, "torch")
    calls.clear()
    opt.step()
    assert calls == []
    assert opt.state[w]["step"].item() == 3 and opt.state[w64]["step"].item() == 3


@needs_compiler
def test_overlapping_buffers_take_the_torch_kernel() -> None:
    """Buffers that share memory would race between threads: the kernel changes nothing and says so (None), and
    the functional entry point gives the tensors to the torch kernel instead."""
    lib = compiled_kernel.load(required=True)
    assert lib is not None
    x, g, m = torch.randn(10), torch.randn(10), torch.zeros(10)
    step = torch.zeros(())
    h = LambHyper(**HYPER)  # type: ignore[arg-type]
    got = lib.lamb([x], [g], [m], [m], [step], h, threads=2, split_min=1, block=3)
    assert got is None and step.item() == 0.0 and not m.any()
    runs = {}
    for kernel in ("compiled", "torch"):
        shared, moved = torch.zeros(10), x.clone()
        lamb([moved], [g], [shared], [shared], [torch.zeros(())], kernel=kernel, **HYPER)  # type: ignore[arg-type]
        runs[kernel] = moved
    torch.testing.assert_close(runs["compiled"], runs["torch"], rtol=0, atol=0, equal_nan=True)  # what torch does
    assert not torch.equal(runs["compiled"], x)


def test_fallback_without_compiler_matches_torch_and_warns_once(
    no_kernel: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """No compiler: ``auto`` runs the torch kernels (same results as ``torch``) and warns once, naming why;
    ``compiled`` raises with the reason."""
    gen = torch.Generator().manual_seed(12)
    shapes = [(12, 9), (9,), (40,)]
    init = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(3)]
    results = {}
    for setting in ("auto", "torch"):
        monkeypatch.setenv(compiled_kernel.KERNEL_ENV, setting)
        params = [nn.Parameter(t.clone()) for t in init]
        opt = LAMB(params, lr=0.01, max_grad_norm=1.0)
        with caplog.at_level(logging.WARNING, logger=compiled_kernel.__name__):
            for step_grads in grads:
                for p, g in zip(params, step_grads, strict=True):
                    p.grad = g
                opt.step()
        results[setting] = params
    assert all(torch.equal(a, b) for a, b in zip(results["auto"], results["torch"], strict=True))
    warnings = [r for r in caplog.records if r.name == compiled_kernel.__name__]
    assert len(warnings) == 1 and "no-such-cc" in warnings[0].getMessage()
    assert "not found" in (compiled_kernel.unavailable_reason() or "")
    with pytest.raises(RuntimeError, match="compiled LAMB kernel is not available"):
        lamb(init, grads[0], _clone(init), _clone(init), [torch.zeros(()) for _ in init], kernel="compiled", **HYPER)  # type: ignore[arg-type]


def test_fallback_when_the_build_fails(no_kernel: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A compiler that fails: the reason carries its exit status and last line; nothing half-built is left."""
    fake = tmp_path / "broken-cc"
    fake.write_text("#!/bin/sh\necho 'fatal: this compiler is broken' >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    assert compiled_kernel.load() is None
    reason = compiled_kernel.unavailable_reason() or ""
    assert "exited with 3" in reason and "broken" in reason
    cache = tmp_path / "cache" / "ivyplug"
    assert not cache.exists() or not list(cache.iterdir())


@needs_compiler
def test_build_is_cached_and_atomic(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The first load builds into the cache (temporary file, then rename); the next process state loads the
    cached library without running the compiler; other flags are another cache entry."""
    compiled_kernel.reset()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    runs: list[list[str]] = []
    real_run = subprocess.run

    def spy(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        runs.append(cmd)
        return real_run(cmd, **kwargs)  # type: ignore[call-overload, no-any-return]

    monkeypatch.setattr(compiled_kernel.subprocess, "run", spy)
    try:
        first = compiled_kernel.load(required=True)
        assert first is not None and len(runs) == 1 and first.path.parent == tmp_path / "ivyplug"
        assert [p.name for p in first.path.parent.iterdir()] == [first.path.name]  # no temporary file left
        compiled_kernel.reset()
        second = compiled_kernel.load(required=True)
        assert second is not None and second.path == first.path and len(runs) == 1
        compiler = compiled_kernel._compiler()
        assert compiler is not None
        source = compiled_kernel.SOURCE.read_bytes()
        paths = {
            compiled_kernel._library_path(tmp_path, compiler, flags, source) for flags in compiled_kernel.FLAG_SETS
        }
        assert len(paths) == len(compiled_kernel.FLAG_SETS)
    finally:
        compiled_kernel.reset()
    assert os.access(first.path, os.R_OK)


def test_kernel_choice_validates(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(compiled_kernel.KERNEL_ENV, " Torch ")
    assert compiled_kernel.kernel_choice() == "torch"
    assert compiled_kernel.kernel_choice("compiled") == "compiled"
    monkeypatch.setenv(compiled_kernel.KERNEL_ENV, "fast")
    with pytest.raises(ValueError, match="IVYPLUG_LAMB_KERNEL"):
        compiled_kernel.kernel_choice()
    with pytest.raises(ValueError, match="kernel"):
        lamb([], [], [], [], [], kernel="gpu", **HYPER)  # type: ignore[arg-type]
