"""``ivyplug serve``: parameter-server shards in a process of their own, for workers that come and go.

Workers join with ``IvyPSStrategy(servers="host:port", token=...)``, ``PSConfig(servers=...)`` or, for
Keras, ``AsyncLAMBExchange(servers=..., token=...)``. The service listens on loopback unless ``--host``
says otherwise, and then only with a token. Ctrl-C or SIGTERM ends it cleanly (after a last snapshot
when ``--state-dir`` is given).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

NAME = "serve"
HELP = "run parameter-server shards that workers join by address (host:port)"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shards", type=int, required=True, help="shards this service holds")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=29600, help="port of the rendezvous store (0: any free one)")
    parser.add_argument("--token", default=None, help="secret workers must prove (default: $IVYPLUG_TOKEN)")
    parser.add_argument(
        "--workers", type=int, default=0, help="worker slots (sync: workers per step; default: the first job's size)"
    )
    parser.add_argument("--state-dir", default=None, help="snapshot the shards here and resume from them")
    parser.add_argument("--snapshot-every", type=float, default=None, help="seconds between snapshots")
    parser.add_argument("--timeout", type=float, default=120.0, help="bound of every wait on a worker (s)")
    parser.add_argument(
        "--join", default=None, metavar="HOST:PORT", help="hold more shards of the job of the ivyplug serve there"
    )
    parser.add_argument("--status-every", type=float, default=60.0, help="seconds between status lines (0: none)")


def run(args: argparse.Namespace) -> int:
    from ivyplug.ps.server.service import ListenError, PSService, run_forever

    token = args.token if args.token is not None else os.environ.get("IVYPLUG_TOKEN")
    snapshot_every = args.snapshot_every
    if args.state_dir is not None and snapshot_every is None:
        snapshot_every = 60.0
    try:  # PSService checks every option first, before anything listens
        service = PSService(
            args.shards,
            host=args.host,
            port=args.port,
            token=token,
            num_workers=args.workers,
            state_dir=args.state_dir,
            snapshot_every=snapshot_every,
            timeout=args.timeout,
            status_every=args.status_every,
            join=args.join,
        )
    except ListenError as exc:
        print(
            f"ivyplug serve: {exc}: --host must be an address of this machine and --port a free port (0: any free "
            "port)",
            file=sys.stderr,
        )
        return 2
    except (ValueError, RuntimeError) as exc:
        print(f"ivyplug serve: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the state directory cannot be made or read
        print(f"ivyplug serve: --state-dir {args.state_dir}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(service.describe(), flush=True)
    run_forever(service, stop)
    code = 1 if service.snapshot_error is not None else 0
    if service.members():
        # workers still connected: their threads wait inside gloo's receives, which the interpreter's teardown
        # would abort (SIGABRT); everything is said and saved, so end here
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
