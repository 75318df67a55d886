"""LAMB for Keras 3: the same algorithm, defaults and choices as :class:`ivyplug.optim.LAMB`.

Keras traps this class works around (checked on Keras 3.15.1, TensorFlow backend):

* The base optimizer applies *decoupled* weight decay when it is given ``weight_decay``; LAMB's
  decay belongs inside the trust-ratio update, so the base class always gets ``None`` and LAMB keeps
  its own value (``lamb_weight_decay``, written to the config as ``weight_decay``).
* Keras's ``clipnorm`` / ``global_clipnorm`` run per replica, before the cross-replica sum. LAMB's
  ``max_grad_norm`` clips by the global norm of the *aggregated* gradient: under
  ``tf.distribute`` the clip runs right after Keras's all-reduce (``_all_reduce_sum_gradients``),
  so a mirrored run takes the same step as a single-device run on the whole batch.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import keras
from ivyplug.integrations.keras import autoregister as _autoregister
from keras import ops

from ivyplug.name_patterns import check_patterns, matches_any
from ivyplug.optim.lamb_hyper import check_eps, check_flag, check_real, check_trust_bounds

__all__ = ["LAMB"]

_CLIP_EPS = 1e-6  # as in torch.nn.utils.clip_grad_norm_ and ivyplug.optim.LAMB
_INT_COUNTER_DTYPE = "int"  # int64 on TensorFlow, int32 on JAX (the base class's own iteration dtype)


def _constant(value: float, dtype: Any) -> Any:
    """A Python float as a tensor of ``dtype``, without a detour through float32 (``ops.cast(0.01, "float64")``
    on TensorFlow rounds 0.01 to float32 first)."""
    return ops.convert_to_tensor(value, dtype=dtype)


def _sum_of_squares(x: Any) -> Any:
    """``Σx²``; on TensorFlow one reduction kernel (``l2_loss``) instead of a squared temporary and a sum."""
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return 2 * tf.nn.l2_loss(x)
    return ops.sum(ops.square(x))


def _is_traced(value: Any) -> bool:
    """Whether ``value`` is a placeholder of a function being traced (JAX ``jit``, PyTorch ``torch.compile``)."""
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        return isinstance(value, jax.core.Tracer)
    if backend == "torch":
        import torch

        return bool(torch.compiler.is_compiling())
    return False


def _no_op_unless(apply: Any, scalars: tuple[Any, ...]) -> tuple[Any, ...]:
    """:meth:`LAMB._step_scalars` that leave ``m``, ``v`` and ``x`` as they are where ``apply`` is false
    (``m·1 + 0·g``, ``v·1 + 0·g²``, ``x − 0·w``; exact while ``w`` is finite, as ``epsilon > 0`` keeps it)."""
    lr, c, eps, b1, one_minus_b1, b2, one_minus_b2, decay_over_c = scalars
    one, zero = ops.ones_like(b1), ops.zeros_like(b1)
    return (
        ops.where(apply, lr, ops.zeros_like(lr)),
        c,
        eps,
        ops.where(apply, b1, one),
        ops.where(apply, one_minus_b1, zero),
        ops.where(apply, b2, one),
        ops.where(apply, one_minus_b2, zero),
        decay_over_c,
    )


def _variable_path(variable: Any) -> str:
    """The name patterns are matched against: ``layer/.../name`` when Keras knows it."""
    return str(getattr(variable, "path", None) or variable.name)


@keras.saving.register_keras_serializable(package="ivyplug")
class LAMB(keras.optimizers.Optimizer):
    """LAMB (You et al., ICLR 2020, Algorithm 2) with a bounded layer-wise trust ratio.

    For every variable ``x`` with gradient ``g`` at step ``t``::

        m = beta_1 m + (1 - beta_1) g          v = beta_2 v + (1 - beta_2) g²
        m̂ = m / (1 - beta_1^t)                 v̂ = v / (1 - beta_2^t)       (if bias_correction)
        u = m̂ / (√v̂ + epsilon) + weight_decay · x
        ratio = clip(‖x‖ / ‖u‖, min_trust_ratio, max_trust_ratio)   (1 if ‖x‖ = 0 or ‖u‖ = 0)
        x = x - learning_rate · ratio · u

    Choices (the same as the torch ``ivyplug.optim.LAMB``):

    * Weight decay sits inside the trust-ratio update, as in the paper; it is not Keras's decoupled decay. The
      value lives in ``lamb_weight_decay`` and in ``get_config()["weight_decay"]``; the base-class attribute
      ``weight_decay`` stays ``None`` so that Keras adds no decay of its own.
    * The *ratio* is clipped (not the norms); the fallback ratio 1 (‖x‖ or ‖u‖ zero or not finite) is not clipped.
    * ``max_grad_norm`` clips all gradients by their global norm after the cross-replica sum
      with ``clip_grad_norm_``'s coefficient: g ← g · min(1, max_grad_norm / (‖g‖ + 1e-6)).
    * ``exclude_from_layer_adaptation`` / ``exclude_from_weight_decay`` are lists of regular expressions, each
      searched anywhere in a variable's path (``re.search``, so ``"bias"`` matches ``"dense_1/bias"``): matching
      variables get ratio 1 / no decay. This is the rule of the torch ``lamb_param_groups`` options of the same
      names, which match qualified parameter names (``"0.bias"``). A path begins with the model's name
      (``"sequential/dense_1/bias"``), so a ``^`` anchor means something else here. Keras's own
      ``exclude_from_weight_decay(var_names=...)`` (also honoured, as ``var_list=...``, when called before the
      optimizer is built) keeps Keras's rule: a substring of the variable's name (``"bias"``), not of its path.
    * Non-finite gradients: if any aggregated gradient holds a NaN or an infinity (or their global norm
      overflows), the whole step is skipped (no variable, moment or bias-correction step changes) and
      :attr:`skipped_steps` counts it. ``iterations`` still advances, as for every Keras optimizer; bias
      correction uses the number of applied steps, as the torch LAMB does.
    * A variable without a gradient in a step (``None``, which Keras leaves out) is not changed, but the step
      still counts for its bias correction later: the count is the optimizer's, as for Keras's own ``Adam``. The
      torch LAMB, as torch's ``Adam``, counts per parameter the steps that had its gradient, so the twins differ
      for a variable whose gradient was missing in some steps (and only there).
    * Sparse (``IndexedSlices``) gradients are made dense: LAMB decays every moment entry each step.

    The default ``learning_rate=1e-3`` is the torch LAMB's, so the twins agree; since the trust ratio makes
    every step a fraction of the layer's own norm, ``1e-2`` is the better start for small Keras models (the
    README's digits convnet reaches about 0.98 test accuracy in 10 epochs with it, about 0.7 with ``1e-3``).

    Example:
        >>> import numpy as np, keras
        >>> from ivyplug.integrations.keras import LAMB
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        >>> opt = LAMB(learning_rate=1e-2, exclude_from_layer_adaptation=["bias"],
        ...            exclude_from_weight_decay=["bias"])
        >>> model.compile(optimizer=opt, loss="mse")
        >>> x, y = np.ones((8, 4), "float32"), np.zeros((8, 2), "float32")
        >>> _ = model.fit(x, y, epochs=1, verbose=0)
        >>> int(opt.iterations), int(opt.skipped_steps)
        (1, 0)
        >>> model.compile(optimizer={"class_name": "ivyplug>LAMB", "config": {"learning_rate": 1e-2}}, loss="mse")
        >>> type(model.optimizer).__name__
        'LAMB'
    """

    def __init__(
        self,
        learning_rate: Any = 1e-3,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-6,
        weight_decay: float = 0.01,
        bias_correction: bool = True,
        max_trust_ratio: float = 10.0,
        min_trust_ratio: float = 0.0,
        max_grad_norm: float | None = None,
        exclude_from_layer_adaptation: Sequence[str] | None = None,
        exclude_from_weight_decay: Sequence[str] | None = None,
        name: str | None = None,
        **kwargs: Any,
    ) -> None:
        if isinstance(learning_rate, numbers.Real):  # a bool too: refused, as the torch twin does
            learning_rate = check_real("learning_rate", learning_rate, "a finite float >= 0", lambda x: x >= 0)
        beta_1 = check_real("beta_1", beta_1, "in [0, 1)", lambda x: 0.0 <= x < 1.0)
        beta_2 = check_real("beta_2", beta_2, "in [0, 1)", lambda x: 0.0 <= x < 1.0)
        epsilon = check_eps("epsilon", epsilon)
        weight_decay = check_real("weight_decay", weight_decay, "a finite float >= 0", lambda x: x >= 0)
        check_flag("bias_correction", bias_correction)
        min_trust_ratio, max_trust_ratio = check_trust_bounds(min_trust_ratio, max_trust_ratio)
        if max_grad_norm is not None:
            max_grad_norm = check_real("max_grad_norm", max_grad_norm, "None or a finite float > 0", lambda x: x > 0)
            for option in ("clipnorm", "global_clipnorm"):
                if kwargs.get(option) is not None:  # as Keras refuses clipnorm with global_clipnorm
                    raise ValueError(
                        f"LAMB: pass one of max_grad_norm and {option}, not both: {option} clips each replica's "
                        "gradient before Keras's cross-replica sum, max_grad_norm the summed gradient after it (the "
                        "same step as on one device); both would clip twice"
                    )
        layer_patterns = check_patterns("exclude_from_layer_adaptation", exclude_from_layer_adaptation)
        decay_patterns = check_patterns("exclude_from_weight_decay", exclude_from_weight_decay)

        # weight_decay=None: the base class would otherwise add decoupled decay on top of LAMB's.
        super().__init__(learning_rate=learning_rate, weight_decay=None, name=name, **kwargs)
        self.beta_1 = beta_1
        self.beta_2 = beta_2
        self.epsilon = epsilon
        self.lamb_weight_decay = weight_decay
        self.bias_correction = bias_correction
        self.max_trust_ratio = max_trust_ratio
        self.min_trust_ratio = min_trust_ratio
        self.max_grad_norm = max_grad_norm
        self.layer_adaptation_patterns = layer_patterns
        self.weight_decay_patterns = decay_patterns

    def build(self, var_list: list[Any]) -> None:
        """Create the moments, the skipped-step counter and the per-variable exclusion flags."""
        if self.built:
            return
        super().build(var_list)
        self._momentums, self._velocities = self.add_optimizer_variables(var_list, ["momentum", "velocity"])
        self._skipped_steps = self.add_variable(
            shape=(), dtype=_INT_COUNTER_DTYPE, aggregation="only_first_replica", name="skipped_steps"
        )
        adapt, decay = [], []
        for variable in var_list:
            path = _variable_path(variable)
            adapt.append(not matches_any(self.layer_adaptation_patterns, path))
            decay.append(
                self.lamb_weight_decay > 0
                and not matches_any(self.weight_decay_patterns, path)
                and self._use_weight_decay(variable)
            )
        # Tuples of plain bools: Keras's tracker leaves them alone.
        self._adapt_flags = tuple(adapt)
        self._decay_flags = tuple(decay)

    @property
    def skipped_steps(self) -> Any:
        """How many steps were skipped because a gradient was not finite (a Keras variable; 0 before build)."""
        if not self.built:
            return 0
        return self._skipped_steps

    # The aggregate-then-clip part of a step -------------------------------------------------------

    def _apply_weight_decay(self, variables: Any) -> None:
        """No decoupled decay: LAMB's decay is inside its update (the base gets weight_decay=None anyway)."""

    def _screen_gradients(self, grads: list[Any]) -> tuple[list[Any], Any]:
        """Clip by the global norm (when asked) and decide whether the step runs (the global norm is finite).

        Runs on the aggregated gradients, so every replica computes the same result.
        """
        grads = [ops.convert_to_tensor(g) for g in grads]
        # float64 if any gradient is, else float32 (keras.backend.result_type(..., "float32") can narrow float64).
        dtypes = {keras.backend.standardize_dtype(g.dtype) for g in grads}
        norm_dtype = "float64" if "float64" in dtypes else "float32"
        total = ops.sqrt(ops.sum(ops.stack([_sum_of_squares(ops.cast(g, norm_dtype)) for g in grads])))
        finite = ops.isfinite(total)  # False when any element is NaN/Inf, or when the norm overflows
        if self.max_grad_norm is None:
            return grads, finite
        # The coefficient of torch.nn.utils.clip_grad_norm_ (and of ivyplug.optim.LAMB): min(1, c / (‖g‖ + 1e-6)).
        # min(coefficient, 1) with ``where``: ops.minimum on PyTorch returns floatx, float64 inputs included.
        coefficient = _constant(self.max_grad_norm, norm_dtype) / (total + _constant(_CLIP_EPS, norm_dtype))
        scale = ops.where(coefficient < 1, coefficient, ops.ones_like(coefficient))
        return [g * ops.cast(scale, g.dtype) for g in grads], finite

    def _backend_update_step(self, grads: list[Any], trainable_variables: list[Any], learning_rate: Any) -> None:
        if keras.backend.backend() == "tensorflow":
            self._tf_update_step(grads, trainable_variables, learning_rate)
        else:
            self._portable_update_step(list(grads), list(trainable_variables), learning_rate)

    def _portable_update_step(self, grads: list[Any], trainable_variables: list[Any], learning_rate: Any) -> None:
        """JAX and PyTorch: screen the gradients, then update every variable or none.

        Run eagerly, a Python ``if`` on the concrete flag. Traced (``jax.jit``, ``torch.compile``), where no side
        effect may sit in a branch: a skipped step is made a no-op through its scalars (``β → 1``, ``1 − β → 0``,
        ``η → 0``, and the gradients read as 0), so ``m``, ``v`` and ``x`` keep their values exactly (``epsilon > 0``
        keeps ``m/(√v + ε)`` finite) and the update stays one fused pass, measured faster on JAX than a branch.
        """
        grads, finite = self._screen_gradients(grads)
        traced = _is_traced(finite)
        scalars: dict[str, tuple[Any, ...]] = {}
        for variable in trainable_variables:
            dtype = keras.backend.standardize_dtype(variable.dtype)
            if dtype not in scalars:
                scalars[dtype] = self._step_scalars(dtype, learning_rate)
                if traced:
                    scalars[dtype] = _no_op_unless(finite, scalars[dtype])
        indices = [self._get_variable_index(v) for v in trainable_variables]

        def updated() -> list[tuple[Any, Any, Any]]:
            out = []
            for grad, variable in zip(grads, trainable_variables, strict=True):
                dtype = keras.backend.standardize_dtype(variable.dtype)
                if traced:  # a skipped step reads zeros (a finite g can still overflow g²)
                    grad = ops.where(finite, grad, ops.zeros_like(grad))
                m_new, v_new, step = self._lamb_step(grad, variable, scalars[dtype])
                out.append((m_new, v_new, ops.convert_to_tensor(variable) - step))
            return out

        new_values = updated() if traced or bool(ops.convert_to_numpy(finite)) else None
        if new_values is not None:
            for (m_new, v_new, x_new), i, variable in zip(new_values, indices, trainable_variables, strict=True):
                self.assign(self._momentums[i], m_new)
                self.assign(self._velocities[i], v_new)
                self.assign(variable, x_new)
        self._skipped_steps.assign_add(ops.cast(ops.logical_not(finite), self._skipped_steps.dtype))

    def _tf_update_step(self, grads: list[Any], trainable_variables: list[Any], learning_rate: Any) -> None:
        """TensorFlow: sum over replicas (Keras's own all-reduce), clip, then update each variable's copies."""
        import tensorflow as tf

        tf_vars = [v.value if isinstance(v, keras.Variable) else v for v in trainable_variables]
        reduced = self._all_reduce_sum_gradients(list(zip(grads, tf_vars, strict=True)))
        dense = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g, _ in reduced]
        dense, finite = self._screen_gradients(dense)
        # The step's scalars (bias corrections, learning rate) once per dtype, not once per variable.
        dtypes = {tf.as_dtype(v.dtype).name for v in tf_vars}
        scalars = {dtype: self._step_scalars(dtype, learning_rate) for dtype in sorted(dtypes)}

        def update_one(var: Any, grad: Any, var_scalars: Any, ok: Any) -> None:  # `update` passes the variable first
            self._lamb_update(grad, var, var_scalars, ok)

        def merge_update(distribution: Any, grads_and_vars: list[Any], scalars: Any, ok: Any) -> None:
            for grad, var in grads_and_vars:
                args = (grad, scalars[tf.as_dtype(var.dtype).name], ok)
                distribution.extended.update(var, update_one, args=args, group=False)

        tf.__internal__.distribute.interim.maybe_merge_call(
            merge_update, self._distribution_strategy, list(zip(dense, tf_vars, strict=True)), scalars, finite
        )
        self._skipped_steps.assign_add(ops.cast(ops.logical_not(finite), self._skipped_steps.dtype))

    # The per-variable LAMB step ---------------------------------------------------------------------

    def update_step(self, gradient: Any, variable: Any, learning_rate: Any) -> None:
        """One variable's step (Keras API); skipped when this gradient is not finite."""
        scalars = self._step_scalars(keras.backend.standardize_dtype(variable.dtype), learning_rate)
        self._lamb_update(gradient, variable, scalars, ops.all(ops.isfinite(gradient)))

    def _lamb_update(self, gradient: Any, variable: Any, scalars: tuple[Any, ...], apply: Any) -> None:
        """Write one variable's step if ``apply`` (a boolean tensor) holds.

        TensorFlow gets one branch per variable (nothing is computed or written when the step is skipped); the other
        backends select with ``where`` (their optimizers are traced without side effects in branches).
        """
        if keras.backend.backend() == "tensorflow":
            import tensorflow as tf

            def run() -> None:
                m_new, v_new, step = self._lamb_step(gradient, variable, scalars)
                self.assign(self._momentums[index], m_new)
                self.assign(self._velocities[index], v_new)
                self.assign_sub(variable, step)

            index = self._get_variable_index(variable)
            tf.cond(tf.convert_to_tensor(apply), run, lambda: None)
            return
        index = self._get_variable_index(variable)
        m, v = self._momentums[index], self._velocities[index]
        m_new, v_new, step = self._lamb_step(gradient, variable, scalars)
        # Variables as tensors: JAX refuses a Keras variable as an argument of a traced function (``where``).
        self.assign(m, ops.where(apply, m_new, ops.convert_to_tensor(m)))
        self.assign(v, ops.where(apply, v_new, ops.convert_to_tensor(v)))
        self.assign_sub(variable, ops.where(apply, step, ops.zeros_like(step)))

    def _step_scalars(self, dtype: str, learning_rate: Any) -> tuple[Any, ...]:
        """``(η, c, ε', β1, 1−β1, β2, 1−β2, λ/c)`` in ``dtype`` for this step, with ``m̂/(√v̂+ε) = c·m/(√v+ε')``,
        ``c = √bc2/bc1`` and ``ε' = ε·√bc2`` (bias correction counts applied steps: skipped ones do not count)."""
        lr = ops.cast(learning_rate, dtype)
        b1 = _constant(self.beta_1, dtype)
        b2 = _constant(self.beta_2, dtype)
        eps = _constant(self.epsilon, dtype)
        if self.bias_correction:
            step = ops.cast(self.iterations + 1 - ops.cast(self._skipped_steps, self.iterations.dtype), dtype)
            bc2_sqrt = ops.sqrt(1 - ops.power(b2, step))
            c = bc2_sqrt / (1 - ops.power(b1, step))
            eps = eps * bc2_sqrt
        else:
            c = _constant(1.0, dtype)
        decay_over_c = _constant(self.lamb_weight_decay, dtype) / c
        return lr, c, eps, b1, 1 - b1, b2, 1 - b2, decay_over_c

    def _lamb_step(self, gradient: Any, variable: Any, scalars: tuple[Any, ...]) -> tuple[Any, Any, Any]:
        """The new moments and the step ``η·ratio·u`` to subtract, with few full-size operations.

        The bias corrections are scalars (:meth:`_step_scalars`), and ``u = c·w`` with ``w = m/(√v+ε') + (λ/c)·x``
        keeps ``c`` out of the full-size work (‖u‖ = c·‖w‖).
        """
        index = self._get_variable_index(variable)
        dtype = variable.dtype
        m = self._momentums[index]
        v = self._velocities[index]
        g = ops.cast(gradient, dtype)
        lr, c, eps, b1, one_minus_b1, b2, one_minus_b2, decay_over_c = scalars

        m_new = m * b1 + g * one_minus_b1
        v_new = v * b2 + ops.square(g) * one_minus_b2
        w = m_new / (ops.sqrt(v_new) + eps)
        if self._decay_flags[index]:
            w = w + variable * decay_over_c
        scale = lr * c
        if self._adapt_flags[index]:
            x_norm = ops.sqrt(_sum_of_squares(variable))
            u_norm = c * ops.sqrt(_sum_of_squares(w))
            usable = ops.logical_and(
                ops.logical_and(x_norm > 0, u_norm > 0), ops.logical_and(ops.isfinite(x_norm), ops.isfinite(u_norm))
            )
            ratio = ops.clip(
                x_norm / ops.where(usable, u_norm, 1),
                _constant(self.min_trust_ratio, dtype),
                _constant(self.max_trust_ratio, dtype),
            )
            ratio = ops.where(usable, ratio, ops.ones_like(ratio))  # the fallback 1 is not clipped
            scale = scale * ratio
        return m_new, v_new, w * scale

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(
            {
                "beta_1": self.beta_1,
                "beta_2": self.beta_2,
                "epsilon": self.epsilon,
                "weight_decay": self.lamb_weight_decay,
                "bias_correction": self.bias_correction,
                "max_trust_ratio": self.max_trust_ratio,
                "min_trust_ratio": self.min_trust_ratio,
                "max_grad_norm": self.max_grad_norm,
                "exclude_from_layer_adaptation": list(self.layer_adaptation_patterns),
                "exclude_from_weight_decay": list(self.weight_decay_patterns),
            }
        )
        return config


# Keras may have been imported for the first time by this module, before LAMB existed: the registration
# Keras's import started (see .autoregister) waited for this point.
_autoregister.finish_deferred()
