"""The balancer core both IvyLoadBalancer twins drive: options and their checks, batch-size bounds, one epoch's
decision from every rank's record, the noise and step-cost estimates, metric names, and the state a checkpoint
keeps. Every expectation is worked out by hand in the comments; nothing here needs a framework."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from typing import Any

import pytest

from ivyplug.load.balancer import BalancerCore, CoreField, mean_noise, policy_bounds, round_batch
from ivyplug.load.balancer_config import BalancerConfig, ShareOptions
from ivyplug.load.balancer_metrics import decision_metrics, load_metrics, rank_metrics, reading_metrics
from ivyplug.load.observation import LoadObservation

IDLE = {"utilization": 20.0, "memory_fraction": 0.3, "oom_count": 0}


def record(rank: int = 0, share: float = 16, step: float = 0.1, wall: float = 0.2, **load: Any) -> dict[str, Any]:
    """One rank's epoch record as the Lightning twin gathers it (no noise estimate unless given)."""
    base = {"noise_grad_sq": 0.0, "noise_trace": 0.0, "noise_steps": 0, **IDLE, **load}
    return {"rank": rank, "step_share": share, "step_time": step, "wall_step": wall, **base}


def started(batch: int = 16, workers: int = 1, **options: Any) -> BalancerCore:
    core = BalancerCore(BalancerConfig(**{"goodput": False, "cooldown": 0, **options}))
    core.start(batch, workers)
    core.build_policy(workers)
    return core


