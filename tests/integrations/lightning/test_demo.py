"""``ivyplug demo``: the quick run end to end as a user starts it, plus its cheap parts."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from ivyplug.commands import demo

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run_cli(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "ivyplug", *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # the workers join its session: one killpg ends them all
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, None)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    out_dir = tmp_path_factory.mktemp("demo") / "out"
    # a hard bound for a hung job, not a timing assertion (the quick run takes ~1 min on a loaded 2-core machine)
    result = _run_cli(["demo", "--quick", "--out", str(out_dir)], cwd=out_dir.parent, timeout=240)
    return result, out_dir


@pytest.mark.timeout(280)
def test_quick_demo_prints_table_for_every_run(quick_run: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    result, out_dir = quick_run
    assert result.returncode == 0, result.stdout[-4000:]
    lines = result.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("run ") and "wall s" in line)
    for column in ("to 0.", "val acc", "vs ddp", "wall s", "samples/s", "samples w0/w1"):
        assert column in lines[header]
    assert "AdamW lr 0.002 (cosine over 2 epochs) in every run" in result.stdout  # like with like
    rows = lines[header + 1 : header + 1 + len(demo.RUN_NAMES)]
    for row, label in zip(rows, demo.RUN_LABELS, strict=True):
        assert row.startswith(label), row
        cells = row[len(label) :].split()
        reached = None if cells[0] == "never" else float(cells[0])
        cells = cells[1:] if reached is None else cells[2:]  # "1.2 s" or "never"
        acc, delta, wall, samples_per_s = float(cells[0]), cells[1], float(cells[2]), float(cells[3])
        assert 0.0 <= acc <= 1.0 and wall > 0 and samples_per_s > 0
        if label == "ddp":  # the target is DDP's own final accuracy: it reaches it, at its last epoch or earlier
            assert reached is not None and reached <= wall and delta == "+0.00"
    # progress while it ran: one line per epoch and run
    assert sum("epoch " in line and "val_acc=" in line for line in lines) == 2 * len(demo.RUN_NAMES)
    assert sum("workers connected" in line for line in lines) == len(demo.RUN_NAMES)
    assert "no IvyLoadBalancer: under async" in result.stdout
    assert "last fitted step compute time t(b) = a + c*b: w0 " in result.stdout
    assert "wrote the accuracy-against-time plot to " in result.stdout and str(out_dir.resolve()) in result.stdout


@pytest.mark.timeout(280)
def test_quick_demo_writes_png_and_json(quick_run: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    result, out_dir = quick_run
    assert result.returncode == 0, result.stdout[-4000:]
    png = (out_dir / "demo.png").read_bytes()
    assert png[:8] == PNG_MAGIC and png[12:16] == b"IHDR"
    width, height = struct.unpack(">II", png[16:24])
    assert width > 0 and height > 0 and len(png) > 1000

    data = json.loads((out_dir / "demo.json").read_text())
    assert data["quick"] is True and data["slowdown"] == 3.0 and len(data["loadavg_before"]) == 3
    runs = {r["run"]: r for r in data["runs"]}
    assert list(runs) == list(demo.RUN_NAMES)
    for r in runs.values():
        assert r["val_acc"] > 0.5, r  # chance is 0.1; two quick epochs reach ~0.8
        times = [t for t, _ in r["curve"]]
        assert len(times) == data["epochs"] and times == sorted(times) and times[-1] <= r["fit_seconds"]
        assert r["samples_per_s"] == pytest.approx(r["epochs"] * r["train_samples"] / r["fit_seconds"])
    sync = runs["ivy_ps_sync_lb"]
    assert sync["balancer"] and all(sum(s) == 2 * sync["batch_per_worker"] == 256 for s in sync["shares"])
    assert {(r["optimizer"], r["lr"], r["schedule"], r["batch_per_worker"]) for r in runs.values()} == {
        ("adamw", 0.002, "cosine over 2 epochs", 128)
    }
    summary = data["summary"]
    assert summary["target_acc"] == runs["ddp"]["val_acc"] and summary["acc_vs_ddp"]["ddp"] == 0.0
    models = runs["ivy_ps_sync_lb"]["step_models"]  # per epoch, per worker: the fitted [a seconds, c seconds/sample]
    assert len(models) == data["epochs"] and all(len(m) == 2 and all(a >= 0 < c for a, c in m) for m in models)
    assert not runs["ivy_ps_async"]["balancer"]
    for r in runs.values():  # every sample trained once per epoch, whoever trained it
        assert sum(r["samples_per_worker"]) == r["epochs"] * r["train_samples"] and min(r["samples_per_worker"]) > 0
    assert runs["ddp"]["injected_sleep_s_per_worker"][0] == 0 < runs["ddp"]["injected_sleep_s_per_worker"][1]
    assert data["summary"]["wall_vs_ddp"]["ddp"] == pytest.approx(1.0)


def test_bad_options_are_refused_before_anything_starts(tmp_path: Path) -> None:
    result = _run_cli(["demo", "--epochs", "0", "--out", str(tmp_path / "x")], cwd=tmp_path, timeout=60)
    assert result.returncode == 2 and "--epochs must be an integer >= 1" in result.stdout
    assert not (tmp_path / "x").exists()
    with pytest.raises(ValueError, match="--slowdown"):
        demo.check_options(2, 0.5, 10.0)
    with pytest.raises(ValueError, match="--timeout"):
        demo.check_options(2, 3.0, 0.0)


@pytest.mark.timeout(120)
def test_a_job_past_its_timeout_is_stopped_with_a_clear_error(tmp_path: Path) -> None:
    result = _run_cli(["demo", "--quick", "--timeout", "3", "--out", str(tmp_path / "x")], cwd=tmp_path, timeout=90)
    assert result.returncode == 1, result.stdout[-3000:]
    assert "ivyplug demo: error: ivyplug demo did not finish within --timeout 3 s" in result.stdout
    assert not (tmp_path / "x" / "demo.json").exists()


def test_command_module_imports_no_framework() -> None:
    """``ivyplug --help`` imports every command module: this one must stay cheap, and agree with the job."""
    code = (
        "import sys, ivyplug.commands.demo; "
        "print(sorted(m for m in ('torch', 'lightning', 'matplotlib', 'sklearn') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
    from ivyplug.benchmarks import demo_job

    assert tuple(demo_job.RUNS) == demo.RUN_NAMES
    assert tuple(spec.label for spec in demo_job.RUNS.values()) == demo.RUN_LABELS
    assert demo.PROGRESS_PREFIX == demo_job.PROGRESS_PREFIX
    assert all(name == spec.name for name, spec in demo_job.RUNS.items())


def test_progress_bar_advances_per_epoch_line() -> None:
    """The rich bar a terminal gets: each run's epochs as they are validated (the quick run above is not a tty)."""
    import io

    from rich.console import Console

    console = Console(file=io.StringIO(), force_terminal=True, width=120)
    with demo.BarProgress(epochs=3, console=console) as bar:
        bar.show("[ddp] workers connected, training 3 epochs", 0.5)
        bar.show("[ddp] epoch 1/3  t=   1.0s  val_acc=0.9100", 1.0)
        bar.show("[ddp] epoch 2/3  t=   2.0s  val_acc=0.9500", 2.0)
        bar.show("[ivy_ps async] epoch 1/3  t=   1.0s  val_acc=0.9000", 3.0)
        bar.show("something else", 3.5)
    tasks = {t.description: t for t in bar.progress.tasks}
    assert tasks["ddp"].completed == 2 and tasks["ivy_ps async"].completed == 1
    assert tasks["ivy_ps sync + IvyLoadBalancer"].completed == 0 and tasks["ddp"].fields["acc"] == "val acc 0.9500"
    assert "something else" in console.file.getvalue()
