"""An input pipeline whose batch size can change while ``model.fit`` runs, identically on every replica.

Keras fixes the batch size of NumPy input for a whole ``fit`` call and captures the step count once.
:class:`ElasticDataset` instead feeds ``fit`` an infinite ``tf.data`` pipeline (use it with
``steps_per_epoch``) in which global batch ``k`` is a pure function of ``k`` and a batch-size schedule
held in a ``tf.Variable``:

* The training samples form an endless *stream*: pass 0's permutation, then pass 1's, ... (each a
  stateless shuffle seeded by ``(seed, pass)``). Batch ``k`` holds the ``B_k`` stream positions after
  those of batches ``0..k-1``. Every sample is therefore seen exactly once per pass over the data; with
  a constant ``B`` that divides ``N`` (or ``steps_per_epoch = ceil(N / B)`` steps for any ``B``) a Keras
  epoch is one pass.
* The schedule is piecewise constant: segments ``(start_step, start_position, batch_size)``. A change is
  scheduled *at a step*, never "from now on", so every replica and every MultiWorkerMirroredStrategy
  worker computes the same batches no matter how far its pipeline has read ahead. Each worker builds
  its replicas' slices itself (``distribute_datasets_from_function``: no auto-sharding, no graph
  rewrite): replica ``r`` of ``R`` gets positions ``[r*B/R, (r+1)*B/R)`` of the global batch, so
  batch sizes must be multiples of the number of replicas.

Why ``tf.data`` and not an infinite ``keras.utils.PyDataset``: Keras turns a PyDataset into a
``from_generator`` dataset that the strategy re-batches and shards by data; Python-side prefetching
(``max_queue_size``, 10 by default) makes the read-ahead large and the generator runs in a Python
thread. The graph pipeline here has no autotuned prefetch, so its read-ahead stays small and bounded.

Every Keras backend: :meth:`ElasticDataset.tf_dataset` feeds TensorFlow (any ``tf.distribute`` strategy)
and JAX, whose trainer reads ``tf.data`` input as NumPy; :meth:`ElasticDataset.py_dataset` is a
``keras.utils.PyDataset`` over the same schedule (batch ``k`` from NumPy indexing, no ``tf.data``), for
PyTorch or any backend. Both feed the same samples in the same order; TensorFlow stays a dependency of
this class on every backend (the per-pass permutation is TensorFlow's stateless shuffle).

Prefetch lag: the distributed iterator reads a few batches ahead of the model (measured here: 1-2 under
MirroredStrategy on 2 logical CPUs). A new batch size may therefore only be scheduled at a step at least
:attr:`ElasticDataset.lag` steps after the last consumed one (``earliest_change_step``); batches already
produced keep the old size. The learning rate must change at that same step, when the new size reaches
the model — :class:`~ivyplug.integrations.keras.load_balancer.IvyLoadBalancer` does exactly that.
:meth:`ElasticDataset.set_batch_size` refuses a step the pipeline has already produced.

Example::

    data = ElasticDataset(x_train, y_train, batch_size=64, seed=0)
    with strategy.scope():
        model = build_model()
    model.fit(data.tf_dataset(strategy), steps_per_epoch=data.steps_per_epoch, epochs=5,
              callbacks=[IvyLoadBalancer(data)])
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

#: Steps between the last consumed batch and the first batch that may get a new size.
DEFAULT_LAG = 4
#: Segments kept in the pipeline's lookup table (older ones can no longer be read).
MAX_SEGMENTS = 16


@dataclass(frozen=True)
class Segment:
    """From ``start_step`` on, batches hold ``batch_size`` samples, starting at stream ``start_position``."""

    start_step: int
    start_position: int
    batch_size: int


def _check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


class ElasticDataset:
    """In-memory ``(x, y)`` data served as an infinite pipeline with a schedulable global batch size.

    ``x`` and ``y`` are arrays with the same first dimension ``N``; ``batch_size`` is the initial
    *global* batch size (over all replicas and workers). ``lag`` is how many steps ahead of the model
    the pipeline may read (see the module docstring).
    """

    def __init__(
        self,
        x: Any,
        y: Any,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        lag: int = DEFAULT_LAG,
    ) -> None:
        x_arr, y_arr = np.asarray(x), np.asarray(y)
        if x_arr.ndim < 1 or y_arr.ndim < 1 or len(x_arr) != len(y_arr) or len(x_arr) == 0:
            raise ValueError(
                f"x and y must be non-empty arrays with the same first dimension, got shapes {x_arr.shape} "
                f"and {y_arr.shape}"
            )
        if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        self.x, self.y = x_arr, y_arr
        self.num_samples = len(x_arr)
        if not isinstance(shuffle, (bool, np.bool_)):
            raise ValueError(f"shuffle must be True or False, got {shuffle!r}")
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.lag = _check_positive_int("lag", lag)
        self.num_replicas = 1
        self._segments: list[Segment] = []
        self._table: tf.Variable | None = None
        self._produced: tf.Variable | None = None
        self._py_produced = -1  # the last batch a py_dataset() handed out (-1: none)
        self._permutations: dict[int, np.ndarray] = {}  # pass -> order, for the NumPy indices
        #: where the next ``fit`` continues the stream, and the learning-rate factor of batch-size changes that
        #: the last ``fit`` scheduled but did not reach (kept here, not on the callback, so that a new
        #: ``IvyLoadBalancer`` over this dataset continues where the last one stopped)
        self.resume_position: int | None = None
        self.owed_lr_factor = 1.0
        self._check_batch_size(batch_size)
        self._segments = [Segment(0, 0, int(batch_size))]

    # ----------------------------------------------------------------- schedule (pure Python)
    @property
    def segments(self) -> tuple[Segment, ...]:
        return tuple(self._segments)

    @property
    def batch_size(self) -> int:
        """The batch size of the latest scheduled segment (the one the run is heading to)."""
        return self._segments[-1].batch_size

    @property
    def steps_per_epoch(self) -> int:
        """Steps of one pass over the data at the initial batch size: pass this to ``fit``."""
        return math.ceil(self.num_samples / self._segments[0].batch_size)

    def _segment_at(self, step: int) -> Segment:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        current = self._segments[0]
        for seg in self._segments:
            if seg.start_step <= step:
                current = seg
        return current

    def batch_size_at(self, step: int) -> int:
        """Global batch size of batch ``step``."""
        return self._segment_at(step).batch_size

    def position_at(self, step: int) -> int:
        """Stream position of the first sample of batch ``step``."""
        seg = self._segment_at(step)
        return seg.start_position + (step - seg.start_step) * seg.batch_size

    def earliest_change_step(self, consumed_steps: int) -> int:
        """First step whose batch size may still change after the model consumed ``consumed_steps`` batches."""
        return max(int(consumed_steps) + self.lag, self._segments[-1].start_step)

    def _check_batch_size(self, batch_size: object) -> int:
        b = _check_positive_int("batch_size", batch_size)
        if b % self.num_replicas:
            raise ValueError(f"batch_size must be a multiple of the number of replicas ({self.num_replicas}), got {b}")
        if b > self.num_samples:
            raise ValueError(f"batch_size must be at most the number of samples ({self.num_samples}), got {b}")
        return b

    def set_batch_size(self, batch_size: int, at_step: int) -> None:
        """Batches from ``at_step`` on hold ``batch_size`` samples (global, a multiple of the replicas).

        ``at_step`` must not precede the latest scheduled change, nor a batch the pipeline has already
        produced (use :meth:`earliest_change_step`).
        """
        b = self._check_batch_size(batch_size)
        step = int(at_step)
        last = self._segments[-1]
        if step < last.start_step:
            raise ValueError(f"at_step must be >= the latest scheduled change ({last.start_step}), got {step}")
        produced = self.produced_step()
        if step <= produced:
            raise RuntimeError(
                f"the input pipeline already produced batch {produced} with the old batch size; schedule the "
                f"change at step > {produced} (earliest_change_step) or raise ElasticDataset(lag=...)"
            )
        position = self.position_at(step)
        if step == last.start_step:
            self._segments[-1] = Segment(step, last.start_position, b)
        elif b != last.batch_size:
            self._segments.append(Segment(step, position, b))
        self._push()

    def restart(self, batch_size: int | None = None, start_position: int = 0) -> None:
        """Begin a new schedule at step 0 (each ``fit`` call iterates afresh from batch 0).

        ``start_position`` is the stream position of batch 0: pass the position reached so far to
        continue the stream, or an epoch's first position to replay that epoch.
        """
        b = self._check_batch_size(self.batch_size if batch_size is None else batch_size)
        if isinstance(start_position, bool) or not isinstance(start_position, (int, np.integer)) or start_position < 0:
            raise ValueError(f"start_position must be an integer >= 0, got {start_position!r}")
        self._segments = [Segment(0, int(start_position), b)]
        if self._produced is not None:
            self._produced.assign(-1)
        self._py_produced = -1
        self._push()

    def produced_step(self) -> int:
        """The last batch index an input pipeline of this dataset has produced (-1: none yet)."""
        produced = self._py_produced
        if self._produced is not None:
            produced = max(produced, int(self._produced.numpy()))
        return produced

    def _push(self) -> None:
        if self._table is not None:
            rows = [[s.start_step, s.start_position, s.batch_size] for s in self._segments[-MAX_SEGMENTS:]]
            self._table.assign(np.asarray(rows, dtype=np.int64))

    # ----------------------------------------------------------------- sample order
    def permutation(self, pass_index: int) -> np.ndarray:
        """Sample order of one pass over the data (identity when ``shuffle=False``)."""
        return self._permutation(tf.constant(int(pass_index), tf.int64)).numpy()

    def _permutation(self, pass_index: tf.Tensor) -> tf.Tensor:
        order = tf.range(self.num_samples, dtype=tf.int64)
        if not self.shuffle:
            return order
        seed = tf.stack([tf.constant(self.seed, tf.int64), pass_index])
        return tf.random.experimental.stateless_shuffle(order, seed=seed)

    def _cached_permutation(self, pass_index: int) -> np.ndarray:
        order = self._permutations.get(pass_index)
        if order is None:
            if len(self._permutations) >= 4:  # a batch spans at most two passes: keep a few
                self._permutations.pop(min(self._permutations))
            order = self._permutations[pass_index] = self.permutation(pass_index)
        return order

    def numpy_indices(self, step: int, replica: int = 0, num_replicas: int = 1) -> np.ndarray:
        """:meth:`indices` computed in NumPy from the schedule (one permutation per pass, cached)."""
        seg = self._segment_at(int(step))
        share = seg.batch_size // num_replicas
        first = seg.start_position + (int(step) - seg.start_step) * seg.batch_size + replica * share
        positions = first + np.arange(share, dtype=np.int64)
        passes, offsets = np.divmod(positions, self.num_samples)
        out = np.empty(share, dtype=np.int64)
        for p in np.unique(passes):
            mask = passes == p
            out[mask] = self._cached_permutation(int(p))[offsets[mask]]
        return out

    def indices(self, step: int, replica: int = 0, num_replicas: int = 1) -> np.ndarray:
        """Sample indices of replica ``replica``'s slice of batch ``step`` (what the pipeline feeds it)."""
        table = tf.constant(
            [[s.start_step, s.start_position, s.batch_size] for s in self._segments[-MAX_SEGMENTS:]], tf.int64
        )
        return self._indices(table, tf.constant(step, tf.int64), replica, num_replicas).numpy()

    def _indices(self, table: tf.Tensor, step: tf.Tensor, replica: Any, num_replicas: int) -> tf.Tensor:
        row = tf.reduce_sum(tf.cast(table[:, 0] <= step, tf.int32)) - 1
        row = tf.maximum(row, 0)
        seg = table[row]
        batch = seg[2]
        share = batch // num_replicas
        first = seg[1] + (step - seg[0]) * batch + tf.cast(replica, tf.int64) * share
        positions = first + tf.range(share, dtype=tf.int64)
        n = tf.constant(self.num_samples, tf.int64)
        passes = positions // n
        offsets = positions % n
        first_pass = first // n
        # batch_size <= N, so one slice spans at most two passes.
        here = tf.gather(self._permutation(first_pass), offsets)
        after = tf.gather(self._permutation(first_pass + 1), offsets)
        return tf.where(passes == first_pass, here, after)

    # ----------------------------------------------------------------- pipelines
    def _ensure_state(self) -> tuple[tf.Variable, tf.Variable]:
        if self._table is None or self._produced is None:
            if tf.distribute.has_strategy():
                raise ValueError(
                    "ElasticDataset.tf_dataset must be called outside strategy.scope(): its schedule "
                    "variables are local to each worker, not mirrored"
                )
            rows = np.asarray([[s.start_step, s.start_position, s.batch_size] for s in self._segments], np.int64)
            self._table = tf.Variable(rows, dtype=tf.int64, shape=tf.TensorShape([None, 3]), trainable=False)
            self._produced = tf.Variable(-1, dtype=tf.int64, trainable=False)
        return self._table, self._produced

    def _pipeline(self, local_replicas: int, first_replica: int, num_replicas: int) -> tf.data.Dataset:
        table, produced = self._ensure_state()
        xs = tf.constant(self.x)
        ys = tf.constant(self.y)

        def element(j: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
            step = j // local_replicas
            replica = first_replica + j % local_replicas
            mark = produced.assign(tf.maximum(produced.read_value(), step))
            with tf.control_dependencies([mark]):
                idx = self._indices(table.read_value(), step, replica, num_replicas)
            return tf.gather(xs, idx), tf.gather(ys, idx)

        options = tf.data.Options()
        options.deterministic = True
        options.autotune.enabled = False
        options.experimental_optimization.inject_prefetch = False
        return tf.data.Dataset.counter().map(element).with_options(options)

    def py_dataset(self) -> Any:
        """The infinite schedule as a ``keras.utils.PyDataset`` of global batches (any backend; use with
        ``model.fit(..., steps_per_epoch=...)``). One Keras worker thread, no multiprocessing: on JAX and
        PyTorch Keras reads it batch by batch, one batch ahead of the model at most. TensorFlow wraps it in a
        prefetching ``tf.data`` pipeline that reads further ahead (changes then land later, at the step
        :meth:`set_batch_size` was given after :meth:`produced_step`): prefer :meth:`tf_dataset` there."""
        import keras

        dataset = self

        class _ElasticPyDataset(keras.utils.PyDataset):  # type: ignore[misc,name-defined]
            def __init__(self) -> None:
                super().__init__(workers=1, use_multiprocessing=False)

            @property
            def num_batches(self) -> int | None:
                return None  # infinite: fit's steps_per_epoch ends an epoch

            def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
                if dataset.num_replicas != 1:
                    raise ValueError(
                        "ElasticDataset.py_dataset feeds global batches: use tf_dataset(strategy) under a "
                        f"tf.distribute strategy ({dataset.num_replicas} replicas)"
                    )
                step = int(index)
                dataset._py_produced = max(dataset._py_produced, step)
                idx = dataset.numpy_indices(step)
                return dataset.x[idx], dataset.y[idx]

        return _ElasticPyDataset()

    def tf_dataset(self, strategy: Any = None) -> Any:
        """The infinite pipeline for ``model.fit(..., steps_per_epoch=...)``.

        ``strategy=None``: a plain ``tf.data.Dataset`` of global batches. Otherwise (pass
        ``model.distribute_strategy`` or the strategy whose scope built the model) a distributed
        dataset in which each worker builds its own replicas' slices. Call outside ``strategy.scope()``.
        """
        if strategy is None:
            return self._pipeline(1, 0, 1)
        replicas = int(strategy.num_replicas_in_sync)
        if self.batch_size % replicas or any(s.batch_size % replicas for s in self._segments):
            raise ValueError(
                f"batch_size must be a multiple of the number of replicas ({replicas}), got {self.batch_size}"
            )
        self.num_replicas = replicas
        self._ensure_state()

        def build(context: tf.distribute.InputContext) -> tf.data.Dataset:
            local = context.num_replicas_in_sync // context.num_input_pipelines
            return self._pipeline(local, context.input_pipeline_id * local, context.num_replicas_in_sync)

        return strategy.distribute_datasets_from_function(build)
