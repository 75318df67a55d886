"""``ivyplug demo``: the main job — DDP against ivyplug's parameter server while one worker is slowed.

Two CPU worker processes train the digits MLP of ``ivyplug bench ps`` (64-1024-1024-10, batch 256 per worker,
sklearn's bundled digits: nothing is downloaded) in three runs, one after the other
(:data:`ivyplug.integrations.lightning.demo_job.RUNS`): ``ddp`` + AdamW, ``ivy_ps`` sync + ivyplug's LAMB +
``IvyLoadBalancer``, and ``ivy_ps`` async + LAMB. In every run rank 1 is a device ``--slowdown`` times slower at
compute (the documented delay injector, the one ``ivyplug bench ps`` uses). Both workers are started once, with
``LOCAL_RANK`` set as torchrun would, and train all runs: importing Lightning twice per run would cost more
than training on a busy 2-core machine.

Prints a side-by-side table (wall time, samples/s, validation accuracy), and writes ``demo.png`` (validation
accuracy against wall time) and ``demo.json`` to ``--out``. Cheap to import: frameworks load in the workers,
matplotlib only when the plot is drawn.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

NAME = "demo"
HELP = "the main job: DDP vs ivy_ps (+ LAMB, IvyLoadBalancer) on digits with one worker slowed; table, plot, JSON"

JOB_MODULE = "ivyplug.integrations.lightning.demo_job"
#: Run names, in the order they train (keys of ``demo_job.RUNS``; kept here so importing this stays cheap).
RUN_NAMES = ("ddp", "ivy_ps_sync_lb", "ivy_ps_async")
PROGRESS_PREFIX = "@@demo "  # same as demo_job.PROGRESS_PREFIX (a test checks they agree)
WORKERS = 2
#: (epochs, training-set repeats) by default and with --quick.
DEFAULT_EPOCHS, DEFAULT_REPEAT = 10, 4
#: The accuracy whose first crossing the table reports (time to a fixed quality, not to a fixed epoch count).
TARGET_ACC = 0.95
QUICK_EPOCHS, QUICK_REPEAT = 2, 1


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="a tiny run (a smoke test, not a measurement)")
    parser.add_argument("--epochs", type=int, help=f"epochs per run (default {DEFAULT_EPOCHS}, --quick {QUICK_EPOCHS})")
    parser.add_argument("--slowdown", type=float, default=3.0, help="worker 1 is this many times slower (default 3)")
    parser.add_argument("--out", type=Path, default=Path("demo-output"), help="folder for demo.png and demo.json")
    parser.add_argument("--timeout", type=float, help="seconds the whole job may take (default: 300 + 120 per epoch)")


def check_options(epochs: int, slowdown: float, timeout: float) -> None:
    """Raise ``ValueError`` naming the bad option."""
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"--epochs must be an integer >= 1, got {epochs!r}")
    if not (isinstance(slowdown, (int, float)) and 1.0 <= slowdown <= 20.0):
        raise ValueError(f"--slowdown must be a number in [1, 20] (1: no slow worker), got {slowdown!r}")
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"--timeout must be a positive number of seconds, got {timeout!r}")


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _stream_progress(stream: IO[str], tail: collections.deque[str], start: float) -> None:
    """Echo rank 0's progress lines as they come; keep the rest of its log for error messages."""
    for line in stream:
        tail.append(line)
        if line.startswith(PROGRESS_PREFIX):
            print(f"  {time.monotonic() - start:6.1f}s  {line[len(PROGRESS_PREFIX) :].rstrip()}", flush=True)


def _kill(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)


