"""LAMB against an independent float64 reference, kernel agreement, and the documented edge-case policies."""

from __future__ import annotations

import copy
import io
import math

import numpy as np
import pytest
import torch
from torch import nn

from ivyplug.optim import LAMB, compiled_kernel, lamb, lamb_param_groups
from ivyplug.optim import functional as F
from tests.optim.reference import RefGroup, RefLamb

STEPS = 32
KERNELS = ["loop", "fused", "fused_pieces", "plain", "compiled", "compiled_split"]
#: The compiled kernel's tests need a C compiler; without one ivyplug runs the torch kernels (tested above).
NO_COMPILER = compiled_kernel._compiler() is None
NO_COMPILER_REASON = "no C compiler (CC, or cc/gcc/clang on PATH): the compiled LAMB kernel cannot be built here"


@pytest.fixture
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """``loop``: the per-tensor reference; ``fused``: multi-tensor with torch's fused Adam moments; ``fused_pieces``:
    the same with its size thresholds shrunk, so that these small tensors take the large-tensor path, split into
    pieces, next to size blocks of several tensors; ``plain``: multi-tensor from ``_foreach`` ops only (what
    accelerators run); ``compiled``: the compiled kernel (CPU default where a C compiler exists);
    ``compiled_split``: the same on three threads with its thresholds shrunk, so that these small tensors are cut
    into blocks the threads share, some keeping the update between the passes and some recomputing it. Returns
    the ``foreach`` flag."""
    name = request.param
    if name.startswith("compiled"):
        if NO_COMPILER:
            pytest.skip(NO_COMPILER_REASON)
        monkeypatch.setenv(compiled_kernel.KERNEL_ENV, "compiled")
        if name == "compiled_split":
            monkeypatch.setattr(F, "COMPILED_SPLIT_ELEMENTS", 2)
            monkeypatch.setattr(F, "COMPILED_PARALLEL_ELEMENTS", 0)
            monkeypatch.setattr(F, "COMPILED_BLOCK_ELEMENTS", 5)
            monkeypatch.setattr(F, "COMPILED_KEEP_ELEMENTS", 40)
            monkeypatch.setattr(F, "_kernel_threads", lambda: 3)
    else:
        monkeypatch.setenv(compiled_kernel.KERNEL_ENV, "torch")
    if name == "plain":
        monkeypatch.setattr(F, "fused_moments_supported", lambda device, dtype: False)
    if name == "fused_pieces":
        monkeypatch.setattr(F, "CPU_SMALL_ELEMENTS", 16)
        monkeypatch.setattr(F, "CPU_CHUNK_ELEMENTS", 64)
    return name != "loop"


def test_fused_moments_serve_cpu_float32() -> None:
    assert F.fused_moments_supported(torch.device("cpu"), torch.float32)
    assert F.fused_moments_supported(torch.device("cpu"), torch.float64)


def _random_params(gen: torch.Generator, shapes: list[tuple[int, ...]], scales: list[float]) -> list[nn.Parameter]:
    return [nn.Parameter(torch.randn(s, generator=gen) * sc) for s, sc in zip(shapes, scales, strict=True)]


def _random_grads(gen: torch.Generator, params: list[nn.Parameter], scale: float = 1.0) -> list[torch.Tensor]:
    # Per-element scales vary so that v differs between elements (bias correction and eps matter).
    return [torch.randn(p.shape, generator=gen) * scale * (0.1 + torch.rand(p.shape, generator=gen)) for p in params]


