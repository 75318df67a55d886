"""One Keras worker of the averaging accuracy test: ``python -m tests.integrations.keras.averaging_worker OUT``.

Started twice with torchrun-style variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and ``OUTER``,
``WIRE``, ``SYNC_EVERY``, ``EPOCHS``, ``MODE``; each worker fits the digits MLP with AsyncLAMB on its half of the
training set and writes its validation accuracy per epoch and its exchanges.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main() -> None:
    out = sys.argv[1]
    import keras
    import numpy as np
    from ivyplug.integrations.keras import AsyncLAMB, AsyncLAMBExchange
    from sklearn.datasets import load_digits

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype("float32")
    perm = np.random.default_rng(0).permutation(len(x))
    train, val = perm[:1440], perm[1440:]
    mine = train[rank::world]
    keras.utils.set_random_seed(rank)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
    model.compile(
        optimizer=AsyncLAMB(learning_rate=0.02, sync_every=int(os.environ["SYNC_EVERY"]), outer=os.environ["OUTER"]),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    exchange = AsyncLAMBExchange(mode=os.environ["MODE"], timeout=60, wire_dtype=os.environ["WIRE"])
    history = model.fit(
        x[mine],
        y[mine],
        batch_size=32,
        epochs=int(os.environ["EPOCHS"]),
        validation_data=(x[val], y[val]),
        callbacks=[exchange],
        verbose=0,
    )
    result = {"val_acc": history.history["val_accuracy"], "exchanges": exchange.exchanges}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
