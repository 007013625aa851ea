"""Pieces of ``BlockSparseOptimizer``'s step that need no optimizer state of their own:
the fusion plan and the exchange per fusion group, the finite-step guard, the statistics row
(the last step's figures, and sums over the steps since a reset for means per epoch) and the
inner optimizer's apply.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf

from tf_blocksparse import _compat, codec, hooks
from tf_blocksparse.collectives import ReplicaCollectives
from tf_blocksparse.exchange import ExchangeResult
from tf_blocksparse.feedback import BlockTopK
from tf_blocksparse.fusion import FusionPlan, plan_backward

#: The figures of the per-replica statistics row, in order: the last step's (the counts and
#: running totals ``skipped_steps`` and ``exchange_s_total`` since the optimizer was built).
STAT_NAMES = ("payload_bytes", "dense_bytes", "blocks_kept", "residual_norm", "skipped_steps",
              "exchange_s", "exchange_s_total")
#: The per-step figures whose sums over the finite steps since the last :func:`reset_sums`
#: follow in the row (for means per epoch), then the number of those steps.
MEAN_NAMES = ("payload_bytes", "dense_bytes", "blocks_kept", "residual_norm", "exchange_s")
#: Length of the statistics row.
STATS_SIZE = len(STAT_NAMES) + len(MEAN_NAMES) + 1


def fusion_plan(tensors: Sequence[Any], idx: Sequence[int], ranks: Sequence[int] | None,
                buffer_bytes: int) -> FusionPlan:
    """Balanced plan of ``tensors`` (tensors or specs of the variables ``idx``) in the
    backward order ``ranks`` (per variable index) when known, else the reverse of their
    order."""
    order = None
    if ranks is not None:
        order = sorted(range(len(tensors)), key=lambda p: ranks[idx[p]])
    return plan_backward([codec.buffer_nbytes(t) for t in tensors],
                         [tf.as_dtype(t.dtype).name for t in tensors], buffer_bytes,
                         order=order)


def when_finite(nonfinite: str, finite: tf.Tensor, fn: Any) -> None:
    """Runs ``fn`` (state commits) only when the step is finite, unless ``"apply"``."""
    if nonfinite == "apply":
        fn()
    else:
        tf.cond(finite, fn, tf.no_op)


def count_skipped(stats: keras.Variable, finite: tf.Tensor) -> None:
    """Adds 1 to ``skipped_steps`` in the per-replica ``stats`` unless the step is
    ``finite`` (a step skipped before the wrapper's own step ran)."""
    def add() -> None:
        stats.value.assign_add(tf.one_hot(STAT_NAMES.index("skipped_steps"), STATS_SIZE,
                                          dtype=stats.dtype))

    tf.cond(finite, lambda: None, add)


def record_stats(stats: keras.Variable, result: ExchangeResult, seconds: tf.Tensor,
                 counted: bool = True) -> None:
    """Writes the step's figures into the per-replica ``stats`` (see :data:`STATS_SIZE`);
    ``seconds`` is the wrapper's time in the step.  A finite step's figures of
    :data:`MEAN_NAMES` are also added to their sums, and it is counted.  An exchange that
    is no training step of its own (``counted=False``: local steps synchronised before an
    evaluation) adds only its bytes and seconds: the means stay per training step."""
    old = tf.convert_to_tensor(stats.value)
    n = len(STAT_NAMES)
    skipped = old[STAT_NAMES.index("skipped_steps")] + tf.cast(
        tf.logical_not(result.finite), tf.float32)
    seconds = tf.cast(seconds, tf.float32)
    total = old[STAT_NAMES.index("exchange_s_total")] + seconds
    last = tf.stack([
        tf.constant(float(result.payload_bytes)), tf.constant(float(result.dense_bytes)),
        tf.constant(float(result.blocks_kept)), tf.cast(result.residual_norm, tf.float32),
        skipped, seconds, total])
    step = tf.concat([tf.gather(last, [STAT_NAMES.index(m) for m in MEAN_NAMES]), [1.0]], 0)
    if not counted:
        keep = [float(m in ("payload_bytes", "exchange_s")) for m in MEAN_NAMES]
        step = step * tf.constant([*keep, 0.0])
    sums = old[n:] + tf.where(result.finite, step, tf.zeros_like(step))  # NaN stays out
    stats.value.assign(tf.concat([last, sums], 0))


def stat_figures(values: Sequence[float], mean: bool) -> dict[str, float]:
    """The figures of a ``stats`` reading: the last step's, or with ``mean`` those of
    :data:`MEAN_NAMES` as means over the steps summed since the last reset (the last step's
    when none was), the others as they stand (``skipped_steps`` is a total)."""
    n = len(STAT_NAMES)
    out = {name: float(v) for name, v in zip(STAT_NAMES, values[:n])}
    steps = float(values[-1])
    if mean and steps > 0:
        out.update({name: float(v) / steps for name, v in zip(MEAN_NAMES, values[n:-1])})
    return out


def reset_sums(stats: keras.Variable) -> None:
    """Zeroes the sums and the step count of ``stats`` on this worker's replicas (a local
    write, no collective); the last step's figures and the totals stay."""
    n = len(STAT_NAMES)
    for component in _compat.local_components(stats):
        value = tf.convert_to_tensor(component)
        component.assign(tf.concat([value[:n], tf.zeros_like(value[n:])], 0))


def replica_cond(flag: tf.Tensor, true_fn: Callable[..., None],
                 false_fn: Callable[..., None], args: Sequence[Any]) -> None:
    """Runs ``true_fn(*args)`` or ``false_fn(*args)`` on every replica, chosen by ``flag``
    (a boolean scalar with the same value on every replica), from replica context.

    The branches may hold collectives and merge calls.  Where the strategy still needs a
    merge call for them (``MirroredStrategy``), the condition is taken in cross-replica
    context and each branch runs the replicas again, so every replica takes the same branch.
    """
    if not tf.distribute.has_strategy() or _compat.strategy_supports_no_merge_call():
        tf.cond(flag, lambda: true_fn(*args), lambda: false_fn(*args))
        return

    def cross_replica(distribution: Any, flag: Any, *args: Any) -> None:
        chosen = distribution.experimental_local_results(flag)[0]
        run = distribution.extended.call_for_each_replica
        tf.cond(chosen, lambda: run(true_fn, args=args), lambda: run(false_fn, args=args))

    tf.distribute.get_replica_context().merge_call(cross_replica, args=(flag, *args))


def apply_inner(inner: keras.optimizers.Optimizer, nonfinite: str,
                updates: Sequence[tf.Tensor], tvs: Sequence[Any], finite: tf.Tensor) -> None:
    """``inner.apply(updates, tvs)`` on every replica, skipped everywhere when not finite
    (unless ``nonfinite="apply"``)."""
    if nonfinite == "apply":
        inner.apply(list(updates), tvs)
        return
    replica_cond(finite, lambda u: inner.apply(list(u), tvs), lambda u: None,
                 (list(updates),))


def record_micro_step(stats: keras.Variable, dense_bytes: int) -> None:
    """Counts a micro-step that only accumulated (``gradient_accumulation_steps``) in the
    sums of ``stats``: no bytes, blocks or exchange seconds, so the means of
    :data:`MEAN_NAMES` are per training step, amortised over the exchange window.
    ``dense_bytes`` (what a dense step would send) and the last residual norm are added as
    they stand; the last step's figures stay those of the last exchange."""
    old = tf.convert_to_tensor(stats.value)
    n = len(STAT_NAMES)
    figures = {"dense_bytes": tf.constant(float(dense_bytes)),
               "residual_norm": old[STAT_NAMES.index("residual_norm")]}
    step = tf.stack([figures.get(m, tf.constant(0.0)) for m in MEAN_NAMES] + [1.0])
    stats.value.assign(tf.concat([old[:n], old[n:] + step], 0))


def run_grouped_exchange(mode: str | Sequence[str], ctx: tf.distribute.ReplicaContext,
                         make_comp: Callable[[Sequence[int]], BlockTopK | None],
                         grads: Sequence[tf.Tensor], state: Sequence[tf.Tensor] | None,
                         groups: Sequence[Sequence[int]], metric: str = "l1"
                         ) -> ExchangeResult:
    """One exchange per fusion group (its own packed buffers and collectives), combined:
    :func:`tf_blocksparse.hooks.block_sparse_hook` on every group's bucket, the entry point
    the CrossDeviceOps and the hybrid trainer's group sync call too.

    Groups come in execution (backward) order, so a group's collectives depend only on its
    own members' gradients and can start while earlier layers' backward still runs.

    Args:
      mode: One of :data:`EXCHANGES`, or one per group (the automatic exchange's choice).
      ctx: The replica context.
      make_comp: Builds the compressor for a group from its positions in ``grads``.
      grads: Per variable local gradients [*shape].
      state: Per variable residuals, or ``None`` for ``"dense"`` (a dense group with
        residuals flushes them; one whose entries are all ``None`` carries none).
      groups: Positions in ``grads``; every position exactly once.
      metric: ``"l1"`` or ``"l2"`` (to combine the residual norms).
    """
    hook_state = hooks.HookState(
        ReplicaCollectives(ctx), mode if isinstance(mode, str) else tuple(mode),
        lambda bucket: make_comp(list(bucket.variables)),
        None if state is None else [list(state)])
    buckets = hooks.buckets_for([list(grads)], groups)
    return hooks.exchange_buckets(hooks.block_sparse_hook, hook_state, buckets, metric)[0]