def run_workers(epochs: int, repeat: int, slowdown: float, timeout: float, result_dir: Path) -> float:
    """Start the two workers, echo progress, wait (at most ``timeout`` s); returns their wall time."""
    ports = _free_ports(len(RUN_NAMES))
    cmd = [sys.executable, "-m", JOB_MODULE, "--runs", ",".join(RUN_NAMES), "--ports", ",".join(map(str, ports))]
    cmd += ["--slowdown", str(slowdown), "--epochs", str(epochs), "--repeat", str(repeat), "--out", str(result_dir)]
    base_env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
    base_env.update({"WORLD_SIZE": str(WORKERS), "NODE_RANK": "0"})
    for key in ("TORCHELASTIC_RUN_ID", "SLURM_NTASKS", "SLURM_JOB_NAME"):  # Lightning must see a plain launch
        base_env.pop(key, None)
    start = time.monotonic()
    tail: collections.deque[str] = collections.deque(maxlen=60)
    rank1_log = result_dir / "rank1.log"
    procs: list[subprocess.Popen[str]] = []
    with rank1_log.open("w") as log1:
        try:
            for rank in range(WORKERS):
                procs.append(
                    subprocess.Popen(
                        cmd,
                        env={**base_env, "LOCAL_RANK": str(rank)},
                        stdout=subprocess.PIPE if rank == 0 else log1,
                        stderr=subprocess.STDOUT,
                        text=True,
                        # same process group as this command: Ctrl-C, or a caller's killpg, reaches the workers too
                    )
                )
            assert procs[0].stdout is not None
            reader = threading.Thread(target=_stream_progress, args=(procs[0].stdout, tail, start), daemon=True)
            reader.start()
            while any(p.poll() is None for p in procs):
                failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
                if failed:
                    break
                if time.monotonic() - start > timeout:
                    raise RuntimeError(
                        f"ivyplug demo did not finish within --timeout {timeout:g} s; last output of worker 0:\n"
                        + "".join(tail)[-3000:]
                    )
                time.sleep(0.2)
            for p in procs:
                if p.poll() is None:
                    _kill(p)  # its peer failed: it would wait at the next collective until gloo times out
            reader.join(timeout=10)
            codes = [p.returncode for p in procs]
            if any(c != 0 for c in codes):
                log1.flush()
                rank1_tail = rank1_log.read_text()[-3000:]
                raise RuntimeError(
                    f"a worker failed (exit codes {codes}).\nworker 0:\n{''.join(tail)[-3000:]}\n"
                    f"worker 1:\n{rank1_tail}"
                )
        finally:
            for p in procs:
                _kill(p)
    return time.monotonic() - start


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Derived numbers: samples/s, wall time relative to DDP's, when each run first reached :data:`TARGET_ACC`."""
    for r in runs:
        r["samples_per_s"] = r["epochs"] * r["train_samples"] / r["fit_seconds"]
    ddp_seconds = next(r["fit_seconds"] for r in runs if r["run"] == "ddp")
    summary: dict[str, Any] = {"target_acc": TARGET_ACC, "wall_vs_ddp": {}, "time_to_target_acc": {}}
    for r in runs:
        summary["wall_vs_ddp"][r["run"]] = r["fit_seconds"] / ddp_seconds
        reached = [t for t, acc in r["curve"] if acc >= TARGET_ACC]
        summary["time_to_target_acc"][r["run"]] = reached[0] if reached else None
    return summary


