"""Load-aware training, framework-free: probes, a background sampler, and pure decision functions.

Probes (:class:`NvmlProbe`, :class:`TorchAllocatorProbe`, :class:`PsutilProbe`, :class:`ScriptedProbe`)
return flat readings; :class:`Sampler` polls them off the training thread; the decisions
(:class:`BatchSizePolicy`, which weighs a growth by goodput from a :class:`NoiseScale`, :func:`lr_factor`,
:func:`next_shares` from per-rank :class:`StepTimeModel` fits,
:func:`worker_shares`, :func:`plan_epoch`,
:func:`least_loaded`, :func:`split_batch`) are pure functions of observations that the Lightning and
Keras callbacks apply. Nothing here imports a framework at import time.
"""

from __future__ import annotations

from ivyplug.load.batch_plan import EpochPlan, plan_epoch, step_sizes
from ivyplug.load.batch_policy import BatchSizePolicy, Decision, PolicyState, default_batch_bounds
from ivyplug.load.device_choice import (
    DeviceLoad,
    NoDeviceAvailableError,
    devices_from_readings,
    least_loaded,
    parse_memory,
    rank_devices,
)
from ivyplug.load.goodput import (
    GoodputEstimate,
    NoiseScale,
    StepCost,
    goodput_gain,
    noise_components,
    predict_step_seconds,
    statistical_efficiency,
)
from ivyplug.load.lr_scaling import RULES, lr_factor, lr_rule_for, resolve_rule
from ivyplug.load.nvml_probe import NvmlProbe
from ivyplug.load.observation import (
    LoadObservation,
    combine_observations,
    observation_from_readings,
    observation_from_summary,
)
from ivyplug.load.oom import OutOfMemoryRecoveryError, batch_length, is_oom_error, next_split, part_sizes, split_batch
from ivyplug.load.probe import Probe, Readings, merge_readings
from ivyplug.load.probes import DEFAULT_PROBE_NAMES, available_probes, default_probes, make_probe
from ivyplug.load.psutil_probe import PsutilProbe
from ivyplug.load.sampler import Sampler, Stat
from ivyplug.load.scripted_probe import ScriptedProbe
from ivyplug.load.share_model import StepTimeModel, fit_step_time, min_max_shares, next_shares
from ivyplug.load.shares import gradient_weights, measured_speeds, smooth_speeds, worker_shares
from ivyplug.load.torch_probe import TorchAllocatorProbe

__all__ = [
    "DEFAULT_PROBE_NAMES",
    "RULES",
    "BatchSizePolicy",
    "Decision",
    "DeviceLoad",
    "EpochPlan",
    "GoodputEstimate",
    "LoadObservation",
    "NoDeviceAvailableError",
    "NoiseScale",
    "NvmlProbe",
    "OutOfMemoryRecoveryError",
    "PolicyState",
    "Probe",
    "PsutilProbe",
    "Readings",
    "Sampler",
    "ScriptedProbe",
    "Stat",
    "StepCost",
    "StepTimeModel",
    "TorchAllocatorProbe",
    "available_probes",
    "batch_length",
    "combine_observations",
    "default_batch_bounds",
    "default_probes",
    "devices_from_readings",
    "fit_step_time",
    "goodput_gain",
    "gradient_weights",
    "is_oom_error",
    "least_loaded",
    "lr_factor",
    "lr_rule_for",
    "make_probe",
    "measured_speeds",
    "merge_readings",
    "min_max_shares",
    "next_shares",
    "next_split",
    "noise_components",
    "observation_from_readings",
    "observation_from_summary",
    "parse_memory",
    "part_sizes",
    "plan_epoch",
    "predict_step_seconds",
    "rank_devices",
    "resolve_rule",
    "smooth_speeds",
    "split_batch",
    "statistical_efficiency",
    "step_sizes",
    "worker_shares",
]
