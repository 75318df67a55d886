"""Which address ivyplug's gloo devices bind, and the refusals of addresses that cannot work (one host)."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from ivyplug.ps.server.dedicated import check_ps_host
from ivyplug.ps.wire import gloo_net
from ivyplug.ps.wire.gloo_net import IFNAME_ENV, PSAddressError


def test_route_address_and_loopback_checks() -> None:
    assert gloo_net.route_address("127.0.0.1") == "127.0.0.1"
    assert gloo_net.is_loopback("localhost") and gloo_net.is_loopback("127.0.1.1")
    assert not gloo_net.is_loopback("10.77.0.1")
    assert gloo_net.is_local("127.0.0.1") and not gloo_net.is_local("192.0.2.1")  # TEST-NET: nobody's
    assert gloo_net.interface_address("lo") == "127.0.0.1" and gloo_net.interface_of("127.0.0.1") == "lo"


def test_gloo_socket_ifname_wins_and_a_wrong_name_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(IFNAME_ENV, "lo")
    assert gloo_net.bind_address("192.0.2.1") == ("127.0.0.1", "GLOO_SOCKET_IFNAME=lo")
    monkeypatch.setenv(IFNAME_ENV, "nosuch0")
    with pytest.raises(PSAddressError, match="GLOO_SOCKET_IFNAME=nosuch0 names an interface 'nosuch0'"):
        gloo_net.bind_address("127.0.0.1")


def test_loopback_toward_another_host_is_refused_with_the_address_and_the_setting() -> None:
    with pytest.raises(PSAddressError) as err:
        gloo_net.check_reaches("127.0.1.1", "the host name 'vm'", "10.77.0.1", "ivyplug serve", "set X")
    text = str(err.value)
    assert "127.0.1.1" in text and "10.77.0.1" in text and socket.gethostname() in text and "set X" in text
    gloo_net.check_reaches("127.0.0.1", "x", "127.0.0.1", "ivyplug serve", "")  # both loopback: fine
    gloo_net.check_reaches("10.77.0.2", "x", "10.77.0.1", "ivyplug serve", "")


def test_interface_for_sets_the_variable_only_while_torch_builds_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(IFNAME_ENV, raising=False)
    with gloo_net.interface_for("127.0.0.1") as name:  # loopback rendezvous: torch's default stays
        assert name is None and IFNAME_ENV not in os.environ
    with gloo_net.interface_for(None) as name:
        assert name is None
    monkeypatch.setattr(gloo_net, "route_address", lambda host: "127.0.0.1")
    with gloo_net.interface_for("192.0.2.1") as name:  # the interface that holds the route's address
        assert name == "lo" and os.environ[IFNAME_ENV] == "lo"
    assert IFNAME_ENV not in os.environ
    monkeypatch.setenv(IFNAME_ENV, "eth9")
    with gloo_net.interface_for("192.0.2.1") as name:  # the user's choice is never overridden
        assert name == "eth9"
    assert os.environ[IFNAME_ENV] == "eth9"


def test_a_loopback_interface_named_toward_another_host_is_refused_before_torch_waits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``GLOO_SOCKET_IFNAME=lo`` in a job whose rendezvous host is elsewhere: torch's groups would advertise
    127.0.0.1 and the other hosts' ranks wait until their timeout; refused at once, naming the setting. Loopback
    toward a rendezvous on this host (a job on one host) stays allowed."""
    monkeypatch.setenv(IFNAME_ENV, "lo")
    with (
        pytest.raises(gloo_net.PSAddressError, match=r"127\.0\.0\.1 \(chosen by GLOO_SOCKET_IFNAME=lo\).*192\.0\.2\.1"),
        gloo_net.interface_for("192.0.2.1"),
    ):
        pass
    with gloo_net.interface_for("127.0.0.1") as name:
        assert name == "lo"
    local = gloo_net.route_address("192.0.2.1")  # an address of this host, not loopback
    with gloo_net.interface_for(local) as name:
        assert name == "lo"
    monkeypatch.setenv(IFNAME_ENV, "eth9")  # no such interface: torch's own error names it
    with gloo_net.interface_for("192.0.2.1") as name:
        assert name == "eth9"


def test_dedicated_servers_on_loopback_are_refused_for_a_worker_on_another_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MASTER_ADDR", "192.0.2.1")  # rank 0 elsewhere (an address no interface here holds)
    monkeypatch.setenv("IVYPLUG_PS_HOST", "127.0.0.1")
    with pytest.raises(PSAddressError) as err:
        check_ps_host("127.0.0.1", 2)
    for words in ("127.0.0.1", "IVYPLUG_PS_HOST=127.0.0.1", "MASTER_ADDR=192.0.2.1", "set IVYPLUG_PS_HOST"):
        assert words in str(err.value)
    check_ps_host("127.0.0.1", 1)  # one worker: nobody on another host
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    check_ps_host("127.0.0.1", 2)  # rank 0 here


def test_a_pair_group_that_does_not_form_ends_within_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    from ivyplug.ps.config import PSConfig
    from ivyplug.ps.wire import auth
    from ivyplug.ps.wire.transport import PSTimeoutError
    from ivyplug.ps.worker import service_link

    release = threading.Event()
    monkeypatch.setattr(auth, "pair_group", lambda *args: release.wait(30))  # a connect that hangs
    cfg = PSConfig(servers="127.0.0.1:29600", timeout=1.0)
    t0 = time.monotonic()
    with pytest.raises(PSTimeoutError, match=r"127\.0\.0\.1:29600 within timeout=1 s.*GLOO_SOCKET_IFNAME"):
        service_link._pair_within(None, "p", cfg, "127.0.0.1")
    assert time.monotonic() - t0 < 4.0
    release.set()
