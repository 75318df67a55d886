"""Keras ``AsyncLAMB``: config, one worker = LAMB, two real worker processes averaging through the PS."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
from ivyplug.integrations.keras import LAMB, AsyncLAMB, AsyncLAMBExchange

from tests.ports import free_port
from tests.ps.diffs import max_abs_diff

REPO = Path(__file__).resolve().parents[3]
WORKER_MODULE = "tests.integrations.keras.async_lamb_worker"


def _model(seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(3)])


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    return rng.normal(size=(80, 6)).astype("float32"), rng.normal(size=(80, 3)).astype("float32")


def test_config_round_trip_and_bad_arguments() -> None:
    opt = AsyncLAMB(learning_rate=0.01, sync_every=3, merge_rate=0.5, max_trust_ratio=5.0)
    again = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert type(again) is AsyncLAMB
    assert (again.sync_every, again.merge_rate, again.max_trust_ratio) == (3, 0.5, 5.0)
    with pytest.raises(ValueError, match="sync_every must be an int >= 1"):
        AsyncLAMB(sync_every=0)
    assert again.overlap is False
    with pytest.raises(ValueError, match="merge_rate must be None or a finite number > 0"):
        AsyncLAMB(merge_rate=float("inf"))
    with pytest.raises(ValueError, match=r"^AsyncLAMBExchange: mode must be one of \('sync', 'async', 'ssp'\)"):
        AsyncLAMBExchange(mode="bsp")


def test_exchange_takes_the_project_ps_defaults_like_the_lightning_strategy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "pyproject.toml").write_text('[tool.ivyplug.ps]\ntimeout = 45.0\nnonfinite = "raise"\n')
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("IVYPLUG_PS_STALENESS_SCALING", "none")
    cfg = AsyncLAMBExchange().config
    assert (cfg.timeout, cfg.nonfinite, cfg.staleness_scaling) == (45.0, "raise", "none")
    cfg = AsyncLAMBExchange(timeout=5.0, nonfinite="skip", staleness_scaling="inverse").config  # code wins
    assert (cfg.timeout, cfg.nonfinite, cfg.staleness_scaling) == (5.0, "skip", "inverse")
    with pytest.raises(ValueError, match="nonfinite"):
        AsyncLAMBExchange(nonfinite="ignore")
    assert AsyncLAMBExchange().config.shared_memory is True  # the twins share the option and its default
    (tmp_path / "pyproject.toml").write_text("[tool.ivyplug.ps]\nshared_memory = false\n")
    assert AsyncLAMBExchange().config.shared_memory is False
    assert AsyncLAMBExchange(shared_memory=True).config.shared_memory is True
    (tmp_path / "pyproject.toml").write_text("[tool.ivyplug.ps]\nnum_servers = 2\n")  # a Lightning option only
    with pytest.warns(RuntimeWarning, match="the project's num_servers=2 .* is not used"):
        AsyncLAMBExchange()


def test_exchange_callback_refuses_another_optimizer() -> None:
    model = _model()
    model.compile(optimizer=LAMB(), loss="mse")
    x, y = _data()
    with pytest.raises(ValueError, match="compiled with AsyncLAMB, got LAMB"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[AsyncLAMBExchange()])


@pytest.mark.parametrize("overlap", [False, True])
def test_one_worker_exchanges_every_h_steps_and_matches_lamb(overlap: bool) -> None:
    """One worker (merge rate 1): the exchanges change nothing but rounding; 5 steps/epoch, H = 2. Overlapped,
    each step's progress is still pushed once and kept once (x <- g + (x - x_sent) with g = x_sent here): a
    lost or doubled step would move the weights far from LAMB's."""
    x, y = _data()
    plain = _model()
    plain.compile(optimizer=LAMB(learning_rate=0.02), loss="mse")
    plain.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    model = _model()
    model.compile(optimizer=AsyncLAMB(learning_rate=0.02, sync_every=2, overlap=overlap), loss="mse")
    exchange = AsyncLAMBExchange(mode="async")
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False, callbacks=[exchange])
    assert exchange.exchanges == 5  # steps 2, 4, 6, 8, 10
    assert exchange.client is None  # closed at the end of fit
    for a, b in zip(model.get_weights(), plain.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    assert history.history["ivy/rank0/sync_every"] == [2.0, 2.0]  # the Lightning strategy's metric name
    assert ("ivy/rank0/overlap_wait_s" in history.history) == overlap
    # the PS counters under the Lightning strategy's names: pushes by each epoch's end (steps 2, 4; 6, 8, 10)
    assert history.history["ivy/rank0/pushes"] == [2.0, 5.0]
    assert history.history["ivy/rank0/nonfinite_skipped"] == [0.0, 0.0]
    assert history.history["ivy/rank0/bytes_sent"] == [0.0, 0.0]  # one worker: its shard is in-process


@pytest.mark.skipif(keras.backend.backend() == "torch", reason="Keras's torch trainer runs one step per call")
def test_steps_per_execution_counts_steps_not_calls() -> None:
    """Two steps per call, the last of each 5-step epoch one (Keras reports it as two), H = 2, 3 epochs: exchanges
    after steps 2, 4; 7, 9; 12, 14 and the end's flush of step 15: 7. Counting that last call as two steps
    would make 9, counting calls 5."""
    x, y = _data()
    model = _model()
    model.compile(optimizer=AsyncLAMB(learning_rate=0.02, sync_every=2), loss="mse", steps_per_execution=2)
    exchange = AsyncLAMBExchange(mode="async")
    model.fit(x, y, batch_size=16, epochs=3, verbose=0, shuffle=False, callbacks=[exchange])
    assert exchange.exchanges == 7


def test_mixed_precision_wraps_async_lamb_and_the_exchange_still_runs() -> None:
    """Under a mixed policy Keras compiles the optimizer into a LossScaleOptimizer; the exchange uses the one inside."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        x, y = _data()
        model = _model()
        model.compile(optimizer=AsyncLAMB(learning_rate=0.02, sync_every=2), loss="mse")
        assert type(model.optimizer).__name__ == "LossScaleOptimizer"
        exchange = AsyncLAMBExchange(mode="async")
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False, callbacks=[exchange])
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert exchange.exchanges == 3 and all(np.isfinite(w).all() for w in model.get_weights())


def test_a_nonfinite_delta_is_dropped_counted_and_logged_and_the_worker_goes_on_from_the_global_copy() -> None:
    """A weight turned NaN after the first step (LAMB itself skips non-finite gradients) makes the first delta NaN:
    the PS drops it whole (``nonfinite="skip"``), the worker restarts from the global copy, and the counters say so
    under the torch twin's and the Lightning strategy's names."""

    class Poison(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
            if batch == 0:
                kernel = self.model.trainable_variables[0]
                value = keras.ops.convert_to_numpy(kernel).copy()
                value[0, 0] = np.nan
                kernel.assign(value)

    x, y = _data()
    model = _model()
    before = [w.copy() for w in model.get_weights()]
    model.compile(optimizer=AsyncLAMB(learning_rate=0.02, sync_every=2), loss="mse")
    exchange = AsyncLAMBExchange(mode="async")
    history = model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False, callbacks=[Poison(), exchange])
    assert exchange.discarded_exchanges == 1 and exchange.exchanges == 3  # steps 2 and 4, then the end's flush
    assert history.history["ivy/rank0/nonfinite_skipped"] == [1.0]
    after = model.get_weights()
    assert all(np.isfinite(w).all() for w in after)
    assert any(not np.array_equal(a, b) for a, b in zip(after, before, strict=True))  # the later steps landed


def test_overlap_in_ssp_is_refused_before_any_process_group_is_made(monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused at the start of fit, not once the gloo group waits for its peers (here: for a rank that never comes)."""
    import torch.distributed as dist

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    model = _model()
    model.compile(optimizer=AsyncLAMB(learning_rate=0.02, overlap=True), loss="mse")
    x, y = _data()
    exchange = AsyncLAMBExchange(mode="ssp", staleness=2, timeout=5.0)
    with pytest.raises(ValueError, match="overlap=True runs in mode='sync' or 'async'"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[exchange])
    assert not dist.is_initialized()


def test_a_failed_start_drops_the_process_group_it_made(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The PS fails to start after the callback made its gloo group: fit raises that error and the group is gone,
    so a second fit in this process starts afresh (a one-rank group stands in for torchrun's two)."""
    import torch.distributed as dist

    from ivyplug.ps import PSClient

    def join(self: AsyncLAMBExchange) -> int:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
        self._own_group = True
        return 1

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the servers cannot be started")

    monkeypatch.setattr(AsyncLAMBExchange, "_join_workers", join)
    monkeypatch.setattr(PSClient, "start", refuse)
    model = _model()
    model.compile(optimizer=AsyncLAMB(learning_rate=0.02), loss="mse")
    x, y = _data()
    exchange = AsyncLAMBExchange(mode="async")
    try:
        with pytest.raises(RuntimeError, match="the servers cannot be started"):
            model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[exchange])
        assert not dist.is_initialized() and exchange.client is None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_sync_every_auto_is_chosen_from_the_measured_times_and_logged() -> None:
    x, y = _data()
    model = _model()
    model.compile(optimizer=AsyncLAMB(learning_rate=0.02, sync_every="auto", overlap=True), loss="mse")
    again = keras.optimizers.deserialize(keras.optimizers.serialize(model.optimizer))
    assert (again.sync_every, again.overlap) == ("auto", True)
    exchange = AsyncLAMBExchange(mode="async")
    history = model.fit(x, y, batch_size=4, epochs=3, verbose=0, shuffle=False, callbacks=[exchange])
    periods = history.history["ivy/rank0/sync_every"]
    assert len(periods) == 3 and all(1 <= p <= 256 for p in periods), periods
    assert exchange.exchanges >= 1
    assert all(np.isfinite(w).all() for w in model.get_weights())
    with pytest.raises(ValueError, match=r"sync_every must be an int >= 1 .* or 'auto'"):
        AsyncLAMB(sync_every="never")
    with pytest.raises(ValueError, match="overlap must be True or False"):
        AsyncLAMB(overlap="yes")


def test_mirrored_strategy_worker_exchanges_and_keeps_replicas_equal(mirrored: object) -> None:
    x, y = _data()
    with mirrored.scope():  # type: ignore[attr-defined]
        model = _model()
        model.compile(optimizer=AsyncLAMB(learning_rate=0.02, sync_every=2), loss="mse")
    exchange = AsyncLAMBExchange(mode="sync")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[exchange], validation_data=(x[:16], y[:16]))
    assert exchange.exchanges == 3  # steps 2 and 4, then the flush before validation (step 5)
    for v in model.trainable_variables:
        replicas = [t.numpy() for t in v.value.values]  # the tf MirroredVariable under the keras.Variable
        np.testing.assert_array_equal(replicas[0], replicas[1])


# --------------------------------------------------------------------------------------------------
# Two real Keras worker processes: every pushed delta and pulled copy recorded, the merges replayed
# --------------------------------------------------------------------------------------------------

#: the -c program of each worker: tests/integrations/keras/async_lamb_worker.py (which sets KERAS_BACKEND
#: before Keras is imported) with the exchange callback replaced by the recording one below
_RECORDING_WORKER = (
    "import tests.integrations.keras.async_lamb_worker as worker\n"
    "from tests.integrations.keras.test_async_lamb import record_exchanges\n"
    "record_exchanges()\n"
    "worker.main()\n"
)


def record_exchanges() -> None:
    """In a worker process: make ``AsyncLAMBExchange`` record what goes through the PS (test code only).

    The recording subclass wraps, after the callback has started the PS, the client's ``step`` (what
    ``DeltaExchange.exchange`` calls: the pseudo-gradient in the params' ``.grad`` is what gets pushed, the
    params afterwards hold the pulled global copy) and this process's shard server's ``push`` (the order
    the pushes of both workers reached this shard, with the staleness the server gave each). At the end of
    ``fit`` it pickles the records, the plan's row blocks and the final weights to ``OUT/rank{r}.pkl``.
    """
    import pickle

    import ivyplug.integrations.keras as ivy_keras
    from ivyplug.integrations.keras.async_lamb import AsyncLAMBExchange

    from tests.ps.introspection import local_shard

    out, rank = sys.argv[1], int(os.environ["RANK"])

    class RecordingExchange(AsyncLAMBExchange):
        def on_train_begin(self, logs: dict | None = None) -> None:
            initial = [np.array(v.numpy(), dtype=np.float32) for v in self.model.trainable_variables]
            super().on_train_begin(logs)
            client, params = self.client, self._delta.params
            server = local_shard(client)
            self.record = {
                "rank": rank,
                "initial": initial,  # rank 0's are the servers' starting copy
                "shard": server.shard,
                "pieces": [[(p.index, p.kind, p.row_start, p.row_end) for p in ps] for ps in client.plan.pieces],
                "merge_rate": self._delta.outer.param_groups[0]["lr"],
                "staleness_scaling": self.config.staleness_scaling,
                "pushes": [],  # (num_samples, pushed pseudo-gradient = snapshot - local, per tensor)
                "pulls": [],  # the params right after that push's reply: the global copy pulled back
                "arrivals": [],  # (worker, staleness) of every push that reached this process's shard
            }
            step, push = client.step, server._push

            def recording_step(num_samples: int, max_grad_norm: float | None = None, *, delta: bool = False) -> None:
                assert delta  # an exchange pushes a delta (the servers' delta staleness rule)
                pushed = [p.grad.detach().numpy().copy() for p in params]
                step(num_samples, max_grad_norm, delta=delta)
                self.record["pushes"].append((num_samples, pushed))
                self.record["pulls"].append([p.detach().numpy().copy() for p in params])

            def recording_push(worker: int, data: Any, hyper: Any) -> int:
                tau = push(worker, data, hyper)  # called with the shard's lock held: this is arrival order
                self.record["arrivals"].append((worker, tau))
                return tau

            client.step = recording_step
            server._push = recording_push

        def on_train_end(self, logs: dict | None = None) -> None:
            super().on_train_end(logs)
            self.record["final"] = [np.array(v.numpy()) for v in self.model.trainable_variables]
            with open(os.path.join(out, f"rank{rank}.pkl"), "wb") as f:
                pickle.dump(self.record, f)

    ivy_keras.AsyncLAMBExchange = RecordingExchange  # what the worker's `from ... import` picks up


def _rows(pieces: list[tuple[int, str, int, int]], shape_of: list[tuple[int, ...]]) -> list[tuple[int, Any]]:
    """(tensor index, index expression) of a shard's parameter row blocks."""
    out = []
    for index, kind, lo, hi in pieces:
        if kind == "param":
            out.append((index, slice(lo, hi) if len(shape_of[index]) else ...))
    return out


def staleness_scale(tau: int) -> float:
    """``staleness_scaling="inverse"`` for a delta: the rate divided by tau once tau >= 2
    (ivyplug/ps/server/shard.py)."""
    return 1.0 / tau if tau >= 2 else 1.0


def replay_merges(
    records: list[dict[str, Any]],
    mode: str,
    rate_factor: float = 1.0,
    drop: tuple[int, int] | None = None,
    ignore_staleness: bool = False,
) -> tuple[list[np.ndarray], list[list[list[np.ndarray]]]]:
    """The server's merge rule replayed in float64 on the recorded deltas: (final copy, expected pulls).

    The servers run SGD with lr = merge_rate on the pushed pseudo-gradient g = snapshot - local = -delta
    (ivyplug/localsgd/delta_exchange.py, ivyplug/ps/server/shard.py):
    - sync: step k merges the weighted mean of the workers' k-th deltas, x += rate * sum(n_w d_w) / sum(n_w),
      with n_w the local steps a worker reports (merge_rate None -> rate 1); every reply is x after step k.
    - async: each delta merges on arrival, x += rate * d (merge_rate None -> rate 1/num_workers), times
      :func:`staleness_scale` of its staleness tau. The rule is linear in the deltas, but their weights depend
      on the arrival order through the taus: only with scaling "none" is the result x0 + rate * (sum of all
      deltas), whatever the order. So each shard (its row blocks) is replayed in the order its pushes
      arrived; a reply is the shard's copy right after that push (push and snapshot happen under one lock).
    ``rate_factor``, ``drop`` (worker, exchange) and ``ignore_staleness`` replay a wrong rule (the test's
    check must reject them).
    """
    world = len(records)
    rate = (1.0 if mode == "sync" else 1.0 / world) * rate_factor
    x0 = [a.astype(np.float64) for a in records[0]["initial"]]
    shapes = [a.shape for a in x0]
    deltas = [[[-g.astype(np.float64) for g in pushed] for _, pushed in r["pushes"]] for r in records]
    if drop is not None:
        w, j = drop
        deltas[w][j] = [np.zeros_like(d) for d in deltas[w][j]]
    pulls: list[list[list[np.ndarray]]] = [[[np.full(s, np.nan) for s in shapes] for _ in r["pushes"]] for r in records]
    final = [np.full(s, np.nan) for s in shapes]
    if mode == "sync":
        x = [a.copy() for a in x0]
        for k in range(len(records[0]["pushes"])):
            n = [float(r["pushes"][k][0]) for r in records]
            for i in range(len(x)):
                x[i] += rate * sum(n[w] * deltas[w][k][i] for w in range(world)) / sum(n)
            for w in range(world):
                pulls[w][k] = [a.copy() for a in x]
        return x, pulls
    by_shard = {r["shard"]: r["arrivals"] for r in records}
    for shard, pieces in enumerate(records[0]["pieces"]):
        rows = _rows(pieces, shapes)
        if not rows:
            continue
        x = [a.copy() for a in x0]
        count = [0] * world
        for w, tau in by_shard[shard]:
            j = count[w]
            count[w] += 1
            inverse = records[0]["staleness_scaling"] == "inverse" and not ignore_staleness
            scale = staleness_scale(tau) if inverse else 1.0
            for i, where in rows:
                x[i][where] += rate * scale * deltas[w][j][i][where]
                pulls[w][j][i][where] = x[i][where]
        for i, where in rows:
            final[i][where] = x[i][where]
    return final, pulls


def _close(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, equal_nan=False)


def _two_workers(args: list[str], timeout: float) -> tuple[list[int], list[str]]:
    """Run ``python *args`` as ranks 0 and 1 of a two-worker job (torchrun's variables), each in a session of its
    own that is killed whole at the end, however the test ends; their return codes and outputs."""
    port = free_port()
    procs: list[subprocess.Popen[str]] = []
    try:
        for rank in (0, 1):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
            procs.append(
                subprocess.Popen(
                    [sys.executable, *args],
                    cwd=str(REPO),
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,
                )
            )
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
    return [p.returncode for p in procs], outputs


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_two_keras_workers_merge_their_deltas_as_the_server_rule_says(tmp_path: Path, mode: str) -> None:
    """Two Keras processes (digits MLP, H = 4): every pushed delta and every pulled global copy is recorded,
    and a float64 replay of the merge rule on those deltas gives every pulled copy and the final model."""
    codes, outputs = _two_workers(["-c", _RECORDING_WORKER, str(tmp_path), mode], timeout=240)
    assert codes == [0, 0], "\n".join(o[-3000:] for o in outputs)
    import pickle

    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    records = []
    for r in (0, 1):
        with open(tmp_path / f"rank{r}.pkl", "rb") as f:
            records.append(pickle.load(f))
    for a, b in zip(r0["weights"], r1["weights"], strict=True):  # both hold the servers' final copy
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert r0["val_acc"][-1] == r1["val_acc"][-1] >= 0.9  # validated the same global model
    # 720 samples each = 23 steps/epoch; H = 4 gives 5 exchanges + 1 flush per epoch
    assert r0["exchanges"] == r1["exchanges"] == 5 * 6
    assert [len(r["pushes"]) for r in records] == [30, 30]
    assert [n for r in records for n, _ in r["pushes"]] == ([4] * 5 + [3]) * 5 * 2  # local steps per push
    assert sorted(r["shard"] for r in records) == [0, 1]
    assert records[0]["merge_rate"] == pytest.approx(1.0 if mode == "sync" else 0.5)
    for r in records:  # every push reached this shard once, each worker's in its order (30 each)
        assert sorted(w for w, _ in r["arrivals"]) == [0] * 30 + [1] * 30
    if mode == "async":  # the staleness the server gave a push is at most the other's pushes since our last
        for r in records:
            last = {0: 0, 1: 0}
            for pos, (w, tau) in enumerate(r["arrivals"]):
                others = sum(1 for v, _ in r["arrivals"][last[w] : pos] if v != w)
                assert 0 <= tau <= others, (pos, r["arrivals"])
                last[w] = pos + 1
    else:
        assert all(tau == 0 for r in records for _, tau in r["arrivals"])
    final, pulls = replay_merges(records, mode)
    assert len(r0["weights"]) == len(final)  # Dense layers only: the weights are the trainable variables
    _close([np.asarray(w, dtype=np.float64) for w in r0["weights"]], final)
    for r in records:
        _close(r["final"], final)
        for j, pulled in enumerate(r["pulls"]):
            try:
                _close(pulled, pulls[r["rank"]][j])
            except AssertionError as exc:
                raise AssertionError(f"worker {r['rank']}'s pull after exchange {j}") from exc
    assert max_abs_diff(final, records[0]["initial"]) > 0.05  # the merges moved the model
    # the comparison is sharp: rate x 0.5 (async: merge_rate applied twice; sync: the mean halved), x 2 (the
    # sum, not the mean), one delta skipped (first, middle, last of each worker), staleness scale not applied: rejected
    wrong = [replay_merges(records, mode, rate_factor=f)[0] for f in (0.5, 2.0)]
    wrong += [replay_merges(records, mode, drop=(w, j))[0] for w in (0, 1) for j in (0, 17, 29)]
    if any(staleness_scale(tau) != 1.0 for r in records for _, tau in r["arrivals"]):
        wrong.append(replay_merges(records, mode, ignore_staleness=True)[0])
    for x in wrong:
        with pytest.raises(AssertionError):
            _close(records[0]["final"], x)


def test_a_worker_that_stops_early_ends_the_others_within_timeout_naming_the_likely_cause(tmp_path: Path) -> None:
    """Rank 0 stops after its first epoch; rank 1 goes on to validate alone. Both end with the PS's timeout error
    (3 s) and the hint that every worker must run the same epochs, not an unexplained wait."""
    started = time.monotonic()
    codes, outputs = _two_workers(["-m", WORKER_MODULE, str(tmp_path), "async", "stop0"], timeout=150)
    took = time.monotonic() - started
    assert 0 not in codes, "\n".join(o[-3000:] for o in outputs)
    for out in outputs:
        assert "PSTimeoutError" in out and "must run the same epochs" in out and "'val_' metric" in out, out[-3000:]
    assert took < 120, took


def test_docstring_example_runs() -> None:
    import doctest

    from ivyplug.integrations.keras import async_lamb

    tests = [t for t in doctest.DocTestFinder().find(async_lamb.AsyncLAMB, "AsyncLAMB", globs={}) if t.examples]
    assert tests, "AsyncLAMB's docstring must hold a runnable example"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in tests:
        runner.run(test)
    assert runner.summarize(verbose=False).failed == 0


class _RaiseAt(keras.callbacks.Callback):
    def __init__(self, batch: int) -> None:
        super().__init__()
        self.batch = batch

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if batch == self.batch:
            raise ValueError("a user's bug")


def test_a_fit_that_raised_leaves_no_client_open_for_the_next_fit(caplog: pytest.LogCaptureFixture) -> None:
    """Keras calls no callback when ``fit`` raises, so the PS client of that fit stayed open (its threads, its
    shard, its slot at an ``ivyplug serve``) next to the one the next fit started: the next fit leaves it first,
    without goodbye, and says so."""
    x, y = _data()
    model = _model()
    model.compile(optimizer=AsyncLAMB(learning_rate=0.02, sync_every=2), loss="mse")
    exchange = AsyncLAMBExchange(mode="async")
    with pytest.raises(ValueError, match="a user's bug"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[exchange, _RaiseAt(3)])
    first = exchange.client
    assert first is not None and not first.closed
    with caplog.at_level("WARNING", logger="ivyplug.integrations.keras.async_lamb"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[exchange])
    assert first.closed
    assert exchange.client is None and exchange.exchanges == 5  # the second fit's 10 steps, every 2
    assert [r.message for r in caplog.records if "previous fit ended with an error" in r.message], caplog.text


def _bf16_share(model: keras.Model) -> float:
    """The share of the model's weights that are bf16 numbers (their low 16 bits zero)."""
    flat = np.concatenate([np.asarray(v.numpy(), dtype=np.float32).ravel() for v in model.trainable_variables])
    return float(np.mean((flat.view(np.uint32) & 0xFFFF) == 0))


class _Shares(keras.callbacks.Callback):
    """Listed after the exchange: the share of bf16 numbers in the weights it pulled at the start and for
    validation."""

    def __init__(self) -> None:
        super().__init__()
        self.shares: dict[str, float] = {}

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self.shares["start"] = _bf16_share(self.model)

    def on_test_begin(self, logs: dict[str, Any] | None = None) -> None:
        self.shares["validation"] = _bf16_share(self.model)


@pytest.mark.timeout(120)
def test_validation_sees_the_exact_global_model_over_a_bf16_wire() -> None:
    """Against an ``ivyplug serve`` whose shard is all remote: the first pull travels in bf16 (every weight a bf16
    number: the control), the pull before validation in fp32, since Keras's ModelCheckpoint, BackupAndRestore and
    EarlyStopping keep the weights validation saw."""
    from tests.ps.service_harness import serve

    x, y = _data()
    model = _model()
    model.compile(optimizer=AsyncLAMB(learning_rate=0.02, sync_every=2), loss="mse")
    shares = _Shares()
    with serve("--shards", "1", "--workers", "1", "--token", "t0ken") as s:
        exchange = AsyncLAMBExchange(servers=s.address, token="t0ken", wire_dtype="bfloat16", timeout=60.0)
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, validation_data=(x, y), callbacks=[exchange, shares])
    assert shares.shares["start"] == 1.0, shares.shares
    assert shares.shares["validation"] < 0.1, shares.shares
