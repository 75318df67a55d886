"""Every option the ``IvyLoadBalancer`` twins share, with its default, checked once.

The Lightning and Keras callbacks take these as keyword arguments and hand them here, so a config moves
between the two and a default cannot differ. A bad value is refused at construction with the parameter's
name and what is allowed, not at the first epoch end.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, TypeAlias

from ivyplug.load.batch_policy import BatchSizePolicy
from ivyplug.load.lr_scaling import check_rule
from ivyplug.load.probe import Probe
from ivyplug.load.probes import DEFAULT_PROBE_NAMES, SCRIPTED, default_probes, make_probe

#: What ``probes`` holds: registry names, ``{"name": ..., **kwargs}`` dicts or probe objects, or a zero-argument
#: callable returning them (for spawn, where probe objects may not pickle).
ProbeSpecs: TypeAlias = Sequence[str | Mapping[str, Any] | Probe] | Callable[[], Sequence[Probe]] | None

#: The :class:`BatchSizePolicy` rules the callbacks take as keywords (the bounds are derived, see ``policy_bounds``).
POLICY_RULES: tuple[str, ...] = (
    "grow_factor",
    "shrink_factor",
    "grow_below_utilization",
    "memory_low",
    "memory_high",
    "cooldown",
    "min_relative_change",
    "goodput",
    "goodput_threshold",
    "min_efficiency",
)

#: The default probes as configs saved by earlier versions list them (a Keras model's ``get_config``): the defaults.
_EARLIER_DEFAULT_NAMES = ["nvml", "torch_allocator", "psutil"]


def _optional_int(name: str, value: object, minimum: int) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
        raise ValueError(f"{name} must be None or an int >= {minimum}, got {value!r}")


#: BatchSizePolicy's rule defaults, by name
_RULE_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(BatchSizePolicy) if f.name in POLICY_RULES}


@dataclass(frozen=True)
class BalancerConfig:
    """The shared options of both ``IvyLoadBalancer`` twins (see their docstrings for what each one does)."""

    probes: ProbeSpecs = None
    interval: float = 1.0
    adapt_batch_size: bool = True
    min_batch_size: int | None = None
    max_batch_size: int | None = None
    # the batch-size rules default to BatchSizePolicy's own: one place holds them, so the twins and the policy agree
    grow_factor: float = _RULE_DEFAULTS["grow_factor"]
    shrink_factor: float = _RULE_DEFAULTS["shrink_factor"]
    grow_below_utilization: float = _RULE_DEFAULTS["grow_below_utilization"]
    memory_low: float = _RULE_DEFAULTS["memory_low"]
    memory_high: float = _RULE_DEFAULTS["memory_high"]
    cooldown: int = _RULE_DEFAULTS["cooldown"]
    min_relative_change: float = _RULE_DEFAULTS["min_relative_change"]
    goodput: bool = _RULE_DEFAULTS["goodput"]
    goodput_threshold: float = _RULE_DEFAULTS["goodput_threshold"]
    min_efficiency: float = _RULE_DEFAULTS["min_efficiency"]
    noise_smoothing: float = 0.5
    policy: BatchSizePolicy | None = None
    lr_scaling: str = "auto"
    log_every_n_steps: int | None = None
    oom_recovery: bool = True
    oom_max_parts: int = 8

    def __post_init__(self) -> None:
        interval = self.interval
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not 0 < interval < math.inf:
            raise ValueError(f"interval must be a positive number of seconds, got {interval!r}")
        object.__setattr__(self, "interval", float(interval))  # seconds, as a float in every config written
        _check_probes(self.probes)
        _optional_int("min_batch_size", self.min_batch_size, 1)
        _optional_int("max_batch_size", self.max_batch_size, 1)
        low, high = self.min_batch_size, self.max_batch_size
        if low is not None and high is not None and high < low:
            raise ValueError(f"max_batch_size ({high}) must be >= min_batch_size ({low})")
        if self.policy is not None and not isinstance(self.policy, BatchSizePolicy):
            raise ValueError(f"policy must be an ivyplug.load.BatchSizePolicy, got {self.policy!r}")
        BatchSizePolicy(1, 1, **self.policy_rules())  # names the first bad rule, with what it allows
        s = self.noise_smoothing
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0.0 <= s < 1.0:
            raise ValueError(f"noise_smoothing (the noise-scale EMA weight of the past) must be in [0, 1), got {s!r}")
        check_rule(self.lr_scaling)
        _optional_int("log_every_n_steps", self.log_every_n_steps, 1)
        parts = self.oom_max_parts
        if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
            raise ValueError(f"oom_max_parts must be an int >= 1, got {parts!r}")
        for name in ("adapt_batch_size", "oom_recovery"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")

    def policy_rules(self) -> dict[str, Any]:
        """The :class:`BatchSizePolicy` keywords, as given."""
        return {name: getattr(self, name) for name in POLICY_RULES}

    @property
    def goodput_on(self) -> bool:
        """Whether a growth must pay in goodput (a full ``policy`` decides, else the ``goodput`` option)."""
        return self.policy.goodput if self.policy is not None else self.goodput

    def build_probes(self) -> list[Probe]:
        """The probes to poll: the defaults (a missing package skips its probe) or those named (they must exist)."""
        specs = self.probes() if callable(self.probes) else self.probes
        if specs is None or list(specs) in (list(DEFAULT_PROBE_NAMES), _EARLIER_DEFAULT_NAMES):
            return default_probes(DEFAULT_PROBE_NAMES)
        return [make_probe(spec) for spec in specs]

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


def _check_probes(probes: object) -> None:
    if probes is None or callable(probes):
        return
    if isinstance(probes, (str, Mapping)) or not isinstance(probes, Sequence):
        raise ValueError(f"probes must be a list of names, dicts or Probe objects, got {probes!r}")
    for spec in probes:
        if not isinstance(spec, (str, Mapping, Probe)):
            raise ValueError(f"probes must hold names, dicts or Probe objects, got {spec!r}")
        if isinstance(spec, str):
            _check_probe_name(spec)
        elif isinstance(spec, Mapping):
            name = spec.get("name")
            if not isinstance(name, str):
                raise ValueError(f"probes: a dict names its probe under 'name', got {dict(spec)!r}")
            _check_probe_name(name, {k: v for k, v in spec.items() if k != "name"})


def _check_probe_name(name: str, options: Mapping[str, Any] | None = None) -> None:
    """A registered probe's name, and the options a dict gives it where its class can be loaded here (a probe
    may need a package this machine lacks: then only the name is checked), before any worker builds it."""
    from ivyplug.registry import AmbiguousComponentError, UnknownComponentError, get_registry

    if name == SCRIPTED and options is not None:  # a scripted probe (a dict with its trace) is no registered one
        from ivyplug.load.scripted_probe import ScriptedProbe

        cls: Any = ScriptedProbe
    else:
        try:
            entry = get_registry().resolve("probe", name)
        except (UnknownComponentError, AmbiguousComponentError, ValueError) as exc:
            raise ValueError(f"probes: {exc}") from None
        if options is None or not entry.available:
            return
        cls = entry.component.load()
    try:
        inspect.signature(cls).bind(**(options or {}))
    except TypeError as exc:
        takes = [p for p in inspect.signature(cls).parameters if p not in ("self", "args", "kwargs")]
        given = dict(options or {})
        raise ValueError(f"probes: the {name!r} probe does not take {given!r} ({exc}); it takes: {takes}") from None


@dataclass(frozen=True)
class ShareOptions:
    """The options of a twin that splits B across ranks by measured speed (the Lightning one).

    ``balance_shares``: split by the ranks' step-time fits (else evenly); ``share_window``: how many recent distinct
    shares a rank's fit uses; ``comm_hook``: compose a user's DDP hook with the share weighting, or refuse it;
    ``loss_reduction``: how micro-batch losses of an OOM split combine; ``seed``: the permutation seed.
    """

    balance_shares: bool = True
    share_window: int = 4
    comm_hook: str = "compose"
    loss_reduction: str = "mean"
    seed: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.balance_shares, bool):
            raise ValueError(f"balance_shares must be True or False, got {self.balance_shares!r}")
        window = self.share_window
        if isinstance(window, bool) or not isinstance(window, int) or window < 2:
            raise ValueError(f"share_window must be an int >= 2 (a line needs two shares), got {window!r}")
        if self.comm_hook not in ("compose", "refuse"):
            raise ValueError(f"comm_hook must be 'compose' or 'refuse', got {self.comm_hook!r}")
        if self.loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {self.loss_reduction!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be None or an int, got {self.seed!r}")

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))
