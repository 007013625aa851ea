"""Layer-wise local gradient clipping, per variable and per replica.

Every rule acts on one variable's *local* gradient, before error feedback, selection and the
exchange (``clip -> accumulate -> select -> exchange``), so clipping a layer needs nothing but
that layer's gradient (and, for AGC, its weights): with per-group exchanges the last layers'
clip + compress + send runs while earlier layers' backward still runs.

What averages the workers' final local gradients per layer is the collective itself: the
exchange (``all_gather`` / ``all_reduce``) sums the clipped, compressed gradients of every
replica (Keras scales each replica's loss by ``1 / replicas``, so the sum is the average).  No
node is central.

Rules (any combination, applied in the order given):

- :class:`ValueClip`: element-wise to ``[lower, upper]`` (two thresholds).
- :class:`LocalNormClip`: norm clipping with DGC's scaling, threshold ``t * N^-1/2``.
- :class:`AdaptiveClip`: NFNets' unit-wise Adaptive Gradient Clipping (units: see
  :mod:`tf_blocksparse.unitwise`; in ``BlockSparseOptimizer`` a rank >= 2 variable's units are
  its blocks in the block-rule table, e.g. a ``Conv2DTranspose`` kernel's filters on axis -2).
- :class:`VarianceClip`: norm clipped at ``mean + c * std`` of the layer's running norms.
- :class:`MomentumClip`: norm clipped at ``factor *`` an exponential moving average of them.

State is explicit (optax style): ``init(shape) -> state`` [S] float32 per variable,
``clip(grad, param, state, num_workers) -> (grad, state)``.  Only the Keras adapter owns
variables (one per rule and variable, per replica, checkpointed with the optimizer).

Checkpoints hold the replicas' *sum*: the state variables are on-read ``SUM`` variables, so
saving writes the sum over replicas and restoring gives each of the ``N`` replicas ``sum / N``.
After a restore every replica therefore starts from the replicas' mean state (the sum is
preserved; the per-replica differences are not).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tf_blocksparse.unitwise import adaptive_clip, unitwise_norm

__all__ = ["AdaptiveClip", "ClipRule", "LocalNormClip", "MomentumClip", "ValueClip",
           "VarianceClip", "adaptive_clip", "apply_rules", "as_rules", "local_norm_clip",
           "rule_config", "rule_from_config", "unitwise_norm", "value_clip"]

_TINY = 1e-6


def value_clip(grad: tf.Tensor, lower: float, upper: float) -> tf.Tensor:
    """Element-wise clipping: values above ``upper`` become ``upper``, below ``lower`` ``lower``.

    Args:
        grad: Gradient [*shape].
        lower: Second (lower) threshold.
        upper: First (upper) threshold, ``>= lower``.

    Returns:
        The clipped gradient [*shape].
    """
    if not lower <= upper:
        raise ValueError(f"`lower` ({lower}) must be <= `upper` ({upper})")
    grad = tf.convert_to_tensor(grad)
    return tf.clip_by_value(grad, tf.cast(lower, grad.dtype), tf.cast(upper, grad.dtype))


def _clip_to_norm(grad: tf.Tensor, threshold: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """Scales ``grad`` so its L2 norm is at most ``threshold``; returns it and the new norm."""
    norm = tf.norm(tf.reshape(grad, [-1]))
    scale = tf.minimum(1.0, threshold / tf.maximum(norm, _TINY))
    return grad * tf.cast(scale, grad.dtype), tf.minimum(norm, threshold)


def local_norm_clip(grad: tf.Tensor, threshold: float, num_workers: int) -> tf.Tensor:
    """DGC's local gradient clipping: the L2 norm at most ``threshold / sqrt(num_workers)``.

    Args:
        grad: A worker's local gradient [*shape].
        threshold: The global norm threshold (> 0).
        num_workers: Workers (replicas) whose gradients are summed, >= 1.

    Returns:
        The clipped gradient [*shape].
    """
    if not threshold > 0:
        raise ValueError(f"`threshold` must be > 0, got {threshold!r}")
    if isinstance(num_workers, bool) or int(num_workers) != num_workers or num_workers < 1:
        raise ValueError(f"`num_workers` must be an int >= 1, got {num_workers!r}")
    grad = tf.convert_to_tensor(grad)
    return _clip_to_norm(grad, tf.constant(threshold / num_workers ** 0.5, grad.dtype))[0]


class ClipRule:
    """A per-variable clipping rule with explicit state (base class)."""

    state_size = 0  # floats of state per variable

    def init(self, shape: Sequence[int]) -> tf.Tensor:
        """Initial state of a variable of ``shape`` [state_size] float32."""
        del shape
        return tf.zeros([self.state_size], tf.float32)

    def clip(self, grad: tf.Tensor, param: tf.Tensor, state: tf.Tensor, num_workers: int,
             unit_axes: Sequence[int] | None = None) -> tuple[tf.Tensor, tf.Tensor]:
        """Clips one variable's local gradient.

        Args:
            grad: Local gradient [*shape].
            param: The variable's value [*shape].
            state: This rule's state for the variable [state_size].
            num_workers: Replicas in sync.
            unit_axes: Axes that index the variable's units, for unit-wise rules (AGC);
                ``None`` for NFNets' default by rank.  Other rules ignore it.

        Returns:
            ``(clipped grad [*shape], new state [state_size])``.
        """
        raise NotImplementedError

    def get_config(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclasses.dataclass(frozen=True)
class ValueClip(ClipRule):
    """Element-wise clipping to ``[lower, upper]``."""

    lower: float
    upper: float

    def __post_init__(self) -> None:
        if not self.lower <= self.upper:
            raise ValueError(f"`lower` ({self.lower}) must be <= `upper` ({self.upper})")

    def clip(self, grad, param, state, num_workers, unit_axes=None):
        return value_clip(grad, self.lower, self.upper), state


@dataclasses.dataclass(frozen=True)
class LocalNormClip(ClipRule):
    """Per-layer norm clipping at ``threshold / sqrt(replicas)`` (DGC)."""

    threshold: float

    def __post_init__(self) -> None:
        if not self.threshold > 0:
            raise ValueError(f"`threshold` must be > 0, got {self.threshold!r}")

    def clip(self, grad, param, state, num_workers, unit_axes=None):
        return local_norm_clip(grad, self.threshold, num_workers), state


@dataclasses.dataclass(frozen=True)
class AdaptiveClip(ClipRule):
    """NFNets' unit-wise Adaptive Gradient Clipping (see :func:`adaptive_clip`)."""

    clip_factor: float = 0.01
    eps: float = 1e-3

    def __post_init__(self) -> None:
        if not self.clip_factor > 0:
            raise ValueError(f"`clip_factor` must be > 0, got {self.clip_factor!r}")
        if not self.eps >= 0:
            raise ValueError(f"`eps` must be >= 0, got {self.eps!r}")

    def clip(self, grad, param, state, num_workers, unit_axes=None):
        return adaptive_clip(grad, param, self.clip_factor, self.eps, unit_axes), state