def _run_against_reference(
    seed: int,
    *,
    foreach: bool,
    bias_correction: bool,
    max_grad_norm: float | None,
    grad_scale: float,
) -> tuple[LAMB, RefLamb, list[nn.Parameter]]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(17, 9), (9,), (23, 5), (5,), (31, 4), (12, 6), (6,)]
    # Scales chosen so that, in group 2, ||x||/||u|| sits far below min_trust_ratio (0.01-scale weights) and, in
    # group 3, far above max_trust_ratio: both clip bounds bind.
    scales = [1.0, 0.5, 0.01, 0.3, 20.0, 0.0, 1.0]
    params = _random_params(gen, shapes, scales)
    base = {"bias_correction": bias_correction}
    groups = [
        {"params": [params[0], params[1]], "lr": 0.01, "weight_decay": 0.05, **base},
        {"params": [params[2]], "lr": 0.02, "weight_decay": 0.0, "min_trust_ratio": 0.5, **base},
        {"params": [params[4], params[5]], "lr": 0.005, "weight_decay": 0.1, "max_trust_ratio": 2.0, **base},
        {
            "params": [params[3], params[6]],
            "lr": 0.003,
            "weight_decay": 0.0,
            "exclude_from_layer_adaptation": True,
            "betas": (0.8, 0.99),
            "eps": 1e-4,
            **base,
        },
    ]
    opt = LAMB(groups, foreach=foreach, max_grad_norm=max_grad_norm)
    ref_groups = [
        RefGroup([0, 1], lr=0.01, weight_decay=0.05, bias_correction=bias_correction),
        RefGroup([2], lr=0.02, weight_decay=0.0, min_trust_ratio=0.5, bias_correction=bias_correction),
        RefGroup([4, 5], lr=0.005, weight_decay=0.1, max_trust_ratio=2.0, bias_correction=bias_correction),
        RefGroup(
            [3, 6],
            lr=0.003,
            weight_decay=0.0,
            exclude_from_layer_adaptation=True,
            betas=(0.8, 0.99),
            eps=1e-4,
            bias_correction=bias_correction,
        ),
    ]
    ref = RefLamb([p.detach().double().numpy() for p in params], ref_groups, max_grad_norm=max_grad_norm)
    for _ in range(STEPS):
        grads = _random_grads(gen, params, grad_scale)
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        opt.step()
        ref.step([g.double().numpy() for g in grads])
        for p, g in zip(params, grads, strict=True):
            assert torch.equal(p.grad, g), "the optimizer must not modify .grad"
    return opt, ref, params


@pytest.mark.parametrize("kernel", KERNELS, indirect=True)
@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("max_grad_norm", [None, 1.5])
def test_matches_float64_reference(kernel: bool, bias_correction: bool, max_grad_norm: float | None) -> None:
    seed = 1000 + 4 * int(kernel) + 2 * int(bias_correction) + int(max_grad_norm is not None)
    opt, ref, params = _run_against_reference(
        seed, foreach=kernel, bias_correction=bias_correction, max_grad_norm=max_grad_norm, grad_scale=3.0
    )
    for i, p in enumerate(params):
        expected = ref.params[i]
        got = p.detach().double().numpy()
        scale = max(np.abs(expected).max(), 1e-3)
        np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-5 * scale, err_msg=f"param {i}")
    ratios = opt.trust_ratios()
    for i, p in enumerate(params):
        assert ratios[p] == pytest.approx(ref.ratios[i], rel=1e-4), f"trust ratio of param {i}"
    # The clip bounds really bound (min in group 2, max in group 3) and the excluded group got ratio 1.
    assert ratios[params[2]] == 0.5
    assert ratios[params[4]] == 2.0
    assert ratios[params[3]] == 1.0 and ratios[params[6]] == 1.0
    # param 5 started at zero: ratio 1 on the first step, then it is no longer zero and adapts.
    assert not torch.all(params[5] == 0)


def test_global_clipping_binds_and_skips_nothing() -> None:
    """With max_grad_norm active the result differs from the unclipped run (so the clip was applied)."""
    _, _, clipped = _run_against_reference(7, foreach=False, bias_correction=True, max_grad_norm=0.5, grad_scale=3.0)
    _, _, plain = _run_against_reference(7, foreach=False, bias_correction=True, max_grad_norm=None, grad_scale=3.0)
    assert any(not torch.allclose(a, b, rtol=1e-3) for a, b in zip(clipped, plain, strict=True))


def _random_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(13, 32),
        nn.LayerNorm(32),
        nn.ReLU(),
        nn.Linear(32, 64),
        nn.Tanh(),
        nn.Linear(64, 7),
    )


