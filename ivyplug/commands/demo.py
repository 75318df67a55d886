"""``ivyplug demo``: the main job — DDP against ivyplug's parameter server while one worker is slowed.

Two CPU worker processes train the digits MLP of ``ivyplug bench ps`` (64-1024-1024-10, here at batch 128 per worker,
sklearn's bundled digits: nothing is downloaded) in three runs, one after the other
(:data:`ivyplug.benchmarks.demo_job.RUNS`): ``ddp``, ``ivy_ps`` sync + ``IvyLoadBalancer``, and
``ivy_ps`` async. Like is compared with like: every run trains the same model from the same weights with the same
optimizer and learning-rate schedule (AdamW, lr 2e-3, cosine-annealed over the epochs). In every run rank 1
is a device ``--slowdown`` times slower at compute (the documented delay injector, the one ``ivyplug bench ps``
uses). Both workers are started once, with ``LOCAL_RANK`` set as torchrun would, and train all runs: importing
Lightning twice per run would cost more than training on a busy 2-core machine.

The headline is the wall time each run needs to reach DDP's final validation accuracy, next to its own final
accuracy, its wall time and the samples each worker computed. A progress bar (rich, in a terminal; plain lines
otherwise) shows the epochs as they finish; the table is printed, and ``demo.png`` (validation accuracy against
wall time) and ``demo.json`` are written to ``--out``. Cheap to import: frameworks load in the workers,
matplotlib and rich only when used.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

NAME = "demo"
HELP = "the main job: DDP vs ivy_ps (sync + IvyLoadBalancer, async) on digits with one worker slowed; table, plot"

JOB_MODULE = "ivyplug.benchmarks.demo_job"
#: Run names, in the order they train (keys of ``demo_job.RUNS``; kept here so importing this stays cheap).
RUN_NAMES = ("ddp", "ivy_ps_sync_lb", "ivy_ps_async")
RUN_LABELS = ("ddp", "ivy_ps sync + IvyLoadBalancer", "ivy_ps async")  # demo_job.RUNS' labels (a test checks)
OPTIMIZER_NAMES = {"lamb": "LAMB", "adamw": "AdamW"}
PROGRESS_PREFIX = "@@demo "  # same as demo_job.PROGRESS_PREFIX (a test checks they agree)
WORKERS = 2
#: (epochs, training-set repeats) by default and with --quick.
DEFAULT_EPOCHS, DEFAULT_REPEAT = 6, 3
QUICK_EPOCHS, QUICK_REPEAT = 2, 1
#: rank 0's progress line after each validated epoch: ``[label] epoch e/E  t=...s  val_acc=...``
PROGRESS_EPOCH = re.compile(r"\[(?P<label>[^\]]+)\] epoch (?P<epoch>\d+)/(?P<epochs>\d+)")


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


def _stream_progress(
    stream: IO[str], tail: collections.deque[str], start: float, show: Callable[[str, float], None]
) -> None:
    """Hand rank 0's progress lines to ``show`` as they come; keep the rest of its log for error messages."""
    for line in stream:
        tail.append(line)
        if line.startswith(PROGRESS_PREFIX):
            show(line[len(PROGRESS_PREFIX) :].rstrip(), time.monotonic() - start)


def print_progress(text: str, elapsed: float) -> None:
    """Plain progress: one line per event (no terminal, or no rich)."""
    print(f"  {elapsed:6.1f}s  {text}", flush=True)


class BarProgress:
    """A rich progress bar per run, advanced by the epoch lines; ``show`` has :func:`print_progress`'s signature."""

    def __init__(self, epochs: int, console: Any = None) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(
            TextColumn("{task.description:<32}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[acc]}"),
            TimeElapsedColumn(),
            console=console,
        )
        self.tasks = {name: self.progress.add_task(name, total=epochs, acc="", start=False) for name in RUN_LABELS}

    def __enter__(self) -> BarProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def show(self, text: str, elapsed: float) -> None:
        label = text[1 : text.index("]")] if text.startswith("[") and "]" in text else None
        task = self.tasks.get(label) if label is not None else None
        if task is None:
            self.progress.console.print(f"  {elapsed:6.1f}s  {text}")
            return
        self.progress.start_task(task)
        match = PROGRESS_EPOCH.match(text)
        if match is not None:
            acc = text.rsplit("val_acc=", 1)[-1] if "val_acc=" in text else ""
            self.progress.update(task, completed=int(match["epoch"]), acc=f"val acc {acc}")


def _use_bar() -> bool:
    import importlib.util

    return sys.stdout.isatty() and importlib.util.find_spec("rich") is not None


def _kill(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)


def run_workers(
    epochs: int,
    repeat: int,
    slowdown: float,
    timeout: float,
    result_dir: Path,
    show: Callable[[str, float], None] = print_progress,
) -> float:
    """Start the two workers, hand progress to ``show``, wait (at most ``timeout`` s); returns their wall time."""
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
            reader = threading.Thread(target=_stream_progress, args=(procs[0].stdout, tail, start, show), daemon=True)
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
    """Derived numbers: DDP's final accuracy as the target, each run's time to it, samples/s, wall vs DDP's."""
    for r in runs:
        r["samples_per_s"] = r["epochs"] * r["train_samples"] / r["fit_seconds"]
    ddp = next(r for r in runs if r["run"] == "ddp")
    target = ddp["val_acc"]
    summary: dict[str, Any] = {"target_acc": target, "wall_vs_ddp": {}, "time_to_target_acc": {}, "acc_vs_ddp": {}}
    for r in runs:
        summary["wall_vs_ddp"][r["run"]] = r["fit_seconds"] / ddp["fit_seconds"]
        reached = [t for t, acc in r["curve"] if target is not None and acc >= target]
        summary["time_to_target_acc"][r["run"]] = reached[0] if reached else None
        final = r["val_acc"]
        summary["acc_vs_ddp"][r["run"]] = None if final is None or target is None else 100.0 * (final - target)
    return summary


