"""Validated configuration of the parameter server (no torch import: usable before spawning)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

MODES: tuple[str, ...] = ("sync", "async", "ssp")
STALENESS_SCALINGS: tuple[str, ...] = ("inverse", "none")
NONFINITE_POLICIES: tuple[str, ...] = ("skip", "raise")
WIRE_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "int8", "int4")
DEFAULT_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class PSConfig:
    """How the parameter server runs.

    ``mode``: ``"sync"`` (all workers' gradients of a step combined, weighted by sample count),
    ``"async"`` (each push applied on arrival) or ``"ssp"`` (async, but a worker blocks while it is more
    than ``staleness`` steps ahead of the slowest live worker). ``staleness`` is required for ``ssp`` and
    refused otherwise. ``staleness_scaling="inverse"`` (async/ssp) takes the server's step for a push
    made ``tau`` updates after its worker's pull with learning rate ``lr / (tau + 1)`` (``"none"``: ``lr``).
    ``nonfinite``: what a push with a NaN or Inf (gradient, delta or float buffer) does: ``"skip"``
    (default) drops that worker's whole push on every shard, ``"raise"`` stops with an error naming the
    rank, the step and the first non-finite tensor. ``timeout`` bounds every wait on the PS, in seconds.
    ``num_servers=0`` co-locates one shard with each worker; ``k > 0``: rank 0 starts one CPU server
    process holding k shards; ``servers="host:port"`` joins the shards an ``ivyplug serve`` runs there (``token``: the
    shared secret it was started with; never logged or saved). ``max_shard_bytes`` splits larger tensors row-wise (a
    split LAMB tensor keeps its whole tensor's trust ratio: the shards combine it, server/split_trust.py); ``"auto"``
    (default) splits where the optimizer's update is element-wise, and for LAMB in sync mode with co-located workers on
    more than one host, so that shards balance (sharding.py); ``None`` keeps whole tensors. ``wire_dtype="bfloat16"``
    sends the floats of pushes (gradients, deltas, float buffers) and of pulled parameters in bf16 over the wire, half
    the bytes of ``"float32"`` (default; in a job across hosts a shard in shared memory with its server travels in
    fp32, see ``shared_memory``); the servers keep fp32 masters and integer buffers travel exactly. A
    local-update delta carries its rounding error into the next delta (error feedback, localsgd/delta_exchange.py). A
    finite fp32 value beyond bf16's range (``|x| >= 3.3962e38``, which rounds to Inf) counts as non-finite.
    ``"int8"`` / ``"int4"``: pushes (gradients, or local-update deltas, for which they are made) travel
    block-quantized, one fp32 scale per 128 values (about 1/3.9 and 1/7.5 of fp32's bytes), with error feedback
    (what rounding leaves out of a push is carried into the next, wire/codecs.py BlockCodec); buffers travel in
    fp32. Pulls travel as the int8 difference (with int4 pushes too) from the copy the worker was last sent,
    which both ends keep (wire/codecs.py PulledCopy; the first pull, at the start or after a restore, in bf16): what one
    difference rounds away goes out with the next, so a worker's parameters stay within half a step of the
    last difference of the servers'. Each worker's copy costs one fp32 copy of its shards on the worker and
    on each server.
    ``overlap_backward=True`` sends each shard's gradients from backward's gradient hooks as soon as backward
    has produced them all, so the transfer overlaps the rest of backward (worker/early_push.py); the shards apply a
    push only at the step, after the whole push was checked, and data changed after backward is sent again;
    writes that bypass autograd's version counter (in-place ops on ``.grad.data``, kernels writing the tensor's
    memory directly) are not seen. ``False`` (default): everything at the step. Opt-in because it has not paid
    where it was measured (two CPU workers on two cores: the step 7-10% slower) and the accelerator path is
    unmeasured.
    ``shared_memory=True`` (default): a worker and a server on the same host (a co-located rank, the job's
    dedicated servers, an ``ivyplug serve`` there) keep each fp32 push and its reply in a region of
    ``/dev/shm`` both map, and only the headers cross gloo (about 1.0x gloo's loopback round trip at 4 MB and
    1.5x at 64 MB where it was measured, against 0.5-0.8x over gloo alone; docs/benchmarks.md). With a bf16 or
    quantized ``wire_dtype`` it does so, in fp32, only in a job whose workers run on more than one host: there a
    rounded copy would lose precision and save no link's bytes (a bf16 local-update delta is still rounded, with
    error feedback, by the worker before it is cut into shards); a job on one host keeps ``wire_dtype`` on gloo.
    Servers on other hosts and workers on CUDA use gloo. ``False``: gloo only.
    """

    mode: str = "async"
    staleness: int | None = None
    staleness_scaling: str = "inverse"
    timeout: float = DEFAULT_TIMEOUT_S
    num_servers: int = 0
    max_shard_bytes: int | str | None = "auto"
    nonfinite: str = "skip"
    servers: str | None = None
    token: str | None = field(default=None, repr=False)
    wire_dtype: str = "float32"
    overlap_backward: bool = False
    shared_memory: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"PSConfig.mode must be one of {MODES}, got {self.mode!r}")
        if self.mode == "ssp":
            if self.staleness is None or isinstance(self.staleness, bool) or not isinstance(self.staleness, int):
                raise ValueError(f"PSConfig.staleness must be an int >= 0 when mode='ssp', got {self.staleness!r}")
            if self.staleness < 0:
                raise ValueError(f"PSConfig.staleness must be >= 0, got {self.staleness}")
        elif self.staleness is not None:
            raise ValueError(
                f"PSConfig.staleness is only meaningful with mode='ssp' (got staleness={self.staleness!r} "
                f"with mode={self.mode!r}); use mode='ssp' or staleness=None"
            )
        if self.staleness_scaling not in STALENESS_SCALINGS:
            raise ValueError(
                f"PSConfig.staleness_scaling must be one of {STALENESS_SCALINGS}, got {self.staleness_scaling!r}"
            )
        if self.nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"PSConfig.nonfinite must be one of {NONFINITE_POLICIES}, got {self.nonfinite!r}")
        if (
            isinstance(self.timeout, bool)
            or not isinstance(self.timeout, (int, float))
            or not math.isfinite(self.timeout)
            or self.timeout <= 0
        ):
            raise ValueError(f"PSConfig.timeout must be a finite number of seconds > 0, got {self.timeout!r}")
        if isinstance(self.num_servers, bool) or not isinstance(self.num_servers, int) or self.num_servers < 0:
            raise ValueError(f"PSConfig.num_servers must be an int >= 0, got {self.num_servers!r}")
        if (
            self.max_shard_bytes is not None
            and self.max_shard_bytes != "auto"
            and (
                isinstance(self.max_shard_bytes, bool)
                or not isinstance(self.max_shard_bytes, int)
                or self.max_shard_bytes <= 0
            )
        ):
            raise ValueError(
                f"PSConfig.max_shard_bytes must be 'auto', None or an int > 0, got {self.max_shard_bytes!r}"
            )

        if not isinstance(self.overlap_backward, bool):
            raise ValueError(f"PSConfig.overlap_backward must be True or False, got {self.overlap_backward!r}")
        if not isinstance(self.shared_memory, bool):
            raise ValueError(f"PSConfig.shared_memory must be True or False, got {self.shared_memory!r}")
        if self.wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"PSConfig.wire_dtype must be one of {WIRE_DTYPES}, got {self.wire_dtype!r}")
        if self.overlap_backward and self.wire_dtype in ("int8", "int4"):
            raise ValueError(
                f"PSConfig.overlap_backward=True cannot be combined with wire_dtype={self.wire_dtype!r}: each push's "
                "rounding error is carried into the next, and a shard sent early and again at the step would carry "
                "it twice; use overlap_backward=False or wire_dtype 'float32'/'bfloat16'"
            )
        if self.servers is not None:
            parse_address(self.servers, "PSConfig.servers")
            if self.num_servers:
                raise ValueError(
                    f"PSConfig: servers={self.servers!r} joins an ivyplug serve; num_servers={self.num_servers} "
                    "would start servers of the job's own: set one of them"
                )
        if self.token is not None and not isinstance(self.token, str):
            raise ValueError(f"PSConfig.token must be a string or None, got {type(self.token).__name__}")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> PSConfig:
        """Build from keyword arguments, refusing unknown names with the list of known ones."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown PSConfig field(s) {unknown}; known fields: {sorted(known)}")
        return cls(**kwargs)

    @classmethod
    def from_settings(cls, caller: str = "PSConfig", **overrides: Any) -> PSConfig:
        """Build from the project's defaults (:mod:`ivyplug.settings`), as ``IvyPSStrategy`` and the Keras
        ``AsyncLAMBExchange`` do, so that both frameworks read ``[tool.ivyplug.ps]`` / ``IVYPLUG_PS_*`` alike.

        A keyword given as None that the settings know (``timeout``, ``num_servers``, ``servers``…) takes the
        project's value, else the built-in default; a keyword not given takes the built-in default (a caller
        that offers no ``num_servers`` never reads it); others are used as given. ``servers`` and ``num_servers``
        choose where the shards run, one or the other: the one given in code also overrides the project's other.
        The token comes from code, else ``$IVYPLUG_TOKEN`` (never a project file). ``caller``: whose arguments
        these are, named by a refusal (``IvyPSStrategy: mode must be one of ...``) in place of the dataclass's
        fields.
        """
        from ivyplug import settings

        project = settings.project_settings("ps")
        defaults = {f.name: f.default for f in fields(cls)}
        values = dict(overrides)
        taken: dict[str, str] = {}  # key -> where the project set it
        for key, value in overrides.items():
            if value is None and key in settings.SECTIONS["ps"]:
                chosen_in_code = overrides.get(_OTHER_TOPOLOGY.get(key, "")) is not None
                if key in project and not chosen_in_code:
                    values[key], taken[key] = project[key]
                else:  # unset, or the code chose the other topology: the project's choice yields to the code's
                    values[key] = defaults.get(key)
        values["token"] = settings.token(overrides.get("token"))
        try:
            return cls.from_kwargs(**values)
        except ValueError as exc:
            own = str(exc).replace(f"{cls.__name__}: ", "").replace(f"{cls.__name__}.", "")
            text = str(exc) if caller == cls.__name__ else f"{caller}: {own}"
            text = naming_sources(text, taken)  # a project value refused: the code never named it
            if text == str(exc):
                raise
            raise ValueError(text) from None

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (for logging and hyperparameter saving); the token shows only whether one is set."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["token"] = None if self.token is None else "<set>"
        return out


#: Settings that choose the same thing (where the shards run) in two ways: one given in code leaves the project's
#: value of the other unread.
_OTHER_TOPOLOGY = {"servers": "num_servers", "num_servers": "servers"}


def naming_sources(refusal: str, sources: Mapping[str, str]) -> str:
    """``refusal`` followed by where the settings it names were set (``sources``: key -> where), if any."""
    named = [where for key, where in sources.items() if re.search(rf"\b{key}\b", refusal)]
    return f"{refusal} (set by {'; '.join(named)})" if named else refusal


def parse_address(value: object, what: str) -> tuple[str, int]:
    """``"host:port"`` as (host, port); ValueError naming ``what`` otherwise (IPv6 hosts in brackets)."""
    if not isinstance(value, str) or ":" not in value:
        raise ValueError(f"{what} must be 'host:port' (e.g. '127.0.0.1:29600'), got {value!r}")
    host, _, port = value.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what} must be 'host:port' with a port in 1..65535, got {value!r}")
    return host, int(port)
