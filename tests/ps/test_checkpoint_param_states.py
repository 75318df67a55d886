"""The PS's optimizer state per parameter (``PSClient.take_param_states``), as torch keeps it for a model stepped in
one process: checked against torch's own optimizer stepped alongside, and loaded back into a PS either way."""

from __future__ import annotations

import copy

import pytest
import torch

from ivyplug.ps import PSClient
from tests.ps.scenarios import batch, mlp, start


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    """Two groups in another order than the model's, and one parameter (the first bias) outside the optimizer."""
    params = list(model.parameters())
    return torch.optim.AdamW(
        [{"params": params[4:], "lr": 0.02}, {"params": [params[0], *params[2:4]], "lr": 0.01}], weight_decay=0.05
    )


def _step(
    model: torch.nn.Module, step: int, client: PSClient | None = None, opt: torch.optim.Optimizer | None = None
) -> None:
    x, y = batch(step, 8)
    model.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    if client is not None:
        client.step(8)
    else:
        assert opt is not None
        opt.step()


def _torch_indices(client: PSClient, opt: torch.optim.Optimizer) -> list[int]:
    where = {id(p): j for j, (_, p) in enumerate(client.params)}
    return [where[id(p)] for group in opt.param_groups for p in group["params"]]


@pytest.mark.parametrize("max_shard_bytes", [None, 200])  # 200: the larger tensors cut in row blocks over both shards
def test_the_state_per_parameter_is_torchs_and_loads_back_either_way(max_shard_bytes: int | None) -> None:
    model, ref = mlp(seed=0), mlp(seed=0)
    opt, ref_opt = _adamw(model), _adamw(ref)
    client = start(model, opt, mode="async", num_servers=2, timeout=30.0, max_shard_bytes=max_shard_bytes)
    try:
        assert (max_shard_bytes is None) == (not client.plan.split_tensors())
        for step in range(3):
            _step(model, step, client=client)
            _step(ref, step, opt=ref_opt)
        client.sync()
        full = client.state_dict()
        stripped, by_param = client.take_param_states(full)
        assert all(not sh["optimizer"]["state"] for sh in stripped["shards"])
        assert all(sh["optimizer"]["state"] for sh in full["shards"])  # the state it was given is left whole
        index = _torch_indices(client, opt)
        want = ref_opt.state_dict()["state"]
        assert sorted(by_param) == sorted(index)  # the bias outside the optimizer has no state
        for k, j in enumerate(index):
            assert sorted(by_param[j]) == sorted(want[k])
            for key in want[k]:
                torch.testing.assert_close(by_param[j][key], want[k][key], rtol=0, atol=0)
        _step(model, 3, client=client)
        after = [p.detach().clone() for p in model.parameters()]
        client.load_state_dict(stripped, by_param)  # back to step 3's state, the optimizer's from its entries
        _step(model, 3, client=client)
        for a, b in zip(after, model.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    finally:
        client.close()

    # into a PS started from a model stepped in one process, as from DDP's checkpoint: the same steps as torch's
    model2 = copy.deepcopy(ref)
    opt2 = _adamw(model2)
    client2 = start(model2, opt2, mode="async", num_servers=2, timeout=30.0, max_shard_bytes=max_shard_bytes)
    try:
        fresh, _ = client2.take_param_states(client2.state_dict())
        torch_state = {j: ref_opt.state_dict()["state"][k] for k, j in enumerate(index)}
        client2.load_state_dict(fresh, {})  # the control: without the moments the same step goes elsewhere
        _step(model2, 3, client=client2)
        without_moments = [p.detach().clone() for p in model2.parameters()]
        client2.load_state_dict(fresh, torch_state)
        for step in (3, 4):
            _step(model2, step, client=client2)
            _step(ref, step, opt=ref_opt)
            if step == 3:
                assert any(not torch.equal(a, b) for a, b in zip(without_moments, model2.parameters(), strict=True))
        for a, b in zip(model2.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    finally:
        client2.close()


def test_a_state_that_is_not_per_element_of_a_split_tensor_is_refused_by_name() -> None:
    """Adafactor keeps a row and a column statistic per matrix: cut in row blocks over two shards, they cannot be
    joined into the whole tensor's (concatenated, the column statistic would double), so the join refuses, and so
    does the cut of a whole tensor's (torch's own, as DDP's checkpoint holds it) into the PS's row blocks."""
    from ivyplug.ps.worker.checkpoint import NotPerElement

    model, ref = mlp(seed=0), mlp(seed=0)
    opt, ref_opt = torch.optim.Adafactor(model.parameters(), lr=0.01), torch.optim.Adafactor(ref.parameters(), lr=0.01)
    client = start(model, opt, mode="async", num_servers=2, timeout=30.0, max_shard_bytes=200)
    try:
        stripped, none_yet = client.take_param_states(client.state_dict())
        assert none_yet == {}
        _step(model, 0, client=client)
        with pytest.raises(NotPerElement, match=r"of parameter '\d+\.weight', cut in row blocks over the shards"):
            client.take_param_states(client.state_dict())
        _step(ref, 0, opt=ref_opt)
        torch_state = {j: ref_opt.state_dict()["state"][k] for k, j in enumerate(_torch_indices(client, opt))}
        with pytest.raises(NotPerElement, match=r"of parameter '\d+\.weight' is not per element .* cannot be cut"):
            client.load_state_dict(stripped, torch_state)
    finally:
        client.close()


def test_a_state_of_another_job_is_named_and_one_of_no_job_is_refused() -> None:
    """``mismatch`` says why a PS state cannot load as it is (the Lightning strategy then resumes from the
    entries' per-parameter state); a dict that is no PS state at all is refused, not taken for another job's."""
    torch.manual_seed(0)
    model = mlp(seed=0)
    client = start(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), mode="sync")
    try:
        state = client.state_dict()
        assert client.mismatch(state) is None
        other = {**state, "num_shards": state["num_shards"] + 1}
        assert "the shard plan differs" in (client.mismatch(other) or "")
        more = {**state, "num_workers": state["num_workers"] + 1}
        assert client.mismatch(more) is None  # the same shards: it loads, its clocks restart
        for bad in ({**state, "format": "ivyplug.ps/1"}, {"state": {}}, None):
            with pytest.raises(ValueError, match="not a PS state dict of this ivyplug"):
                client.mismatch(bad)
    finally:
        client.close()


def test_a_state_of_another_number_of_workers_on_the_same_shards_resumes_with_its_optimizer_state() -> None:
    """Dedicated servers keep their shard plan whatever the number of workers: a state written by two workers loads
    into a job of one (the clocks restart at the saved version) and the servers' optimizer state carries over, so
    the steps after it are those of torch's SGD with momentum stepped throughout. Control: a fresh momentum
    buffer gives other weights."""
    model, ref = mlp(seed=0), mlp(seed=0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    client = start(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), mode="async", num_servers=2)
    try:
        for step in range(3):
            _step(model, step, client=client)
            _step(ref, step, opt=ref_opt)
        state = client.state_dict()
    finally:
        client.close()
    # as two workers wrote it: a clock and a seen version per worker, the second worker one version behind
    two = {**state, "num_workers": 2}
    two["shards"] = [
        {**sh, "clock": [sh["version"], sh["version"] - 1], "seen": [sh["version"], sh["version"] - 1]}
        for sh in state["shards"]
    ]
    fresh_ref = copy.deepcopy(ref)
    fresh_opt = torch.optim.SGD(fresh_ref.parameters(), lr=0.1, momentum=0.9)
    resumed = mlp(seed=1)  # other weights: the state brings them
    client = start(resumed, torch.optim.SGD(resumed.parameters(), lr=0.1, momentum=0.9), mode="async", num_servers=2)
    try:
        client.load_state_dict(two)
        for p, q in zip(resumed.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=0)
        for step in range(3, 5):
            _step(resumed, step, client=client)
            _step(ref, step, opt=ref_opt)
            _step(fresh_ref, step, opt=fresh_opt)
        assert client.metrics()["staleness_max"] == 0.0  # the clocks restarted at the saved version
    finally:
        client.close()
    for p, q in zip(resumed.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert any(not torch.equal(p, q) for p, q in zip(resumed.parameters(), fresh_ref.parameters(), strict=True))
