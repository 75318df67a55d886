"""The default process group's store for a torchrun attempt, so that a restarted attempt can rendezvous.

Under torchrun every worker of every attempt meets through the elastic agent's store
(``TORCHELASTIC_USE_AGENT_STORE``), and torch's ``env://`` rendezvous uses it without a per-attempt prefix:
measured with torch 2.13 and ``--max-restarts 1``, the restarted workers' gloo ``connectFullMesh`` can read
the previous attempt's addresses (still in the store) and fail with "Connection refused" — a race that a
plain ``init_process_group`` loses about as often as Lightning's. A store prefixed by the attempt
(``TORCHELASTIC_RESTART_COUNT``) keeps each attempt's keys apart, as torch itself once did.

:func:`meet` then bounds the wait for the other ranks by the PS's ``timeout``: a rank that fails before it joins
(a setting refused on its host, an import error) would otherwise keep the others in torch's rendezvous for the
process group's timeout (30 minutes by default), where torchrun's agents do not end them either.
"""

from __future__ import annotations

import os
import socket
import time
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


#: the counter of ranks that reached the rendezvous, in an attempt's store
JOINED_KEY = "ivyplug/joined"


def meet(store: dist.Store, world_size: int, rank: int, timeout: float) -> None:
    """Count this rank in and wait until all ``world_size`` ranks are (TimeoutError after ``timeout`` seconds,
    naming how many came and where they meet)."""
    store.add(JOINED_KEY, 1)
    deadline = time.monotonic() + timeout
    while (joined := store.add(JOINED_KEY, 0)) < world_size:
        if time.monotonic() > deadline:
            where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
            raise TimeoutError(
                f"rank {rank} on host {socket.gethostname()!r} waited {timeout:g} s (IvyPSStrategy's timeout) for the "
                f"job's other ranks at its rendezvous {where}: {joined} of {world_size} came; a rank that failed "
                "before joining says why in its own host's output (torchrun's agent there ended)"
            )
        time.sleep(0.05)
