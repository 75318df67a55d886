"""Shards and endpoints without gloo: two shards wired in-process, two workers' pushes as futures."""

from __future__ import annotations

import copy
import threading
from typing import Any

import pytest
import torch

from ivyplug.ps import PSConfig
from ivyplug.ps.server.endpoints import InProcessEndpoint
from ivyplug.ps.server.mirror import OptimizerSpec
from ivyplug.ps.server.shard import Shard
from ivyplug.ps.sharding import TensorSpec, build_plan
from ivyplug.ps.wire.push import PushFlag, hyper_prefix
from ivyplug.ps.wire.transport import PSProtocolError, PSTimeoutError
from ivyplug.ps.worker.layout import FlatLayout
from tests.ps.scenarios import batch, mlp


def _job(
    mode: str, opt_name: str = "sgd"
) -> tuple[list[torch.nn.Module], list[FlatLayout], list[InProcessEndpoint], list]:
    models = [mlp(seed=0), mlp(seed=0)]
    opts = [
        torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        if opt_name == "sgd"
        else torch.optim.AdamW(m.parameters())
        for m in models
    ]
    named = list(models[0].named_parameters())
    spec = OptimizerSpec.from_optimizer(opts[0], [p for _, p in named])
    plan = build_plan([TensorSpec(n, tuple(p.shape)) for n, p in named], 2)
    layouts = [FlatLayout(plan, list(m.named_parameters()), []) for m in models]
    full = layouts[0].flat_local()
    shards = [Shard(s, plan, PSConfig(mode=mode), 2, spec, layouts[0].shard_values(full, s)) for s in range(2)]
    endpoints = [InProcessEndpoint(sh) for sh in shards]
    for sh in shards:  # the norm exchange goes shard to shard, here in-process
        sh.connect_peers({other.shard: other for other in shards})
    return models, layouts, endpoints, [spec, opts]


def _hyper(
    spec: OptimizerSpec, opt: torch.optim.Optimizer, n: int, clip: float, num_params: int, value: float = -1.0
) -> torch.Tensor:
    prefix = hyper_prefix([True] * num_params, n, max_grad_norm=clip, clip_value=value)
    return torch.cat([prefix, spec.encode(opt)])


def _sync_step(job: Any, step: int, sizes: list[int], clip: float = -1.0, value: float = -1.0) -> tuple[Any, Any]:
    """Every worker of ``job`` pushes its part of batch ``step`` to every shard, then takes the replies; worker 0's
    wait (futures) until the last worker pushed. Returns the whole batch."""
    models, layouts, endpoints, (spec, opts) = job
    num_params = len(list(models[0].parameters()))
    x, y = batch(step, sum(sizes))
    pending = []
    for w, (model, layout) in enumerate(zip(models, layouts, strict=True)):
        lo = sum(sizes[:w])
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x[lo : lo + sizes[w]]), y[lo : lo + sizes[w]]).backward()
        hyper = _hyper(spec, opts[w], sizes[w], clip, num_params, value=value)
        replies = [(ep.shard, ep.push_pull(w, layout.pack(ep.shard, 1.0).clone(), hyper)) for ep in endpoints]
        if w == 0:  # nothing is applied before every worker pushed: these are still pending
            with pytest.raises(PSTimeoutError, match="pushes of step"):
                replies[0][1].result(0.01)
        pending.append(replies)
    for w, replies in enumerate(pending):
        for s, reply in replies:
            layouts[w].unpack(s, reply.result(1.0).snapshot)
    return x, y


def test_sync_two_shards_clip_by_the_global_norm_through_shard_to_shard_norms() -> None:
    """Worker 0's replies wait (futures) until worker 1 pushed; both then hold one process's result."""
    job = _job("sync")
    models = job[0]
    ref = copy.deepcopy(models[0])
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(4):
        x, y = _sync_step(job, step, [3, 5], clip=0.5)
        ref.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
    for model in models:
        for got, want in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_sync_value_clipping_clamps_the_combined_gradient_as_ddp_does() -> None:
    """gradient_clip_algorithm="value" in sync: each shard clamps its part of the sample-weighted mean gradient
    (DDP clamps the averaged gradient), against a float64 reference; clamping each worker's gradient before
    combining (the control) ends elsewhere."""
    job = _job("sync")
    models = job[0]
    ref = copy.deepcopy(models[0]).double()
    control = copy.deepcopy(models[0]).double()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    control_opt = torch.optim.SGD(control.parameters(), lr=0.1, momentum=0.9)
    sizes, value = [3, 5], 0.05
    for step in range(4):
        x, y = _sync_step(job, step, sizes, value=value)
        ref.zero_grad()
        torch.nn.functional.mse_loss(ref(x.double()), y.double()).backward()
        assert torch.cat([p.grad.abs().flatten() for p in ref.parameters()]).max() > value  # the clamp acts
        torch.nn.utils.clip_grad_value_(ref.parameters(), value)
        ref_opt.step()
        worker_grads = []
        for w in range(2):
            lo = sum(sizes[:w])
            control.zero_grad()
            torch.nn.functional.mse_loss(
                control(x[lo : lo + sizes[w]].double()), y[lo : lo + sizes[w]].double()
            ).backward()
            worker_grads.append([p.grad.clamp(-value, value) * sizes[w] / sum(sizes) for p in control.parameters()])
        for p, g0, g1 in zip(control.parameters(), *worker_grads, strict=True):
            p.grad = g0 + g1
        control_opt.step()
    for model in models:
        for got, want in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-6)
    differences = [(a - b).abs().flatten() for a, b in zip(ref.parameters(), control.parameters(), strict=True)]
    assert torch.cat(differences).max() > 1e-4


