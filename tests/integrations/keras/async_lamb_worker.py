"""One Keras worker of the AsyncLAMB test: ``python -m tests.integrations.keras.async_lamb_worker OUT MODE [stop0]``.

Started twice with torchrun-style variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); each worker fits the
digits MLP on its own half of the training set and writes its final weights and validation accuracy. With
``stop0``, rank 0 stops after its first epoch (as an EarlyStopping on its own loss would) and the PS timeout is 3 s.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main() -> None:
    out, mode = sys.argv[1], sys.argv[2]
    stop0 = sys.argv[3:] == ["stop0"]
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
    keras.utils.set_random_seed(rank)  # different initial weights: the servers' copy (worker 0's) wins
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
    model.compile(
        optimizer=AsyncLAMB(learning_rate=0.02, sync_every=4),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    exchange = AsyncLAMBExchange(mode=mode, timeout=3 if stop0 else 60)

    class StopRank0(keras.callbacks.Callback):
        def on_epoch_end(self, epoch: int, logs: object = None) -> None:
            self.model.stop_training = rank == 0

    history = model.fit(
        x[mine],
        y[mine],
        batch_size=32,
        epochs=5,
        validation_data=(x[val], y[val]),
        callbacks=[exchange, StopRank0()] if stop0 else [exchange],
        verbose=0,
    )
    weights = [w.tolist() for w in model.get_weights()]
    result = {"val_acc": history.history["val_accuracy"], "exchanges": exchange.exchanges, "weights": weights}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
