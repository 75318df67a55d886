"""What tests read inside a running PS that the shipped API does not expose: the in-process shard a client
serves, the buffers a shard's state holds, a layout forced onto or off its staged path."""

from __future__ import annotations

import torch

from ivyplug.ps import PSClient
from ivyplug.ps.server.lent_state import LentState
from ivyplug.ps.server.shard import Shard
from ivyplug.ps.worker.layout import FlatLayout


def local_shard(client: PSClient) -> Shard:
    """The shard ``client``'s process serves in-process (co-located topology), reached through its topology."""
    shard = client.topo.local
    assert shard is not None, "this client serves no shard in-process (dedicated or remote servers)"
    return shard


def held_buffers(state: LentState) -> int:
    """Buffers ``state`` holds: the current one and those lent out or kept spare (memory = this x the shard)."""
    return 1 + len(state._spare)


def force_staging(layout: FlatLayout, staged: bool) -> FlatLayout:
    """Make ``layout`` pack and unpack every shard through one flat buffer on its tensors' device (``staged``:
    the CUDA path, on any device, the CPU too) or always piece by piece (not ``staged``)."""
    plain = layout.staging_device

    def staging_device(shard: int) -> torch.device | None:
        if not staged:
            return None
        devices = {layout.tensor(p.index).device for p in layout.plan.pieces[shard]}
        return devices.pop() if len(devices) == 1 else plain(shard)

    setattr(layout, "staging_device", staging_device)  # noqa: B010 (an instance override, not an attribute)
    return layout


def ask_ahead_now(client: PSClient) -> None:
    """Make ``client`` ask the batch queue one index ahead from its next request on in this epoch, as it does
    where answers are slow (worker/ask_ahead.py), whatever its answers take here."""
    client._ask_ahead.enabled = True


def asked_ahead(client: PSClient) -> bool:
    """Whether ``client`` holds a request to the batch queue sent ahead of its next batch."""
    return client._asked_ahead is not None
