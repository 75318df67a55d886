"""ivyplug.integrations.keras.LAMB: the formula (float64 reference), Keras plumbing, tf.distribute, torch twin."""

from __future__ import annotations

import doctest
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from ivyplug.integrations.keras import lamb as lamb_module  # noqa: E402
from ivyplug.integrations.keras.lamb import LAMB  # noqa: E402

# --------------------------------------------------------------------------------------------------
# An independent float64 reference of LAMB (paper Algorithm 2 plus ivyplug's documented choices)
# --------------------------------------------------------------------------------------------------


def reference_lamb(
    x0: Sequence[np.ndarray],
    grad_steps: Sequence[Sequence[np.ndarray]],
    *,
    learning_rate: float = 1e-3,
    beta_1: float = 0.9,
    beta_2: float = 0.999,
    epsilon: float = 1e-6,
    weight_decay: float = 0.01,
    bias_correction: bool = True,
    max_trust_ratio: float = 10.0,
    min_trust_ratio: float = 0.0,
    max_grad_norm: float | None = None,
    adapt: Sequence[bool] | None = None,
    decay: Sequence[bool] | None = None,
) -> tuple[list[np.ndarray], int, set[str]]:
    """Returns the final variables, the number of skipped steps and which bounds were hit ("max", "min", "clip")."""
    x = [np.array(a, dtype=np.float64) for a in x0]
    m = [np.zeros_like(a) for a in x]
    v = [np.zeros_like(a) for a in x]
    adapt = [True] * len(x) if adapt is None else adapt
    decay = [True] * len(x) if decay is None else decay
    t, skipped, hits = 0, 0, set()
    for step_grads in grad_steps:
        g = [np.array(a, dtype=np.float64) for a in step_grads]
        norm = np.sqrt(sum(float(np.sum(a * a)) for a in g))
        if not np.isfinite(norm):
            skipped += 1
            continue
        if max_grad_norm is not None and norm > max_grad_norm:
            g = [a * (max_grad_norm / (norm + 1e-6)) for a in g]
            hits.add("clip")
        t += 1
        for i in range(len(x)):
            m[i] = beta_1 * m[i] + (1 - beta_1) * g[i]
            v[i] = beta_2 * v[i] + (1 - beta_2) * g[i] ** 2
            m_hat = m[i] / (1 - beta_1**t) if bias_correction else m[i]
            v_hat = v[i] / (1 - beta_2**t) if bias_correction else v[i]
            u = m_hat / (np.sqrt(v_hat) + epsilon)
            if decay[i]:
                u = u + weight_decay * x[i]
            ratio = 1.0
            if adapt[i]:
                x_norm, u_norm = np.linalg.norm(x[i]), np.linalg.norm(u)
                if x_norm > 0 and u_norm > 0:
                    raw = x_norm / u_norm
                    ratio = min(max(raw, min_trust_ratio), max_trust_ratio)
                    hits.update({"max"} if raw > max_trust_ratio else {"min"} if raw < min_trust_ratio else set())
            x[i] = x[i] - learning_rate * ratio * u
    return x, skipped, hits


NAMES = ("dense_kernel", "dense_bias", "layer_norm_gamma")


def random_problem(rng: np.random.Generator, steps: int) -> tuple[list[np.ndarray], list[list[np.ndarray]]]:
    """Initial values (one zero-initialised bias) and a gradient sequence for the variables in NAMES."""
    x0 = [rng.normal(size=(6, 5)) * 0.7, np.zeros(5), 1.0 + 0.1 * rng.normal(size=5)]
    grads = [[rng.normal(size=a.shape) * rng.uniform(0.1, 2.0) for a in x0] for _ in range(steps)]
    return x0, grads


def run_keras(
    x0: Sequence[np.ndarray],
    grad_steps: Sequence[Sequence[np.ndarray]],
    dtype: str = "float64",
    method_excludes: Sequence[str] | None = None,
    **hp: Any,
) -> tuple[list[np.ndarray], LAMB]:
    variables = [keras.Variable(a, dtype=dtype, name=n) for a, n in zip(x0, NAMES, strict=True)]
    opt = LAMB(**hp)
    if method_excludes:
        opt.exclude_from_weight_decay(var_names=list(method_excludes))
    for g in grad_steps:
        opt.apply([tf.constant(a, dtype=dtype) for a in g], variables)
    return [v.numpy() for v in variables], opt


