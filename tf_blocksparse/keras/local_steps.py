"""Local steps: every replica trains alone for ``sync_every`` steps, then one compressed
exchange of the replicas' progress (DiLoCo's outer step with the block top-k compressor).

With ``BlockSparseOptimizer(inner, sync_every=H, outer=...)`` a step on each replica is::

    w_r = inner.apply(N * g_r, w_r)                 # the replica's own gradient, no traffic
    every H-th step:
        delta_r = (anchor - w_r) / N                 # the replica's pseudo-gradient [*shape]
        acc = delta_r + residual_r; select blocks; exchange   # as a per-step exchange
        anchor = outer.apply(sum_r sent(delta_r), anchor)      # identical on every replica
        w_r = anchor                                 # every replica restarts from it

``anchor`` is the weights at the last synchronisation (an optimizer variable, saved with
it).  Keras divides each replica's loss by ``N``, so ``N * g_r`` is the gradient of the
replica's own batch, and the exchanged sum of ``delta_r`` is the replicas' mean progress.
Error feedback, the exchange modes and the byte counts are those of the per-step exchange;
what is exchanged is the pseudo-gradient.  With ``H = 1``, a plain ``SGD(1.0)`` outer step
and a plain SGD inner one this is the per-step exchange (up to rounding: the residuals
hold learning-rate-scaled values).

The inner optimizer's state (e.g. momentum) stays on each replica: each replica's copy of a
slot variable follows its own gradients and is never averaged, as in DiLoCo.  Backups save
it per worker with the residuals (:mod:`~tf_blocksparse.keras.replica_state`), so a resumed
run continues exactly.

Evaluation and saving must see synchronised weights.  :class:`LocalStepsCallback` (pass it to
``model.fit``: ``tfbs.fit_callbacks(model)`` adds it; a step traced without it warns)
synchronises after the last step of every epoch (so the epoch's evaluation,
``BackupAndRestore`` and ``ModelCheckpoint`` see the synchronised model) and at the end of
training; ``model.fit``'s end synchronises also without it (the wrapper's
``finalize_variable_values``).  A partial window is exchanged like a full one.  A custom loop calls
:meth:`BlockSparseOptimizer.synchronize` before it evaluates or saves.

``exchange="auto"`` decides per fusion group as for the per-step exchange, with the
exchange's time spread over the ``sync_every`` steps of a window (the policy weighs a window:
``sync_every`` steps of compute and one exchange).  A group that turns dense sends its
pseudo-gradient plus its residual at its next synchronisation (nothing is lost); the
synchronisation is re-traced after a change.

Non-finite values: a replica whose gradient is not finite applies a zero gradient instead
(no communication decides it; the inner optimizer's momentum still moves the weights); a
pseudo-gradient that is not finite on some replica is dropped on every replica, which all
restart from the anchor, as a skipped step of the per-step exchange.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf

from tf_blocksparse import _compat, codec
from tf_blocksparse.keras import fit_loop
from tf_blocksparse.keras import optimizer_step as step

__all__ = ["LocalSteps", "LocalStepsCallback", "check_local_steps", "default_outer",
           "local_gradients"]


def default_outer(sparse: bool) -> keras.optimizers.Optimizer:
    """The outer optimizer that measured best (``cnn_small``, 4 replicas, 32 local steps):

    - a sparse exchange: plain ``SGD(1.0)``.  Error feedback already carries the unsent
      progress from exchange to exchange, as momentum would (SparseLoCo's finding); with
      DiLoCo's Nesterov momentum on top, 5% of the blocks ended 9.7 points below dense,
      without it 0.4 points below;
    - the dense exchange: DiLoCo's ``SGD(0.7)`` with Nesterov momentum 0.9.

    ``exchange="auto"`` counts as sparse: a group may be exchanged either way, and plain
    ``SGD(1.0)`` is safe in both (dense, it is model averaging), where the Nesterov step
    compounds with error feedback on the sparse groups.
    """
    if sparse:
        return keras.optimizers.SGD(1.0)
    return keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True)


def check_local_steps(sync_every: Any, outer: Any, *, clipping: Sequence[Any],
                      accumulation_steps: int) -> None:
    """Checks the local-step arguments of ``BlockSparseOptimizer``.

    Raises:
      ValueError: Naming the argument: ``sync_every`` not an int >= 1, ``outer`` without
        ``sync_every``, or a feature that local steps do not combine with.
      TypeError: ``outer`` is not a Keras optimizer.
    """
    if sync_every is None:
        if outer is not None:
            raise ValueError("`outer` needs `sync_every` (the local steps per exchange)")
        return
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise ValueError(f"`sync_every` must be None or an int >= 1, got {sync_every!r}")
    if outer is not None and not isinstance(outer, keras.optimizers.Optimizer):
        raise TypeError(f"`outer` must be a Keras optimizer, got {type(outer).__name__}")
    if isinstance(outer, keras.optimizers.LossScaleOptimizer):
        raise TypeError("`outer` must not be a LossScaleOptimizer")
    if clipping:
        raise ValueError("`clipping` does not combine with `sync_every` (the inner optimizer's "
                         "own `clipnorm` / `global_clipnorm` clip each local step)")
    if accumulation_steps > 1:
        raise ValueError("`gradient_accumulation_steps` does not combine with `sync_every` "
                         "(local steps already exchange once per window)")


def local_gradients(grads: Sequence[tf.Tensor], num_replicas: int
                    ) -> tuple[list[tf.Tensor], tf.Tensor]:
    """The replica's own-batch gradients for a local step, non-finite ones zeroed.

    Args:
      grads: The replica's gradients [*shape] of a loss Keras divided by ``num_replicas``.
      num_replicas: Replicas in sync.

    Returns:
      ``num_replicas * grads`` (all zeros where any of them is not finite) and whether they
      were finite (a boolean scalar, this replica's alone).
    """
    finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads])
    scaled = [g * tf.cast(num_replicas, g.dtype) for g in grads]
    return [tf.where(finite, g, tf.zeros_like(g)) for g in scaled], finite


def assign_on_each_replica(variables: Sequence[Any], values: Sequence[tf.Tensor]) -> None:
    """``variables[i] = values[i]`` for mirrored variables, from replica context: each
    replica's copy gets that replica's value (no collective)."""
    _compat.assign_replica_copies([getattr(v, "value", v) for v in variables], list(values))


class LocalStepsCallback(fit_loop.OptimizerCallback):
    """Synchronises a ``BlockSparseOptimizer`` with ``sync_every`` after the last step of
    every epoch and at the end of training (so evaluation, backups and saved models see
    synchronised weights), and restarts its window from the model's weights at the start
    of training (weights loaded after the optimizer was built are adopted)."""

    def train_begin(self, opt: Any) -> None:
        if opt.built:
            opt.restart_window()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        steps = (self.params or {}).get("steps")
        if steps and batch + 1 >= steps:  # the epoch's last step: before evaluation
            self._synchronize()

    def on_test_begin(self, logs: dict | None = None) -> None:
        self._synchronize()  # nothing to do if the epoch's last step synchronised

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if not (self.params or {}).get("steps"):  # epoch length unknown in advance
            self._synchronize()

    def train_end(self, opt: Any) -> None:
        self._synchronize()

    def _synchronize(self) -> None:
        opt = self.block_sparse
        if opt is not None and opt.built:
            opt.synchronize()


class LocalSteps:
    """The local steps of one ``BlockSparseOptimizer`` with ``sync_every`` (a component the
    optimizer owns): the anchors, the window of steps since the last exchange and the outer
    optimizer's step.

    Args:
      sync_every: Local steps per exchange.
      outer: The optimizer of the exchanged progress (its all-reduce disabled).
      inner: The optimizer of each local step.
      exchange: The optimizer's exchange, ``exchange(grads, variables, idx, optimizer=,
        counted=)`` (its clipping, error feedback and statistics).
      stats: Returns the optimizer's per-replica statistics row.
    """

    def __init__(self, sync_every: int, outer: keras.optimizers.Optimizer,
                 inner: keras.optimizers.Optimizer, exchange: Callable[..., None],
                 stats: Callable[[], keras.Variable]):
        self.sync_every = sync_every
        self.outer = outer
        self.inner = inner
        self._exchange = exchange
        self._stats = stats
        self.anchors: list[keras.Variable] = []
        self.outer_norm: keras.Variable | None = None
        self.window: keras.Variable | None = None
        self._strategy: Any = None
        self._variables: list[Any] = []
        self._sync_fn: Any = None

    def retrace(self) -> None:
        """Drops the traced synchronisation (the exchange's modes changed): the next
        :meth:`synchronize` traces it again."""
        self._sync_fn = None

    def build(self, var_list: Sequence[Any], add_variable_from_reference: Callable[..., Any]
              ) -> tuple[list[keras.Variable], keras.Variable]:
        """Creates the anchors (optimizer variables, set to ``var_list``), builds the outer
        optimizer over them and creates the per-replica ``outer_update_norm``; returns the
        anchors and that norm."""
        self.anchors = [add_variable_from_reference(v, "anchor") for v in var_list]
        for anchor, v in zip(self.anchors, var_list):
            anchor.assign(v)
        self.outer.build(self.anchors)
        self.outer_norm = keras.Variable(
            initializer=keras.initializers.Zeros(), shape=(), dtype="float32",
            trainable=False, synchronization="on_read", aggregation="mean",
            name="outer_update_norm")
        return self.anchors, self.outer_norm

    def bind(self, window: keras.Variable, strategy: Any, variables: Sequence[Any]) -> None:
        """Takes the optimizer's window counter, strategy and trainable variables (once
        built)."""
        self.window, self._strategy, self._variables = window, strategy, list(variables)

    def local_variables(self) -> list[keras.Variable]:
        """The mirrored variables whose replicas' copies differ inside a window: the inner
        optimizer's state (but ``iterations`` and the learning rate) and the weights."""
        shared = {id(self.inner.iterations), id(self.inner.learning_rate)}
        return [v for v in self.inner.variables if id(v) not in shared] + self._variables

    def step(self, grads: Sequence[tf.Tensor], tvs: Sequence[Any], idx: Sequence[int]
             ) -> None:
        """One local step: the inner optimizer applies the replica's own gradient to its
        own weights (no communication); every ``sync_every``-th step synchronises
        (:meth:`synchronize_replica`)."""
        ctx = tf.distribute.get_replica_context()
        local, finite = local_gradients(grads, ctx.num_replicas_in_sync)
        self.inner.apply(local, tvs)
        window = self.window
        window.assign_add(tf.ones_like(window.value))
        step.count_skipped(self._stats(), finite)

        def synchronize(_: Any) -> None:
            self.synchronize_replica(tvs, idx)

        def wait(_: Any) -> None:
            step.record_micro_step(self._stats(), sum(codec.buffer_nbytes(g) for g in grads))

        step.replica_cond(window.value >= self.sync_every, synchronize, wait, (0,))

    def synchronize_replica(self, tvs: Sequence[Any], idx: Sequence[int],
                            counted: bool = True) -> None:
        """The exchange of a window (in replica context): the replica's pseudo-gradient
        ``(anchor - w) / N`` through the exchange, ``outer`` applied to the anchors, every
        replica's weights set to them, the window restarted.  ``counted``: the exchange is
        part of a training step (not :meth:`synchronize`'s)."""
        ctx = tf.distribute.get_replica_context()
        anchors = [self.anchors[i] for i in idx]
        n = ctx.num_replicas_in_sync
        before = [tf.convert_to_tensor(a) for a in anchors]
        deltas = [(a - tf.convert_to_tensor(v)) / tf.cast(n, v.dtype)
                  for a, v in zip(before, tvs)]
        self._exchange(deltas, anchors, idx, optimizer=self.outer, counted=counted)
        moves = [tf.cast(tf.convert_to_tensor(a) - b, tf.float32)
                 for a, b in zip(anchors, before)]
        self.outer_norm.value.assign(tf.sqrt(tf.add_n([tf.reduce_sum(m * m) for m in moves])))
        assign_on_each_replica(tvs, [tf.convert_to_tensor(a) for a in anchors])
        self.window.assign(tf.zeros_like(self.window.value))

    def synchronize(self) -> None:
        """Exchanges the current window's progress now (eagerly, cross-replica context);
        nothing when the window is empty."""
        if int(self.window.numpy()) == 0:
            return
        if self._sync_fn is None:
            strategy, tvs = self._strategy, list(self._variables)
            idx = list(range(len(tvs)))

            @tf.function(autograph=False)
            def sync() -> None:
                strategy.run(lambda: self.synchronize_replica(tvs, idx, counted=False))

            self._sync_fn = sync
        self._sync_fn()

    def restart_window(self) -> None:
        """Takes the current weights as the anchors when the window is empty (eagerly,
        cross-replica context)."""
        if int(self.window.numpy()) != 0:
            return
        for anchor, v in zip(self.anchors, self._variables):
            anchor.assign(v)