@pytest.mark.parametrize("kernel", ["fused", "fused_pieces", "plain", "compiled", "compiled_split"], indirect=True)
@pytest.mark.parametrize("seed", [3, 4])
@pytest.mark.parametrize("max_grad_norm", [None, 0.7])
def test_foreach_matches_loop(kernel: bool, seed: int, max_grad_norm: float | None) -> None:
    """Two kernels, same model, same batches: parameters agree to 1e-6 relative after 30+ steps."""
    model_a = _random_model(seed)
    model_b = copy.deepcopy(model_a)
    opt_a = LAMB(lamb_param_groups(model_a, weight_decay=0.02), lr=3e-3, foreach=False, max_grad_norm=max_grad_norm)
    opt_b = LAMB(lamb_param_groups(model_b, weight_decay=0.02), lr=3e-3, foreach=True, max_grad_norm=max_grad_norm)
    gen = torch.Generator().manual_seed(seed + 100)
    for _ in range(STEPS):
        x = torch.randn(16, 13, generator=gen)
        y = torch.randint(0, 7, (16,), generator=gen)
        for model, opt in ((model_a, opt_a), (model_b, opt_b)):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters(), strict=True):
        err = (a - b).abs().max().item()
        assert err <= 1e-6 * max(a.abs().max().item(), 1e-6), f"{name}: max abs diff {err}"
    assert opt_a.param_groups[0]["foreach"] is False and opt_b.param_groups[0]["foreach"] is True


def _layout_zoo(gen: torch.Generator) -> list[nn.Parameter]:
    """Parameters in every layout the CPU kernel must handle."""
    return [
        nn.Parameter(torch.randn(6, 4, 3, 3, generator=gen).to(memory_format=torch.channels_last)),  # grads alike
        nn.Parameter(torch.randn(6, 4, 3, 3, generator=gen).to(memory_format=torch.channels_last)),  # grads not
        nn.Parameter(torch.randn(20, 12, generator=gen)),  # non-contiguous (transposed) gradients
        nn.Parameter(torch.randn(30, 30, generator=gen)),
        nn.Parameter(torch.randn(12, generator=gen)),  # three of one size: one block
        nn.Parameter(torch.randn(12, generator=gen)),
        nn.Parameter(torch.zeros(12)),
        nn.Parameter(torch.randn(5, generator=gen)),
        nn.Parameter(torch.zeros(0, 5)),
    ]


def _zoo_grads(gen: torch.Generator) -> list[torch.Tensor]:
    conv = [torch.randn(6, 4, 3, 3, generator=gen) for _ in range(2)]
    return [
        conv[0].to(memory_format=torch.channels_last),
        conv[1],
        torch.randn(12, 20, generator=gen).t(),
        torch.randn(30, 30, generator=gen),
        *(torch.randn(12, generator=gen) for _ in range(3)),
        torch.randn(5, generator=gen),
        torch.zeros(0, 5),
    ]


@pytest.mark.parametrize("kernel", ["fused", "fused_pieces", "compiled", "compiled_split"], indirect=True)
@pytest.mark.parametrize("weight_decay", [0.05, 0.0, 1e-13])
@pytest.mark.parametrize("max_grad_norm", [None, 0.5])
@pytest.mark.parametrize("exclude", [False, True])
def test_cpu_kernel_layouts_and_branches_match_loop(
    kernel: bool, weight_decay: float, max_grad_norm: float | None, exclude: bool
) -> None:
    """Channels-last weights (with and without matching gradients), transposed gradients, bias-sized and empty
    tensors, every weight-decay branch, clipping and the ratio-1 (AdamW-like) path: the CPU multi-tensor kernel
    takes the loop's steps to 1e-6 relative. (torch's fused kernels pair elements by memory offset, so layouts
    that do not match must not reach them.)"""
    gen = torch.Generator().manual_seed(41)
    params_a = _layout_zoo(gen)
    params_b = [nn.Parameter(p.detach().clone(memory_format=torch.preserve_format)) for p in params_a]
    group = {"weight_decay": weight_decay, "exclude_from_layer_adaptation": exclude}
    opt_a = LAMB([{"params": params_a, **group}], lr=0.01, foreach=False, max_grad_norm=max_grad_norm)
    opt_b = LAMB([{"params": params_b, **group}], lr=0.01, foreach=kernel, max_grad_norm=max_grad_norm)
    for _ in range(10):
        grads = _zoo_grads(gen)
        for pa, pb, g in zip(params_a, params_b, grads, strict=True):
            pa.grad = g.clone(memory_format=torch.preserve_format)
            pb.grad = g.clone(memory_format=torch.preserve_format)
        opt_a.step()
        opt_b.step()
        for pb, g in zip(params_b, grads, strict=True):
            assert torch.equal(pb.grad, g), "the optimizer must not modify .grad"
    for i, (a, b) in enumerate(zip(params_a, params_b, strict=True)):
        err = (a - b).abs().max().item() if a.numel() else 0.0
        assert err <= 1e-6 * max(a.abs().max().item() if a.numel() else 0.0, 1e-6), f"param {i}: max abs diff {err}"
    ratios_a, ratios_b = opt_a.trust_ratios(), opt_b.trust_ratios()
    for a, b in zip(params_a, params_b, strict=True):
        assert ratios_b[b] == pytest.approx(ratios_a[a], rel=1e-5)
    assert params_b[0].is_contiguous(memory_format=torch.channels_last)


