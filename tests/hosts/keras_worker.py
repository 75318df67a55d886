"""A Keras worker of an ``ivyplug serve`` (``AsyncLAMB`` + ``AsyncLAMBExchange``) for the cross-host tests.

``python keras_worker.py SERVERS --token T --timeout S --epochs E`` fits a small MLP on random data and
prints ``batch N`` after every batch and ``done`` at the end; an error that ends ``fit`` is printed as
``error: Type: message`` (exit code 3).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("servers")
    ap.add_argument("--token", default=None)
    ap.add_argument("--timeout", type=float, default=20.0)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--sleep", type=float, default=0.0, help="seconds to sleep after every batch")
    args = ap.parse_args()
    import keras
    import numpy as np
    from ivyplug.integrations.keras import AsyncLAMB, AsyncLAMBExchange

    class Progress(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: object = None) -> None:
            print(f"batch {batch}", flush=True)
            if args.sleep:
                time.sleep(args.sleep)

    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 8)).astype("float32")
    y = np.tanh(x @ rng.normal(size=(8, 1))).astype("float32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer=AsyncLAMB(learning_rate=0.01, sync_every=2), loss="mse")
    exchange = AsyncLAMBExchange(mode="async", servers=args.servers, token=args.token, timeout=args.timeout)
    t0 = time.monotonic()
    try:
        model.fit(x, y, batch_size=16, epochs=args.epochs, callbacks=[exchange, Progress()], verbose=0)
    except Exception as exc:
        print(f"error after {time.monotonic() - t0:.1f} s: {type(exc).__name__}: {exc}", flush=True)
        return 3
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