def format_table(results: dict[str, Any]) -> str:
    """The side-by-side table and what each run did about the slow worker."""
    runs = results["runs"]
    summary = results["summary"]
    width = max(len(r["label"]) for r in runs)
    quick = ", QUICK: a smoke run, not a measurement" if results["quick"] else ""
    lines = [
        f"ivyplug demo: digits MLP 64-1024-1024-10, 2 CPU workers, worker 1 {results['slowdown']:g}x slower, "
        f"{results['epochs']} epochs of {runs[0]['train_samples']} samples{quick}",
        f"{'run':<{width}}  {'wall s':>7}  {'samples/s':>9}  {'val acc':>7}  {'wall vs ddp':>11}  "
        f"{f'to {TARGET_ACC:.0%} acc':>10}  {'samples w0/w1':>13}",
    ]
    for r in runs:
        reached = summary["time_to_target_acc"][r["run"]]
        split = "/".join(str(n) for n in r["samples_per_worker"])
        lines.append(
            f"{r['label']:<{width}}  {r['fit_seconds']:>7.1f}  {r['samples_per_s']:>9.0f}  {r['val_acc']:>7.4f}  "
            f"{summary['wall_vs_ddp'][r['run']]:>10.2f}x  {(f'{reached:.1f} s' if reached is not None else '-'):>10}  "
            f"{split:>13}"
        )
    lines.append(
        "wall s: rank 0's time from on_fit_start to on_fit_end (validation after every epoch included); val acc: "
        f"after the last epoch; to {TARGET_ACC:.0%} acc: wall time of the first validation at or above it; "
        "samples w0/w1: training samples each worker computed"
    )
    for r in runs:
        detail = r["note"]
        if r.get("shares"):
            detail += f"; shares of the 512-sample global batch per epoch: {r['shares']}"
        if r.get("step_models") and r["step_models"][-1]:
            fits = ", ".join(
                f"w{i} {1e3 * a:.1f} ms + {1e6 * c:.0f} us/sample" for i, (a, c) in enumerate(r["step_models"][-1])
            )
            detail += f"; last fitted step compute time t(b) = a + c*b: {fits}"
        lines.append(f"- {r['label']}: {detail}")
    load = results["loadavg_before"][0], results["loadavg_after"][0]
    lines.append(
        f"load average (1 min) {load[0]:.2f} before, {load[1]:.2f} after, on {results['cpu_count']} CPUs; "
        f"job wall time {results['job_seconds']:.0f} s including worker start-up"
    )
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    """Validation accuracy against wall time, one line per run (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    try:
        for r in results["runs"]:
            times = [t for t, _ in r["curve"]]
            accs = [a for _, a in r["curve"]]
            ax.plot(times, accs, marker="o", markersize=4, label=f"{r['label']} ({r['fit_seconds']:.0f} s)")
        ax.set_xlabel("wall time since fit start (s)")
        ax.set_ylabel("validation accuracy")
        ax.set_xlim(left=0)
        load = results["loadavg_before"][0]
        ax.set_title(
            f"digits, 2 CPU workers, worker 1 {results['slowdown']:g}x slower "
            f"(load average {load:.1f} on {results['cpu_count']} CPUs)",
            fontsize=10,
        )
        ax.grid(True, alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)


def demo(epochs: int, repeat: int, slowdown: float, out: Path, timeout: float, quick: bool) -> dict[str, Any]:
    """Train the runs, write ``demo.json`` and ``demo.png`` to ``out``; return the results."""
    out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="ivyplug-demo-") as tmp:
        job_seconds = run_workers(epochs, repeat, slowdown, timeout, Path(tmp))
        runs = []
        for name in RUN_NAMES:
            path = Path(tmp, f"{name}.json")
            if not path.exists():
                raise RuntimeError(f"worker 0 wrote no results for run {name!r}")
            result = json.loads(path.read_text())
            workers = [json.loads(Path(tmp, f"{name}.rank{r}.json").read_text()) for r in range(WORKERS)]
            result["samples_per_worker"] = [w["samples"] for w in workers]
            result["injected_sleep_s_per_worker"] = [w["injected_sleep_s"] for w in workers]
            runs.append(result)
    results: dict[str, Any] = {
        "quick": quick,
        "epochs": epochs,
        "repeat": repeat,
        "slowdown": slowdown,
        "runs": runs,
        "summary": summarise(runs),
        "job_seconds": job_seconds,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "cpu_count": os.cpu_count(),
        "command": "ivyplug demo" + (" --quick" if quick else "") + f" --epochs {epochs} --slowdown {slowdown:g}",
    }
    (out / "demo.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, out / "demo.png")
    return results


def run(args: argparse.Namespace) -> int:
    epochs = args.epochs if args.epochs is not None else (QUICK_EPOCHS if args.quick else DEFAULT_EPOCHS)
    repeat = QUICK_REPEAT if args.quick else DEFAULT_REPEAT
    timeout = args.timeout if args.timeout is not None else 300.0 + 120.0 * epochs
    try:
        check_options(epochs, args.slowdown, timeout)
    except ValueError as exc:
        print(f"ivyplug demo: error: {exc}", file=sys.stderr)
        return 2
    print(
        f"ivyplug demo: {len(RUN_NAMES)} runs ({', '.join(RUN_NAMES)}), {epochs} epochs each, 2 CPU workers, "
        f"worker 1 {args.slowdown:g}x slower at compute{' (--quick)' if args.quick else ''}",
        flush=True,
    )
    print("  starting the workers (importing Lightning can take a while on a busy machine)...", flush=True)
    try:
        results = demo(epochs, repeat, args.slowdown, args.out, timeout, args.quick)
    except RuntimeError as exc:  # a worker failed or the job ran past --timeout: the message has the logs
        print(f"ivyplug demo: error: {exc}", file=sys.stderr)
        return 1
    print()
    print(format_table(results))
    print(f"wrote {args.out / 'demo.png'} and {args.out / 'demo.json'}")
    return 0
