"""Dedicated CPU servers (``PSConfig(num_servers=k)``): an ``ivyplug serve`` that rank 0 starts for its job.

Rank 0 starts one server process on its host, holding the k shards (service.py), with a fresh random token
that the workers receive through their own group; every worker then joins it as it would join any
``ivyplug serve`` (one two-rank gloo group per worker, worker/service_link.py). So a worker that dies leaves the
others serving, exactly as with an external service. The process ends by itself once every worker of the
job has left, is killed when rank 0's interpreter exits without closing the PS (an atexit hook), and exits if
rank 0 dies (a parent watchdog).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import socket
import subprocess
import sys
import threading
import time

from ivyplug.settings import PS_HOST_ENV as HOST_ENV


def ps_host() -> str:
    """Address at which workers reach rank 0's servers: $IVYPLUG_PS_HOST, $MASTER_ADDR or loopback."""
    return os.environ.get(HOST_ENV) or os.environ.get("MASTER_ADDR") or "127.0.0.1"


def check_ps_host(host: str, world_size: int) -> None:
    """PSAddressError at once where rank 0's servers at ``host`` cannot be reached from this worker: a loopback
    ``host`` while rank 0 (``$MASTER_ADDR``) is on another host."""
    from ivyplug.ps.wire import gloo_net

    master = os.environ.get("MASTER_ADDR")
    if world_size < 2 or not master or not gloo_net.is_loopback(host) or gloo_net.is_local(master):
        return
    setting = f"{HOST_ENV}={os.environ[HOST_ENV]}" if os.environ.get(HOST_ENV) else f"the default {host}"
    raise gloo_net.PSAddressError(
        f"the job's dedicated servers listen on the loopback address {host} ({setting}) of rank 0's host "
        f"(MASTER_ADDR={master}), which this worker on host {socket.gethostname()!r} cannot reach: set {HOST_ENV} "
        "to an address of rank 0's host that every worker reaches (for example MASTER_ADDR's)"
    )


def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            print("[ivyplug.ps] dedicated server: rank 0 is gone, exiting", file=sys.stderr, flush=True)
            os._exit(1)


def _log(line: str) -> None:
    """Only what a user must see reaches stderr (a lost worker, a refusal), not every join and clean leave."""
    if " is gone" in line or "refused" in line or "ended" in line:
        print(f"[ivyplug.ps] {line}", file=sys.stderr, flush=True)


def serve(host: str, num_shards: int, num_workers: int, token: str, timeout: float, parent_pid: int) -> None:
    """Main of the server process: report the port to rank 0 on stdout, serve until every worker has left."""
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    from ivyplug.ps.server.service import ListenError, PSService

    try:
        service = PSService(
            num_shards,
            host=host,
            port=0,
            token=token,
            num_workers=num_workers,
            timeout=timeout,
            status_every=None,
            log=_log,
        )
    except ListenError as exc:
        _report(f"error {exc}: the job's dedicated servers listen on ${HOST_ENV}, else $MASTER_ADDR")
        os._exit(1)
    _report(f"port {service.port}")
    os.dup2(2, 1)  # from here on what it prints goes to stderr: nobody reads the pipe any more
    service.emptied.wait()
    print("[ivyplug.ps] dedicated server: every worker of its job has left, exiting", file=sys.stderr, flush=True)
    service.close()
    # Nothing is left to do; skip the interpreter's teardown, where destroying the members' gloo groups and the
    # store aborted the process (SIGABRT: "terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _report(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class ServerProcess:
    """The server process as rank 0 holds it (the calls of a ``multiprocessing.Process`` that it needs)."""

    name = "ivyplug-ps-server"

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.popen = popen
        self.pid = popen.pid

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        if self.is_alive():
            self.popen.kill()

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout)
        if not self.is_alive():
            _started.discard(self)


#: the server processes started by this interpreter and not yet seen to have ended
_started: set[ServerProcess] = set()


@atexit.register
def _end_started() -> None:
    """Rank 0's interpreter exits without having closed the PS (an exception in user code): its server goes too."""
    for proc in list(_started):
        proc.kill()
        proc.join(5)


#: what the server process runs: rank 0's ``sys.path`` (so it imports the ivyplug rank 0 imported, as a
#: ``multiprocessing`` spawn would), then :func:`main`
_STARTER = (
    "import json, sys; sys.path[:] = json.loads(sys.argv[1]); from ivyplug.ps.server.dedicated import main; main()"
)


def launch(host: str, num_shards: int, num_workers: int, token: str, timeout: float) -> tuple[ServerProcess, int]:
    """Start the server process (on rank 0); returns it and the port its store listens on.

    A fresh interpreter runs :func:`main`, not a ``multiprocessing`` spawn: a spawned child imports the parent's
    main script again, and a training script without an ``if __name__ == "__main__":`` guard (which torchrun and
    DDP do not need) would start a second fit in the server process. The token travels on stdin, never on the
    command line, where every user of the machine can read it; the port comes back on stdout.
    """
    flags = subprocess._args_from_interpreter_flags()  # type: ignore[attr-defined]  # what multiprocessing passes
    cmd = [sys.executable, *flags, "-c", _STARTER, json.dumps(sys.path), host, str(num_shards), str(num_workers)]
    cmd += [repr(float(timeout)), str(os.getpid())]
    popen = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    proc = ServerProcess(popen)
    _started.add(proc)
    try:
        assert popen.stdin is not None and popen.stdout is not None
        popen.stdin.write(token.encode() + b"\n")
        popen.stdin.close()
        line = _report_line(popen.stdout.fileno(), time.monotonic() + timeout, timeout)
        popen.stdout.close()
        if line.startswith("port "):
            return proc, int(line.split()[1])
        proc.join(5)
        said = line.removeprefix("error ") if line else "see its error above on stderr"
        raise RuntimeError(f"the dedicated server process failed to start (exit code {proc.exitcode}): {said}")
    except BaseException:
        proc.kill()
        proc.join(5)
        raise


def _report_line(fd: int, deadline: float, timeout: float) -> str:
    """The server's ``port N`` or ``error ...`` line ("" if it ended without one); whatever else it printed
    before (a site hook, a library's banner) goes on to stderr. TimeoutError after ``deadline``."""
    pending = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise TimeoutError(f"the dedicated server process did not start within {timeout:g} s")
        chunk = os.read(fd, 4096)
        if not chunk:
            return ""
        pending += chunk
        while b"\n" in pending:
            raw, pending = pending.split(b"\n", 1)
            line = raw.decode(errors="replace").strip()
            if line.startswith(("port ", "error ")):
                return line
            print(line, file=sys.stderr, flush=True)


def main() -> None:
    """The server process's entry (see :data:`_STARTER`): its arguments after rank 0's path, its token on stdin."""
    host, num_shards, num_workers, timeout, parent_pid = sys.argv[2:]
    token = sys.stdin.readline().strip()
    if not token:  # rank 0 ended before it wrote one: a server without a token would take anyone
        _report("error no token arrived on stdin (rank 0 ended?)")
        os._exit(1)
    serve(host, int(num_shards), int(num_workers), token, float(timeout), int(parent_pid))
