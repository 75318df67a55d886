"""The default process group's store for a torchrun attempt, so that a restarted attempt can rendezvous.

Under torchrun every worker of every attempt meets through the elastic agent's store
(``TORCHELASTIC_USE_AGENT_STORE``), and torch's ``env://`` rendezvous uses it without a per-attempt prefix:
measured with torch 2.13 and ``--max-restarts 1``, the restarted workers' gloo ``connectFullMesh`` can read
the previous attempt's addresses (still in the store) and fail with "Connection refused" — a race that a
plain ``init_process_group`` loses about as often as Lightning's. A store prefixed by the attempt
(``TORCHELASTIC_RESTART_COUNT``) keeps each attempt's keys apart, as torch itself once did.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist


def attempt_store(world_size: int, timeout: timedelta) -> dist.Store | None:
    """A store for this torchrun attempt's default process group, or None outside torchrun's agent store."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    agent = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False, timeout=timeout
    )
    return dist.PrefixStore(f"ivyplug/attempt_{attempt}", agent)
