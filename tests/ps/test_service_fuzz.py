"""A raw member sending malformed requests never crashes, hangs or corrupts an ``ivyplug serve`` (hypothesis).

The service runs in this process; each example joins as a proper worker, then sends raw messages on its
pair: headers with any kind, shard, sizes and arguments (magic and wire version right or wrong, the header
cut short), payloads cut short of what the header announced. After each, the service must still serve a
well-behaved worker, with every shard error-free and finite. Messages longer than announced are left out:
gloo aborts the receiving process on those (auth.py keeps unauthenticated peers away from gloo for that
reason).
"""

from __future__ import annotations

import json
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ivyplug.ps import PSClient, PSConfig
from ivyplug.ps.server.service import PSService
from ivyplug.ps.wire import auth
from ivyplug.ps.wire.messages import HEADER_LEN, MAGIC, TAG_REQUEST, TAG_REQUEST_DATA, TAG_REQUEST_HYPER, WIRE_VERSION

pytestmark = pytest.mark.timeout(300)


def _client(address: str) -> tuple[PSClient, torch.nn.Module]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = PSConfig(mode="async", servers=address, timeout=10)
    return PSClient.start(cfg, list(model.named_parameters()), [], opt), model


def _good_step(address: str) -> None:
    client, model = _client(address)
    try:
        client.pull_initial()
        model(torch.randn(3, 4)).sum().backward()
        client.step(3)
        assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    finally:
        client.close()


@pytest.fixture(scope="module")
def service() -> PSService:
    svc = PSService(2, port=0, num_workers=2, timeout=10, status_every=None, log=lambda line: None)
    _good_step(svc.address)  # the job exists before the fuzzing starts
    yield svc
    svc.close()


header_values = st.fixed_dictionaries(
    {
        "magic": st.sampled_from([MAGIC, MAGIC + 1, 0]),
        "version": st.sampled_from([WIRE_VERSION, WIRE_VERSION + 1]),
        "kind": st.one_of(st.integers(0, 17), st.integers(-(2**40), 2**40)),
        "shard": st.integers(-3, 3),
        "numel": st.integers(0, 40),
        "n_hyper": st.integers(0, 12),
        "args": st.lists(st.integers(-(2**62), 2**62), min_size=8, max_size=8),
        "cut": st.integers(1, HEADER_LEN),
        "data_sent": st.floats(0, 1),
        "sized_kind": st.sampled_from([1, 2, 3, 4, 5, 6, 8, 9, 10, 12]),
    }
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sized=st.lists(header_values, max_size=3), malformed=st.one_of(st.none(), header_values))
def test_malformed_requests_never_break_the_service(
    service: PSService, sized: list[dict], malformed: dict | None
) -> None:
    """``sized``: requests that announce the sizes their kind must carry (they reach the request handlers,
    with any arguments and payload values), then possibly one ``malformed`` in any way (the member ends)."""
    client, _ = _client(service.address)
    channel = client.topo.channel
    assert channel is not None
    works = []
    job = service.job
    assert job is not None
    for m in sized:
        m["magic"], m["version"], m["cut"], m["data_sent"] = MAGIC, WIRE_VERSION, HEADER_LEN, 1.0
        m["kind"] = m["sized_kind"]
        m["shard"] = abs(m["shard"]) % 2
        m["numel"], m["n_hyper"] = 0, 0
        if m["kind"] == 1:
            m["numel"], m["n_hyper"] = job.shards[m["shard"]].n_total, job.shards[m["shard"]].n_hyper
        if m["kind"] == 10:
            m["args"][3] = abs(m["args"][3]) % 64  # arg0: the state's length in bytes
            m["numel"] = (m["args"][3] + 3) // 4
        if m["kind"] == 12:
            m["args"][4] = m["args"][4] % 7 - 3  # arg1: batches (a negative count is a bad request)
    for m in [*sized, *([malformed] if malformed else [])]:
        # magic, version, kind, sender, shard, numel, n_hyper, then seq, status, flags, arg0..arg3
        words = [m["magic"], m["version"], m["kind"], 1, m["shard"], m["numel"], m["n_hyper"], *m["args"]]
        header = torch.tensor(words[:HEADER_LEN], dtype=torch.int64)[: m["cut"]].clone()
        works.append(channel.group.send([header], 0, TAG_REQUEST))
        n_data = int(m["numel"] * m["data_sent"])
        if n_data:
            works.append(channel.group.send([torch.rand(n_data)], 0, TAG_REQUEST_DATA))
        if m["n_hyper"]:
            hyper = torch.rand(m["n_hyper"], dtype=torch.float64) * 4 - 2
            works.append(channel.group.send([hyper], 0, TAG_REQUEST_HYPER))
    time.sleep(0.05)
    client.closed = True  # drop the pair without a goodbye (the service sees its connection close)
    client.topo.channel = None
    del works, channel, client
    deadline = time.monotonic() + 10
    while service.members() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert service.members() == 0
    for shard in job.shards.values():
        assert shard.error is None
        assert all(bool(torch.isfinite(m).all()) for m in shard.masters)
    _good_step(service.address)


