"""``ivyplug bench lamb``: optimizer step time of ivyplug's LAMB next to AdamW and other LAMBs, on CPU; with
``--keras`` also ivyplug's Keras LAMB next to Keras's own ``Lamb`` and ``AdamW`` (:mod:`.lamb_keras_job`).

Why it is built this way:

* Every optimizer gets its own copy of the same random parameters and gradients, and they step **interleaved**,
  round-robin in a rotating order, so that foreign load on a shared machine hits all of them alike; the table
  reports medians and ratios to ``AdamW(fused=True)`` measured in the same rounds.
* The memory-bandwidth floor is measured in the same run: the bandwidth of an in-place ``add_`` (12 bytes moved per
  element) over tensors of the benchmark's size, times the 28 bytes per element that an Adam-family step must
  move (read grad, read+write param, both moments).
* glibc returns large freed blocks to the OS and faults them in again on the next step; kernels with per-step
  temporaries pay for it. Each setting therefore runs twice, in fresh subprocesses: with the default allocator
  and with ``MALLOC_TRIM_THRESHOLD_``/``MALLOC_MMAP_THRESHOLD_``/``MALLOC_TOP_PAD_`` raised (they are read at
  process start). Minor page faults per step are recorded for every optimizer.
* The warm-up lasts a number of rounds *and* a minimum time: the first passes over freshly allocated memory are
  several times slower than later ones (first touch, and on virtual machines the host backing the pages), and
  that is not what a training loop sees after its first steps.
* Two intra-op threads unless ``IVYPLUG_BENCH_THREADS`` says otherwise, so that runs on machines with different
  core counts compare.
* ``os.getloadavg()`` is recorded before and after each part: a load above the core count means the numbers are
  inflated by other processes.
* The torch CPU kernel's passes over the large tensors are timed one by one inside its sequence, and other orders
  of the same torch operations (:data:`SEQUENCES`), and the compiled kernel, as whole steps next to fused AdamW:
  what each order costs against the alternatives, and what the all-or-nothing gradient check costs.
* ivyplug's default LAMB row is the compiled kernel where a C compiler exists (each child builds or loads it
  before timing and records which kernel the default is); the torch multi-tensor kernel has its own row.

timm's and torch-optimizer's ``Lamb`` are measured only when importable (they are not ivyplug dependencies).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

DESCRIPTION = (
    "LAMB step time vs AdamW (loop/foreach/fused), other LAMBs and the memory-bandwidth floor (CPU); --keras: the "
    "Keras LAMB vs keras.optimizers.Lamb and AdamW"
)

#: label -> (total parameters, tensors); half the tensors are square 2-D weights, half 1-D biases.
SIZES: dict[str, tuple[int, int]] = {"1M": (1_000_000, 40), "10M": (10_000_000, 100)}
#: glibc settings of the "raised" run: no trimming, no mmap for blocks up to 32 MiB (the maximum), 256 MiB top pad.
RAISED_MALLOC_ENV = {
    "MALLOC_TRIM_THRESHOLD_": str(1 << 30),
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
    "MALLOC_TOP_PAD_": str(256 << 20),
}
BYTES_PER_ELEMENT = 28
REFERENCE = "AdamW fused=True"
LAMB_DEFAULT = "ivyplug LAMB (default: compiled kernel)"
LAMB_TORCH = "ivyplug LAMB multi-tensor torch kernel"
TORCH_OPTIMIZER = "torch-optimizer Lamb"
#: ivyplug's LAMB (default kernel) at most this many times fused AdamW's step time, with either allocator setting.
TARGET_VS_FUSED_ADAMW = 1.8
#: ivyplug's LAMB at least this many times as fast as torch-optimizer's, with either allocator setting.
TARGET_VS_TORCH_OPTIMIZER = 2.5
CHILD_TIMEOUT_S = {True: 300.0, False: 1800.0}
#: Environment variable that sets the intra-op threads of ``ivyplug bench lamb`` (torch and TensorFlow).
THREADS_ENV = "IVYPLUG_BENCH_THREADS"
DEFAULT_THREADS = 2
#: Minimum warm-up time per size (seconds) on top of the warm-up rounds; a quick run skips it.
WARMUP_SECONDS = 3.0


def _make_params(total: int, n_tensors: int, seed: int) -> list[Any]:
    """``n_tensors/2`` square weights and as many biases adding up to about ``total`` elements, with grads."""
    import torch

    n_weights = max(1, n_tensors // 2)
    side = max(1, round((total / n_weights) ** 0.5))
    gen = torch.Generator().manual_seed(seed)
    params = []
    for _ in range(n_weights):
        for shape in ((side, side), (side,)):
            p = torch.nn.Parameter(torch.randn(shape, generator=gen) * 0.02)
            p.grad = torch.randn(shape, generator=gen) * 1e-3
            params.append(p)
    return params


def _contenders() -> list[tuple[str, Callable[[list[Any]], Any] | None, str]]:
    """(name, factory or None, status). A factory returns a step function."""
    import torch

    from ivyplug.optim import LAMB, compiled_kernel
    from ivyplug.optim import functional as lamb_functional

    def stepper(opt: Any) -> Callable[[], None]:
        return lambda: opt.step()

    def torch_kernel(opt: Any) -> Callable[[], None]:
        """``opt.step()`` with ivyplug's torch kernels (``IVYPLUG_LAMB_KERNEL=torch``), whatever the default."""

        def step() -> None:
            saved = os.environ.get(compiled_kernel.KERNEL_ENV)
            os.environ[compiled_kernel.KERNEL_ENV] = "torch"
            try:
                opt.step()
            finally:
                if saved is None:
                    del os.environ[compiled_kernel.KERNEL_ENV]
                else:
                    os.environ[compiled_kernel.KERNEL_ENV] = saved

        return step

    def plain_foreach_lamb(params: list[Any]) -> Callable[[], None]:
        run = torch_kernel(LAMB(params, weight_decay=0.01, foreach=True))
        cache = lamb_functional._FUSED_MOMENTS_SUPPORT
        key = (params[0].device, params[0].dtype)

        def step() -> None:
            saved = cache.get(key)
            cache[key] = False  # the kernel accelerators run: plain _foreach ops, no fused moments
            try:
                run()
            finally:
                if saved is None:
                    cache.pop(key, None)
                else:
                    cache[key] = saved

        return step

    rows: list[tuple[str, Callable[[list[Any]], Any] | None, str]] = [
        ("AdamW foreach=False", lambda ps: stepper(torch.optim.AdamW(ps, weight_decay=0.01, foreach=False)), "ok"),
        ("AdamW foreach=True", lambda ps: stepper(torch.optim.AdamW(ps, weight_decay=0.01, foreach=True)), "ok"),
        (REFERENCE, lambda ps: stepper(torch.optim.AdamW(ps, weight_decay=0.01, fused=True)), "ok"),
        (
            "ivyplug LAMB loop (foreach=False)",
            lambda ps: torch_kernel(LAMB(ps, weight_decay=0.01, foreach=False)),
            "ok",
        ),
        (LAMB_DEFAULT, lambda ps: stepper(LAMB(ps, weight_decay=0.01)), "ok"),
        (LAMB_TORCH, lambda ps: torch_kernel(LAMB(ps, weight_decay=0.01)), "ok"),
        ("ivyplug LAMB multi-tensor, plain _foreach ops", plain_foreach_lamb, "ok"),
        (
            "ivyplug LAMB default + max_grad_norm=1",
            lambda ps: stepper(LAMB(ps, weight_decay=0.01, max_grad_norm=1.0)),
            "ok",
        ),
    ]
    try:
        import torch_optimizer

        rows.append(
            (TORCH_OPTIMIZER, lambda ps: stepper(torch_optimizer.Lamb(ps, weight_decay=0.01)), "ok"),
        )
    except Exception as exc:
        rows.append((TORCH_OPTIMIZER, None, f"not installed ({type(exc).__name__})"))
    try:
        from timm.optim import Lamb as TimmLamb

        rows.append(("timm Lamb", lambda ps: stepper(TimmLamb(ps, weight_decay=0.01)), "ok"))
    except Exception as exc:
        rows.append(("timm Lamb", None, f"not installed ({type(exc).__name__}: {str(exc)[:60]})"))
    return rows


