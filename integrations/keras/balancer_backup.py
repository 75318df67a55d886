"""The Keras ``IvyLoadBalancer``'s state beside a ``keras.callbacks.BackupAndRestore`` backup.

``BackupAndRestore`` saves the weights, the optimizer's variables among them, so the learning rate it restores is
the one the balancer had scaled for the batch size it had reached; the batch size itself lives on the Python
``ElasticDataset`` and is not in that backup. With ``backup_dir`` (the ``BackupAndRestore``'s own) the balancer
writes what a resumed fit needs at every epoch's end, keyed by the epochs done then (the number ``BackupAndRestore``
writes to its ``training_metadata.json``), and a resumed fit takes the state of the epoch Keras resumes at (known at
its first epoch's start, after ``BackupAndRestore`` has fallen back to its previous backup where the latest could
not be read, ``double_checkpoint=True``). The last two epochs are kept, and any the metadata still names (a
``save_freq`` in batches lags behind). List the balancer before ``BackupAndRestore`` in ``callbacks``: at an epoch's
end its state is then written before Keras's backup, so a crash between the two cannot leave a backup without the
balancer's state (the other order is warned once). ``BackupAndRestore`` removes its directory, this file with it,
when a fit ends.
"""

from __future__ import annotations

import json
import os
import uuid
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

#: the file in ``backup_dir``; Keras's own are ``latest.weights.h5`` and ``training_metadata.json``
STATE_FILE = "ivyplug_load_balancer.json"
KERAS_METADATA_FILE = "training_metadata.json"
_KEPT = 2


@dataclass(frozen=True)
class BalancerBackup:
    """What a fit resumed at ``epochs_done`` needs to go on as the uninterrupted one would: the decision state
    (``BalancerCore.state_dict()``, the Lightning twin's checkpoint state: the rules' counters, the noise scale),
    where the stream continues and at which batch size, the changes decided but not reached (steps ahead, batch
    size) with their learning-rate factors (steps ahead, factor), and the learning rate then."""

    epochs_done: int
    core: dict[str, Any]
    position: int
    batch_now: int
    scheduled: list[tuple[int, int]]
    pending: list[tuple[int, float]]
    learning_rate: float


def keras_epoch(backup_dir: str | os.PathLike[str]) -> int | None:
    """The epoch ``BackupAndRestore``'s metadata in ``backup_dir`` names (``None``: it wrote none)."""
    path = Path(backup_dir) / KERAS_METADATA_FILE
    try:
        return int(json.loads(path.read_text())["epoch"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:  # Keras writes it in place: another worker may be
        warnings.warn(  # writing it now, or a crash cut it short
            f"IvyLoadBalancer: {path} could not be read ({type(exc).__name__}: {exc}); taken as naming no epoch",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


def save(backup_dir: str | os.PathLike[str], state: BalancerBackup, named: int | None) -> None:
    """Add ``state`` to the directory's file (atomically; the last two epochs kept, and any from ``named`` on:
    the epoch Keras's metadata names, :func:`keras_epoch`, which the caller has read)."""
    directory = Path(backup_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / STATE_FILE
    states = _read(path)
    states[str(state.epochs_done)] = asdict(state)
    latest = sorted(states, key=int)[-_KEPT:]
    kept = [k for k in sorted(states, key=int) if k in latest or (named is not None and int(k) >= named)]
    tmp = directory / f".{STATE_FILE}.{uuid.uuid4().hex}"  # every worker writes the same state: last one wins
    tmp.write_text(json.dumps({"version": 1, "states": {k: states[k] for k in kept}}))
    os.replace(tmp, path)


def state_at(backup_dir: str | os.PathLike[str], epoch: int) -> BalancerBackup | None:
    """The state saved in ``backup_dir`` for a fit resumed at ``epoch`` (``None``: none saved)."""
    path = Path(backup_dir) / STATE_FILE
    saved = _read(path).get(str(epoch))
    if saved is None:
        return None
    try:
        return BalancerBackup(**saved)
    except TypeError as exc:  # another version's fields
        warnings.warn(f"IvyLoadBalancer: ignoring {path}: {exc}", RuntimeWarning, stacklevel=2)
        return None


def _read(path: Path) -> dict[str, Any]:
    """The saved states by epoch; none (warned) where the file is not one of ours or was cut short."""
    data: Any
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except ValueError as exc:  # a write cut short (the file is replaced atomically, but a disk may lose it)
        data = exc
    if not isinstance(data, dict) or data.get("version") != 1 or not isinstance(data.get("states"), dict):
        warnings.warn(f"IvyLoadBalancer: ignoring {path}, not a balancer backup ({data!r:.80})", RuntimeWarning, 2)
        return {}
    return dict(data["states"])