def test_another_wire_version_is_refused_in_the_handshake_on_both_sides(service: PSService) -> None:
    store = dist.TCPStore("127.0.0.1", service.port, is_master=False, timeout=timedelta(seconds=10))
    member = int(store.add(auth.MEMBER_COUNTER, 1)) - 1
    store.set(f"{auth.PREFIX}/hello/{member}", json.dumps({"wire": WIRE_VERSION + 7, "nonce": "00" * 16}).encode())
    store.wait([f"{auth.PREFIX}/verdict/{member}"], timedelta(seconds=10))
    verdict = json.loads(store.get(f"{auth.PREFIX}/verdict/{member}"))
    assert verdict["ok"] is False and f"wire version {WIRE_VERSION + 7}" in verdict["reason"]
    _good_step(service.address)


def _raw_member(port: int) -> tuple[object, int]:
    """A store client that took a member number, as a worker's first handshake step does."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    return store, int(store.add(auth.MEMBER_COUNTER, 1)) - 1


def test_a_joiner_that_never_proves_the_token_holds_up_no_one() -> None:
    """A worker gone after its hello (killed while it started): the service waits its timeout for that worker's
    proof, on that member's own store connection, while the next worker joins and trains."""
    lines: list[str] = []
    svc = PSService(1, port=0, timeout=30, status_every=None, log=lines.append)
    store, member = _raw_member(svc.port)
    try:
        store.set(f"{auth.PREFIX}/hello/{member}", json.dumps({"wire": WIRE_VERSION, "nonce": "00" * 16}).encode())
        store.wait([f"{auth.PREFIX}/challenge/{member}"], timedelta(seconds=10))  # the service is waiting for it
        start = time.monotonic()
        _good_step(svc.address)  # its own timeout (10 s) is a third of the service's
        assert time.monotonic() - start < 8, lines
    finally:
        store.set(f"{auth.PREFIX}/proof/{member}", json.dumps({"proof": ""}).encode())  # ends its handshake
        svc.close()
    deadline = time.monotonic() + 10
    while not any(f"refused member {member}" in line for line in lines) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert any(f"refused member {member}: wrong token" in line for line in lines), lines


def test_a_member_number_taken_without_a_hello_holds_up_no_one_and_is_forgotten_after_the_timeout() -> None:
    """A worker gone between taking its member number and writing its hello (or any client of the store that
    bumped the counter): the next worker is served at once, and the service forgets that number after its
    timeout."""
    lines: list[str] = []
    svc = PSService(1, port=0, timeout=4, status_every=None, log=lines.append)
    try:
        _store, member = _raw_member(svc.port)
        taken = time.monotonic()
        _good_step(svc.address)
        assert time.monotonic() - taken < 3.5, lines  # served before the silent number was given up
        assert not any("sent no hello" in line for line in lines), lines
        while not any("sent no hello" in line for line in lines) and time.monotonic() - taken < 10:
            time.sleep(0.05)
        forgotten = time.monotonic() - taken
        assert 4 - 0.5 <= forgotten < 6, (forgotten, lines)
        assert any(f"member {member} sent no hello within 4 s: forgotten" in line for line in lines), lines
    finally:
        svc.close()