def test_functional_entry_point_matches_optimizer() -> None:
    gen = torch.Generator().manual_seed(11)
    params = _random_params(gen, [(8, 8), (8,)], [1.0, 1.0])
    twins = [p.detach().clone() for p in params]
    opt = LAMB(params, lr=0.01, weight_decay=0.03, foreach=False)
    m = [torch.zeros_like(t) for t in twins]
    v = [torch.zeros_like(t) for t in twins]
    steps = [torch.zeros(()) for _ in twins]
    ws = F.Workspace()
    for _ in range(5):
        grads = _random_grads(gen, params)
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        opt.step()
        ratios = lamb(twins, grads, m, v, steps, foreach=True, lr=0.01, beta1=0.9, beta2=0.999, eps=1e-6,
                      weight_decay=0.03, workspace=ws)  # fmt: skip
        assert len(ratios) == 2
    for p, t in zip(params, twins, strict=True):
        torch.testing.assert_close(p.detach(), t, rtol=1e-6, atol=1e-7)
    assert all(s.item() == 5 for s in steps)
    with pytest.raises(ValueError, match="same length"):
        lamb(twins, grads[:1], m, v, steps, lr=0.1, beta1=0.9, beta2=0.9, eps=1e-6, weight_decay=0.0)


@pytest.mark.parametrize("kernel", KERNELS, indirect=True)
def test_zero_initialised_params_move(kernel: bool) -> None:
    w = nn.Parameter(torch.zeros(6, 4))
    b = nn.Parameter(torch.zeros(4))
    opt = LAMB([w, b], lr=0.1, foreach=kernel)
    w.grad = torch.randn(6, 4)
    b.grad = torch.randn(4)
    opt.step()
    assert w.abs().min() > 0 and b.abs().min() > 0
    assert opt.trust_ratios() == {w: 1.0, b: 1.0}
    # ratio 1 with ||x|| = 0: the first update is exactly lr * m̂/(√v̂+ε) = lr * g/(|g|+ε) (decay of 0 adds 0).
    g = w.grad.double()
    torch.testing.assert_close(w.detach().double(), -0.1 * g / (g.abs() + 1e-6), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kernel", KERNELS, indirect=True)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_gradient_skips_whole_step(kernel: bool, bad: float) -> None:
    gen = torch.Generator().manual_seed(5)
    params = _random_params(gen, [(5, 5), (5,), (3, 2)], [1.0, 1.0, 1.0])
    opt = LAMB([{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}], lr=0.01, foreach=kernel)
    for p, g in zip(params, _random_grads(gen, params), strict=True):
        p.grad = g
    opt.step()
    before_params = [p.detach().clone() for p in params]
    before_state = copy.deepcopy(opt.state_dict())
    ratios_before = opt.trust_ratios()
    grads = _random_grads(gen, params)
    grads[2][1, 1] = bad  # in the *last* group: earlier groups must not have been touched either
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    opt.step()
    assert opt.skipped_steps == 1
    for p, q in zip(params, before_params, strict=True):
        assert torch.equal(p.detach(), q)
    after_state = opt.state_dict()
    assert after_state["skipped_steps"] == 1
    for key, st in before_state["state"].items():
        for name, value in st.items():
            assert torch.equal(after_state["state"][key][name], value), name
    assert opt.trust_ratios() == ratios_before
    # A finite step afterwards runs normally (step count 2).
    for p, g in zip(params, _random_grads(gen, params), strict=True):
        p.grad = g
    opt.step()
    assert opt.skipped_steps == 1
    assert all(opt.state[p]["step"].item() == 2 for p in params)


def test_sparse_gradient_raises() -> None:
    emb = nn.Embedding(10, 3, sparse=True)
    opt = LAMB(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse gradients"):
        opt.step()


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"lr": -1.0}, "lr"),
        ({"lr": float("nan")}, "lr"),
        ({"betas": (1.0, 0.999)}, r"betas\[0\]"),
        ({"betas": (0.9, -0.1)}, r"betas\[1\]"),
        ({"betas": (0.9,)}, "betas"),
        ({"eps": -1e-8}, "eps"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"max_trust_ratio": 0.0}, "max_trust_ratio"),
        ({"min_trust_ratio": -1.0}, "min_trust_ratio"),
        ({"min_trust_ratio": 2.0, "max_trust_ratio": 1.0}, "min_trust_ratio"),
        ({"max_grad_norm": 0.0}, "max_grad_norm"),
        ({"max_grad_norm": float("inf")}, "max_grad_norm"),
        ({"foreach": "yes"}, "foreach"),
        ({"bias_correction": 1}, "bias_correction"),
    ],
)
def test_invalid_hyperparameters_raise_value_error(kwargs: dict[str, object], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        LAMB([nn.Parameter(torch.zeros(2))], **kwargs)  # type: ignore[arg-type]


def test_invalid_group_value_raises_and_is_not_added() -> None:
    opt = LAMB([nn.Parameter(torch.zeros(2))])
    with pytest.raises(ValueError, match="weight_decay"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(3))], "weight_decay": -1.0})
    with pytest.raises(ValueError, match="exclude_from_layer_adaptation"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(3))], "exclude_from_layer_adaptation": "yes"})
    assert len(opt.param_groups) == 1


