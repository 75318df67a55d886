"""One worker, everything in-process (no process group): exactness and API checks, fast."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from ivyplug.ps import PSClient, PSConfig
from tests.ps.introspection import local_shard
from tests.ps.scenarios import batch, make_opt, mlp


def start(model: torch.nn.Module, opt: torch.optim.Optimizer, **cfg: object) -> PSClient:
    config = PSConfig.from_kwargs(**cfg)
    client = PSClient.start(config, list(model.named_parameters()), list(model.named_buffers()), opt)
    client.pull_initial()
    return client


@pytest.mark.parametrize("name", ["sgd", "adamw", "lamb"])
@pytest.mark.parametrize("clip", [None, 0.3])
def test_async_one_worker_equals_single_process_exactly(name: str, clip: float | None) -> None:
    model, ref = mlp(seed=0, bn=True), mlp(seed=0, bn=True)
    opt, ref_opt = make_opt(name, model.parameters()), make_opt(name, ref.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    # split rows too for the element-wise optimizers; LAMB's trust ratio is per piece, so splitting changes it
    client = start(model, opt, mode="async", max_shard_bytes=None if name == "lamb" else 200)
    for step in range(6):
        x, y = batch(step, 8)
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        client.step(8, max_grad_norm=clip)
        sched.step()
        ref.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        ref_opt.step()
        ref_sched.step()
    for a, b in zip(model.state_dict().values(), ref.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    m = client.metrics()
    assert m["pushes"] == 6 and m["staleness_max"] == 0
    client.close()


def test_sync_one_worker_matches_single_process() -> None:
    model, ref = mlp(seed=0), mlp(seed=0)
    opt, ref_opt = make_opt("adamw", model.parameters()), make_opt("adamw", ref.parameters())
    client = start(model, opt, mode="sync")
    for step in range(4):
        x, y = batch(step, 8)
        for net in (model, ref):
            net.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
        client.step(8, max_grad_norm=0.5)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_state_dict_round_trip_continues_bitwise_and_loads_without_code() -> None:
    import io

    model = mlp(seed=1, bn=True)
    opt = make_opt("lamb", model.parameters())
    client = start(model, opt, mode="sync")

    def train(c: PSClient, net: torch.nn.Module, steps: range) -> None:
        for step in steps:
            x, y = batch(step, 8)
            net.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            c.step(8)

    train(client, model, range(3))
    sd = client.state_dict()
    buf = io.BytesIO()
    torch.save(sd, buf)
    sd = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)  # checkpoint-safe: tensors and containers
    train(client, model, range(3, 5))
    want = [t.clone() for t in model.state_dict().values()]
    model2 = mlp(seed=2, bn=True)
    client2 = start(model2, make_opt("lamb", model2.parameters()), mode="sync")
    client2.load_state_dict(sd)
    train(client2, model2, range(3, 5))
    assert all(torch.equal(a, b) for a, b in zip(want, model2.state_dict().values(), strict=True))
    assert client2.state_dict()["shards"][0]["version"] == 5

    other = mlp(seed=0)
    client3 = start(other, make_opt("lamb", other.parameters()), mode="sync")
    with pytest.raises(ValueError, match="another model"):
        client3.load_state_dict(sd)
    with pytest.raises(ValueError, match="not a PS state dict"):
        client3.load_state_dict({"shards": []})


def test_dispatch_and_stop_in_process() -> None:
    model = mlp(seed=0)
    client = start(model, make_opt("sgd", model.parameters()), mode="async")
    with pytest.raises(RuntimeError, match="start_epoch"):
        client.next_batch()
    client.start_epoch(0, 4)
    assert [client.next_batch() for _ in range(5)] == [0, 1, 2, 3, None]
    client.start_epoch(1, 2)
    assert [client.next_batch() for _ in range(3)] == [0, 1, None]
    assert not client.stop_requested()
    client.request_stop()
    assert client.stop_requested()
    assert client.metrics()["batches"] == 6
    with pytest.raises(ValueError, match="num_batches"):
        client.start_epoch(2, -1)
    client.close()
    with pytest.raises(RuntimeError, match="closed"):
        client.step(1)


def _hyper(spec: Any, opt: torch.optim.Optimizer, num_params: int = 1, flags: int = 0) -> torch.Tensor:
    """A push's hyper vector as PSClient.step builds it: every parameter has a gradient."""
    from ivyplug.ps.wire.push import HYPER_PREFIX, encode_mask, hyper_prefix

    prefix = hyper_prefix([True] * num_params, flags=flags)
    hyper = torch.cat([prefix, spec.encode(opt)])
    assert hyper.numel() == HYPER_PREFIX + len(encode_mask([True] * num_params)) + spec.num_values
    return hyper


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_staleness_scaling_inverse_steps_with_lr_over_tau_plus_one(optimizer: str) -> None:
    """Drive a shard directly: a push made 3 updates after its worker's pull is stepped with lr / 4.

    Adam is the control that the *learning rate* is scaled: its first step is lr · sign(g) whatever the
    gradient's size, so scaling the gradient by 1/4 (the old rule) would still move every element by lr.
    """
    from ivyplug.ps.server.mirror import OptimizerSpec
    from ivyplug.ps.server.shard import Shard
    from ivyplug.ps.sharding import TensorSpec, build_plan

    p = torch.zeros(4, requires_grad=True)
    opt = torch.optim.SGD([p], lr=1.0) if optimizer == "sgd" else torch.optim.Adam([p], lr=0.1)
    lr = opt.param_groups[0]["lr"]
    spec = OptimizerSpec.from_optimizer(opt, [p])
    plan = build_plan([TensorSpec("p", (4,))], 1)
    for scaling, want in (("inverse", -lr / 4.0), ("none", -lr)):
        srv = Shard(0, plan, PSConfig(mode="async", staleness_scaling=scaling), 2, spec, torch.zeros(4))
        hyper = _hyper(spec, opt)
        srv.pull(1).result(1)  # worker 1 saw version 0
        for _ in range(3):
            srv.push_pull(0, torch.zeros(4), hyper).result(1)
        before = srv.masters[0].detach().clone()
        if optimizer == "adam":  # a fresh Adam state, so its step is lr · sign(g) (times the scale)
            srv.optimizer.state.clear()
        tau = srv.push_pull(1, torch.ones(4), hyper).result(1).staleness
        assert tau == 3
        torch.testing.assert_close(srv.masters[0].detach() - before, torch.full((4,), want), rtol=1e-5, atol=1e-7)
        assert srv.optimizer.param_groups[0]["lr"] == lr  # the scale applied to that step only


