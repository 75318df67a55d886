"""The ``ivy/...`` metric names both ``IvyLoadBalancer`` twins log, built in one place so they cannot drift."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from ivyplug.load.observation import LoadObservation

#: Per-rank values logged as ``ivy/rank{r}/<key>`` (a twin logs those it measures).
RANK_KEYS: tuple[str, ...] = ("compute_time", "samples", "share", "utilization", "memory_fraction", "oom_count")


def is_per_core(key: str) -> bool:
    """``cpu{k}_util``: one reading per core, too many to log every few steps."""
    return key.startswith("cpu") and key.endswith("_util") and key[3:-5].isdigit()


def reading_metrics(readings: Mapping[str, float], per_core: bool = True) -> dict[str, float]:
    """Every probe reading as ``ivy/<key>`` (``per_core=False`` leaves out ``cpu{k}_util``)."""
    return {f"ivy/{k}": float(v) for k, v in readings.items() if per_core or not is_per_core(k)}


def load_metrics(observation: LoadObservation) -> dict[str, float]:
    """``ivy/utilization`` and ``ivy/memory_fraction``, where known."""
    metrics: dict[str, float] = {}
    if observation.utilization is not None:
        metrics["ivy/utilization"] = float(observation.utilization)
    if observation.memory_fraction is not None:
        metrics["ivy/memory_fraction"] = float(observation.memory_fraction)
    return metrics


def decision_metrics(batch_size: int | None, lr_factor: float, noise_scale: float | None = None) -> dict[str, float]:
    """``ivy/batch_size`` (where known), ``ivy/lr_factor`` and ``ivy/noise_scale`` (where measured)."""
    metrics: dict[str, float] = {} if batch_size is None else {"ivy/batch_size": float(batch_size)}
    metrics["ivy/lr_factor"] = float(lr_factor)
    if noise_scale is not None:
        metrics["ivy/noise_scale"] = float(noise_scale)
    return metrics


def rank_metrics(ranks: Iterable[Mapping[str, float | int | None]]) -> dict[str, float]:
    """``ivy/rank{r}/<key>`` for every :data:`RANK_KEYS` value a rank's record holds (``rank``: its index)."""
    metrics: dict[str, float] = {}
    for record in ranks:
        for key in RANK_KEYS:
            value = record.get(key)
            if value is not None:
                metrics[f"ivy/rank{record['rank']}/{key}"] = float(value)
    return metrics