REFERENCE_CASES: dict[str, tuple[dict[str, Any], dict[str, Any], set[str]]] = {
    # name: (hyperparameters, extra reference settings, bounds that must be hit)
    "default": ({"learning_rate": 0.05}, {}, set()),
    "no_weight_decay": ({"learning_rate": 0.05, "weight_decay": 0.0}, {}, set()),
    "strong_decay_no_bias_correction": (
        {"learning_rate": 0.02, "weight_decay": 0.3, "bias_correction": False},
        {},
        set(),
    ),
    "max_trust_ratio_binds": ({"learning_rate": 0.05, "max_trust_ratio": 0.2}, {}, {"max"}),
    "min_trust_ratio_binds": ({"learning_rate": 0.01, "min_trust_ratio": 1.5, "max_trust_ratio": 3.0}, {}, {"min"}),
    "global_clip_binds": ({"learning_rate": 0.05, "max_grad_norm": 0.5}, {}, {"clip"}),
    "exclusion_patterns": (
        {
            "learning_rate": 0.05,
            "exclude_from_layer_adaptation": ["bias", "norm"],
            "exclude_from_weight_decay": ["norm"],
        },
        {"adapt": [True, False, False], "decay": [True, True, False]},
        set(),
    ),
}


@pytest.mark.parametrize("case", sorted(REFERENCE_CASES))
def test_matches_float64_reference(case: str) -> None:
    hp, ref_extra, must_hit = REFERENCE_CASES[case]
    seed = int.from_bytes(os.urandom(4), "little")
    x0, grads = random_problem(np.random.default_rng(seed), steps=20)
    got, opt = run_keras(x0, grads, **hp)
    # Keras keeps the learning rate in a floatx (float32) variable: give the reference the same number.
    ref_hp = {k: v for k, v in hp.items() if not k.startswith("exclude_")}  # the reference takes adapt/decay
    ref_hp["learning_rate"] = float(np.float32(hp["learning_rate"]))
    want, skipped, hits = reference_lamb(x0, grads, **ref_hp, **ref_extra)
    assert must_hit <= hits, f"seed {seed}: the case does not exercise {must_hit - hits}"
    assert skipped == 0 and int(opt.skipped_steps) == 0
    assert int(opt.iterations) == 20
    for name, g, w in zip(NAMES, got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12, err_msg=f"{name}, seed {seed}")
    assert np.all(got[1] != 0), "the zero-initialised bias must move (trust ratio 1 when ‖x‖ = 0)"


def test_float32_matches_reference_and_base_method_exclusion() -> None:
    """float32 variables, and the Keras base-class exclude_from_weight_decay(var_names=...) method is honoured."""
    seed = int.from_bytes(os.urandom(4), "little")
    x0, grads = random_problem(np.random.default_rng(seed), steps=20)
    got, _ = run_keras(x0, grads, dtype="float32", method_excludes=["gamma"], learning_rate=0.05, weight_decay=0.1)
    want, _, _ = reference_lamb(x0, grads, learning_rate=0.05, weight_decay=0.1, decay=[True, True, False])
    for name, g, w in zip(NAMES, got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6, err_msg=f"{name}, seed {seed}")


def test_non_finite_gradients_skip_the_whole_step_and_are_counted() -> None:
    seed = int.from_bytes(os.urandom(4), "little")
    x0, grads = random_problem(np.random.default_rng(seed), steps=20)
    grads[4][2][1] = np.nan  # one NaN in one variable: every variable's step is skipped
    grads[9][0][0, 0] = -np.inf
    hp = {"learning_rate": 0.05, "max_grad_norm": 1.0}
    variables = [keras.Variable(a, dtype="float64", name=n) for a, n in zip(x0, NAMES, strict=True)]
    opt = LAMB(**hp)

    def state() -> list[np.ndarray]:
        moments = [s for s in opt.variables if s.name.endswith(("momentum", "velocity"))]
        return [v.numpy().copy() for v in [*variables, *moments]]

    for step, g in enumerate(grads):
        before = state()
        opt.apply([tf.constant(a) for a in g], variables)
        if step in (4, 9):
            after = state()
            assert len(after) == len(before) == 9
            for b, a in zip(before, after, strict=True):
                np.testing.assert_array_equal(a, b)
    want, skipped, _ = reference_lamb(x0, grads, **{**hp, "learning_rate": float(np.float32(0.05))})
    assert skipped == 2 and int(opt.skipped_steps) == 2 and int(opt.iterations) == 20
    for name, v, w in zip(NAMES, variables, want, strict=True):
        np.testing.assert_allclose(v.numpy(), w, rtol=1e-10, atol=1e-12, err_msg=f"{name}, seed {seed}")