def test_hyperparameters_follow_the_worker_optimizer() -> None:
    model = mlp(seed=0)
    opt = torch.optim.SGD(
        [{"params": list(model.parameters())[:2], "lr": 0.5}, {"params": list(model.parameters())[2:]}],
        lr=0.1,
        momentum=0.5,
    )
    client = start(model, opt, mode="async")
    opt.param_groups[0]["lr"] = 0.25
    opt.param_groups[1]["momentum"] = 0.0
    x, y = batch(0, 4)
    torch.nn.functional.mse_loss(model(x), y).backward()
    client.step(4)
    server = local_shard(client)
    assert server.optimizer is not None
    groups = server.optimizer.param_groups
    assert [g["lr"] for g in groups] == [0.25, 0.1] and [g["momentum"] for g in groups] == [0.5, 0.0]


def test_a_change_the_servers_cannot_follow_warns_once_and_a_new_group_is_refused() -> None:
    model = mlp(seed=0)
    params = list(model.parameters())
    opt = torch.optim.SGD(params[:2], lr=0.1, momentum=0.5)
    client = start(model, opt, mode="async")
    x, y = batch(0, 4)

    def step() -> None:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        client.step(4)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step()  # numeric values travel: no warning
        opt.param_groups[0]["lr"] = 0.05
        step()
    opt.param_groups[0]["nesterov"] = True
    opt.param_groups[0]["initial_lr"] = 0.1  # a scheduler created after the start adds it
    opt.param_groups[0]["foreach"] = True  # a kernel choice (LAMB records its resolved one): each server's own
    with pytest.warns(RuntimeWarning) as caught:
        step()
        step()
    texts = sorted(str(w.message) for w in caught)
    assert len(texts) == 2, texts  # once each
    assert "'initial_lr'" in texts[0] and "gained" in texts[0]
    assert "'nesterov' changed from False to True" in texts[1]
    # a non-numeric entry replaced by a tensor of several values: reported, never an ambiguous-truth error
    spec_groups = client.spec.groups[0]
    spec_groups["mask"] = torch.ones(3)
    opt.param_groups[0]["mask"] = torch.ones(3)
    changes = client.spec.unmirrored_changes(opt)
    assert "param group 0's 'mask' changed from tensor([1., 1., 1.]) to tensor([1., 1., 1.])" in changes, changes
    del spec_groups["mask"], opt.param_groups[0]["mask"]
    opt.add_param_group({"params": params[2:]})
    with pytest.raises(ValueError, match="has 2 param groups, but it had 1"):
        step()