# ---------------------------------------------------------------------------------------------- options
@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"interval": 0}, "interval must be a positive number of seconds"),
        ({"interval": math.inf}, "interval must be a positive number of seconds"),
        ({"min_batch_size": 0}, "min_batch_size must be None or an int >= 1"),
        ({"max_batch_size": True}, "max_batch_size must be None or an int >= 1"),
        ({"min_batch_size": 8, "max_batch_size": 4}, r"max_batch_size \(4\) must be >= min_batch_size \(8\)"),
        ({"memory_low": 0.95}, "memory_low"),
        ({"grow_factor": 1.0}, "grow_factor"),
        ({"noise_smoothing": 1.0}, r"noise_smoothing .* must be in \[0, 1\)"),
        ({"lr_scaling": "cubic"}, "lr_scaling must be one of"),
        ({"oom_max_parts": 0}, "oom_max_parts must be an int >= 1"),
        ({"log_every_n_steps": 0}, "log_every_n_steps must be None or an int >= 1"),
        ({"probes": "nvml"}, "probes must be a list"),
        ({"probes": [1]}, "probes must hold names, dicts or Probe objects"),
        ({"probes": ["psutil", "nvmll"]}, r"probes: unknown probe 'nvmll'; available probe names: .*psutil"),
        ({"probes": [{"name": "bogus", "x": 1}]}, "probes: unknown probe 'bogus'"),
        ({"probes": [{"trace": []}]}, "probes: a dict names its probe under 'name'"),
        (
            {"probes": [{"name": "psutil", "bogus": 1}]},
            r"the 'psutil' probe does not take \{'bogus': 1\}.*per_cpu",
        ),
        ({"probes": [{"name": "scripted", "trac": [1]}]}, r"probes: the 'scripted' probe does not take .*'trace'"),
        ({"probes": ["scripted"]}, "probes: unknown probe 'scripted'"),  # a scripted probe needs its trace: a dict
        ({"policy": {"cooldown": 2}}, "policy must be an ivyplug.load.BatchSizePolicy"),
        ({"adapt_batch_size": "yes"}, "adapt_batch_size must be True or False"),
    ],
)
def test_a_bad_option_is_refused_at_construction_naming_it(options: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        BalancerConfig(**options)


@pytest.mark.parametrize(
    ("options", "match"),
    [({"share_window": 1}, "share_window"), ({"comm_hook": "x"}, "comm_hook"), ({"loss_reduction": "max"}, "loss")],
)
def test_a_bad_share_option_is_refused_naming_it(options: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ShareOptions(**options)


def test_registered_and_scripted_probe_names_are_accepted_whether_or_not_they_run_here() -> None:
    specs = ["nvml", "torch_allocator", {"name": "psutil", "per_cpu": False}, {"name": "scripted", "trace": []}]
    assert BalancerConfig(probes=specs).probes == specs


def test_the_config_is_frozen_and_holds_seconds_as_a_float() -> None:
    config = BalancerConfig(interval=2)
    assert config.interval == 2.0 and isinstance(config.interval, float)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.interval = 3.0  # type: ignore[misc]
    assert BalancerConfig(goodput=False).goodput_on is False
    assert set(BalancerConfig().policy_rules()) <= set(BalancerConfig.option_names())


# ---------------------------------------------------------------------------------------------- bounds
def test_bounds_default_to_one_sample_per_worker_and_eight_times_the_initial_batch() -> None:
    assert policy_bounds(BalancerConfig(), 32, 2) == (2, 256)
    assert policy_bounds(BalancerConfig(), 16, 1) == (1, 128)  # one worker
    # a minimum below one sample per worker is raised to it (every rank needs a sample)
    assert policy_bounds(BalancerConfig(min_batch_size=3), 16, 4) == (4, 128)
    # replicas of 4 and a data set of 50: multiples of 4, at most 48
    assert policy_bounds(BalancerConfig(), 32, 4, multiple=4, most=50) == (4, 48)
    # a minimum goes up to a multiple, never below what the user asked for (5 went down to 4); a maximum down
    assert policy_bounds(BalancerConfig(min_batch_size=5, max_batch_size=100), 32, 4, multiple=4) == (8, 100)
    assert policy_bounds(BalancerConfig(min_batch_size=7, max_batch_size=33), 16, 1, multiple=2) == (8, 32)


def test_round_batch_keeps_a_multiple_within_the_data() -> None:
    assert [round_batch(b, 4) for b in (3, 4, 7, 9)] == [4, 4, 4, 8]
    assert round_batch(100, 8, most=50) == 48
    assert round_batch(5) == 5


def test_a_given_policy_is_used_as_is() -> None:
    from ivyplug.load import BatchSizePolicy

    given = BatchSizePolicy(8, 64)
    core = BalancerCore(BalancerConfig(policy=given, max_batch_size=1000))
    core.start(32)
    assert core.build_policy(4) is given


# ---------------------------------------------------------------------------------------------- estimates
def test_norms_at_two_batch_sizes_give_the_noise_scale() -> None:
    core = started()
    # |G|² = (8·2 − 2·5)/(8 − 2) = 1, tr(Σ) = (5 − 2)/(1/2 − 1/8) = 8, so B_noise = 8 (the EMA bias cancels)
    assert core.add_norms(5.0, 2, 2.0, 8)
    assert core.noise.value == pytest.approx(8.0)


def test_a_nan_norm_or_equal_batches_add_nothing() -> None:
    core = started()
    assert not core.add_norms(math.nan, 2, 2.0, 8)
    assert core.noise.skipped == 1 and core.noise.updates == 0 and core.noise.value is None
    assert not core.add_norms(5.0, 8, 2.0, 8)  # B not above b: no information, not even a skip
    assert not core.add_norms(5.0, 0, 2.0, 8)
    assert core.noise.skipped == 1


def test_step_costs_skip_zero_and_nan_and_keep_the_last_eight() -> None:
    core = started()
    for wall, compute in ((0.0, 0.1), (0.2, 0.0), (math.nan, 0.1), (math.inf, 0.1), (0.2, -1.0)):
        core.add_step_cost(16, wall, compute)
    assert core.step_costs == []
    for i in range(10):
        core.add_step_cost(16 + i, 0.2, 0.1)
    assert [c.batch_size for c in core.step_costs] == list(range(18, 26))


def test_mean_noise_weights_each_rank_by_its_steps() -> None:
    ranks = [
        {"noise_grad_sq": 1.0, "noise_trace": 10.0, "noise_steps": 1},
        {"noise_grad_sq": 2.0, "noise_trace": 20.0, "noise_steps": 3},
    ]
    assert mean_noise(ranks) == pytest.approx((1.75, 17.5))  # (1 + 3·2)/4, (10 + 3·20)/4
    assert mean_noise([{"noise_grad_sq": 5.0, "noise_trace": 5.0, "noise_steps": 0}]) is None


# ---------------------------------------------------------------------------------------------- one epoch
def test_one_worker_idle_grows_and_the_decision_is_pure_until_applied() -> None:
    core = started(16)
    decision = core.decide_epoch([record()], adapt=True)
    assert decision["batch_size"] == 32 and decision["shares"] == [32]
    assert decision["reason"].startswith("grow")
    assert decision["step_costs"] == [[16, 0.2, 0.1]]
    assert core.batch_size == 16 and core.step_costs == []  # nothing applied yet
    assert core.apply_epoch(json.loads(json.dumps(decision))) == 16  # survives a JSON broadcast
    assert (core.batch_size, core.shares, core.policy_state.since_change) == (32, [32], 0)


def test_an_oom_shrinks_and_caps_growth() -> None:
    core = started(16)
    decision = core.decide_epoch([record(oom_count=1)], adapt=True)
    assert decision["batch_size"] == 8 and decision["reason"].startswith("shrink: out of memory")
    core.apply_epoch(decision)
    assert core.policy_state.ceiling == 8


def test_fixed_and_held_keep_the_batch_and_shares() -> None:
    core = started(32, 2)
    fixed = core.decide_epoch([record(0), record(1)], adapt=False, share_options=ShareOptions(balance_shares=False))
    assert (fixed["batch_size"], fixed["shares"], fixed["reason"]) == (32, [16, 16], "fixed")
    held = core.decide_epoch([record(0, step=0.1), record(1, step=0.3)], adapt=True, held="monitoring only")
    assert (held["batch_size"], held["shares"], held["reason"]) == (32, [16, 16], "fixed")


def test_two_ranks_split_by_their_step_times() -> None:
    # one observation each: t_i(b) = c_i·b with c_0 = 0.1/16, c_1 = 0.3/16; equal times at b_0 = 32·0.3/0.4 = 24
    core = started(32, 2)
    decision = core.decide_epoch([record(0, step=0.1), record(1, step=0.3)], adapt=False)
    assert decision["shares"] == [24, 8] and decision["target_shares"] == [24, 8]
    assert decision["previous_shares"] == [16, 16]
    assert decision["step_observations"] == [[(16.0, 0.1)], [(16.0, 0.3)]]


def test_unmeasured_ranks_keep_their_shares_and_a_nan_rank_costs_nothing() -> None:
    core = started(32, 2)
    zero = core.decide_epoch([record(0, step=0.0, wall=0.0), record(1, step=0.0, wall=0.0)], adapt=False)
    assert zero["shares"] == [16, 16] and zero["step_costs"] == [] and zero["step_models"] is None
    nan = core.decide_epoch([record(0, step=math.nan, wall=math.nan), record(1, step=0.3, wall=0.4)], adapt=False)
    assert nan["shares"] == [16, 16]  # not every rank measured: no fit
    assert nan["step_costs"] == [[32, 0.4, 0.3]]  # the slowest rank that measured


def test_a_new_batch_keeps_the_share_proportions_when_shares_are_not_balanced() -> None:
    core = started(32, 2)
    core.shares = [24, 8]
    decision = core.decide_epoch([record(0), record(1)], adapt=True, share_options=ShareOptions(balance_shares=False))
    assert decision["batch_size"] == 64 and decision["shares"] == [48, 16]


def test_growth_without_a_noise_estimate_holds_and_says_why() -> None:
    core = started(16, goodput=True)
    core.goodput_unavailable = "one process sees its gradient at one batch size only"
    decision = core.decide_epoch([record()], adapt=True)
    assert decision["batch_size"] == 16 and "goodput unknown (one process" in decision["reason"]
    direct = core.decide_batch(16, LoadObservation(20.0, 0.3))
    assert not direct.changed and "goodput unknown (one process" in direct.reason


def test_records_must_be_complete() -> None:
    core = started(16)
    with pytest.raises(ValueError, match="one epoch record per rank"):
        core.decide_epoch([], adapt=True)
    with pytest.raises(ValueError, match=r"lacks \['wall_step'\]"):
        core.decide_epoch([{k: v for k, v in record().items() if k != "wall_step"}], adapt=True)


def test_the_noise_of_the_epoch_is_folded_in_on_rank_zero() -> None:
    core = started(16)
    decision = core.decide_epoch([record(noise_grad_sq=1.0, noise_trace=8.0, noise_steps=2)], adapt=False)
    core.apply_epoch(decision)
    assert core.noise.value == pytest.approx(8.0) and core.noise.updates == 1


# ---------------------------------------------------------------------------------------------- state
def test_state_dict_round_trips_through_json_and_old_checkpoints_start_afresh() -> None:
    core = started(16)
    core.apply_epoch(core.decide_epoch([record(noise_grad_sq=1.0, noise_trace=8.0, noise_steps=1)], adapt=True))
    core.note_epoch(0, 16, {"target_shares": None, "step_models": None, "reason": "grow"}, [record()])
    state = json.loads(json.dumps(core.state_dict()))
    restored = BalancerCore(BalancerConfig())
    restored.load_state_dict(state)
    assert json.loads(json.dumps(restored.state_dict())) == state
    assert restored.history[0]["next_batch_size"] == 32
    old = {"batch_size": 64, "shares": [64], "policy_state": {"since_change": 2}, "lr_factor": 2.0, "oom_count": 1}
    fresh = BalancerCore(BalancerConfig())
    fresh.load_state_dict({**old, "history": []})
    assert (fresh.initial_batch_size, fresh.noise.updates, fresh.step_costs, fresh.share_gain) == (64, 0, [], 1.0)


def test_core_fields_read_and_write_the_core() -> None:
    class Holder:
        batch_size: CoreField[int | None] = CoreField()

        def __init__(self) -> None:
            self.core = BalancerCore(BalancerConfig())

    holder = Holder()
    holder.batch_size = 48
    assert holder.core.batch_size == 48 and holder.batch_size == 48


# ---------------------------------------------------------------------------------------------- metrics
def test_metric_names_are_the_twins_shared_ones() -> None:
    assert decision_metrics(None, 1.5) == {"ivy/lr_factor": 1.5}
    assert decision_metrics(32, 1.0, 8.0) == {"ivy/batch_size": 32.0, "ivy/lr_factor": 1.0, "ivy/noise_scale": 8.0}
    assert load_metrics(LoadObservation(None, 0.5)) == {"ivy/memory_fraction": 0.5}
    assert reading_metrics({"cpu_util": 1.0, "cpu3_util": 2.0}, per_core=False) == {"ivy/cpu_util": 1.0}
    ranks = [{"rank": 1, "utilization": None, "memory_fraction": 0.25, "oom_count": 0, "other": 3.0}]
    assert rank_metrics(ranks) == {"ivy/rank1/memory_fraction": 0.25, "ivy/rank1/oom_count": 0.0}


def test_the_core_imports_no_framework() -> None:
    blocked = ("torch", "lightning", "keras", "tensorflow", "jax")
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] in {blocked!r}:\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import ivyplug.load.balancer, ivyplug.load.balancer_config, ivyplug.load.balancer_metrics\n"
        f"assert not any(m.split('.')[0] in {blocked!r} for m in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