def _weight(count: tf.Tensor, decay: float) -> tf.Tensor:
    """Moving-average weight: the running mean for the first steps, then ``1 - decay``."""
    return tf.maximum(1.0 / (count + 1.0), 1.0 - decay)


def _check_stats_args(decay: float, warmup_steps: int) -> None:
    if not 0.0 <= decay < 1.0:
        raise ValueError(f"`decay` must be in [0, 1), got {decay!r}")
    if isinstance(warmup_steps, bool) or int(warmup_steps) != warmup_steps or warmup_steps < 1:
        raise ValueError(f"`warmup_steps` must be an int >= 1, got {warmup_steps!r}")


@dataclasses.dataclass(frozen=True)
class VarianceClip(ClipRule):
    """Norm clipped at ``mean + c * std`` of the layer's (clipped) gradient norms.

    State ``[mean, variance, count]``: exponentially weighted with weight
    ``max(1 / (count + 1), 1 - decay)`` (plain running mean and variance at first); no clipping
    until ``warmup_steps`` norms were seen.  The statistics take the clipped norm, so one spike
    does not raise the threshold.
    """

    c: float = 3.0
    decay: float = 0.99
    warmup_steps: int = 10
    state_size = 3

    def __post_init__(self) -> None:
        if not self.c > 0:
            raise ValueError(f"`c` must be > 0, got {self.c!r}")
        _check_stats_args(self.decay, self.warmup_steps)

    def clip(self, grad, param, state, num_workers, unit_axes=None):
        mean, var, count = state[0], state[1], state[2]
        armed = count >= float(self.warmup_steps)
        threshold = tf.where(armed, mean + self.c * tf.sqrt(tf.maximum(var, 0.0)), float("inf"))
        grad, norm = _clip_to_norm(grad, tf.cast(threshold, grad.dtype))
        norm = tf.cast(norm, tf.float32)
        a = _weight(count, self.decay)
        diff = norm - mean
        new_mean = mean + a * diff
        new_var = (1.0 - a) * (var + a * diff * diff)
        return grad, tf.stack([new_mean, new_var, count + 1.0])