def test_splitting_rows_changes_lamb_trust_ratio_as_documented() -> None:
    """With row blocks, LAMB's trust ratio is computed per block: results differ from whole-layer LAMB."""
    results = []
    for limit in (None, 64):
        model = mlp(seed=0)
        opt = make_opt("lamb", model.parameters())
        client = start(model, opt, mode="async", max_shard_bytes=limit)
        x, y = batch(0, 8)
        torch.nn.functional.mse_loss(model(x), y).backward()
        client.step(8)
        results.append([p.detach().clone() for p in model.parameters()])
    assert not all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_one_worker_with_dedicated_servers_equals_single_process_and_resumes() -> None:
    """num_servers=2 from a process without torch.distributed: exact in async, state round trip."""
    model, ref = mlp(seed=0, bn=True), mlp(seed=0, bn=True)
    opt, ref_opt = make_opt("sgd", model.parameters()), make_opt("sgd", ref.parameters())
    client = start(model, opt, mode="async", num_servers=2, timeout=30.0)
    try:
        assert client.plan.num_shards == 2 and len(client.server_procs) == 1  # one process holds both shards
        for step in range(4):
            x, y = batch(step, 8)
            for net in (model, ref):
                net.zero_grad()
                torch.nn.functional.mse_loss(net(x), y).backward()
            client.step(8, max_grad_norm=0.5)
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
            ref_opt.step()
            if step == 1:
                client.sync()
                sd = client.state_dict()
        pairs = zip(model.state_dict().values(), ref.state_dict().values(), strict=True)
        assert all(torch.equal(a, b) for a, b in pairs)
        want = [t.clone() for t in model.state_dict().values()]
        client.load_state_dict(sd)  # back to step 2, then the same two steps again
        for step in (2, 3):
            x, y = batch(step, 8)
            model.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            client.step(8, max_grad_norm=0.5)
        assert all(torch.equal(a, b) for a, b in zip(want, model.state_dict().values(), strict=True))
        assert [s["version"] for s in client.state_dict()["shards"]] == [4, 4]
    finally:
        client.close()
    assert not any(p.is_alive() for p in client.server_procs)


def test_params_outside_the_optimizer_are_served_but_not_updated() -> None:
    model = mlp(seed=0)
    frozen = model[0].weight
    frozen.requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, weight_decay=0.1)
    before = frozen.detach().clone()
    client = PSClient.start(PSConfig(mode="async"), [p for p in model.parameters()], [], opt)  # plain tensors
    client.pull_initial()
    x, y = batch(0, 4)
    torch.nn.functional.mse_loss(model(x), y).backward()
    client.step(4)
    assert torch.equal(frozen, before)
    assert not torch.equal(model[2].weight, mlp(seed=0)[2].weight)