def format_table(results: dict[str, Any]) -> str:
    """The side-by-side table, headed by the time to DDP's final accuracy, and what each run did."""
    runs = results["runs"]
    summary = results["summary"]
    width = max(len(r["label"]) for r in runs)
    quick = ", QUICK: a smoke run, not a measurement" if results["quick"] else ""
    target = summary["target_acc"]
    first = runs[0]
    lines = [
        f"ivyplug demo: digits MLP 64-{first['hidden']}-{first['hidden']}-10, 2 CPU workers, "
        f"worker 1 {results['slowdown']:g}x slower, "
        f"{results['epochs']} epochs of {first['train_samples']} samples, "
        f"{OPTIMIZER_NAMES.get(first['optimizer'], first['optimizer'])} lr {first['lr']:g} "
        f"({first['schedule']}) in every run{quick}",
        f"{'run':<{width}}  {f'to {target:.4f}':>9}  {'val acc':>7}  {'vs ddp':>7}  {'wall s':>7}  "
        f"{'samples/s':>9}  {'samples w0/w1':>13}",
    ]
    for r in runs:
        reached = summary["time_to_target_acc"][r["run"]]
        delta = summary["acc_vs_ddp"][r["run"]]
        split = "/".join(str(n) for n in r["samples_per_worker"])
        lines.append(
            f"{r['label']:<{width}}  {(f'{reached:.1f} s' if reached is not None else 'never'):>9}  "
            f"{r['val_acc']:>7.4f}  {(f'{delta:+.2f}' if delta is not None else '-'):>7}  {r['fit_seconds']:>7.1f}  "
            f"{r['samples_per_s']:>9.0f}  {split:>13}"
        )
    lines.append(
        f"to {target:.4f}: wall time of the first validation at or above DDP's final accuracy ({target:.4f}); "
        "val acc: after the last epoch; vs ddp: points; wall s: rank 0's time from on_fit_start to on_fit_end "
        "(validation after every epoch included); samples w0/w1: training samples each worker computed"
    )
    for r in runs:
        detail = r["note"]
        if r.get("shares"):
            detail += f"; shares of the {sum(r['shares'][0])}-sample global batch per epoch: {r['shares']}"
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
    """Validation accuracy against wall time, one line per run, DDP's final accuracy dashed (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    try:
        for r in results["runs"]:
            times = [t for t, _ in r["curve"]]
            accs = [a for _, a in r["curve"]]
            ax.plot(times, accs, marker="o", markersize=4, label=f"{r['label']} ({r['fit_seconds']:.1f} s)")
        target = results["summary"]["target_acc"]
        if target is not None:
            ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"DDP's final accuracy {target:.4f}")
        ax.set_xlabel("wall time since fit start (s)")
        ax.set_ylabel("validation accuracy")
        ax.set_xlim(left=0)
        load = results["loadavg_before"][0]
        ax.set_title(
            f"digits, 2 CPU workers, worker 1 {results['slowdown']:g}x slower, "
            "the same optimizer and schedule in every run\n"
            f"(load average {load:.1f} on {results['cpu_count']} CPUs)",
            fontsize=9,
        )
        ax.grid(True, alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)


def demo(
    epochs: int,
    repeat: int,
    slowdown: float,
    out: Path,
    timeout: float,
    quick: bool,
    show: Callable[[str, float], None] = print_progress,
) -> dict[str, Any]:
    """Train the runs, write ``demo.json`` and ``demo.png`` to ``out``; return the results."""
    out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="ivyplug-demo-") as tmp:
        job_seconds = run_workers(epochs, repeat, slowdown, timeout, Path(tmp), show)
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
    from ivyplug.commands.output_paths import unwritable_folder

    why = unwritable_folder("--out", args.out)
    if why is not None:
        print(f"ivyplug demo: error: {why}", file=sys.stderr)
        return 2
    print(
        f"ivyplug demo: {len(RUN_NAMES)} runs ({', '.join(RUN_NAMES)}), {epochs} epochs each, 2 CPU workers, "
        f"worker 1 {args.slowdown:g}x slower at compute{' (--quick)' if args.quick else ''}",
        flush=True,
    )
    print("  starting the workers (importing Lightning can take a while on a busy machine)...", flush=True)
    try:
        if _use_bar():
            with BarProgress(epochs) as bar:
                results = demo(epochs, repeat, args.slowdown, args.out, timeout, args.quick, bar.show)
        else:
            results = demo(epochs, repeat, args.slowdown, args.out, timeout, args.quick)
    except RuntimeError as exc:  # a worker failed or the job ran past --timeout: the message has the logs
        print(f"ivyplug demo: error: {exc}", file=sys.stderr)
        return 1
    print()
    print(format_table(results))
    out = args.out.resolve()
    print(f"wrote the accuracy-against-time plot to {out / 'demo.png'} and the numbers to {out / 'demo.json'}")
    return 0