# --------------------------------------------------------------------------------------------------
# Keras plumbing: validation, config, compile by name, save/load
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("learning_rate", -1e-3),
        ("beta_1", 1.0),
        ("beta_2", -0.1),
        ("epsilon", -1e-8),
        ("weight_decay", -0.01),
        ("weight_decay", float("nan")),
        ("bias_correction", "yes"),
        ("max_trust_ratio", 0.0),
        ("min_trust_ratio", -1.0),
        ("min_trust_ratio", 20.0),
        ("max_grad_norm", 0.0),
        ("max_grad_norm", float("inf")),
        ("exclude_from_layer_adaptation", "bias"),
        ("exclude_from_weight_decay", ["("]),
    ],
)
def test_invalid_hyperparameters_raise_value_error_naming_them(name: str, value: Any) -> None:
    with pytest.raises(ValueError, match=name):
        LAMB(**{name: value})


@pytest.mark.parametrize("keras_clip", ["clipnorm", "global_clipnorm"])
def test_max_grad_norm_with_a_keras_norm_clip_is_refused(keras_clip: str) -> None:
    with pytest.raises(ValueError, match=f"pass one of max_grad_norm and {keras_clip}, not both"):
        LAMB(max_grad_norm=1.0, **{keras_clip: 1.0})
    LAMB(**{keras_clip: 1.0})  # each alone is fine, and so is an element-wise clip beside max_grad_norm
    LAMB(max_grad_norm=1.0, clipvalue=0.5)


CONFIG = {
    "learning_rate": 0.01,
    "beta_1": 0.8,
    "beta_2": 0.99,
    "epsilon": 1e-7,
    "weight_decay": 0.05,
    "bias_correction": False,
    "max_trust_ratio": 5.0,
    "min_trust_ratio": 0.1,
    "max_grad_norm": 1.5,
    "exclude_from_layer_adaptation": ["bias"],
    "exclude_from_weight_decay": ["bias", "norm"],
}


def _comparable(config: dict[str, Any]) -> dict[str, Any]:
    """The CONFIG keys, with the learning rate as Keras stores it (a float32 variable)."""
    return {k: float(np.float32(config[k])) if k == "learning_rate" else config[k] for k in CONFIG}


def test_config_round_trip_keeps_lamb_decay_out_of_the_base_class() -> None:
    opt = LAMB(**CONFIG, name="my_lamb")
    config = opt.get_config()
    assert _comparable(config) == _comparable(CONFIG)
    assert opt.weight_decay is None, "the Keras base class must not apply decoupled decay"
    clone = LAMB.from_config(config)
    assert clone.get_config() == config
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert type(restored) is LAMB and restored.get_config() == config
    assert LAMB().get_config()["weight_decay"] == 0.01 and LAMB().epsilon == 1e-6


def _tiny_model() -> Any:
    return keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(12, activation="tanh"),
            keras.layers.Dense(3),
        ]
    )


@pytest.fixture(scope="module")
def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1234)
    return rng.normal(size=(64, 8)).astype("float32"), rng.normal(size=(64, 3)).astype("float32")


@pytest.fixture(scope="module")
def initial_weights() -> list[np.ndarray]:
    keras.utils.set_random_seed(7)
    return [w.copy() for w in _tiny_model().get_weights()]