def test_bad_arguments_are_refused() -> None:
    from ivyplug.optim import LAMB

    model = mlp(seed=0)
    params = list(model.named_parameters())
    with pytest.raises(ValueError, match="optimizer is required"):
        PSClient.start(PSConfig(), params, [], None)
    with pytest.raises(ValueError, match="max_grad_norm"):
        PSClient.start(PSConfig(), params, [], LAMB(model.parameters(), max_grad_norm=1.0))
    with pytest.raises(ValueError, match="world_size > 1"):
        PSClient.start(PSConfig(), params, [], make_opt("sgd", model.parameters()), rank=0, world_size=2)
    client = start(model, make_opt("sgd", model.parameters()))
    with pytest.raises(ValueError, match="num_samples"):
        client.step(0)
    for bad in (-1.0, 0, float("nan"), True, "1"):
        with pytest.raises(ValueError, match=r"max_grad_norm must be None or a number > 0 \(inf: no clipping\)"):
            client.step(2, max_grad_norm=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"clip_value must be None or a number > 0 \(inf: no clipping\)"):
            client.step(2, clip_value=bad)  # type: ignore[arg-type]
    # inf clips nothing (torch's idiom for the norm without clipping): the same step as without
    clipped, plain = mlp(seed=0), mlp(seed=0)
    for net, kwargs in ((clipped, {"max_grad_norm": float("inf"), "clip_value": float("inf")}), (plain, {})):
        c = start(net, make_opt("sgd", net.parameters()))
        net(torch.ones(3, net[0].in_features)).square().sum().backward()
        c.step(3, **kwargs)
        c.close()
    torch.testing.assert_close(list(clipped.parameters()), list(plain.parameters()), rtol=0, atol=0)


