"""``ivyplug bench keras_overhead``: the Keras ``IvyLoadBalancer``'s hook time over step time (target <= 1 %).

The measure: the callback's summed hook time divided by the steps' wall time, on a compute-bound
model (digits MLP 64-1024-1024-10, global batch 256), on one device and under ``MirroredStrategy`` over 2
logical CPUs; medians over several epochs and rounds. The work runs in one child process
(:mod:`ivyplug.benchmarks.keras_overhead_job`, where the definitions of every column are); the machine is
shared, so ``os.getloadavg()`` is recorded before and after and printed with every number.
"""

from __future__ import annotations

from typing import Any

from ivyplug.benchmarks.job_runner import run_job

DESCRIPTION = "Keras IvyLoadBalancer callback overhead: hook time / step time (1 device, MirroredStrategy)"
TARGET = 0.01


def run(quick: bool = False) -> dict[str, Any]:
    epochs, rounds = (3, 1) if quick else (8, 3)
    args = ["--epochs", str(epochs), "--rounds", str(rounds)]
    result = run_job("ivyplug.benchmarks.keras_overhead_job", args, timeout=900.0)
    result["quick"] = quick
    result["target"] = TARGET
    result["within_target"] = all(m["hooks_over_steps_median"] <= TARGET for m in result["modes"].values())
    return result


def format_table(results: dict[str, Any]) -> str:
    header = (
        f"{'mode':<9} {'epochs':>6} {'step ms':>8} {'self-rep %':>10} {'hooks/steps %':>13} {'max %':>7} "
        f"{'epoch with/without':>18}"
    )
    lines = [DESCRIPTION, header]
    for mode, m in results["modes"].items():
        lines.append(
            f"{mode:<9} {m['measured_epochs']:>6} {m['step_ms_median']:>8.1f} {100 * m['self_reported_median']:>10.3f} "
            f"{100 * m['hooks_over_steps_median']:>13.3f} {100 * m['hooks_over_steps_max']:>7.3f} "
            f"{m['epoch_ratio']:>18.3f}"
        )
    before = results.get("loadavg_before")
    after = results.get("loadavg_after")
    lines.append(f"load average before {before}, after {after} (shared machine)")
    verdict = "within" if results.get("within_target") else "ABOVE"
    lines.append(f"median hook/step time {verdict} the {100 * results.get('target', TARGET):.0f} % target")
    return "\n".join(lines)