def _add_probe(total: int) -> Callable[[], None]:
    """An in-place ``a.add_(b)`` over ``total`` float32 elements: 12 bytes moved per element (read a, b; write a).

    Timed in the same interleaved rounds as the optimizers, so the floor sees the same foreign load.
    """
    import torch

    a = torch.zeros(total)
    b = torch.ones(total)

    def probe() -> None:
        a.add_(b)

    return probe


def _measure_size(
    label: str, total: int, n_tensors: int, warmup: int, steps: int, warmup_s: float = 0.0
) -> dict[str, Any]:
    contenders = _contenders()
    steppers: dict[str, Callable[[], None]] = {}
    rows: dict[str, dict[str, Any]] = {}
    n_params = 0
    for name, factory, status in contenders:
        rows[name] = {"name": name, "status": status}
        if factory is None:
            continue
        params = _make_params(total, n_tensors, seed=0)
        n_params = sum(p.numel() for p in params)
        try:
            steppers[name] = factory(params)
        except Exception as exc:  # a third-party optimizer that rejects this torch
            rows[name]["status"] = f"error: {type(exc).__name__}: {str(exc)[:80]}"
    probe = "in-place add_ (bandwidth probe)"
    steppers[probe] = _add_probe(n_params)
    times: dict[str, list[float]] = {name: [] for name in steppers}
    faults: dict[str, int] = dict.fromkeys(steppers, 0)
    names = list(steppers)
    started = time.perf_counter()
    warm = 0
    while warm < warmup or time.perf_counter() - started < warmup_s:
        for name in names:
            steppers[name]()
        warm += 1
    for r in range(steps):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            steppers[name]()
            elapsed = time.perf_counter() - t0
            after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            times[name].append(elapsed)
            faults[name] += after - before
    bandwidth = 12.0 * n_params / statistics.median(times.pop(probe))
    floor_ms = BYTES_PER_ELEMENT * n_params / bandwidth * 1e3
    reference_ms = statistics.median(times[REFERENCE]) * 1e3 if REFERENCE in times else float("nan")
    for name, samples in times.items():
        q = statistics.quantiles(samples, n=4) if len(samples) >= 2 else [samples[0]] * 3
        median_ms = statistics.median(samples) * 1e3
        rows[name].update(
            median_ms=median_ms,
            p25_ms=q[0] * 1e3,
            p75_ms=q[2] * 1e3,
            ratio_vs_fused_adamw=median_ms / reference_ms,
            ratio_vs_floor=median_ms / floor_ms,
            minor_faults_per_step=faults[name] / len(samples),
        )
    return {
        "label": label,
        "params": n_params,
        "tensors": n_tensors,
        "steps": steps,
        "warmup": warm,
        "add_bandwidth_gbs": bandwidth / 1e9,
        "floor_ms": floor_ms,
        "rows": [rows[name] for name, _, _ in contenders],
    }