def _train(model: nn.Module, opt: torch.optim.Optimizer, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for x, y in batches:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


@pytest.mark.parametrize("foreach", [None, False])
def test_state_dict_round_trip_continues_bit_identically(foreach: bool | None) -> None:
    gen = torch.Generator().manual_seed(21)
    batches = [(torch.randn(8, 13, generator=gen), torch.randint(0, 7, (8,), generator=gen)) for _ in range(12)]
    model = _random_model(9)
    opt = LAMB(lamb_param_groups(model), lr=1e-2, foreach=foreach, max_grad_norm=1.0)
    _train(model, opt, batches[:5])
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)

    resumed_model = _random_model(123)  # different init, overwritten by the checkpoint
    resumed_model.load_state_dict(ckpt["model"])
    resumed = LAMB(lamb_param_groups(resumed_model), lr=0.5, max_grad_norm=1.0)  # lr comes from the checkpoint
    resumed.load_state_dict(ckpt["opt"])
    assert resumed.param_groups[0]["foreach"] == opt.param_groups[0]["foreach"]

    _train(model, opt, batches[5:])
    _train(resumed_model, resumed, batches[5:])
    for a, b in zip(model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(a, b)
    for p, q in zip(model.parameters(), resumed_model.parameters(), strict=True):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], resumed.state[q][key])


def test_kernel_choice_is_resolved_recorded_and_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(compiled_kernel.KERNEL_ENV, "torch")  # the compiled kernel's routing: test_compiled_kernel
    p = nn.Parameter(torch.randn(4, 4))
    opt = LAMB([p])
    assert opt.param_groups[0]["foreach"] is None
    p.grad = torch.randn(4, 4)
    opt.step()
    # The documented device rule: the multi-tensor kernel on CPU while torch's fused Adam serves the dtype.
    assert opt.param_groups[0]["foreach"] is True
    assert opt.state_dict()["param_groups"][0]["foreach"] is True

    calls: list[str] = []
    real_multi, real_single = F._multi_tensor_lamb, F._single_tensor_lamb
    monkeypatch.setattr(F, "_multi_tensor_lamb", lambda *a, **k: calls.append("multi") or real_multi(*a, **k))
    monkeypatch.setattr(F, "_single_tensor_lamb", lambda *a, **k: calls.append("single") or real_single(*a, **k))

    saved = LAMB([p], foreach=False)
    saved.step()
    resumed = LAMB([p])  # foreach=None here, but the checkpoint says: the loop
    resumed.load_state_dict(saved.state_dict())
    resumed.step()
    opt.step()
    assert calls == ["single", "single", "multi"]


