"""The ``IvyLoadBalancer`` decisions, framework-free: one core both the Lightning and the Keras callback drive.

The callbacks measure (probes, step times, gradient norms) and apply (loaders, learning rates, the OOM split);
everything between lives here, so the twins cannot drift: the batch-size bounds, when B changes and why
(:class:`~ivyplug.load.BatchSizePolicy` weighed by goodput), the gradient-noise and step-cost estimates, the
per-rank shares, the learning-rate factor, the OOM counts, and the state a checkpoint keeps. Nothing here
imports a framework; every input is a plain number or a JSON-able record, so rank 0 can decide and broadcast.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Generic, TypeVar

from ivyplug.load.balancer_config import BalancerConfig, ShareOptions
from ivyplug.load.batch_policy import BatchSizePolicy, Decision, PolicyState, default_batch_bounds
from ivyplug.load.goodput import GoodputEstimate, NoiseScale, StepCost, noise_components
from ivyplug.load.observation import LoadObservation, combine_observations
from ivyplug.load.share_model import next_shares
from ivyplug.load.shares import worker_shares

T = TypeVar("T")

#: How many recent (B, seconds per step) measurements the goodput estimate keeps.
STEP_COST_WINDOW = 8

#: The per-rank epoch record keys :meth:`BalancerCore.decide_epoch` reads (the Lightning twin gathers them).
RECORD_KEYS: tuple[str, ...] = (
    "rank",
    "step_share",
    "step_time",
    "wall_step",
    "noise_grad_sq",
    "noise_trace",
    "noise_steps",
    "utilization",
    "memory_fraction",
    "oom_count",
)


def round_batch(batch_size: int, multiple: int = 1, most: int | None = None) -> int:
    """``batch_size`` down to a multiple of ``multiple``, at least ``multiple`` and at most ``most`` (rounded)."""
    top = math.inf if most is None else (most // multiple) * multiple
    return int(max(multiple, min(top, (batch_size // multiple) * multiple)))


def policy_bounds(
    config: BalancerConfig, initial: int, workers: int, multiple: int = 1, most: int | None = None
) -> tuple[int, int]:
    """``(min, max)`` of B: the options, else one sample per worker and 8 × ``initial``; never below ``workers``.

    ``multiple``: what every B must divide into (replicas under ``tf.distribute``; 1 where shares may differ);
    ``most``: the data set size, if B may not exceed it.
    """
    low, high = default_batch_bounds(initial, workers)
    low = config.min_batch_size if config.min_batch_size is not None else low
    high = config.max_batch_size if config.max_batch_size is not None else max(high, low)
    low = max(workers, round_batch(-(-low // multiple) * multiple, multiple, most))  # up: never below the floor
    high = max(workers, round_batch(high, multiple, most))
    return min(low, high), max(low, high)


def mean_noise(records: Sequence[Mapping[str, Any]]) -> tuple[float, float] | None:
    """Step-weighted mean over workers of each worker's epoch mean ``(|G|², tr(Σ))``; ``None`` without steps."""
    steps = sum(int(r["noise_steps"]) for r in records)
    if steps <= 0:
        return None
    grad_sq = sum(float(r["noise_grad_sq"]) * int(r["noise_steps"]) for r in records) / steps
    trace = sum(float(r["noise_trace"]) * int(r["noise_steps"]) for r in records) / steps
    return grad_sq, trace


def _positive(value: float) -> bool:
    return math.isfinite(value) and value > 0


def _slowest(seconds: Iterable[float]) -> float:
    """The largest measured time (a zero or NaN rank measured nothing), 0.0 where none measured anything."""
    return max((t for t in seconds if _positive(t)), default=0.0)


