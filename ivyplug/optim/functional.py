"""LAMB as functions over tensor lists: a per-tensor reference loop and a multi-tensor kernel.

The algorithm is Algorithm 2 of You et al. (ICLR 2020), with these documented choices:

* weight decay sits inside the trust-ratio update: ``u = m̂ / (√v̂ + ε) + λx`` (paper and its reference code;
  not decoupled decay outside the ratio);
* the *ratio* ``‖x‖ / ‖u‖`` is clipped to ``[min_trust_ratio, max_trust_ratio]`` (not the norm ``‖x‖``);
* the ratio is exactly 1 when ``‖x‖ = 0`` or ``‖u‖ = 0`` (zero-initialised layers still move), and that fallback
  is not clipped;
* ``exclude_from_layer_adaptation`` forces the ratio to 1 (the update is then AdamW-like with L2-in-update decay);
* global gradient clipping (``grad_scale``) is applied by scaling ``g`` inside the moment updates, so the caller's
  ``.grad`` tensors are never modified.

The kernels keep the number of passes small and allocate nothing per step: the direction ``u`` (stored as ``u/λ``,
or ``u/c``, and rescaled in the norms and the final update) lives in a reused scratch buffer (:class:`Workspace`),
so no large temporaries are freed to the OS and faulted in again each step, whatever the allocator settings. The
loop and the plain ``_foreach`` path use ``m̂/(√v̂+ε) = c·m/(√v+ε·√bc2)`` with ``c = √bc2/bc1``; the CPU
multi-tensor path lets torch's fused Adam kernel write ``m̂/(√v̂+ε)`` (same formula, torch's rounding).

Device rule for ``foreach=None`` (:func:`resolve_foreach`): the multi-tensor kernel, except on CPU when torch's
fused Adam kernel cannot serve the dtype, where the per-tensor loop runs. On CPU the multi-tensor kernel
(:func:`_cpu_fused_lamb`) computes the moments and the Adam direction in one pass through that fused kernel (into
a scratch buffer), one large tensor at a time and small tensors in blocks of one size, so that a step costs few
calls per tensor; groups excluded from layer adaptation get torch's fused AdamW update directly. It was measured
faster than the loop; built from plain ``_foreach`` ops it is slower than the loop on CPU (``ivyplug bench lamb``,
docs/benchmarks.md). On accelerators it saves launches, as in torch.optim.

The compiled kernel (:mod:`ivyplug.optim.compiled_kernel`, ``kernel=`` or ``IVYPLUG_LAMB_KERNEL``) takes the place
of the CPU multi-tensor kernel for contiguous float32 tensors: two passes per tensor in C (moments and both norms;
then the update, kept in a cache-sized scratch or recomputed), split across ``torch.get_num_threads()`` threads of
torch's own OpenMP team where there is one (one thread below :data:`COMPILED_PARALLEL_ELEMENTS`). The torch kernels
stay the reference and the fallback: for every other tensor, and whenever no C compiler is at hand.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from ivyplug.optim import compiled_kernel
from ivyplug.optim.lamb_hyper import LambHyper

__all__ = [
    "COMPILED_BLOCK_ELEMENTS",
    "COMPILED_KEEP_ELEMENTS",
    "COMPILED_PARALLEL_ELEMENTS",
    "COMPILED_SPLIT_ELEMENTS",
    "CPU_CHUNK_ELEMENTS",
    "CPU_SMALL_ELEMENTS",
    "Direction",
    "LambHyper",
    "Workspace",
    "direction_ratio",
    "global_grad_norm",
    "lamb",
    "lamb_apply",
    "lamb_direction",
    "resolve_foreach",
    "trust_ratio",
]

#: Elements per block of small tensors, and per piece of a larger tensor, in the CPU kernel: a piece's passes run
#: back to back over at most this much of each buffer (param, grad, both moments, scratch).
CPU_CHUNK_ELEMENTS = 1 << 19
#: Tensors below this size run in multi-tensor blocks on CPU (ATen runs them on one thread anyway, so a call per
#: tensor and pass would be all overhead); larger ones run alone, in pieces.
CPU_SMALL_ELEMENTS = 1 << 15
#: Elements per multi-tensor chunk on accelerators: bounds the scratch memory to two buffers of this size.
DEVICE_CHUNK_ELEMENTS = 1 << 25
#: Fewest elements per thread for the compiled kernel to split one tensor (or the gradient norm) across threads:
#: below it the threads' start-up and the barrier cost more than the pass; such tensors are shared out whole.
COMPILED_SPLIT_ELEMENTS = 1 << 15
#: Below this many elements in one call the compiled kernel runs on one thread: waking the second one costs more
#: than it saves. Measured with the kernel on torch's OpenMP team, whole steps interleaved with fused AdamW's
#: (2 threads): 100k parameters in 20 tensors 0.88x on one thread, 0.92x on two; 300k in 20 1.36x and 1.13x;
#: 1M in 40 1.34-1.49x and 1.14-1.18x.
COMPILED_PARALLEL_ELEMENTS = 1 << 18
#: About this many elements per block that a thread of the compiled kernel claims at a time (512 KiB per buffer):
#: small enough that a thread's blocks stay in its cache between the two passes and that a thread the OS preempts
#: holds the others up briefly. Measured at 10M parameters in 200k-element tensors on 2 threads (kernel alone, data
#: partly in cache from the previous call):
#: blocks of 100k elements 1.03-1.08x fused AdamW's step, of 25k 1.09x, of 50k 1.6-1.7x, recomputing u 1.3x.
COMPILED_BLOCK_ELEMENTS = 1 << 17
#: Elements of the update each thread of the compiled kernel may keep between its two passes over its blocks (a
#: scratch small enough to stay in its cache); blocks beyond that room recompute it from the moments instead.
COMPILED_KEEP_ELEMENTS = 1 << 18
#: Sums of squares above float32's range count as an overflow (not finite), as they do in the torch kernels.
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def resolve_foreach(foreach: bool | None, tensors: Sequence[Tensor]) -> bool:
    """Which kernel runs: an explicit choice wins; ``None`` applies the device rule.

    The rule: the multi-tensor kernel on every non-CPU device; on CPU the multi-tensor kernel when torch's fused
    Adam kernel serves its dtype (:func:`fused_moments_supported`: one pass for the moments, measured faster), and
    otherwise the per-tensor loop (plain ``_foreach`` ops lose cache locality on CPU and were measured slower).
    """
    if foreach is not None:
        return bool(foreach)
    if any(t.device.type != "cpu" for t in tensors):
        return True
    kinds = {(t.device, t.dtype) for t in tensors}
    return bool(kinds) and all(fused_moments_supported(device, dtype) for device, dtype in kinds)


def trust_ratio(param_norm: float, update_norm: float, min_ratio: float, max_ratio: float) -> float:
    """``‖x‖/‖u‖`` clipped to ``[min_ratio, max_ratio]``; exactly 1 when either norm is 0 (or not finite)."""
    if param_norm > 0.0 and update_norm > 0.0 and math.isfinite(param_norm) and math.isfinite(update_norm):
        return min(max(param_norm / update_norm, min_ratio), max_ratio)
    return 1.0


def _trust_ratio_tensor(param_norms: Tensor, update_norms: Tensor, min_ratio: float, max_ratio: float) -> Tensor:
    """Vectorised :func:`trust_ratio` that never leaves the device (no host sync)."""
    ok = (param_norms > 0) & (update_norms > 0) & param_norms.isfinite() & update_norms.isfinite()
    ratio = (param_norms / torch.where(ok, update_norms, torch.ones_like(update_norms))).clamp_(min_ratio, max_ratio)
    return torch.where(ok, ratio, torch.ones_like(ratio))


class Workspace:
    """Scratch buffers that live across steps, so the kernels allocate nothing per step.

    One flat buffer per (slot, device, dtype), grown when a larger request arrives; the views carved from it are
    cached by the shapes asked for, so a steady-state step does a dict lookup per request. The CPU kernel's
    constant operands (the step increment, the infinite step that switches off bias correction) live here too.
    """

    def __init__(self) -> None:
        self._flat: dict[tuple[int, torch.device, torch.dtype], Tensor] = {}
        self._views: dict[tuple[object, ...], tuple[list[Tensor], list[Tensor], Tensor]] = {}
        self._constants: dict[tuple[float, torch.device], Tensor] = {}

    def views(self, tensors: Sequence[Tensor], slot: int = 0) -> list[Tensor]:
        """Uninitialised scratch tensors shaped like ``tensors`` (same device and dtype), disjoint from each other."""
        return self._carve(tensors, slot)[0]

    def span(self, tensors: Sequence[Tensor], slot: int = 0) -> tuple[list[Tensor], list[Tensor], Tensor]:
        """:meth:`views`, the same views flattened to 1-D, and the one contiguous 1-D tensor they tile."""
        return self._carve(tensors, slot)

    def _carve(
        self, tensors: Sequence[Tensor], slot: int, device: torch.device | None = None
    ) -> tuple[list[Tensor], list[Tensor], Tensor]:
        first = tensors[0]
        device = first.device if device is None else device
        key = (slot, device, first.dtype, *(t.shape for t in tensors))
        cached = self._views.get(key)
        if cached is not None:
            return cached
        flat_key = (slot, device, first.dtype)
        total = sum(t.numel() for t in tensors)
        flat = self._flat.get(flat_key)
        if flat is None or flat.numel() < total:
            # Drop views of the old buffer so its memory is released.
            self._views = {k: v for k, v in self._views.items() if k[:3] != flat_key}
            flat = torch.empty(total, device=device, dtype=first.dtype)
            self._flat[flat_key] = flat
        shaped: list[Tensor] = []
        flats: list[Tensor] = []
        offset = 0
        for t in tensors:
            n = t.numel()
            piece = flat[offset : offset + n]
            flats.append(piece)
            shaped.append(piece.view(t.shape))
            offset += n
        entry = (shaped, flats, flat[:total])
        self._views[key] = entry
        return entry

    def constant(self, value: float, device: torch.device) -> Tensor:
        """A cached 0-dim float32 tensor holding ``value`` (read-only operand of the kernels)."""
        key = (value, device)
        t = self._constants.get(key)
        if t is None:
            t = torch.full((), value, dtype=torch.float32, device=device)
            self._constants[key] = t
        return t

    def flat(self, numel: int, slot: int, device: torch.device, dtype: torch.dtype) -> Tensor:
        """An uninitialised contiguous 1-D scratch tensor of ``numel`` elements in ``slot``."""
        return self._carve([torch.empty((numel,), device="meta", dtype=dtype)], slot, device)[2]

    def nbytes(self) -> int:
        """Bytes held by the scratch buffers (for memory accounting)."""
        return sum(f.numel() * f.element_size() for f in self._flat.values())

    def clear(self) -> None:
        self._flat.clear()
        self._views.clear()
        self._constants.clear()


def global_grad_norm(grads: Sequence[Tensor], workspace: Workspace | None = None, kernel: str | None = None) -> Tensor:
    """The L2 norm of all ``grads`` together (0-dim, on the first grad's device): float64 where a gradient is, as
    torch's ``clip_grad_norm_`` (a float32 norm put float64 clipping ~1e-8 off), else float32.

    Not finite when any gradient element is NaN/Inf, or when the sum of squares of the float32 ones leaves
    float32's range (of float64 ones, float64's); this is how the optimizer detects a step to skip. On CPU the
    compiled kernel (chosen as in :func:`lamb`) sums the contiguous float32 gradients in one multi-threaded pass;
    otherwise a ``workspace`` lets small gradients be stacked into a scratch buffer and summed in one call.
    """
    if not grads:
        return torch.zeros(())
    wide = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    if all(g.is_cpu for g in grads):
        total = 0.0
        rest: Sequence[Tensor] = grads
        choice = compiled_kernel.kernel_choice(kernel)
        if choice != "torch":
            dense = [g for g in grads if _compiled_tensor(g)]
            lib = compiled_kernel.load(required=choice == "compiled") if dense else None
            if lib is not None:
                total = lib.sumsq(
                    dense,
                    threads=_kernel_threads(),
                    split_min=COMPILED_SPLIT_ELEMENTS,
                    parallel_min=COMPILED_PARALLEL_ELEMENTS,
                    block=COMPILED_BLOCK_ELEMENTS,
                )
                if total > _FLOAT32_MAX:
                    total = math.inf
                rest = [g for g in grads if not _compiled_tensor(g)] if len(dense) < len(grads) else []
        if rest:
            total += _cpu_sumsq(rest, workspace, wide)
        return torch.tensor(math.sqrt(total), dtype=wide)
    target = grads[0].device
    by_device: dict[torch.device, list[Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    partial = []
    for dev_grads in by_device.values():
        norms = torch._foreach_norm(dev_grads)
        partial.append(torch.linalg.vector_norm(torch.stack([n.to(wide) for n in norms])).to(target))
    return torch.linalg.vector_norm(torch.stack(partial))


_DOT_DTYPES = (torch.float32, torch.float64)


def _sumsq(t: Tensor) -> float:
    """``‖t‖²`` as a float; on CPU through BLAS ``dot``, several times faster than ``vector_norm`` there.

    NaN/Inf elements (or a sum that overflows) give a non-finite result.
    """
    if t.is_cpu and t.dtype in _DOT_DTYPES:
        flat = t if t.dim() == 1 else t.view(-1) if t.is_contiguous() else t.reshape(-1)
        return torch.dot(flat, flat).item()
    return float(torch.linalg.vector_norm(t, dtype=torch.float32) ** 2)


def _cpu_sumsq(tensors: Sequence[Tensor], workspace: Workspace | None, wide: torch.dtype = torch.float32) -> float:
    """``Σ‖t‖²`` over CPU tensors: one BLAS ``dot`` per large tensor; small float32/float64 tensors of one shape
    are stacked into scratch slot 2 first, because for them the call, not the data, is the cost. ``wide`` float64
    (a float64 tensor among them): every tensor's sum is taken in float64, as the compiled kernel takes it."""
    parts: list[float] = []
    small: dict[tuple[torch.Size, torch.dtype], list[Tensor]] = {}
    for t in tensors:
        if wide == torch.float64 and t.dtype != torch.float64:
            parts.append(float(torch.linalg.vector_norm(t, dtype=torch.float64)) ** 2)
        elif workspace is not None and t.numel() < CPU_SMALL_ELEMENTS and t.dtype in _DOT_DTYPES:
            small.setdefault((t.shape, t.dtype), []).append(t)
        else:
            parts.append(_sumsq(t))
    for (shape, _), same in small.items():
        per = max(1, CPU_CHUNK_ELEMENTS // max(1, same[0].numel()))
        for lo in range(0, len(same), per):
            batch = same[lo : lo + per]
            if len(batch) == 1:
                parts.append(_sumsq(batch[0]))
                continue
            _, _, span = workspace.span(batch, slot=2)  # type: ignore[union-attr]
            torch.stack(batch, out=span.view(len(batch), *shape))
            parts.append(torch.dot(span, span).item())
    return math.fsum(parts)


def _kernel_threads() -> int:
    """Threads of the compiled kernel: torch's intra-op thread count, so both kernels use the same cores."""
    return torch.get_num_threads()


def _compiled_tensor(t: Tensor) -> bool:
    """Whether the compiled kernel can address ``t`` by pointer: a plain dense contiguous float32 CPU tensor."""
    return (
        t.dtype == torch.float32
        and t.is_cpu
        and type(t) in _PLAIN_TENSOR_TYPES
        and t.layout == torch.strided
        and t.is_contiguous()
        and not t.is_neg()
    )


_PLAIN_TENSOR_TYPES = (Tensor, torch.nn.Parameter)


def _compiled_eligible(p: Tensor, g: Tensor, m: Tensor, v: Tensor, step: Tensor) -> bool:
    """Whether one parameter's tensors can take the compiled kernel (the rest take the torch kernels): all
    :func:`_compiled_tensor` (spelled out, once per parameter and step), one shape, a one-element step counter."""
    f32, plain, strided, shape = torch.float32, _PLAIN_TENSOR_TYPES, torch.strided, p.shape
    return (
        p.dtype == f32
        and g.dtype == f32
        and m.dtype == f32
        and v.dtype == f32
        and step.dtype == f32
        and p.is_cpu
        and g.is_cpu
        and m.is_cpu
        and v.is_cpu
        and step.is_cpu
        and type(p) in plain
        and type(g) in plain
        and type(m) in plain
        and type(v) in plain
        and type(step) in plain
        and p.layout == strided
        and g.layout == strided
        and m.layout == strided
        and v.layout == strided
        and g.shape == shape
        and m.shape == shape
        and v.shape == shape
        and step.numel() == 1
        and p.is_contiguous()
        and g.is_contiguous()
        and m.is_contiguous()
        and v.is_contiguous()
        and not (p.is_neg() or g.is_neg() or m.is_neg() or v.is_neg())
    )


def _folds(h: LambHyper, dtype: torch.dtype) -> bool:
    """Whether a scratch buffer of ``dtype`` keeps ``u/λ`` (:attr:`LambHyper.fold`): not in float16, whose range
    (65504) ``c/λ`` times an element whose ``v`` underflowed leaves (the update would turn Inf)."""
    return h.fold and dtype != torch.float16


def _bias_factors(step: float, beta1: float, beta2: float, eps: float, bias_correction: bool) -> tuple[float, float]:
    """(c, ε') with ``m̂/(√v̂+ε) = c·m/(√v+ε')``."""
    if not bias_correction:
        return 1.0, eps
    bc1 = 1.0 - beta1**step
    bc2_sqrt = math.sqrt(1.0 - beta2**step)
    return bc2_sqrt / bc1, eps * bc2_sqrt


class StepTensors(NamedTuple):
    """The parallel lists one step updates: parameters, gradients, both moments, step counters."""

    params: Sequence[Tensor]
    grads: Sequence[Tensor]
    exp_avgs: Sequence[Tensor]
    exp_avg_sqs: Sequence[Tensor]
    steps: Sequence[Tensor]

    def take(self, indices: Sequence[int]) -> StepTensors:
        """The tensors of the parameters at ``indices``, in that order."""
        return StepTensors(*([t[i] for i in indices] for t in self))


#: a kernel: the tensors of one step, its hyperparameters, the scratch buffers -> the trust ratios, in order
_Kernel = Callable[[StepTensors, LambHyper, "Workspace"], "list[float | Tensor]"]


def _in_parts(
    t: StepTensors, h: LambHyper, workspace: Workspace, parts: Sequence[tuple[Sequence[int], _Kernel]]
) -> list[float | Tensor]:
    """Run each kernel on the parameters at its indices (``parts`` partition them); the ratios in the caller's order."""
    ratios: list[float | Tensor] = [1.0] * len(t.params)
    for indices, kernel in parts:
        if indices:
            for i, r in zip(indices, kernel(t.take(indices), h, workspace), strict=True):
                ratios[i] = r
    return ratios


class Direction(NamedTuple):
    """What :func:`lamb_direction` leaves for :func:`lamb_apply`: the update is ``scale`` times the scratch it
    filled; ``param_sq`` = ``‖x‖²`` (0 when the ratio is not adapted), ``scratch_sq`` = ``‖scratch‖²``."""

    param_sq: float
    scratch_sq: float
    scale: float


def lamb_direction(p: Tensor, g: Tensor, m: Tensor, v: Tensor, step: Tensor, h: LambHyper, out: Tensor) -> Direction:
    """First half of one tensor's LAMB step: the moments and the direction ``u = m̂/(√v̂+ε) + λx`` (into ``out``,
    shaped like ``p``, as ``u/λ`` or ``u/c``), and the sums of squares its trust ratio needs; ``p`` is not changed.

    A tensor split across parameter-server shards takes its ratio from every piece's sums: each shard runs this on
    its piece, the shards add up their :class:`Direction` sums, and each applies :func:`lamb_apply` with the ratio
    of the whole tensor.
    """
    beta1, beta2, weight_decay, grad_scale = h.beta1, h.beta2, h.weight_decay, h.grad_scale
    step += 1
    c, eps_s = _bias_factors(step.item(), beta1, beta2, h.eps, h.bias_correction)
    if grad_scale == 1.0:
        m.lerp_(g, 1.0 - beta1)
    else:
        m.mul_(beta1).add_(g, alpha=(1.0 - beta1) * grad_scale)
    v.mul_(beta2).addcmul_(g, g, value=(1.0 - beta2) * grad_scale * grad_scale)
    param_sq = _sumsq(p) if h.adapt else 0.0
    torch.sqrt(v, out=out)
    out.add_(eps_s)
    if _folds(h, out.dtype):  # out holds (m̂/(√v̂+ε) + λx) / λ
        torch.addcdiv(p, m, out, value=c / weight_decay, out=out)
        scale = weight_decay
    else:  # out holds (m̂/(√v̂+ε) + λx) / c
        torch.div(m, out, out=out)
        if weight_decay != 0.0:
            out.add_(p, alpha=weight_decay / c)
        scale = c
    return Direction(param_sq, _sumsq(out) if h.adapt else 0.0, scale)


def direction_ratio(param_sq: float, scratch_sq: float, scale: float, h: LambHyper) -> float:
    """The trust ratio of a tensor from its (summed) :class:`Direction` sums of squares."""
    if not h.adapt:
        return 1.0
    return trust_ratio(math.sqrt(param_sq), scale * math.sqrt(scratch_sq), h.min_trust_ratio, h.max_trust_ratio)


def lamb_apply(p: Tensor, direction: Tensor, scale: float, ratio: float, lr: float) -> None:
    """Second half of the step: ``x ← x − η·ratio·u`` with ``u = scale · direction`` (:func:`lamb_direction`)."""
    p.add_(direction, alpha=-lr * ratio * scale)


def _single_tensor_lamb(t: StepTensors, h: LambHyper, workspace: Workspace) -> list[float | Tensor]:
    """Reference kernel: one tensor at a time, each tensor's passes run while it is hot in cache.

    Reads norms back to the host per tensor (free on CPU, a sync per tensor on accelerators, where the
    multi-tensor kernel is the default). Its ops honour strides and any dtype.
    """
    ratios: list[float | Tensor] = []
    for p, g, m, v, step_t in zip(*t, strict=True):
        (u,) = workspace.views((p,))
        d = lamb_direction(p, g, m, v, step_t, h, u)
        ratio = direction_ratio(d.param_sq, d.scratch_sq, d.scale, h)
        lamb_apply(p, u, d.scale, ratio, h.lr)
        ratios.append(ratio)
    return ratios


def _chunks(tensors: Sequence[Tensor], limit: int) -> list[tuple[int, int]]:
    """Consecutive index ranges whose element counts add up to at most ``limit`` (a bigger tensor stands alone)."""
    ranges: list[tuple[int, int]] = []
    start, total = 0, 0
    for i, t in enumerate(tensors):
        n = t.numel()
        if i > start and total + n > limit:
            ranges.append((start, i))
            start, total = i, 0
        total += n
    if start < len(tensors):
        ranges.append((start, len(tensors)))
    return ranges


_FUSED_MOMENTS_SUPPORT: dict[tuple[torch.device, torch.dtype], bool] = {}


def fused_moments_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's fused Adam kernels can compute LAMB's Adam direction (and, for groups excluded from layer
    adaptation, the whole AdamW-like update) for tensors of this device and dtype.

    Used on CPU only (where LAMB keeps its step counters); probed once per (device, dtype) on a tiny tensor, so an
    older torch or an unsupported dtype falls back to plain ``_foreach`` ops instead of failing mid-step.
    """
    key = (device, dtype)
    if key not in _FUSED_MOMENTS_SUPPORT:
        ok = device.type == "cpu" and hasattr(torch, "_fused_adam_") and hasattr(torch, "_fused_adamw_")
        if ok:
            try:
                u = [torch.zeros(4, device=device, dtype=dtype)]
                g = [torch.ones(4, device=device, dtype=dtype)]
                m = [torch.zeros(4, device=device, dtype=dtype)]
                v = [torch.zeros(4, device=device, dtype=dtype)]
                _fused_adam_direction(u, g, m, v, [torch.ones(())], beta1=0.9, beta2=0.999, eps=1e-6, lr=-1.0)
                ok = bool(torch.allclose(u[0].float(), torch.ones(4), rtol=1e-2))
                x = [torch.ones(4, device=device, dtype=dtype)]
                m = [torch.zeros(4, device=device, dtype=dtype)]
                v = [torch.zeros(4, device=device, dtype=dtype)]
                _fused_adamw_update(x, g, m, v, [torch.ones(())], lr=0.25, beta1=0.9, beta2=0.999, eps=1e-6,
                                    weight_decay=1.0)  # fmt: skip
                # x(1 − ηλ) − η·m̂/(√v̂+ε) with x = 1 and m̂/(√v̂+ε) = 1 at the first step: 0.75 − 0.25
                ok = ok and bool(torch.allclose(x[0].float(), torch.full((4,), 0.5), rtol=1e-2))
            except (RuntimeError, NotImplementedError, TypeError):
                ok = False
        _FUSED_MOMENTS_SUPPORT[key] = ok
    return _FUSED_MOMENTS_SUPPORT[key]


def _fused_adam_direction(
    u: list[Tensor],
    g: list[Tensor],
    m: list[Tensor],
    v: list[Tensor],
    steps: list[Tensor],
    *,
    beta1: float,
    beta2: float,
    eps: float,
    lr: float,
) -> None:
    """``u ← u − lr · m̂/(√v̂+ε)`` after updating ``m`` and ``v`` in place, in one pass (torch's fused Adam kernel).

    With ``lr = −1/λ`` and ``u = x`` this leaves ``u = (m̂/(√v̂+ε) + λx)/λ``. ``grad_scale`` is not passed: that
    kernel unscales gradients in place, and LAMB must not modify ``.grad``.
    """
    torch._fused_adam_(u, g, m, v, [], steps, lr=lr, beta1=beta1, beta2=beta2, weight_decay=0.0, eps=eps,
                       amsgrad=False, maximize=False, grad_scale=None, found_inf=None)  # fmt: skip


def _fused_adamw_update(
    x: list[Tensor],
    g: list[Tensor],
    m: list[Tensor],
    v: list[Tensor],
    steps: list[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """``x ← x(1 − ηλ) − η·m̂/(√v̂+ε)`` in one pass: LAMB's update when the trust ratio is 1 (torch's fused AdamW)."""
    torch._fused_adamw_(x, g, m, v, [], steps, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
                        amsgrad=False, maximize=False, grad_scale=None, found_inf=None)  # fmt: skip


def _same_dense_layout(p: Tensor, g: Tensor, m: Tensor, v: Tensor) -> bool:
    """Whether torch's fused kernels may pair these tensors' elements by memory offset (they do, ignoring strides)."""
    return (
        p.is_contiguous()
        and g.is_contiguous()
        and m.is_contiguous()
        and v.is_contiguous()
        and g.dtype == p.dtype
        and m.dtype == p.dtype
        and v.dtype == p.dtype
    )


def _cpu_fused_lamb(t: StepTensors, h: LambHyper, workspace: Workspace) -> list[float | Tensor]:
    """The CPU multi-tensor kernel: one large tensor at a time, small ones in blocks, few calls per tensor.

    * A tensor of at least :data:`CPU_SMALL_ELEMENTS` runs alone, in pieces of at most :data:`CPU_CHUNK_ELEMENTS`:
      per piece, copy ``x`` into the scratch buffer, take ``‖x‖²`` from it, let torch's fused Adam kernel update
      ``m``, ``v`` and turn the copy into ``u/λ`` (one pass), take ``‖u‖²``; then update ``x`` from the scratch
      buffer, last piece first (the one still in cache).
    * Smaller tensors (biases, norms) are below ATen's parallel grain, so their cost is calls, not bandwidth: those
      of one size run as a block whose scratch rows form one matrix, so each pass (copy, moments, both norms,
      scaling, update) is one call for the whole block.
    * With ``exclude_from_layer_adaptation`` (ratio 1) the update is AdamW's, so torch's fused AdamW kernel applies
      it straight to the parameters, with no scratch pass at all.
    * The fused kernels pair elements by memory offset: a parameter whose tensors do not all share one contiguous
      layout and dtype (e.g. channels-last weights) takes the per-tensor loop instead, whose ops honour strides.
    """
    params, grads, exp_avgs, exp_avg_sqs, steps = t
    n = len(params)
    fast = [i for i in range(n) if _same_dense_layout(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i])]
    if len(fast) < n:
        other = sorted(set(range(n)).difference(fast))
        return _in_parts(t, h, workspace, [(other, _single_tensor_lamb), (fast, _cpu_fused_lamb)])
    ratios: list[float | Tensor] = [1.0] * n
    lr, beta1, beta2, eps, weight_decay = h.lr, h.beta1, h.beta2, h.eps, h.weight_decay
    min_ratio, max_ratio = h.min_trust_ratio, h.max_trust_ratio
    device = params[0].device
    steps = list(steps)
    # The list overload: the scalar one wraps the 1 into a fresh tensor once per counter.
    torch._foreach_add_(steps, [workspace.constant(1.0, device)] * n)
    # The fused kernels always bias-correct; an infinite step makes 1 - beta**step exactly 1.
    kernel_steps = steps if h.bias_correction else [workspace.constant(math.inf, device)] * n

    if not h.adapt:
        for lo, hi in _chunks(params, CPU_CHUNK_ELEMENTS) if h.grad_scale != 1.0 else [(0, n)]:
            g = _scaled_grads(params[lo:hi], grads[lo:hi], h.grad_scale, workspace)
            _fused_adamw_update(list(params[lo:hi]), g, list(exp_avgs[lo:hi]), list(exp_avg_sqs[lo:hi]),
                                kernel_steps[lo:hi], lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                weight_decay=weight_decay)  # fmt: skip
        return ratios

    fold = _folds(h, params[0].dtype)
    scale = weight_decay if fold else 1.0  # the scratch buffer holds u / scale
    kernel_lr = -1.0 / weight_decay if fold else -1.0
    vectorised = params[0].dtype in _DOT_DTYPES
    # The common large tensor (one piece, fold, no clipping, float32/64) inline: a step costs few calls per tensor,
    # so Python per tensor shows.
    inline = fold and h.grad_scale == 1.0 and vectorised
    dot, fused_adam = torch.dot, torch._fused_adam_
    by_size: dict[int, list[int]] = {}
    for i, x in enumerate(params):
        numel = x.numel()
        if numel < CPU_SMALL_ELEMENTS:
            by_size.setdefault(numel, []).append(i)
        elif inline and numel <= CPU_CHUNK_ELEMENTS:
            (buf,), (buf_flat,), _ = workspace.span((x,))
            buf.copy_(x)
            param_sq = dot(buf_flat, buf_flat).item()  # buf holds x here
            fused_adam([buf], [grads[i]], [exp_avgs[i]], [exp_avg_sqs[i]], [], [kernel_steps[i]], lr=kernel_lr,
                       beta1=beta1, beta2=beta2, weight_decay=0.0, eps=eps, amsgrad=False, maximize=False,
                       grad_scale=None, found_inf=None)  # fmt: skip
            r = trust_ratio(
                math.sqrt(param_sq), scale * math.sqrt(dot(buf_flat, buf_flat).item()), min_ratio, max_ratio
            )
            x.add_(buf, alpha=-lr * r * scale)
            ratios[i] = r
        else:
            ratios[i] = _big_tensor_step(
                (x, grads[i], exp_avgs[i], exp_avg_sqs[i]), kernel_steps[i], h, workspace, kernel_lr
            )
    for numel, same in by_size.items():
        per = max(1, CPU_CHUNK_ELEMENTS // max(1, numel))
        for lo in range(0, len(same), per):
            block = same[lo : lo + per]
            count = len(block)
            p = [params[i] for i in block]
            u, _, span = workspace.span(p)
            rows = span.view(count, numel)
            g = _scaled_grads(p, [grads[i] for i in block], h.grad_scale, workspace)
            if fold:
                torch._foreach_copy_(u, p)
                param_norms = _row_norms(rows)  # the rows hold x here
            else:
                span.zero_()
                param_norms = [math.sqrt(_sumsq(x)) for x in p]
            _fused_adam_direction(u, g, [exp_avgs[i] for i in block], [exp_avg_sqs[i] for i in block],
                                  [kernel_steps[i] for i in block], lr=kernel_lr, beta1=beta1, beta2=beta2,
                                  eps=eps)  # fmt: skip
            if not fold and weight_decay != 0.0:
                torch._foreach_add_(u, p, alpha=weight_decay)
            update_norms = _row_norms(rows)
            coefs = []
            for k, i in enumerate(block):
                r = trust_ratio(param_norms[k], scale * update_norms[k], min_ratio, max_ratio)
                ratios[i] = r
                coefs.append(-lr * r * scale)
            if vectorised:
                rows.mul_(torch.tensor(coefs, dtype=rows.dtype).unsqueeze(1))
                torch._foreach_add_(p, u)
            else:
                for x, ui, c in zip(p, u, coefs, strict=True):
                    x.add_(ui, alpha=c)
    return ratios


def _row_norms(rows: Tensor) -> list[float]:
    """The L2 norm of each row, in one call (float32 accumulation or wider, as ``_sumsq`` for narrow dtypes)."""
    dtype = None if rows.dtype in _DOT_DTYPES else torch.float32
    norms: list[float] = torch.linalg.vector_norm(rows, dim=1, dtype=dtype).tolist()
    return norms


def _big_tensor_step(
    one: tuple[Tensor, Tensor, Tensor, Tensor],
    kernel_step: Tensor,
    h: LambHyper,
    workspace: Workspace,
    kernel_lr: float,
) -> float:
    """One large tensor of :func:`_cpu_fused_lamb`, piece by piece (see there): ``one`` is its parameter, gradient
    and moments, ``kernel_step`` its step counter already incremented (or the infinite step). Returns its ratio."""
    x, grad, exp_avg, exp_avg_sq = one
    fold, weight_decay = _folds(h, x.dtype), h.weight_decay
    scale = weight_decay if fold else 1.0
    numel = x.numel()
    (u,), (u_flat,), _ = workspace.span((x,))
    pieces = -(-numel // CPU_CHUNK_ELEMENTS)
    if pieces == 1:
        parts = [(x, grad, exp_avg, exp_avg_sq, u, u_flat)]
    else:
        edges = [numel * j // pieces for j in range(pieces + 1)]
        xf, gf, mf, vf = (t.view(-1) for t in one)
        parts = [(xf[a:b], gf[a:b], mf[a:b], vf[a:b], u_flat[a:b], u_flat[a:b]) for a, b in itertools.pairwise(edges)]
    param_sq = update_sq = 0.0
    for xp, gp, mp, vp, up, up_flat in parts:
        gs = gp
        if h.grad_scale != 1.0:
            (gs,) = workspace.views((gp,), slot=1)
            torch.mul(gp, h.grad_scale, out=gs)  # one pass; the fused kernels' own scaling would divide .grad in place
        if fold:
            up.copy_(xp)
            param_sq += _sumsq(up_flat)  # up holds x here
        else:
            up.zero_()
            param_sq += _sumsq(xp)
        _fused_adam_direction([up], [gs], [mp], [vp], [kernel_step], lr=kernel_lr, beta1=h.beta1, beta2=h.beta2,
                              eps=h.eps)  # fmt: skip
        if not fold and weight_decay != 0.0:
            up.add_(xp, alpha=weight_decay)
        update_sq += _sumsq(up_flat)
    r = trust_ratio(math.sqrt(param_sq), scale * math.sqrt(update_sq), h.min_trust_ratio, h.max_trust_ratio)
    alpha = -h.lr * r * scale
    for xp, _, _, _, up, _ in reversed(parts):
        xp.add_(up, alpha=alpha)
    return r


def _scaled_grads(
    like: Sequence[Tensor], grads: Sequence[Tensor], grad_scale: float, workspace: Workspace
) -> list[Tensor]:
    """``grads`` times ``grad_scale`` in scratch slot 1 (the fused kernels' own scaling would divide ``.grad`` in
    place); ``grads`` themselves when the scale is 1."""
    if grad_scale == 1.0:
        return list(grads)
    scaled, _, span = workspace.span(like, slot=1)
    torch._foreach_copy_(scaled, list(grads))
    span.mul_(grad_scale)
    return scaled


def _multi_tensor_lamb(t: StepTensors, h: LambHyper, workspace: Workspace) -> list[float | Tensor]:
    """Multi-tensor kernel for one device and dtype.

    On CPU, when :func:`fused_moments_supported`, :func:`_cpu_fused_lamb` runs (torch's fused Adam kernels, per
    tensor while it is in cache, ratios computed on the host). Elsewhere it uses ``torch._foreach_*`` ops, in
    chunks, and keeps the ratios on the device (no host sync). Returns the ratios as floats (CPU) or as 0-dim
    device tensors.
    """
    params, grads, exp_avgs, exp_avg_sqs, steps = t
    if not params:
        return []
    on_cpu = params[0].device.type == "cpu"
    if on_cpu and fused_moments_supported(params[0].device, params[0].dtype):
        return _cpu_fused_lamb(t, h, workspace)
    lr, beta1, beta2, weight_decay, grad_scale = h.lr, h.beta1, h.beta2, h.weight_decay, h.grad_scale
    min_ratio, max_ratio = h.min_trust_ratio, h.max_trust_ratio
    limit = CPU_CHUNK_ELEMENTS if on_cpu else DEVICE_CHUNK_ELEMENTS

    steps = list(steps)
    torch._foreach_add_(steps, 1.0)
    factors = [_bias_factors(s.item(), beta1, beta2, h.eps, h.bias_correction) for s in steps]

    ratios_out: list[float | Tensor] = []
    for lo, hi in _chunks(params, limit):
        p, g, m, v = list(params[lo:hi]), list(grads[lo:hi]), list(exp_avgs[lo:hi]), list(exp_avg_sqs[lo:hi])
        n = len(p)
        u = workspace.views(p, slot=0)
        scales: list[float]
        cs = [f[0] for f in factors[lo:hi]]
        if grad_scale == 1.0:
            torch._foreach_lerp_(m, g, 1.0 - beta1)
        else:
            torch._foreach_mul_(m, beta1)
            torch._foreach_add_(m, g, alpha=(1.0 - beta1) * grad_scale)
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, g, g, value=(1.0 - beta2) * grad_scale * grad_scale)
        d = workspace.views(p, slot=1)
        torch._foreach_copy_(d, v)
        torch._foreach_sqrt_(d)
        torch._foreach_add_(d, [f[1] for f in factors[lo:hi]])
        if _folds(h, p[0].dtype):  # u = (m̂/(√v̂+ε) + λx) / λ
            torch._foreach_copy_(u, p)
            torch._foreach_addcdiv_(u, m, d, [ci / weight_decay for ci in cs])
            scales = [weight_decay] * n
        else:  # u = (m̂/(√v̂+ε) + λx) / c
            torch._foreach_copy_(u, m)
            torch._foreach_div_(u, d)
            if weight_decay != 0.0:
                for ui, pi, ci in zip(u, p, cs, strict=True):
                    ui.add_(pi, alpha=weight_decay / ci)
            scales = cs
        if not h.adapt:
            if on_cpu:
                for pi, ui, si in zip(p, u, scales, strict=True):
                    pi.add_(ui, alpha=-lr * si)
            else:
                torch._foreach_mul_(u, [-lr * s for s in scales])
                torch._foreach_add_(p, u)
            ratios_out.extend([1.0] * n)
            continue
        if on_cpu:
            ratios = [
                trust_ratio(math.sqrt(_sumsq(pi)), si * math.sqrt(_sumsq(ui)), min_ratio, max_ratio)
                for pi, ui, si in zip(p, u, scales, strict=True)
            ]
            for pi, ui, si, ri in zip(p, u, scales, ratios, strict=True):
                pi.add_(ui, alpha=-lr * ri * si)
            ratios_out.extend(ratios)
            continue
        norms = torch.stack(torch._foreach_norm(p + u)).float()
        scale_t = torch.tensor(scales, device=norms.device, dtype=norms.dtype)
        ratio_t = _trust_ratio_tensor(norms[:n], norms[n:] * scale_t, min_ratio, max_ratio)
        coef = (ratio_t * scale_t * -lr).to(p[0].dtype)
        torch._foreach_mul_(u, list(coef.unbind()))
        torch._foreach_add_(p, u)
        ratios_out.extend(ratio_t.unbind())
    return ratios_out


def lamb(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    steps: Sequence[Tensor],
    *,
    foreach: bool | None = None,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    bias_correction: bool = True,
    max_trust_ratio: float = 10.0,
    min_trust_ratio: float = 0.0,
    exclude_from_layer_adaptation: bool = False,
    grad_scale: float = 1.0,
    workspace: Workspace | None = None,
    kernel: str | None = None,
) -> list[float | Tensor]:
    """One LAMB step over parallel lists of tensors, in place (like ``torch.optim.adam.adam``).

    ``steps`` are 0-dim float tensors, incremented here. ``grad_scale`` multiplies every gradient (global norm
    clipping). Returns the trust ratio used for each tensor, in order: floats, or 0-dim tensors from the
    multi-tensor kernel on accelerators (which never syncs with the host for them). ``workspace`` holds scratch
    buffers between calls; pass the same one every step to avoid per-step allocations.

    Which kernel: ``foreach`` (resolved by :func:`resolve_foreach`) picks the per-tensor reference loop or a
    multi-tensor kernel; for the multi-tensor kernel ``kernel`` (default: the ``IVYPLUG_LAMB_KERNEL`` environment
    variable, else ``"auto"``) picks the compiled kernel (``"compiled"``: required, an error if it cannot be
    built; ``"auto"``: when it builds) or the torch ones (``"torch"``). The compiled kernel serves the tensors it
    can (contiguous float32 on CPU, 0-dim float32 step counters); the others take the torch kernels.
    """
    n = len(params)
    if not (len(grads) == len(exp_avgs) == len(exp_avg_sqs) == len(steps) == n):
        raise ValueError(
            "params, grads, exp_avgs, exp_avg_sqs and steps must have the same length, got "
            f"{n}, {len(grads)}, {len(exp_avgs)}, {len(exp_avg_sqs)}, {len(steps)}"
        )
    for g in grads:
        if g.is_sparse:
            raise RuntimeError("LAMB does not support sparse gradients; use dense gradients (e.g. sparse=False)")
    h = LambHyper(
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        bias_correction=bias_correction,
        max_trust_ratio=max_trust_ratio,
        min_trust_ratio=min_trust_ratio,
        exclude_from_layer_adaptation=exclude_from_layer_adaptation,
        grad_scale=grad_scale,
    )
    t = StepTensors(params, grads, exp_avgs, exp_avg_sqs, steps)
    workspace = workspace if workspace is not None else Workspace()
    choice = compiled_kernel.kernel_choice(kernel)
    if not resolve_foreach(foreach, params):
        _check_shapes(t, range(n))
        return _single_tensor_lamb(t, h, workspace)
    if choice != "torch":
        fast = [i for i in range(n) if _compiled_eligible(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], steps[i])]
        lib = compiled_kernel.load(required=choice == "compiled") if fast else None
        if lib is not None:
            if len(fast) < n:  # the eligible ones have one shape each
                chosen = set(fast)
                _check_shapes(t, [i for i in range(n) if i not in chosen])
            return _compiled_lamb(lib, fast, t, h, workspace)
    _check_shapes(t, range(n))
    return _torch_lamb(t, h, workspace)


def _check_shapes(t: StepTensors, indices: Iterable[int]) -> None:
    """ValueError, before any tensor changes, where a parameter's gradient or moments have another shape than it
    (the kernels pair elements by offset: they would read and write past the smaller tensor)."""
    for i in indices:
        p = t.params[i]
        for what, other in (("gradient", t.grads[i]), ("exp_avg", t.exp_avgs[i]), ("exp_avg_sq", t.exp_avg_sqs[i])):
            if other.shape != p.shape:
                raise ValueError(
                    f"LAMB: parameter {i} of the step has shape {tuple(p.shape)} but its {what} has shape "
                    f"{tuple(other.shape)}: its optimizer state is not this parameter's (a state_dict of an "
                    "optimizer whose parameters came in another order or shapes, or a parameter resized after a step)"
                )


def _compiled_lamb(
    lib: compiled_kernel.CompiledKernel, fast: list[int], t: StepTensors, h: LambHyper, workspace: Workspace
) -> list[float | Tensor]:
    """The compiled kernel for the tensors at indices ``fast``; the torch kernels for the rest (and for all of
    them when two buffers overlap, which the kernel's threads could not update safely)."""
    n = len(t.params)
    every = len(fast) == n
    threads = _kernel_threads()
    scratch = workspace.flat(threads * COMPILED_KEEP_ELEMENTS, 3, t.params[fast[0]].device, torch.float32)
    mine = StepTensors(*(list(x) for x in t)) if every else t.take(fast)
    got = lib.lamb(
        *mine,
        h,
        threads=threads,
        split_min=COMPILED_SPLIT_ELEMENTS,
        parallel_min=COMPILED_PARALLEL_ELEMENTS,
        block=COMPILED_BLOCK_ELEMENTS,
        scratch=scratch,
    )
    if got is None:
        return _torch_lamb(t, h, workspace)
    # Written through pointers: tell autograd, as torch's in-place ops would, so stale saved tensors are caught.
    torch.autograd.graph.increment_version([*mine.params, *mine.exp_avgs, *mine.exp_avg_sqs, *mine.steps])
    if every:
        return list(got)
    chosen = set(fast)
    ratios = _in_parts(t, h, workspace, [([i for i in range(n) if i not in chosen], _torch_lamb)])
    for i, r in zip(fast, got, strict=True):
        ratios[i] = r
    return ratios


def _torch_lamb(t: StepTensors, h: LambHyper, workspace: Workspace) -> list[float | Tensor]:
    """The torch multi-tensor kernels, one call per (device, dtype) group, ratios in the caller's order."""
    params = t.params
    # foreach lists must share device and dtype: run the kernel per (device, dtype) group, keep the caller's order.
    dtype = params[0].dtype if params else None
    if params and params[0].is_cpu and all(p.dtype == dtype and p.is_cpu for p in params):  # the common case, cheaply
        return _multi_tensor_lamb(t, h, workspace)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault((p.device, p.dtype), []).append(i)
    if len(groups) <= 1:
        return _multi_tensor_lamb(t, h, workspace)
    return _in_parts(t, h, workspace, [(idx, _multi_tensor_lamb) for idx in groups.values()])