def test_device_rule_falls_back_to_loop_without_fused_moments(monkeypatch: pytest.MonkeyPatch) -> None:
    p = torch.zeros(3)
    assert F.resolve_foreach(None, [p]) is True
    assert F.resolve_foreach(False, [p]) is False
    monkeypatch.setattr(F, "fused_moments_supported", lambda device, dtype: False)
    assert F.resolve_foreach(None, [p]) is False
    assert F.resolve_foreach(True, [p]) is True
    # A non-CPU device gets the multi-tensor kernel whatever the fused support.
    assert F.resolve_foreach(None, [torch.empty(3, device="meta")]) is True


@pytest.mark.parametrize("scheduler", ["step", "lambda"])
def test_lr_schedulers_change_the_lr_used(scheduler: str) -> None:
    gen = torch.Generator().manual_seed(31)
    params = _random_params(gen, [(6, 5), (5,)], [1.0, 1.0])
    opt = LAMB(params, lr=0.05, weight_decay=0.01, foreach=False)
    if scheduler == "step":
        sched: torch.optim.lr_scheduler.LRScheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.2)

        def lr_at(t: int) -> float:
            return 0.05 * 0.2 ** ((t - 1) // 3)
    else:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 / (1 + epoch))

        def lr_at(t: int) -> float:
            return 0.05 / t

    ref = RefLamb([p.detach().double().numpy() for p in params], [RefGroup([0, 1], lr_at=lr_at)])
    for _ in range(10):
        grads = _random_grads(gen, params)
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        opt.step()
        sched.step()
        ref.step([g.double().numpy() for g in grads])
    for p, r in zip(params, ref.params, strict=True):
        np.testing.assert_allclose(p.detach().double().numpy(), r, rtol=1e-5, atol=1e-6)
    assert opt.param_groups[0]["lr"] == pytest.approx(lr_at(11))


def test_trust_ratios_empty_before_first_step_and_closure_runs() -> None:
    p = nn.Parameter(torch.randn(3, 3))
    opt = LAMB([p])
    assert opt.trust_ratios() == {}

    def closure() -> float:
        opt.zero_grad()
        loss = (p * p).sum()
        loss.backward()
        return float(loss.detach())

    loss = opt.step(closure)
    assert loss is not None and math.isfinite(loss)
    (ratio,) = opt.trust_ratios().values()
    assert isinstance(ratio, float) and 0.0 <= ratio <= 10.0


def test_pickle_and_deepcopy_keep_counters() -> None:
    p = nn.Parameter(torch.randn(3))
    opt = LAMB([p], max_grad_norm=2.0)
    p.grad = torch.tensor([float("nan"), 0.0, 0.0])
    opt.step()
    twin = copy.deepcopy(opt)
    assert twin.skipped_steps == 1 and twin.max_grad_norm == 2.0


def test_trust_ratio_rule() -> None:
    assert F.trust_ratio(0.0, 3.0, 0.0, 10.0) == 1.0
    assert F.trust_ratio(3.0, 0.0, 0.0, 10.0) == 1.0
    assert F.trust_ratio(1.0, 100.0, 0.1, 10.0) == 0.1
    assert F.trust_ratio(100.0, 1.0, 0.1, 10.0) == 10.0
    assert F.trust_ratio(2.0, 4.0, 0.1, 10.0) == 0.5
    t = F._trust_ratio_tensor(torch.tensor([0.0, 3.0, 1.0, 100.0, 2.0]), torch.tensor([3.0, 0.0, 100.0, 1.0, 4.0]),
                              0.1, 10.0)  # fmt: skip
    assert t.tolist() == [1.0, 1.0, pytest.approx(0.1), 10.0, 0.5]


def test_workspace_reuses_and_grows() -> None:
    ws = F.Workspace()
    a = [torch.zeros(4, 3), torch.zeros(5)]
    first = ws.views(a)
    assert [v.shape for v in first] == [(4, 3), (5,)]
    assert ws.views(a)[0].data_ptr() == first[0].data_ptr()
    assert first[1].data_ptr() != first[0].data_ptr()
    big = ws.views([torch.zeros(100)])
    assert big[0].numel() == 100 and ws.nbytes() == 400
    assert F._chunks([torch.zeros(3), torch.zeros(3), torch.zeros(10), torch.zeros(1)], 6) == [(0, 2), (2, 3), (3, 4)]