def test_a_failing_shard_fails_its_pending_replies_at_once() -> None:
    models, layouts, endpoints, (spec, opts) = _job("sync")
    num_params = len(list(models[0].parameters()))
    models[0](torch.randn(2, 6)).sum().backward()
    hyper = _hyper(spec, opts[0], 2, -1.0, num_params)
    reply = endpoints[0].push_pull(0, layouts[0].pack(0, 1.0).clone(), hyper)  # waits for worker 1
    endpoints[0].target.fail(RuntimeError("disk on fire"))
    with pytest.raises(PSProtocolError, match="disk on fire"):
        reply.result(1.0)
    with pytest.raises(PSProtocolError, match="failed earlier: RuntimeError: disk on fire"):
        endpoints[0].pull(1).result(1.0)


def test_a_reply_is_resolved_after_the_shard_lock_is_released() -> None:
    """A callback on a reply (the server loop's send) may call the shard again: it runs outside its lock."""
    models, layouts, endpoints, (spec, opts) = _job("sync")
    shard = endpoints[0].target
    num_params = len(list(models[0].parameters()))
    for model in models:
        model(torch.randn(2, 6)).sum().backward()
    hypers = [_hyper(spec, opts[w], 2, -1.0, num_params) for w in range(2)]
    seen: list[int] = []
    fut = shard.push_pull(0, layouts[0].pack(0, 1.0).clone(), hypers[0])  # pending until worker 1 pushes
    fut.add_done_callback(lambda f: seen.append(shard.versions()[0]))  # takes the (non-reentrant) lock
    worker1 = threading.Thread(
        target=shard.push_pull, args=(1, layouts[1].pack(0, 1.0).clone(), hypers[1]), daemon=True
    )
    worker1.start()
    worker1.join(10)
    assert not worker1.is_alive(), "the reply was resolved with the shard's lock held (deadlock)"
    assert seen == [1]


def _ssp_shard(num_workers: int = 2, mode: str = "ssp") -> tuple[Shard, torch.Tensor, torch.Tensor]:
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=0.1)
    spec = OptimizerSpec.from_optimizer(opt, [p])
    plan = build_plan([TensorSpec("p", (3,))], 1)
    cfg = PSConfig(mode=mode, staleness=0 if mode == "ssp" else None)
    shard = Shard(0, plan, cfg, num_workers, spec, torch.zeros(3))
    hyper = torch.cat([hyper_prefix([True]), spec.encode(opt)])
    return shard, torch.ones(3), hyper


def test_ssp_a_worker_that_leaves_stops_holding_back_the_others_and_a_joiner_counts_from_its_first_push() -> None:
    shard, grad, hyper = _ssp_shard()
    for w in (0, 1):
        shard.join(w)
    shard.push_pull(1, grad, hyper).result(1)  # worker 1 counts from its first push (clock 1)
    shard.push_pull(0, grad, hyper).result(1)  # worker 0 at clock 1: within staleness 0
    ahead = shard.push_pull(0, grad, hyper)
    assert not ahead.done()  # clock 2, one ahead of worker 1
    shard.leave(1, "its connection broke")  # async/ssp: the others go on without it
    assert ahead.result(1).clock == 2
    # a worker joining later starts at the slowest live worker's clock (2), not at 0 (it would block everyone)
    shard.join(1)
    assert shard.push_pull(0, grad, hyper).result(1).clock == 3  # worker 1 does not count before it pushes
    assert shard.push_pull(1, grad, hyper).result(1).clock == 3
    assert not shard.push_pull(0, grad, hyper).done()  # now it counts: worker 0 (clock 4) waits for it
    control, grad, hyper = _ssp_shard()
    for w in (0, 1):
        control.join(w)
    control.push_pull(1, grad, hyper)
    control.push_pull(0, grad, hyper)
    assert not control.push_pull(0, grad, hyper).done()  # the control: without the leave it stays parked


