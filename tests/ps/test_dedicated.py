"""Starting the job's dedicated server process (``ivyplug.ps.server.dedicated.launch``)."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ivyplug.ps.server import dedicated

pytestmark = pytest.mark.timeout(180)

UNGUARDED = """\
import torch
from ivyplug.ps import PSClient, PSConfig

torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
cfg = PSConfig(mode="async", num_servers=1, timeout=30)
client = PSClient.start(cfg, list(model.named_parameters()), [], opt)
client.pull_initial()
before = model.weight.detach().clone()
model(torch.ones(3, 4)).sum().backward()
client.step(3)
client.close()
print("STEPPED", bool((model.weight != before).any()), flush=True)
"""


def _server_children() -> list[int]:
    """Pids of this process's children that run the dedicated server module."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == os.getpid() and b"ivyplug.ps.server.dedicated" in cmdline:
            found.append(int(entry.name))
    return found


def test_a_script_without_a_main_guard_gets_its_servers(tmp_path: Path) -> None:
    """The server process does not import the user's script again: a script without ``if __name__ ==
    "__main__":`` (which torchrun and DDP do not need) trains once. A ``multiprocessing`` spawn ran the script's
    top level in the child, which started a second PS there, and rank 0 failed after its timeout."""
    script = tmp_path / "train.py"
    script.write_text(UNGUARDED)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
        env=env,
        start_new_session=True,  # the server joins its process group: one killpg ends everything
    )
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == 0, out
    assert out.count("STEPPED True") == 1, out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the children from /proc")
def test_a_server_that_does_not_start_in_time_is_killed_and_named() -> None:
    """A start that outlives ``timeout`` raises the TimeoutError (it was taken for a failed start, an OSError) and
    leaves no server process behind."""
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"did not start within 0\.001 s"):
        dedicated.launch("127.0.0.1", 1, 1, secrets.token_hex(16), 0.001)
    assert time.monotonic() - start < 10
    assert _server_children() == []


def test_a_server_that_cannot_listen_says_why_in_rank_0s_error() -> None:
    """An address of no interface here: the child's reason (and the settings that choose the address) reach the
    error rank 0 raises, not only the child's stderr."""
    with pytest.raises(RuntimeError, match=r"failed to start \(exit code 1\): .*IVYPLUG_PS_HOST"):
        dedicated.launch("192.0.2.77", 1, 1, secrets.token_hex(16), 60)
    assert _server_children() == []


def test_the_port_line_is_found_after_other_output_and_a_partial_line_times_out(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """What the server prints before its port (a site hook, a banner) goes on to stderr instead of failing the
    start; a line that never ends is bounded by the start's timeout."""
    read, write = os.pipe()
    try:
        os.write(write, b"a banner\nport 4242\n")
        assert dedicated._report_line(read, time.monotonic() + 5, 5) == "port 4242"
        assert "a banner" in capfd.readouterr().err
        os.write(write, b"port 43")  # no newline, ever
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=r"did not start within 0\.3 s"):
            dedicated._report_line(read, time.monotonic() + 0.3, 0.3)
        assert time.monotonic() - start < 3
    finally:
        os.close(read)
        os.close(write)