def test_compile_by_registered_name_and_save_load_continues_identically(
    tmp_path: Any, data: tuple[np.ndarray, np.ndarray], initial_weights: list[np.ndarray]
) -> None:
    x, y = data
    model = _tiny_model()
    model.set_weights(initial_weights)
    model.compile(optimizer={"class_name": "ivyplug>LAMB", "config": dict(CONFIG)}, loss="mse")
    assert type(model.optimizer) is LAMB
    assert _comparable(model.optimizer.get_config()) == _comparable(CONFIG)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)

    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert type(loaded.optimizer) is LAMB
    assert loaded.optimizer.get_config() == model.optimizer.get_config()
    assert len(loaded.optimizer.variables) == len(model.optimizer.variables)
    for a, b in zip(loaded.optimizer.variables, model.optimizer.variables, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())

    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    loaded.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert int(loaded.optimizer.iterations) == int(model.optimizer.iterations) == 8
    for a, b in zip(loaded.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


# --------------------------------------------------------------------------------------------------
# tf.distribute.MirroredStrategy (2 logical CPUs) against a single device
# --------------------------------------------------------------------------------------------------


def _fit(
    strategy: Any, initial: list[np.ndarray], data: tuple[np.ndarray, np.ndarray], **hp: Any
) -> tuple[list[np.ndarray], Any]:
    with strategy.scope():
        model = _tiny_model()
        model.set_weights(initial)
        model.compile(optimizer=LAMB(learning_rate=0.02, exclude_from_layer_adaptation=["bias"], **hp), loss="mse")
    x, y = data
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    return model.get_weights(), model


def _max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    """NaN-propagating (tests/ps/diffs.py): a NaN in any weight fails both ``< 1e-6`` and ``> 1e-4``."""
    from tests.ps.diffs import max_abs_diff

    return max_abs_diff(a, b)


class _OwnKeysMirroredStrategy(tf.distribute.MirroredStrategy):
    """A MirroredStrategy whose collective keys no other strategy in this process uses.

    Every MirroredStrategy starts its collective group/instance keys at the same numbers, and TensorFlow's
    collective runtime remembers a key's tensor shape for the whole process: a second strategy whose first
    all-reduce has another shape aborts with "Shape mismatch in the collective instance 100". TensorFlow's
    own tests offset the keys with ``_collective_key_base``; this module uses one strategy with its own base.
    """

    _collective_key_base = 7919


@pytest.fixture(scope="module")
def strategy() -> Any:
    """One MirroredStrategy over the two logical CPUs for all tests of this module."""
    logical = tf.config.list_logical_devices("CPU")
    if len(logical) < 2:
        pytest.skip("TensorFlow was initialised before the logical-CPU split")
    return _OwnKeysMirroredStrategy([d.name for d in logical[:2]])


@pytest.fixture(scope="module")
def single_device_runs(
    data: tuple[np.ndarray, np.ndarray], initial_weights: list[np.ndarray]
) -> dict[float | None, list[np.ndarray]]:
    default = tf.distribute.get_strategy()
    return {clip: _fit(default, initial_weights, data, max_grad_norm=clip)[0] for clip in (None, 0.05)}


@pytest.mark.parametrize("max_grad_norm", [None, 0.05])
def test_mirrored_matches_single_device(
    strategy: Any,
    max_grad_norm: float | None,
    data: tuple[np.ndarray, np.ndarray],
    initial_weights: list[np.ndarray],
    single_device_runs: dict[float | None, list[np.ndarray]],
) -> None:
    assert _max_diff(single_device_runs[None], single_device_runs[0.05]) > 1e-4, "the clip must bind"
    weights, model = _fit(strategy, initial_weights, data, max_grad_norm=max_grad_norm)
    assert strategy.num_replicas_in_sync == 2
    for var in [*model.trainable_variables, *model.optimizer.variables]:
        first, second = strategy.experimental_local_results(var.value)
        np.testing.assert_array_equal(first.numpy(), second.numpy(), err_msg=f"replicas differ: {var.path}")
    assert _max_diff(weights, single_device_runs[max_grad_norm]) < 1e-6


def test_keras_per_replica_clipping_would_not_match(
    strategy: Any,
    data: tuple[np.ndarray, np.ndarray],
    initial_weights: list[np.ndarray],
    single_device_runs: dict[float | None, list[np.ndarray]],
) -> None:
    """The trap max_grad_norm avoids: Keras's global_clipnorm clips each replica's gradient before the sum.

    On one device global_clipnorm=0.05 and max_grad_norm=0.05 clip the same full-batch gradient; mirrored, Keras's
    clip lands elsewhere, so the test above would fail if LAMB clipped per replica.
    """
    weights, _ = _fit(strategy, initial_weights, data, global_clipnorm=0.05)
    assert _max_diff(weights, single_device_runs[0.05]) > 1e-4


def test_nan_on_one_replica_skips_the_step_on_all(strategy: Any) -> None:
    with strategy.scope():
        variables = [keras.Variable(np.ones((3, 2), "float32"), name="w"), keras.Variable(np.zeros(2), name="b")]
        opt = LAMB(learning_rate=0.1)
        opt.build(variables)

    @tf.function
    def step(poison: Any) -> None:
        def replica_fn() -> None:
            ctx = tf.distribute.get_replica_context()
            bad = tf.logical_and(poison, tf.equal(ctx.replica_id_in_sync_group, 0))
            g = tf.where(bad, tf.constant(np.nan, tf.float32), tf.constant(1.0, tf.float32))
            opt.apply([tf.fill((3, 2), g), tf.fill((2,), g)], variables)

        strategy.run(replica_fn)

    step(tf.constant(True))
    assert int(opt.skipped_steps.numpy()) == 1
    for var in variables:
        for local in strategy.experimental_local_results(var.value):
            assert np.all(np.isfinite(local.numpy()))
    np.testing.assert_array_equal(variables[0].numpy(), np.ones((3, 2)))
    step(tf.constant(False))
    assert int(opt.skipped_steps.numpy()) == 1 and int(opt.iterations.numpy()) == 2
    assert np.all(variables[0].numpy() < 1)


# --------------------------------------------------------------------------------------------------
# Registry, lazy imports, docstring example
# --------------------------------------------------------------------------------------------------


def test_registry_provides_the_keras_lamb() -> None:
    import ivyplug

    registry = ivyplug.get_registry()
    assert "keras.lamb" in registry.names("optimizer")
    assert registry.get("optimizer", "keras.lamb") is LAMB


def test_lazy_package_and_plugin_import_no_framework() -> None:
    code = (
        "import sys, ivyplug.integrations.keras as k, ivyplug.integrations.keras.plugin as p\n"
        "assert 'LAMB' in dir(k) and 'LAMB' in k.__all__\n"
        "names = [c.full_name for c in p.ivyplug_optimizers()]\n"
        "assert names == ['keras.lamb', 'keras.async_lamb'], names\n"
        "loaded = sorted(m for m in ('keras', 'tensorflow', 'torch') if m in sys.modules)\n"
        "assert not loaded, loaded\n"
    )
    env = {**os.environ, "IVYPLUG_DISABLE_PLUGIN_AUTOLOAD": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    import ivyplug.integrations.keras as package

    assert package.LAMB is LAMB
    with pytest.raises(AttributeError, match="NoSuchThing"):
        _ = package.NoSuchThing


def test_docstring_example_runs() -> None:
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    tests = [t for t in finder.find(lamb_module.LAMB, "LAMB", globs={}) if t.examples]
    assert tests, "LAMB's docstring must hold a runnable example"
    for test in tests:
        runner.run(test)
    assert runner.summarize(verbose=False).failed == 0


# --------------------------------------------------------------------------------------------------
# The torch twin: same weights and gradient sequence, same result
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_grad_norm", [None, 2.0])
def test_agrees_with_torch_lamb(max_grad_norm: float | None) -> None:
    torch = pytest.importorskip("torch")
    from ivyplug.optim import LAMB as TorchLAMB

    seed = int.from_bytes(os.urandom(4), "little")
    x0, grads = random_problem(np.random.default_rng(seed), steps=20)
    x0 = [a.astype(np.float32) for a in x0]
    grads = [[a.astype(np.float32) for a in g] for g in grads]
    grads[6][1][0] = np.nan  # the skip policy must agree too
    hp = {"weight_decay": 0.1, "max_trust_ratio": 0.4, "min_trust_ratio": 0.0, "max_grad_norm": max_grad_norm}

    params = [torch.nn.Parameter(torch.tensor(a)) for a in x0]
    torch_opt = TorchLAMB(params, lr=0.05, betas=(0.9, 0.999), eps=1e-6, **hp)
    for g in grads:
        for p, a in zip(params, g, strict=True):
            p.grad = torch.tensor(a)
        torch_opt.step()

    got, keras_opt = run_keras(x0, grads, dtype="float32", learning_rate=0.05, beta_1=0.9, beta_2=0.999, **hp)
    _, skipped, hits = reference_lamb(x0, grads, learning_rate=0.05, **hp)
    assert "max" in hits, f"seed {seed}: max_trust_ratio must bind"
    assert skipped == 1 and torch_opt.skipped_steps == 1 and int(keras_opt.skipped_steps) == 1
    for name, p, k in zip(NAMES, params, got, strict=True):
        np.testing.assert_allclose(k, p.detach().numpy(), rtol=1e-5, atol=1e-5, err_msg=f"{name}, seed {seed}")