def test_sync_a_lost_worker_fails_the_step_in_progress_and_later_ones_naming_it_until_it_rejoins() -> None:
    shard, grad, hyper = _ssp_shard(mode="sync")
    for w in (0, 1):
        shard.join(w)
    waiting = shard.push_pull(0, grad, hyper)
    assert not waiting.done()
    shard.leave(1, "its connection broke")
    with pytest.raises(PSProtocolError, match="worker 1 is gone: its connection broke"):
        waiting.result(1)
    with pytest.raises(PSProtocolError, match="worker 1 is gone"):
        shard.push_pull(0, grad, hyper).result(1)
    assert shard.error is None  # the shard itself is fine: a new run may join
    shard.join(1)
    a, b = shard.push_pull(0, grad, hyper), shard.push_pull(1, grad, hyper)
    assert a.result(1).version == b.result(1).version == 1
    torch.testing.assert_close(shard.masters[0].detach(), torch.full((3,), -0.1))


def _sync_sgd_shard(num_workers: int, n: int) -> tuple[Shard, list[torch.Tensor]]:
    """A one-shard sync job over one parameter of ``n`` values, plain SGD at lr 1: a step subtracts the combined
    gradient exactly as the shard computed it (fp32 in, fp32 out)."""
    p = torch.nn.Parameter(torch.zeros(n))
    opt = torch.optim.SGD([p], lr=1.0)
    spec = OptimizerSpec.from_optimizer(opt, [p])
    plan = build_plan([TensorSpec("p", (n,))], 1)
    shard = Shard(0, plan, PSConfig(mode="sync"), num_workers, spec, torch.zeros(n))
    return shard, [_hyper(spec, opt, k, -1.0, 1) for k in range(8)]


def test_sync_combines_pushes_as_the_sample_weighted_mean_step_after_step() -> None:
    """sum(n_w g_w) / sum(n_w) against float64 on fresh random pushes, in arrival orders that differ by step,
    with a dropped (non-finite) push and the shard's combine buffer reused from step to step."""
    n, workers = 1000, 3
    shard, hypers = _sync_sgd_shard(workers, n)
    gen = torch.Generator().manual_seed(7)
    want = torch.zeros(n, dtype=torch.float64)
    unweighted = torch.zeros(n, dtype=torch.float64)
    steps = [((3, 5, 1), (0, 1, 2)), ((7, 2, 4), (2, 0, 1)), ((1, 6, 6), (1, 2, 0)), ((2, 3, 5), (0, 2, 1))]
    for step, (samples, order) in enumerate(steps):
        grads = [torch.randn(n, generator=gen) * 10 ** (w - 1) for w in range(workers)]
        dropped = step == 2  # worker 1's push is flagged non-finite: it counts zero samples
        if dropped:
            grads[1][17] = float("nan")
        replies = []
        for w in order:
            hyper = hypers[samples[w]].clone()
            if dropped and w == 1:
                hyper[2] = float(PushFlag.NONFINITE)
            replies.append(shard.push_pull(w, grads[w].clone(), hyper))
        for reply in replies:
            reply.result(1.0).release()
        kept = [w for w in range(workers) if not (dropped and w == 1)]
        total = sum(samples[w] for w in kept)
        want -= sum(samples[w] * grads[w].double() for w in kept) / total
        unweighted -= sum(grads[w].double() for w in kept) / len(kept)
        torch.testing.assert_close(shard.masters[0].detach().double(), want, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(shard.masters[0]).all()
    # the control: the weights matter on these inputs (a plain mean would be far from the shard's result)
    assert not torch.allclose(shard.masters[0].detach().double(), unweighted, rtol=1e-3, atol=1e-3)


def test_an_optimizer_that_clips_itself_is_refused_naming_the_global_clipping_to_use() -> None:
    from ivyplug.optim import LAMB

    p = torch.nn.Parameter(torch.randn(4))
    with pytest.raises(ValueError, match=r"max_grad_norm=None .*Trainer\(gradient_clip_val=.*PSClient.step"):
        OptimizerSpec.from_optimizer(LAMB([p], lr=1e-2, max_grad_norm=1.0), [p])
    OptimizerSpec.from_optimizer(LAMB([p], lr=1e-2), [p])  # without its own clipping: mirrored