#: The passes of ivyplug's torch CPU kernel over one large tensor, in the order it runs them (``_pass_breakdown``).
PASSES = ("gradient norm", "copy x", "‖x‖", "fused moments", "‖u‖", "update x")


def _pass_breakdown(total: int, n_tensors: int, rounds: int) -> dict[str, Any]:
    """Where LAMB's time goes: each pass of the CPU kernel's large-tensor path, timed inside the sequence it runs
    in (so each sees the cache state the kernel leaves it), next to fused AdamW's whole step on the same tensors.

    Per element of the large tensors (the 2-D weights), medians over ``rounds``; the sum of the passes is what the
    kernel cannot go below with these torch operations, whatever its Python costs.
    """
    import torch

    from ivyplug.optim.functional import _fused_adam_direction

    weights = [p.detach() for p in _make_params(total, n_tensors, seed=1) if p.dim() == 2]
    grads = [torch.randn_like(w) for w in weights]
    exp_avgs = [torch.zeros_like(w) for w in weights]
    exp_avg_sqs = [torch.rand_like(w) for w in weights]
    steps = [torch.ones(()) for _ in weights]
    numel = sum(w.numel() for w in weights)
    scratch = torch.empty(max(w.numel() for w in weights))
    twins = [torch.nn.Parameter(w.clone()) for w in weights]
    for twin, g in zip(twins, grads, strict=True):
        twin.grad = g.clone()
    adamw = torch.optim.AdamW(twins, weight_decay=0.01, fused=True)
    clock = time.perf_counter
    samples: dict[str, list[float]] = {name: [] for name in (*PASSES, "AdamW fused=True")}
    for r in range(rounds + 2):
        t0 = clock()
        adamw.step()
        adamw_s = clock() - t0
        spent = dict.fromkeys(PASSES, 0.0)
        t0 = clock()
        for g in grads:
            flat = g.view(-1)
            torch.dot(flat, flat).item()
        spent["gradient norm"] = clock() - t0
        for i, w in enumerate(weights):
            u_flat = scratch[: w.numel()]
            u = u_flat.view(w.shape)
            t0 = clock()
            u.copy_(w)
            t1 = clock()
            torch.dot(u_flat, u_flat).item()
            t2 = clock()
            _fused_adam_direction([u], [grads[i]], [exp_avgs[i]], [exp_avg_sqs[i]], [steps[i]], beta1=0.9,
                                  beta2=0.999, eps=1e-6, lr=-100.0)  # fmt: skip
            t3 = clock()
            torch.dot(u_flat, u_flat).item()
            t4 = clock()
            w.add_(u, alpha=-1e-9)
            t5 = clock()
            for name, dt in zip(PASSES[1:], (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=True):
                spent[name] += dt
        if r >= 2:  # two rounds of warm-up
            samples["AdamW fused=True"].append(adamw_s)
            for name in PASSES:
                samples[name].append(spent[name])
    ns = {name: statistics.median(v) / numel * 1e9 for name, v in samples.items()}
    passes = sum(ns[name] for name in PASSES)
    return {
        "elements": numel,
        "tensors": len(weights),
        "rounds": rounds,
        "ns_per_element": ns,
        "passes_ns_per_element": passes,
        "passes_vs_fused_adamw": passes / ns["AdamW fused=True"],
        "sequences": _sequences(weights, grads, exp_avgs, exp_avg_sqs, steps, adamw, rounds),
    }


#: Orders of torch operations for the large tensors' LAMB step (name -> what it runs), timed as whole steps next
#: to fused AdamW by ``_sequences``: the kernel's own and the alternatives it was measured against.
SEQUENCES = {
    "kernel": "gradient pass; per tensor: copy x, ‖x‖, fused moments into the copy, ‖u‖, update x",
    "fused moments on x": "gradient pass; per tensor: copy x aside, ‖x‖, fused moments into x itself, ‖u‖, "
    "x = copy − step",
    "zeroed direction": "gradient pass; per tensor: zero the scratch, fused moments into it (d), ‖x‖, ⟨x, d⟩, ‖d‖ "
    "(‖u‖ from the three), lerp x",
    "no gradient pass": "per tensor: copy x as x + 0·g, then as the kernel; no all-or-nothing skip (reference only: "
    "a NaN is seen only when its tensor comes)",
    "compiled kernel": "ivyplug's compiled kernel: gradient pass in C; per tensor, moments and both norms in one pass, "
    "then the update (only where a C compiler exists)",
}


def _sequence_steps(
    weights: list[Any],
    grads: list[Any],
    exp_avgs: list[Any],
    exp_avg_sqs: list[Any],
    steps: list[Any],
    lr: float = 1e-9,
    decay: float = 0.01,
) -> dict[str, Callable[[], None]]:
    """One LAMB step (betas 0.9/0.999, ε 1e-6, ratio clipped to [0, 10]) over these tensors for each of
    :data:`SEQUENCES`, in place. The step counters are not advanced: the caller does that (tests compare a step of
    each with ivyplug's LAMB)."""
    import math

    import torch

    from ivyplug.optim import compiled_kernel
    from ivyplug.optim import functional as lamb_functional
    from ivyplug.optim.functional import _fused_adam_direction, trust_ratio
    from ivyplug.optim.lamb_hyper import LambHyper

    scratch = torch.empty(max(w.numel() for w in weights))
    aside = torch.empty_like(scratch)
    dot = torch.dot

    def grad_pass() -> bool:
        return math.isfinite(math.fsum(dot(g.view(-1), g.view(-1)).item() for g in grads))

    def fused(u: Any, i: int, kernel_lr: float) -> None:
        _fused_adam_direction([u], [grads[i]], [exp_avgs[i]], [exp_avg_sqs[i]], [steps[i]], beta1=0.9,
                              beta2=0.999, eps=1e-6, lr=kernel_lr)  # fmt: skip

    def kernel(pre_pass: bool = True) -> None:
        if pre_pass and not grad_pass():
            return
        for i, w in enumerate(weights):
            u_flat = scratch[: w.numel()]
            u = u_flat.view(w.shape)
            if pre_pass:
                u.copy_(w)
            else:
                torch.add(w, grads[i], alpha=0.0, out=u)
            x_sq = dot(u_flat, u_flat).item()
            fused(u, i, -1.0 / decay)
            r = trust_ratio(math.sqrt(x_sq), decay * math.sqrt(dot(u_flat, u_flat).item()), 0.0, 10.0)
            w.add_(u, alpha=-lr * r * decay)

    def fused_on_x() -> None:
        if not grad_pass():
            return
        for i, w in enumerate(weights):
            kept_flat = aside[: w.numel()]
            kept_flat.view(w.shape).copy_(w)
            x_sq = dot(kept_flat, kept_flat).item()
            fused(w, i, -1.0 / decay)  # w holds u/λ now
            w_flat = w.view(-1)
            r = trust_ratio(math.sqrt(x_sq), decay * math.sqrt(dot(w_flat, w_flat).item()), 0.0, 10.0)
            torch.add(kept_flat.view(w.shape), w, alpha=-lr * r * decay, out=w)

    def zeroed_direction() -> None:
        if not grad_pass():
            return
        for i, w in enumerate(weights):
            d_flat = scratch[: w.numel()]
            d_flat.zero_()
            fused(d_flat.view(w.shape), i, 1.0 / decay)  # holds -d/λ
            w_flat = w.view(-1)
            x_sq, x_d, d_sq = dot(w_flat, w_flat).item(), dot(w_flat, d_flat).item(), dot(d_flat, d_flat).item()
            u_norm = decay * math.sqrt(max(x_sq - 2.0 * x_d + d_sq, 0.0))  # ‖λx + d‖ = λ‖x − (−d/λ)‖
            r = trust_ratio(math.sqrt(x_sq), u_norm, 0.0, 10.0)
            w.lerp_(d_flat.view(w.shape), lr * r * decay)

    runs = {
        "kernel": kernel,
        "fused moments on x": fused_on_x,
        "zeroed direction": zeroed_direction,
        "no gradient pass": lambda: kernel(pre_pass=False),
    }
    lib = compiled_kernel.load()
    if lib is None:
        return runs
    threads = torch.get_num_threads()
    sizes = dict(
        split_min=lamb_functional.COMPILED_SPLIT_ELEMENTS,
        parallel_min=lamb_functional.COMPILED_PARALLEL_ELEMENTS,
        block=lamb_functional.COMPILED_BLOCK_ELEMENTS,
    )
    keep = torch.empty(threads * lamb_functional.COMPILED_KEEP_ELEMENTS)
    own_steps = [torch.zeros(()) for _ in steps]  # the kernel advances its counters: these, set to the caller's - 1
    hyper = LambHyper(lr=lr, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=decay)

    def compiled() -> None:
        if not math.isfinite(lib.sumsq(grads, threads=threads, **sizes)):
            return
        torch._foreach_copy_(own_steps, list(steps))
        torch._foreach_sub_(own_steps, 1.0)
        lib.lamb(weights, grads, exp_avgs, exp_avg_sqs, own_steps, hyper, threads=threads, scratch=keep, **sizes)

    runs["compiled kernel"] = compiled
    return runs


def _sequences(
    weights: list[Any],
    grads: list[Any],
    exp_avgs: list[Any],
    exp_avg_sqs: list[Any],
    steps: list[Any],
    adamw: Any,
    rounds: int,
) -> dict[str, Any]:
    """Each of :data:`SEQUENCES` as a whole step over the large tensors, interleaved with fused AdamW's step on
    their twins; medians (ms) and ratios to AdamW from the same rounds. The step sizes are tiny, so the tensors
    stay as they are for every sequence."""
    runs = _sequence_steps(weights, grads, exp_avgs, exp_avg_sqs, steps)
    names = ["AdamW fused=True", *runs]
    run_of = {"AdamW fused=True": adamw.step, **runs}
    samples: dict[str, list[float]] = {name: [] for name in names}
    clock = time.perf_counter
    for r in range(rounds + 2):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            t0 = clock()
            run_of[name]()
            if r >= 2:
                samples[name].append(clock() - t0)
    ms = {name: statistics.median(v) * 1e3 for name, v in samples.items()}
    return {"median_ms": ms, "vs_fused_adamw": {name: ms[name] / ms["AdamW fused=True"] for name in names}}


def _child(config: dict[str, Any]) -> dict[str, Any]:
    """One allocator setting, measured in this (fresh) process."""
    import torch

    from ivyplug.optim import compiled_kernel

    if config.get("threads"):
        torch.set_num_threads(int(config["threads"]))
    lib = compiled_kernel.load()  # built here, not inside the first timed step
    lamb_kernel = "compiled" if lib is not None else f"torch ({compiled_kernel.unavailable_reason()})"
    load_before = os.getloadavg()
    warmup_s = float(config.get("warmup_s", 0.0))
    sizes = [
        _measure_size(label, total, n, config["warmup"], config["steps"], warmup_s)
        for label, (total, n) in config["sizes"]
    ]
    label, (total, n) = config["sizes"][-1]
    breakdown = {"size": label, **_pass_breakdown(total, n, 5 if config["steps"] < 50 else 30)}
    return {
        "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
        "torch": torch.__version__,
        "pass_breakdown": breakdown,
        "torch_threads": torch.get_num_threads(),
        "lamb_kernel": lamb_kernel,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "sizes": sizes,
    }


def _run_child(
    config: dict[str, Any], extra_env: dict[str, str], timeout: float, module: str = "ivyplug.benchmarks.lamb"
) -> dict[str, Any]:
    """``python -m module --child CONFIG`` in a fresh process: no MALLOC_ settings but those of ``extra_env``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(extra_env)
    proc = subprocess.run(
        [sys.executable, "-m", module, "--child", json.dumps(config)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark child failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


#: Keras backends the ``--keras`` comparison runs on, each in a child of its own.
KERAS_BACKENDS: tuple[str, ...] = ("tensorflow", "jax", "torch")


def _run_keras_child(config: dict[str, Any], timeout: float, backend: str) -> dict[str, Any]:
    """The Keras comparison on one backend, in its own process (Keras fixes its backend at import; the backend's
    threads and allocator stay out of the torch runs)."""
    env = {"KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "2"}
    return _run_child(config, env, timeout, module="ivyplug.benchmarks.lamb_keras_job")


def _targets(settings: dict[str, Any]) -> dict[str, Any]:
    """The targets at the largest size, judged on every allocator setting (each must meet them)."""
    out: dict[str, Any] = {"size": None, "per_setting": {}}
    for setting, child in settings.items():
        size = child["sizes"][-1]
        out["size"] = size["label"]
        rows = {r["name"]: r for r in size["rows"]}
        lamb = rows.get(LAMB_DEFAULT, {})
        ratio = lamb.get("ratio_vs_fused_adamw")
        tor = rows.get(TORCH_OPTIMIZER, {})
        speedup = tor["median_ms"] / lamb["median_ms"] if "median_ms" in tor and "median_ms" in lamb else None
        out["per_setting"][setting] = {
            "lamb_vs_fused_adamw": ratio,
            "lamb_vs_fused_adamw_met": ratio is not None and ratio <= TARGET_VS_FUSED_ADAMW,
            "speedup_vs_torch_optimizer": speedup,
            "speedup_vs_torch_optimizer_met": None if speedup is None else speedup >= TARGET_VS_TORCH_OPTIMIZER,
        }
    per = out["per_setting"].values()
    out["lamb_vs_fused_adamw_met"] = all(p["lamb_vs_fused_adamw_met"] for p in per)
    measured = [p["speedup_vs_torch_optimizer_met"] for p in per if p["speedup_vs_torch_optimizer_met"] is not None]
    out["speedup_vs_torch_optimizer_met"] = all(measured) if measured else None
    return out


def _resolve_threads(threads: int | None) -> int:
    if threads is None:
        raw = os.environ.get(THREADS_ENV)
        if not raw:
            return DEFAULT_THREADS
        try:
            threads = int(raw)
        except ValueError:
            raise ValueError(f"{THREADS_ENV} must be an int >= 1, got {raw!r}") from None
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be None or an int >= 1, got {threads!r}")
    return threads


def run(
    quick: bool = False,
    sizes: dict[str, tuple[int, int]] | None = None,
    threads: int | None = None,
    keras: bool = False,
    keras_backends: tuple[str, ...] = KERAS_BACKENDS,
) -> dict[str, Any]:
    """Both allocator settings, each in a fresh subprocess; with ``keras`` the Keras comparison, one more
    subprocess per Keras backend in ``keras_backends``.

    ``sizes`` overrides :data:`SIZES` and ``threads`` the intra-op thread count (default: the
    ``IVYPLUG_BENCH_THREADS`` environment variable, else 2; smoke tests use tiny sizes and one thread).
    """
    threads = _resolve_threads(threads)
    unknown = [b for b in keras_backends if b not in KERAS_BACKENDS]
    if unknown or not keras_backends:
        raise ValueError(f"keras_backends must be a non-empty subset of {KERAS_BACKENDS}, got {keras_backends!r}")
    chosen = SIZES if sizes is None else sizes
    for label, (total, n) in chosen.items():
        if total < 2 or n < 2:
            raise ValueError(f"sizes[{label!r}] must have >= 2 elements and >= 2 tensors, got {(total, n)}")
    config = {
        "sizes": list(chosen.items()),
        "warmup": 2 if quick else 5,
        "warmup_s": 0.0 if quick else WARMUP_SECONDS,
        "steps": 5 if quick else 50,
        "threads": threads,
    }
    load_before = os.getloadavg()
    settings = {
        "default": _run_child(config, {}, CHILD_TIMEOUT_S[quick]),
        "glibc_raised": _run_child(config, RAISED_MALLOC_ENV, CHILD_TIMEOUT_S[quick]),
    }
    results: dict[str, Any] = {
        "benchmark": "lamb",
        "quick": quick,
        "cpu_count": os.cpu_count(),
        "threads": threads,
        "loadavg_before": load_before,
        "settings": settings,
        "targets": _targets(settings),
    }
    if keras:
        from ivyplug.benchmarks import lamb_keras_job

        keras_config = {**config, "steps": 5 if quick else 30}
        results["keras"] = {b: _run_keras_child(keras_config, CHILD_TIMEOUT_S[quick], b) for b in keras_backends}
        results["keras_targets"] = {b: lamb_keras_job.targets(child) for b, child in results["keras"].items()}
    results["loadavg_after"] = os.getloadavg()
    return results


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


_VERDICT = {True: "met", False: "NOT met", None: "not measured"}


def format_table(results: dict[str, Any]) -> str:
    """Markdown tables, one per allocator setting and size (and the Keras ones), plus the targets."""
    lines: list[str] = []
    load = results["loadavg_before"], results["loadavg_after"]
    lines.append(
        f"cpus: {results['cpu_count']}; load average (1/5/15 min) before {_fmt_load(load[0])}, "
        f"after {_fmt_load(load[1])}{' (quick run: not a measurement)' if results['quick'] else ''}"
    )
    for setting, child in results["settings"].items():
        env = ", ".join(f"{k}={v}" for k, v in sorted(child["malloc_env"].items())) or "glibc defaults"
        lines.append("")
        lines.append(
            f"### allocator: {setting} ({env}); torch {child['torch']}, {child['torch_threads']} threads; "
            f"ivyplug's default CPU kernel: {child['lamb_kernel']}"
        )
        before, after = _fmt_load(child["loadavg_before"]), _fmt_load(child["loadavg_after"])
        lines.append(f"load average before {before}, after {after}")
        for size in child["sizes"]:
            lines.append("")
            lines.append(
                f"**{size['label']}**: {size['params']:,} params in {size['tensors']} tensors; median of "
                f"{size['steps']} interleaved steps after {size['warmup']} warm-up rounds; in-place add_ bandwidth "
                f"{size['add_bandwidth_gbs']:.1f} GB/s, floor (28 B/element) {size['floor_ms']:.2f} ms"
            )
            lines.append("")
            lines.append("| optimizer | median ms | p25–p75 ms | × fused AdamW | × floor | page faults/step |")
            lines.append("|---|---:|---:|---:|---:|---:|")
            for row in size["rows"]:
                if "median_ms" not in row:
                    lines.append(f"| {row['name']} | {row['status']} | | | | |")
                    continue
                lines.append(
                    f"| {row['name']} | {row['median_ms']:.2f} | {row['p25_ms']:.2f}–{row['p75_ms']:.2f} | "
                    f"{row['ratio_vs_fused_adamw']:.2f} | {row['ratio_vs_floor']:.2f} | "
                    f"{row['minor_faults_per_step']:.0f} |"
                )
        b = child["pass_breakdown"]
        lines.append("")
        lines.append(
            f"**passes of the torch CPU kernel** at {b['size']} ({b['tensors']} large tensors, {b['elements']:,} "
            f"elements; median of {b['rounds']} rounds, ns per element, each pass timed inside the kernel's sequence):"
        )
        lines.append("")
        names = [*PASSES, "AdamW fused=True"]
        lines.append("| " + " | ".join(names) + " | passes / fused AdamW |")
        lines.append("|" + "---:|" * (len(names) + 1))
        cells = [f"{b['ns_per_element'][name]:.3f}" for name in names]
        lines.append("| " + " | ".join(cells) + f" | {b['passes_vs_fused_adamw']:.2f} |")
        seq = b["sequences"]
        lines.append("")
        lines.append(
            "**orders of operations for those tensors**, whole steps interleaved with fused AdamW's "
            f"(median of {b['rounds']} rounds):"
        )
        lines.append("")
        lines.append("| sequence | median ms | × fused AdamW | what it runs |")
        lines.append("|---|---:|---:|---|")
        for name, ms in seq["median_ms"].items():
            what = SEQUENCES.get(name, "torch's fused AdamW kernel over all of them")
            lines.append(f"| {name} | {ms:.2f} | {seq['vs_fused_adamw'][name]:.2f} | {what} |")
    t = results["targets"]
    lines.append("")
    for setting, p in t["per_setting"].items():
        lines.append(
            f"targets at {t['size']} ({setting}): LAMB / fused AdamW = {_fmt(p['lamb_vs_fused_adamw'], '.2f')} "
            f"(target <= {TARGET_VS_FUSED_ADAMW}: {_VERDICT[p['lamb_vs_fused_adamw_met']]}); speed-up vs "
            f"torch-optimizer Lamb = {_fmt(p['speedup_vs_torch_optimizer'], '.2f')} (target >= "
            f"{TARGET_VS_TORCH_OPTIMIZER}: {_VERDICT[p['speedup_vs_torch_optimizer_met']]})"
        )
    if "keras" in results:
        from ivyplug.benchmarks import lamb_keras_job

        for backend, child in results["keras"].items():
            lines.append("")
            lines.append(lamb_keras_job.format_table(child, results["keras_targets"][backend]))
    return "\n".join(lines)


def _fmt_load(load: Any) -> str:
    return "/".join(f"{x:.2f}" for x in load)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(_child(json.loads(sys.argv[2]))))
    else:
        results = run(quick="--quick" in sys.argv, keras="--keras" in sys.argv)
        print(format_table(results))