class BalancerCore:
    """The decisions and the decided state of one ``IvyLoadBalancer``.

    ``batch_size`` and ``shares`` are the current global batch and per-rank split (``None`` until the callback
    learns B from its loader or data set); the rest is what the next decision needs and a checkpoint keeps.
    """

    def __init__(self, config: BalancerConfig) -> None:
        self.config = config
        self.policy: BatchSizePolicy | None = config.policy
        self.batch_size: int | None = None
        self.shares: list[int] | None = None
        self.initial_batch_size: int | None = None  # B when the first fit started (min_efficiency's reference)
        self.policy_state = PolicyState()
        self.noise = NoiseScale(smoothing=config.noise_smoothing)
        self.step_costs: list[StepCost] = []  # (B, wall seconds per step, compute seconds per step), recent epochs
        self.goodput_unavailable: str | None = None  # why this fit has no noise-scale estimate
        self.lr_factor = 1.0  # current LR / LR at the start (the first optimizer's, where there are several)
        self.oom_count = 0
        # per rank: (median samples per step, median compute seconds per step) of every balanced epoch, oldest first
        self.step_observations: list[list[tuple[float, float]]] = []
        self.previous_shares: list[int] | None = None  # the shares before the current ones (damping)
        self.share_gain = 1.0  # fraction of the way to the target share taken per epoch (damping)
        self.history: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ batch size
    def build_policy(self, workers: int, multiple: int = 1, most: int | None = None) -> BatchSizePolicy:
        """The policy for this fit: the user's, or the options' rules within :func:`policy_bounds` of B."""
        if self.policy is None:
            assert self.batch_size is not None, "the batch size must be known before the policy is built"
            # 8 x the B the first fit started with: a fit resumed at a grown B keeps the bounds it had
            initial = self.initial_batch_size or self.batch_size
            low, high = policy_bounds(self.config, initial, workers, multiple, most)
            self.policy = BatchSizePolicy(low, high, **self.config.policy_rules())
            if not low <= self.batch_size <= high:
                warnings.warn(
                    f"IvyLoadBalancer: the batch size {self.batch_size} is outside the bounds [{low}, {high}] "
                    "(min_batch_size, max_batch_size): it stays there until a decision moves it, and then only "
                    "toward them (a shrink never grows it, a growth never shrinks it)",
                    RuntimeWarning,
                    stacklevel=2,
                )
        return self.policy

    def start(self, batch_size: int, workers: int = 1) -> None:
        """Take B from the first loader (or a checkpoint's); equal shares where they do not fit B and ``workers``."""
        if self.batch_size is None:
            self.batch_size = batch_size
        if self.initial_batch_size is None:
            self.initial_batch_size = self.batch_size
        if self.shares is None or len(self.shares) != workers or sum(self.shares) != self.batch_size:
            self.shares = worker_shares(self.batch_size, [1.0] * workers)

    def estimate(self, noise: NoiseScale | None = None, costs: Sequence[StepCost] | None = None) -> GoodputEstimate:
        """What the policy weighs a growth with: B_noise and the step costs, or why there is none."""
        noise = self.noise if noise is None else noise
        costs = self.step_costs if costs is None else costs
        return GoodputEstimate(noise.value, tuple(costs), self.goodput_unavailable, self.initial_batch_size)

    def decide_batch(self, batch_size: int, observation: LoadObservation) -> Decision:
        """One policy decision from B and the (combined) epoch observation; the policy state moves on."""
        assert self.policy is not None, "build_policy first"
        decision = self.policy.decide(batch_size, observation, self.policy_state, self.estimate())
        self.policy_state = decision.state
        return decision

    # ------------------------------------------------------------------ estimates
    def add_noise(self, grad_sq: float, trace: float) -> None:
        """Fold one epoch's ``(|G|², tr(Σ))`` into the moving averages (a non-finite pair is counted as skipped)."""
        self.noise.update(grad_sq, trace)

    def add_norms(self, small_sq: float, small_batch: float, big_sq: float, big_batch: float) -> bool:
        """Fold the estimate from the mean squared gradient norms at b and at B; ``False`` where it adds nothing.

        B not above b carries no information about the noise and is ignored; a non-finite norm (a NaN gradient) is
        counted in ``noise.skipped`` and leaves the averages alone.
        """
        if not (small_batch > 0 and big_batch > small_batch):
            return False
        grad_sq, trace = noise_components(small_sq, small_batch, big_sq, big_batch)
        self.noise.update(grad_sq, trace)
        return math.isfinite(grad_sq) and math.isfinite(trace)

    def add_step_cost(self, batch_size: int, wall: float, compute: float) -> None:
        """Keep one epoch's seconds per step at B (a zero or non-finite measurement is no measurement)."""
        self.step_costs = self._with_cost(self.step_costs, batch_size, wall, compute)

    @staticmethod
    def _with_cost(costs: Sequence[StepCost], batch_size: int, wall: float, compute: float) -> list[StepCost]:
        if not (_positive(wall) and _positive(compute)):
            return list(costs)
        return [*costs, StepCost(batch_size, wall, compute)][-STEP_COST_WINDOW:]

    # ------------------------------------------------------------------ one epoch, every rank's records (rank 0)
    def decide_epoch(
        self,
        records: Sequence[Mapping[str, Any]],
        *,
        adapt: bool,
        share_options: ShareOptions | None = None,
        held: str | None = None,
    ) -> dict[str, Any]:
        """The next B, shares and estimates from every rank's epoch record (keys: :data:`RECORD_KEYS`).

        Pure: nothing here changes ``self``; the JSON-able result is broadcast and applied on every rank with
        :meth:`apply_epoch`. ``share_options`` say how shares move (default: :class:`ShareOptions`); ``held`` (why
        the callback only monitors) keeps B and the shares.
        """
        options = ShareOptions() if share_options is None else share_options
        if not records:
            raise ValueError("records must hold one epoch record per rank, got none")
        for r in records:
            missing = [key for key in RECORD_KEYS if key not in r]
            if missing:
                raise ValueError(f"an epoch record lacks {missing}; it needs every key of RECORD_KEYS")
        assert self.batch_size is not None and self.shares is not None, "start first"
        world = len(self.shares)
        old = self.batch_size
        noise = NoiseScale.from_dict(self.noise.to_dict())
        pair = mean_noise(records)
        if pair is not None:
            noise.update(*pair)
        wall = _slowest(float(r["wall_step"]) for r in records)  # the step waits for the slowest rank
        compute = _slowest(float(r["step_time"]) for r in records)
        costs = self._with_cost(self.step_costs, old, wall, compute)
        estimate = self.estimate(noise, costs)
        if estimate.unavailable is None and held is not None:
            estimate = GoodputEstimate(estimate.noise_scale, estimate.costs, held, estimate.base_batch_size)
        new, state, reason = old, self.policy_state, "fixed"
        if adapt and held is None:
            observations = [LoadObservation(r["utilization"], r["memory_fraction"], r["oom_count"]) for r in records]
            assert self.policy is not None, "build_policy first"
            decision = self.policy.decide(old, combine_observations(observations), self.policy_state, estimate)
            new, state, reason = decision.batch_size, decision.state, decision.reason
        shares = list(self.shares)
        history = [list(h) for h in self.step_observations]
        previous, gain, target, models = self.previous_shares, self.share_gain, None, None
        if world > 1 and held is None:
            measured = all(_positive(float(r["step_share"])) and _positive(float(r["step_time"])) for r in records)
            if options.balance_shares and measured:
                if len(history) != world:
                    history = [[] for _ in range(world)]
                for r in records:  # median local batch and median compute seconds per step of the epoch
                    history[r["rank"]].append((float(r["step_share"]), float(r["step_time"])))
                    del history[r["rank"]][: -4 * options.share_window]  # bounded history
                step = next_shares(new, self.shares, previous, history, gain, window=options.share_window)
                shares, gain, target = step.shares, step.gain, step.target
                models = [[m.intercept, m.slope] for m in step.models]
                previous = list(self.shares)
            elif new != old:
                shares = worker_shares(new, [float(s) for s in self.shares])
        elif world == 1:
            shares = [new]
        return {
            "batch_size": new,
            "shares": shares,
            "policy_state": state.to_dict(),
            "reason": reason,
            "step_observations": history,
            "previous_shares": previous,
            "share_gain": gain,
            "target_shares": target,
            "step_models": models,  # per rank [a_i seconds per step, c_i seconds per sample]
            "noise": noise.to_dict(),
            "step_costs": [[c.batch_size, c.seconds, c.compute] for c in costs],
        }

    def apply_epoch(self, decision: Mapping[str, Any]) -> int:
        """Take a decision of :meth:`decide_epoch` (broadcast from rank 0); returns the B it replaces."""
        old = self.batch_size
        assert old is not None
        self.batch_size = int(decision["batch_size"])
        self.shares = [int(s) for s in decision["shares"]]
        self.policy_state = PolicyState.from_dict(decision["policy_state"])
        self.step_observations = [[(float(b), float(t)) for b, t in h] for h in decision["step_observations"]]
        self.previous_shares = decision["previous_shares"]
        self.share_gain = float(decision["share_gain"])
        self.noise = NoiseScale.from_dict(decision["noise"])
        self.step_costs = [StepCost(int(b), float(t), float(c)) for b, t, c in decision["step_costs"]]
        return old

    def note_epoch(self, epoch: int, old: int, decision: Mapping[str, Any], ranks: Sequence[Any]) -> None:
        """Append what this epoch decided, and from what, to :attr:`history` (checkpointed)."""
        self.history.append(
            {
                "epoch": epoch,
                "batch_size": old,
                "next_batch_size": self.batch_size,
                "next_shares": list(self.shares or ()),
                "target_shares": decision["target_shares"],
                "step_models": decision["step_models"],
                "reason": decision["reason"],
                "lr_factor": self.lr_factor,
                "noise_scale": self.noise.value,
                "ranks": list(ranks),
            }
        )

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed fit needs to continue with the decided B, shares and estimates (JSON-able)."""
        return {
            "batch_size": self.batch_size,
            "shares": self.shares,
            "policy_state": self.policy_state.to_dict(),
            "lr_factor": self.lr_factor,
            "oom_count": self.oom_count,
            "step_observations": self.step_observations,
            "previous_shares": self.previous_shares,
            "share_gain": self.share_gain,
            "noise": self.noise.to_dict(),
            "step_costs": [[c.batch_size, c.seconds, c.compute] for c in self.step_costs],
            "initial_batch_size": self.initial_batch_size,
            "history": self.history,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; keys older checkpoints lack start afresh."""
        self.batch_size = state["batch_size"]
        self.shares = state["shares"]
        self.policy_state = PolicyState.from_dict(state["policy_state"])
        self.lr_factor = float(state["lr_factor"])
        self.oom_count = int(state["oom_count"])
        # checkpoints written before the step-time model (they held "speeds") start the fit afresh
        self.step_observations = [[(float(b), float(t)) for b, t in h] for h in state.get("step_observations", [])]
        self.previous_shares = state.get("previous_shares")
        self.share_gain = float(state.get("share_gain", 1.0))
        if "noise" in state:  # checkpoints from before the goodput rule start the estimate afresh
            self.noise = NoiseScale.from_dict(state["noise"])
        self.step_costs = [StepCost(int(b), float(t), float(c)) for b, t, c in state.get("step_costs", [])]
        self.initial_batch_size = state.get("initial_batch_size", self.batch_size)
        self.history = list(state["history"])