def test_hyperparameters_still_follow_the_worker_optimizer_after_load_state_dict() -> None:
    """A resumed server keeps taking the LR each push carries (torch's load_state_dict replaces group dicts)."""
    model = mlp(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    client = start(model, opt, mode="sync")
    x, y = batch(0, 4)
    torch.nn.functional.mse_loss(model(x), y).backward()
    client.step(4)
    sd = client.state_dict()
    client.load_state_dict(sd)
    opt.param_groups[0]["lr"] = 0.05  # what a scheduler does after the resume
    model.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    client.step(4)
    server = local_shard(client)
    assert server.optimizer is not None
    assert [g["lr"] for g in server.optimizer.param_groups] == [0.05]


def test_nonfinite_raise_names_the_rank_the_step_and_the_first_tensor() -> None:
    from ivyplug.ps.worker.client import PSNonFiniteError

    model = mlp(seed=0)
    client = start(model, make_opt("adamw", model.parameters()), mode="async", nonfinite="raise")
    before = [p.detach().clone() for p in model.parameters()]
    x, y = batch(0, 8)
    torch.nn.functional.mse_loss(model(x), y).backward()
    list(model.parameters())[2].grad[0, 0] = float("nan")
    with pytest.raises(PSNonFiniteError, match=r"rank 0, step 1: non-finite values in the gradient of '2\.weight'"):
        client.step(8)
    assert local_shard(client).version == 0  # nothing was pushed
    for got, want in zip(model.parameters(), before, strict=True):
        torch.testing.assert_close(got.detach(), want, rtol=0, atol=0)
    client.close()


def test_a_failing_dedicated_server_sends_its_error_text_back() -> None:
    from ivyplug.ps.wire.transport import PSProtocolError

    model = mlp(seed=0)
    client = start(model, make_opt("sgd", model.parameters()), mode="async", num_servers=1, timeout=60.0)
    try:
        state = client.state_dict()
        state["shards"][0]["params"][0] = torch.zeros(3, 3)  # same plan, wrong shape: the server refuses it
        with pytest.raises(PSProtocolError, match=r"failed while answering .*checkpoint tensor shape \(3, 3\)"):
            client.load_state_dict(state)
    finally:
        client.close()


def test_a_dedicated_server_process_exits_cleanly_once_its_job_closed(capfd: pytest.CaptureFixture[str]) -> None:
    """Exit code 0 and no abort: the interpreter's teardown used to abort it (SIGABRT, "terminate called")."""
    model = mlp(seed=0)
    client = start(model, make_opt("sgd", model.parameters()), mode="async", num_servers=1, timeout=60.0)
    procs = list(client.server_procs)
    assert procs
    try:
        client.close()
        for proc in procs:
            proc.join(30)
        assert [proc.exitcode for proc in procs] == [0] * len(procs)
    finally:
        for proc in procs:  # ended whatever the assertions said
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    err = capfd.readouterr().err
    assert "every worker of its job has left" in err and "terminate called" not in err


def test_integer_buffers_travel_as_exact_int64() -> None:
    model = torch.nn.BatchNorm1d(3)
    model.num_batches_tracked.fill_(2**40 + 1)  # fp32 would round this to 2**40
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    client = start(model, opt, mode="async")
    model(torch.randn(4, 3)).sum().backward()
    client.step(4)
    assert model.num_batches_tracked.dtype == torch.int64
    assert int(model.num_batches_tracked) == 2**40 + 2
    client.close()


def test_delta_pushes_are_scaled_only_beyond_one_round_of_staleness() -> None:
    """A local-update delta is averaged by its merge rate already: tau = 1 leaves it whole, tau = 3 divides by 3.

    Control: the same pushes flagged as gradients are divided by tau + 1.
    """
    from ivyplug.ps.server.mirror import OptimizerSpec
    from ivyplug.ps.server.shard import Shard, staleness_factor
    from ivyplug.ps.sharding import TensorSpec, build_plan
    from ivyplug.ps.wire.push import PushFlag

    assert [staleness_factor(t, True, "inverse") for t in (0, 1, 2, 3)] == [1.0, 1.0, 0.5, 1 / 3]
    assert [staleness_factor(t, False, "inverse") for t in (0, 1, 3)] == [1.0, 0.5, 0.25]
    assert staleness_factor(5, True, "none") == staleness_factor(5, False, "none") == 1.0
    p = torch.zeros(4, requires_grad=True)
    opt = torch.optim.SGD([p], lr=1.0)
    spec = OptimizerSpec.from_optimizer(opt, [p])
    plan = build_plan([TensorSpec("p", (4,))], 1)
    for flags, want in ((PushFlag.DELTA, [-1.0, -1.0 / 3.0]), (0, [-0.5, -0.25])):
        moves = []
        for tau in (1, 3):
            srv = Shard(0, plan, PSConfig(mode="async"), 2, spec, torch.zeros(4))
            srv.pull(1).result(1)
            for _ in range(tau):
                srv.push_pull(0, torch.zeros(4), _hyper(spec, opt)).result(1)
            before = srv.masters[0].detach().clone()
            assert srv.push_pull(1, torch.ones(4), _hyper(spec, opt, flags=flags)).result(1).staleness == tau
            moves.append(float((srv.masters[0].detach() - before)[0]))
        torch.testing.assert_close(torch.tensor(moves), torch.tensor(want), rtol=1e-6, atol=1e-7)


def test_an_aborted_worker_s_shard_prints_why_it_failed(capfd: pytest.CaptureFixture[str]) -> None:
    """``abort()`` fails the co-located shard with a reason handed in, not raised there: the shard's error line
    shows that reason (it printed ``NoneType: None``, the traceback of no exception being handled)."""
    model = mlp(seed=0)
    client = start(model, make_opt("sgd", model.parameters()), mode="async")
    client.abort()
    err = capfd.readouterr().err
    assert "shard 0 error:\nivyplug.ps.wire.transport.PSProtocolError: rank 0 failed and left the PS" in err, err
    assert "NoneType: None" not in err