@pytest.mark.parametrize("max_grad_norm", [None, 1.0])
@pytest.mark.parametrize("kernel", KERNELS, indirect=True)
def test_float64_params_match_reference_tightly(kernel: bool, max_grad_norm: float | None) -> None:
    """In float64 the only differences left are rounding: 1e-10 relative after 30+ steps, global clipping (which
    binds here: the gradients' norm is about 8) included."""
    gen = torch.Generator().manual_seed(77)
    weight = nn.Parameter(torch.randn(9, 7, generator=gen, dtype=torch.float64))
    params = [weight, nn.Parameter(torch.zeros(7, dtype=torch.float64))]
    opt = LAMB(params, lr=0.01, weight_decay=0.02, max_trust_ratio=5.0, foreach=kernel, max_grad_norm=max_grad_norm)
    ref = RefLamb([p.detach().numpy().copy() for p in params], [RefGroup([0, 1], lr=0.01, weight_decay=0.02,
                                                                         max_trust_ratio=5.0)],
                  max_grad_norm=max_grad_norm)  # fmt: skip
    for _ in range(STEPS):
        grads = [torch.randn(p.shape, generator=gen, dtype=torch.float64) for p in params]
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        opt.step()
        ref.step([g.numpy() for g in grads])
    for p, r in zip(params, ref.params, strict=True):
        np.testing.assert_allclose(p.detach().numpy(), r, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kernel", KERNELS, indirect=True)
def test_bfloat16_and_mixed_dtypes_step(kernel: bool) -> None:
    gen = torch.Generator().manual_seed(78)
    w16 = nn.Parameter(torch.randn(8, 8, generator=gen).bfloat16())
    w32 = nn.Parameter(torch.randn(8, 8, generator=gen))
    opt = LAMB([w16, w32], lr=0.01, foreach=kernel)
    before = [w16.detach().clone(), w32.detach().clone()]
    for _ in range(3):
        w16.grad = torch.randn(8, 8, generator=gen).bfloat16()
        w32.grad = torch.randn(8, 8, generator=gen)
        opt.step()
    assert w16.dtype == torch.bfloat16 and opt.state[w16]["exp_avg"].dtype == torch.bfloat16
    assert not torch.equal(w16, before[0]) and not torch.equal(w32, before[1])
    assert all(math.isfinite(r) and r > 0 for r in opt.trust_ratios().values())


def test_eps_zero_is_refused_in_the_constructor_and_in_a_loaded_state() -> None:
    """eps=0 makes m/sqrt(v) 0/0 where every gradient of an element was 0: NaN weights at the first step (the
    control below), so it is refused, also from a state saved when it was still taken."""
    p = nn.Parameter(torch.ones(4))
    with pytest.raises(ValueError, match=r"^eps must be a finite float > 0 \(with 0, an element whose gradients"):
        LAMB([p], eps=0.0)
    g = torch.tensor([1.0, 0.0, 2.0, 0.0])  # two elements never get a gradient
    m_hat, v_hat = g, g * g  # after the first step, bias-corrected
    assert torch.isnan(m_hat / (v_hat.sqrt() + 0.0)).sum() == 2  # what eps=0 would make of them
    opt = LAMB([p])
    saved = opt.state_dict()
    saved["param_groups"][0]["eps"] = 0.0
    with pytest.raises(ValueError, match=r"^eps must be a finite float > 0 .* in a loaded state, got 0.0"):
        LAMB([p]).load_state_dict(saved)


@pytest.mark.parametrize("kernel", KERNELS, indirect=True)
@pytest.mark.parametrize("how", ["order", "resize"])
def test_a_state_of_another_shape_is_refused_before_anything_changes(kernel: bool, how: str) -> None:
    """A state_dict loaded into an optimizer whose parameters come in another order (or a parameter resized after a
    step) gives a parameter moments of another size. The kernels pair elements by offset: the default CPU kernels
    read and wrote past the smaller tensor (NaN weights, then a crash). Refused by name, nothing changed."""
    gen = torch.Generator().manual_seed(81)
    a, b = nn.Parameter(torch.randn(1000, generator=gen)), nn.Parameter(torch.randn(4, generator=gen))
    opt = LAMB([a, b], lr=0.1, foreach=kernel)
    a.grad, b.grad = torch.randn(1000, generator=gen), torch.randn(4, generator=gen)
    opt.step()
    if how == "order":
        saved = opt.state_dict()
        a, b = nn.Parameter(a.detach().clone()), nn.Parameter(b.detach().clone())
        opt = LAMB([b, a], lr=0.1, foreach=kernel)
        opt.load_state_dict(saved)  # b takes a's moments and a b's, as torch's Adam would give them
    else:
        with torch.no_grad():
            b.data = torch.randn(1000, generator=gen)
    a.grad, b.grad = torch.randn(a.shape, generator=gen), torch.randn(b.shape, generator=gen)
    before = [a.detach().clone(), b.detach().clone()]
    state_before = copy.deepcopy(opt.state_dict()["state"])
    with pytest.raises(ValueError, match=r"^LAMB: parameter \d of the step has shape \(\d+,\) but its exp_avg has"):
        opt.step()
    torch.testing.assert_close([a.detach(), b.detach()], before, rtol=0, atol=0)
    for key, st in opt.state_dict()["state"].items():
        for name, value in st.items():
            assert torch.equal(value, state_before[key][name]), name


@pytest.mark.parametrize("kernel", KERNELS, indirect=True)
def test_float16_params_whose_second_moment_underflows_stay_finite(kernel: bool) -> None:
    """float16 keeps ``v`` where float16 keeps it: an element with a gradient of 1e-3 gets v = 1e-9, which underflows
    to 0, so its ``m̂/(√v̂+ε)`` is about 1000. The kernels keep ``u/λ`` in a buffer of the parameter's dtype where
    the weight decay allows: with the default λ = 0.01 that is 1e5, past float16's 65504, and the per-tensor loop
    turned such weights into Inf. Checked against the formula in float64 on the moments the optimizer kept."""
    g = torch.tensor([1e-3, 2e-3, 5e-3, 1e-2, 0.1, 1.0, -1e-3, 0.5], dtype=torch.float16)
    x0 = torch.linspace(-1, 1, 8).to(torch.float16)
    p = nn.Parameter(x0.clone())
    opt = LAMB([p], lr=0.01, foreach=kernel)  # weight_decay 0.01, eps 1e-6: the defaults
    p.grad = g.clone()
    opt.step()
    assert torch.isfinite(p).all(), p
    m, v = (opt.state[p][k].double() for k in ("exp_avg", "exp_avg_sq"))
    assert (v == 0).any()  # the case in point: some v underflowed
    x = x0.double()
    u = (m / 0.1) / ((v / 1e-3).sqrt() + 1e-6) + 0.01 * x
    assert float((u / 0.01).abs().max()) > 65504  # u/λ is out of float16's range here
    if not kernel:  # the loop takes its moments as stored; the fused kernel uses v before its float16 rounding
        ratio = min(float(x.norm() / u.norm()), 10.0)
        torch.testing.assert_close(p.detach().double(), x - 0.01 * ratio * u, rtol=0, atol=2e-3)


def test_a_float64_gradients_norm_sums_float32_ones_in_float64_with_every_kernel() -> None:
    """With a float64 gradient among them the global norm is float64 (as torch's ``clip_grad_norm_``): the torch
    kernels summed the float32 gradients' squares in float32 (5e-9 off), the compiled kernel in double."""
    gen = torch.Generator().manual_seed(83)
    grads = [torch.randn(64, 64, generator=gen) for _ in range(3)] + [torch.randn(10, generator=gen).double()]
    exact = math.sqrt(math.fsum(float((g.double() ** 2).sum()) for g in grads))
    kernels = ["torch"] if NO_COMPILER else ["torch", "compiled"]
    for name in kernels:
        norm = F.global_grad_norm(grads, F.Workspace(), kernel=name)
        assert norm.dtype == torch.float64
        assert abs(float(norm) - exact) <= 1e-14 * exact, (name, float(norm), exact)
    float32_only = F.global_grad_norm(grads[:3], F.Workspace(), kernel="torch")  # the control: float32 where all are
    assert float32_only.dtype == torch.float32