class CoreField(Generic[T]):
    """An adapter attribute that is the core's: ``cb.batch_size`` reads and writes ``cb.core.batch_size``.

    The callbacks keep the public names users and checkpoints know, while the one copy of the state is the core's.
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, objtype: type | None = None) -> T:
        return getattr(obj.core, self.name)  # type: ignore[no-any-return]

    def __set__(self, obj: Any, value: T) -> None:
        setattr(obj.core, self.name, value)


class CoreState:
    """The decided state as attributes of a callback holding a ``core``: the names users and tests know, one copy."""

    core: BalancerCore
    batch_size: CoreField[int | None] = CoreField()
    shares: CoreField[list[int] | None] = CoreField()
    policy: CoreField[BatchSizePolicy | None] = CoreField()
    policy_state: CoreField[PolicyState] = CoreField()
    noise: CoreField[NoiseScale] = CoreField()
    step_costs: CoreField[list[StepCost]] = CoreField()
    goodput_unavailable: CoreField[str | None] = CoreField()
    initial_batch_size: CoreField[int | None] = CoreField()
    lr_factor: CoreField[float] = CoreField()
    oom_count: CoreField[int] = CoreField()
    step_observations: CoreField[list[list[tuple[float, float]]]] = CoreField()
    previous_shares: CoreField[list[int] | None] = CoreField()
    share_gain: CoreField[float] = CoreField()
    history: CoreField[list[dict[str, Any]]] = CoreField()