@dataclasses.dataclass(frozen=True)
class MomentumClip(ClipRule):
    """Norm clipped at ``factor *`` the moving average of the layer's (clipped) norms.

    State ``[average, count]``, weights as in :class:`VarianceClip`.
    """

    factor: float = 2.0
    decay: float = 0.9
    warmup_steps: int = 10
    state_size = 2

    def __post_init__(self) -> None:
        if not self.factor > 0:
            raise ValueError(f"`factor` must be > 0, got {self.factor!r}")
        _check_stats_args(self.decay, self.warmup_steps)

    def clip(self, grad, param, state, num_workers, unit_axes=None):
        avg, count = state[0], state[1]
        armed = count >= float(self.warmup_steps)
        threshold = tf.where(armed, self.factor * avg, float("inf"))
        grad, norm = _clip_to_norm(grad, tf.cast(threshold, grad.dtype))
        a = _weight(count, self.decay)
        return grad, tf.stack([avg + a * (tf.cast(norm, tf.float32) - avg), count + 1.0])


RULES = {cls.__name__: cls for cls in
         (ValueClip, LocalNormClip, AdaptiveClip, VarianceClip, MomentumClip)}


def rule_from_config(config: dict[str, Any]) -> ClipRule:
    """Inverse of ``{"class_name": type(rule).__name__, "config": rule.get_config()}``."""
    name = config.get("class_name")
    if name not in RULES:
        raise ValueError(f"`clipping`: unknown rule {name!r}; expected one of {sorted(RULES)}")
    return RULES[name](**config.get("config", {}))


def as_rules(clipping: Any) -> tuple[ClipRule, ...]:
    """Normalises ``clipping=`` (None, a rule, a config dict or a list of them) to rules."""
    if clipping is None:
        return ()
    items = clipping if isinstance(clipping, (list, tuple)) else [clipping]
    rules = []
    for item in items:
        if isinstance(item, dict):
            item = rule_from_config(item)
        if not isinstance(item, ClipRule):
            raise TypeError(f"`clipping` must be a ClipRule or a list of them, got {item!r}")
        rules.append(item)
    return tuple(rules)


def rule_config(rule: ClipRule) -> dict[str, Any]:
    """Serialisable form of ``rule`` (see :func:`rule_from_config`)."""
    return {"class_name": type(rule).__name__, "config": rule.get_config()}


def apply_rules(rules: Sequence[ClipRule], grads: Sequence[tf.Tensor],
                params: Sequence[tf.Tensor], states: Sequence[Sequence[tf.Tensor]],
                num_workers: int,
                unit_axes: Sequence[Sequence[int] | None] | None = None
                ) -> tuple[list[tf.Tensor], list[list[tf.Tensor]]]:
    """Runs every rule, in order, on every variable's local gradient.

    Args:
        rules: The rules.
        grads: Local gradients, per variable [*shape].
        params: Variable values, per variable [*shape].
        states: Per variable, the state [state_size] of each *stateful* rule, in rule order.
        num_workers: Replicas in sync.
        unit_axes: Optional, per variable, the axes that index its AGC units (``None``
            entries: the default by rank); see :mod:`tf_blocksparse.unitwise`.

    Returns:
        ``(clipped gradients, new states)`` shaped like the arguments.
    """
    if unit_axes is None:
        unit_axes = [None] * len(grads)
    if len(unit_axes) != len(grads):
        raise ValueError(f"`unit_axes` has {len(unit_axes)} entries for {len(grads)} gradients")
    out_grads, out_states = [], []
    for g, p, st, axes in zip(grads, params, states, unit_axes):
        it, new = iter(st), []
        for rule in rules:
            s = next(it) if rule.state_size else tf.zeros([0], tf.float32)
            g, s = rule.clip(g, p, s, num_workers, unit_axes=axes)
            if rule.state_size:
                new.append(s)
        out_grads.append(g)
        out_states.append(new)
    return out_grads, out_states
