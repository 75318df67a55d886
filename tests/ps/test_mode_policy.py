"""The consistency modes as policies: one per mode, a clear error for another name; their rules are exercised
through real shards in test_shard.py (sync weighting, async staleness, ssp waits)."""

from __future__ import annotations

import pytest

from ivyplug.ps.server.mode_policy import POLICIES, AsyncPolicy, SspPolicy, SyncPolicy, policy_for


def test_every_mode_has_its_policy_and_only_sync_needs_every_worker() -> None:
    assert {name: type(policy_for(name)) for name in ("sync", "async", "ssp")} == {
        "sync": SyncPolicy,
        "async": AsyncPolicy,
        "ssp": SspPolicy,
    }
    assert [name for name, cls in POLICIES.items() if cls.needs_every_worker] == ["sync"]


def test_an_unknown_mode_is_refused_with_the_modes_listed() -> None:
    with pytest.raises(ValueError, match=r"mode must be one of \['async', 'ssp', 'sync'\], got 'bsp'"):
        policy_for("bsp")
