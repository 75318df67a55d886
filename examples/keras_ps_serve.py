"""Two Keras workers, started on their own, averaging through an ``ivyplug serve``.

Run it all in one go (it starts the servers and both workers, then prints their validation accuracy)::

    python examples/keras_ps_serve.py

or by hand, one command per terminal::

    ivyplug serve --shards 2 --workers 2 --token demo
    IVYPLUG_TOKEN=demo python examples/keras_ps_serve.py --servers 127.0.0.1:29600 --part 0/2
    IVYPLUG_TOKEN=demo python examples/keras_ps_serve.py --servers 127.0.0.1:29600 --part 1/2

Each worker fits a small MLP on its half of scikit-learn's digits with ``AsyncLAMB`` (4 local steps between
two exchanges) and ``AsyncLAMBExchange(servers=...)``: no torchrun, no process group. The servers keep the
model after the workers are gone: run a worker again and it continues from there.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def train(servers: str, part: int, parts: int, epochs: int, token: str | None) -> tuple[float, str, float]:
    """Fit this worker's share of digits through the servers; returns the last validation accuracy, and the name
    and value of its pushes counter (``ivy/rank{slot}/pushes``: the slot the serve gave it)."""
    import keras
    import numpy as np
    from ivyplug.integrations.keras import AsyncLAMB, AsyncLAMBExchange
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype("float32")
    order = np.random.default_rng(0).permutation(len(x))
    train_idx, val_idx = order[:1440], order[1440:]
    mine = train_idx[part::parts]
    keras.utils.set_random_seed(part)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
    model.compile(
        optimizer=AsyncLAMB(learning_rate=0.02, sync_every=4),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    exchange = AsyncLAMBExchange(mode="async", servers=servers, token=token, timeout=60)
    history = model.fit(
        x[mine],
        y[mine],
        batch_size=32,
        epochs=epochs,
        validation_data=(x[val_idx], y[val_idx]),
        callbacks=[exchange],
        verbose=0,
    )
    (pushes,) = [key for key in history.history if key.endswith("/pushes")]
    return float(history.history["val_accuracy"][-1]), pushes, float(history.history[pushes][-1])


def demo(epochs: int) -> int:
    """Start ``ivyplug serve`` on a free port and two workers of this script; print what they reached."""
    token = "demo-token"
    env = dict(os.environ, IVYPLUG_TOKEN=token)
    serve = subprocess.Popen(
        [sys.executable, "-m", "ivyplug", "serve", "--shards", "2", "--workers", "2", "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        assert serve.stdout is not None
        line = serve.stdout.readline()
        print(line.strip())
        address = line.split("listening on ", 1)[1].split(" ", 1)[0]
        t0 = time.monotonic()
        workers = [
            subprocess.Popen(
                [sys.executable, __file__, "--servers", address, "--part", f"{i}/2", "--epochs", str(epochs)],
                env=env,
                start_new_session=True,
            )
            for i in range(2)
        ]
        codes = [w.wait(600) for w in workers]
        print(f"both workers done in {time.monotonic() - t0:.1f} s")
        return max(codes)
    finally:
        serve.terminate()
        serve.wait(30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--servers", default=None, help="host:port of a running ivyplug serve (default: start one)")
    ap.add_argument("--part", default="0/1", help="this worker's share of the data, i/n")
    ap.add_argument("--epochs", type=int, default=5)
    args = ap.parse_args()
    if args.servers is None:
        return demo(args.epochs)
    part, parts = (int(v) for v in args.part.split("/"))
    acc, key, pushes = train(args.servers, part, parts, args.epochs, os.environ.get("IVYPLUG_TOKEN"))
    print(f"worker {part}: validation accuracy {acc:.3f} ({key} = {pushes:.0f})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
