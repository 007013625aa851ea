"""``BlockSparseOptimizer``: block top-k exchange with error feedback around any Keras optimizer.

Per step, on every replica (``model.fit`` and ``strategy.run`` both call ``apply`` in replica
context with the replica's own, un-aggregated gradients)::

    grad = clip(grad)                                        # optional, per variable
    acc = grad + residual; select blocks; exchange (allgather | shared | dense)
    residual = acc with the selected blocks zeroed          # per-replica state
    inner.apply(summed update)                               # identical on every replica

The wrapper is composed of parts, each with its own config: *what* is exchanged is a
:class:`~tf_blocksparse.options.CompressionOptions`, *where the momentum lives* a
:class:`~tf_blocksparse.keras.momentum.MomentumCorrection` policy, and the optional clipping
rules of :mod:`tf_blocksparse.clipping`.  The inner optimizer's own all-reduce is switched off
(the wrapper's exchange replaces it); its Keras options (``clipnorm``, ``weight_decay``, EMA)
act on the exchanged update, not per replica.  If any replica's gradient holds an inf or NaN,
every replica skips the step (``nonfinite="skip"``, the default; ``skipped_steps`` counts
it).  Mixed precision: wrap this optimizer in ``tfbs.LossScaleOptimizer``, whose overflow
check is :meth:`BlockSparseOptimizer.agreed_finite` (docs/optimizer.md).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from tf_blocksparse import _compat, blocks, checks
from tf_blocksparse.feedback import BlockTopK, compressor_for
from tf_blocksparse.keras import (
    inner_optimizer,
    keras_saving,
    local_steps,
    loss_scale,
)
from tf_blocksparse.keras import optimizer_step as step
from tf_blocksparse.keras.accumulation import GradientAccumulation
from tf_blocksparse.keras.exchange_schedule import ExchangeSchedule
from tf_blocksparse.keras.exchange_step import ExchangeStep
from tf_blocksparse.keras.fit_loop import BlockSparseBase
from tf_blocksparse.keras.momentum import MomentumCorrection
from tf_blocksparse.keras.optimizer_args import (
    OptionsView,
    from_wrapper_config,
    resolve_arguments,
    wrapper_config,
)
from tf_blocksparse.keras.optimizer_hooks import WrapperHooks
from tf_blocksparse.keras.optimizer_inputs import discover_owners, replica_gradients
from tf_blocksparse.keras.optimizer_state import (
    WrapperState,
    create_state,
    per_replica_variable,
)
from tf_blocksparse.keras.optimizer_views import WrapperViews
from tf_blocksparse.keras.step_metrics import StepMetrics
from tf_blocksparse.keras.transforms import ClippingTransform, MomentumTransform
from tf_blocksparse.options import AUTO, NONFINITE, CompressionOptions
from tf_blocksparse.unitwise import layout_unit_axes

__all__ = ["NONFINITE", "STAT_NAMES", "BlockSparseOptimizer", "discover_owners"]

STAT_NAMES = step.STAT_NAMES


@keras.saving.register_keras_serializable(package="tf_blocksparse")
class BlockSparseOptimizer(OptionsView, WrapperViews, WrapperHooks, BlockSparseBase,
                           keras.optimizers.Optimizer):
    """Wraps a Keras optimizer with block-wise top-k gradient exchange and error feedback.

    ``BlockSparseOptimizer(keras.optimizers.SGD(0.05, momentum=0.9))`` is the default: the
    exchange chosen from measurements of the running cluster (``exchange="auto"``: dense
    where compression does not pay, e.g. on a fast link, block-sparse where it does, see
    :mod:`~tf_blocksparse.auto.auto_exchange`; with ``tfbs.fit_callbacks(model)`` passed to
    ``model.fit`` it re-decides after 20 steps on measured step times),
    one block per variable and replica per step (``k=1``) when sparse, variables under 1024
    elements sent whole, the SGD's momentum moved before a sparse exchange.  ``exchange=
    "allgather"`` always compresses.

    The inner (and outer) optimizer is touched only through
    :mod:`~tf_blocksparse.keras.inner_optimizer`, which lists every way (its all-reduce
    switched off; with a sparse exchange an inner SGD's momentum moved before the exchange).

    Args:
      inner: The Keras optimizer that applies the exchanged update (e.g. ``SGD(0.1,
        momentum=0.9)``); it sets the learning rate.  It becomes owned by the wrapper (its
        all-reduce is disabled).
      compression: A :class:`~tf_blocksparse.options.CompressionOptions` (``k``,
        ``density``, ``metric``, ``exchange``, ``granularity``, ``dense_below``,
        ``block_rules``).  Its arguments may instead be given as keywords here; either
        form defaults to ``exchange="auto"``.
      momentum_correction: Where the momentum lives: a
        :class:`~tf_blocksparse.keras.momentum.MomentumCorrection`, or its shorthand:
        ``"auto"`` (default: an inner ``SGD(momentum=m)``, not Nesterov, with a sparse
        exchange has ``m`` moved before the exchange and its own set to 0; otherwise
        ``None``), a float ``m`` in [0, 1) (the inner optimizer must have no momentum), or
        ``None`` (no local momentum; an inner SGD's momentum then applies *global*
        momentum to the exchanged update).  With ``momentum_masking=`` for the shorthand
        (default ``"auto"``: ``"none"`` with ``recurrent="whole"``, else ``"all"``).
      clipping: Optional rule or list of rules of :mod:`tf_blocksparse.clipping`, applied
        to each replica's local gradient of each variable before error feedback and the
        exchange (their state is per replica and saved with the optimizer).
      nonfinite: ``"skip"`` (default) or ``"apply"``.
      fusion_buffer_bytes: Optional fusion buffer size: variables are exchanged in balanced
        groups (contiguous in backward order, see :mod:`tf_blocksparse.fusion`),
        one set of collectives per group, so the last layers' exchange can start while
        backward still runs.  The backward order is derived from ``model`` when given, else
        taken as the reverse of the variable order.  Default: one group for all variables.
      gradient_accumulation_steps: Optional micro-steps accumulated locally per exchange
        (each replica adds its gradients; the window's mean is exchanged once).
      sync_every: Optional local steps per exchange (:mod:`~tf_blocksparse.keras.local_steps`):
        every replica trains alone for ``sync_every`` steps with ``inner``, then the
        replicas' progress since the last exchange (a pseudo-gradient) is compressed and
        exchanged, and ``outer`` applies its mean.  Default: every step exchanges.
      outer: The optimizer of the exchanged progress with ``sync_every`` (default: plain
        ``SGD(1.0)`` with a sparse exchange, whose error feedback does what outer momentum
        would; DiLoCo's ``SGD(0.7, momentum=0.9, nesterov=True)`` with ``exchange="dense"``).
        Create it in the strategy's scope.
      model: Optional Keras model whose layers own the variables.  Without it the owning
        layers are found among the live Keras layers at build time; either way every
        variable is looked up by its layer's class (see :mod:`tf_blocksparse.blocks`).
        With it (and ``fusion_buffer_bytes``) the backward order is derived from a trace of
        its forward pass at build time (:mod:`tf_blocksparse.fusion.forward_order`).
      name: Optimizer name.
      **options: The arguments of ``CompressionOptions`` (instead of ``compression``) and
        ``momentum_masking``.

    Raises:
      TypeError: ``inner`` is not a Keras optimizer, or is a ``LossScaleOptimizer`` or
        ``BlockSparseOptimizer``.
      ValueError: Any bad argument, named: e.g. ``learning_rate`` (set it on the inner
        optimizer), an invalid ``block_rules`` regex, an inner optimizer with
        ``gradient_accumulation_steps``.  The inner optimizer is left unchanged then.
    """

    def __init__(self, inner: keras.optimizers.Optimizer,
                 compression: CompressionOptions | None = None, *,
                 momentum_correction: MomentumCorrection | float | str | None = AUTO,
                 clipping: Any = None, nonfinite: str = "skip",
                 fusion_buffer_bytes: int | None = None,
                 gradient_accumulation_steps: int | None = None,
                 sync_every: int | None = None,
                 outer: keras.optimizers.Optimizer | None = None, model: Any = None,
                 name: str | None = None, **options: Any):
        if isinstance(inner, BlockSparseOptimizer):
            raise TypeError("`inner` is already a BlockSparseOptimizer")
        args = resolve_arguments(
            inner, compression, momentum_correction=momentum_correction, clipping=clipping,
            nonfinite=nonfinite, fusion_buffer_bytes=fusion_buffer_bytes,
            gradient_accumulation_steps=gradient_accumulation_steps, sync_every=sync_every,
            outer=outer, options=options)
        super().__init__(learning_rate=0.0, name=name)
        self.compression, self.momentum_policy = args.compression, args.momentum
        self.inner_optimizer, self.nonfinite = inner, nonfinite
        self.fusion_buffer_bytes = fusion_buffer_bytes
        self.accumulation_steps, self.clipping = args.accumulation_steps, args.clipping
        self.sync_every, self.outer_optimizer = args.sync_every, args.outer
        self._clip = ClippingTransform(args.clipping, lambda: self._unit_axes)
        self._momentum = MomentumTransform(args.momentum)
        self._model = model
        # components: fusion groups and changing modes (exchange="auto", a dense phase), the
        # reported figures
        self._schedule = ExchangeSchedule(self, self._compressor)
        self._metrics = StepMetrics(self, lambda: self._state.stats,
                                    lambda: self._state.outer_norm)
        self.layouts: list[blocks.BlockLayout] = []
        self._unit_axes: list[tuple[int, ...] | None] = []
        self._state: WrapperState | None = None
        inner_optimizer.take_over(inner, args.outer)
        # components: the exchange; local steps or accumulation (each owns its step and
        # calls the exchange once per window); Keras saving
        self._exchange = ExchangeStep(self._clip, self._momentum, self._schedule,
                                      self._compressor, inner, nonfinite, self.metric)
        self._local = None if sync_every is None else local_steps.LocalSteps(
            sync_every, args.outer, inner, self._exchange, lambda: self._state.stats)
        self._accumulation = None if args.accumulation_steps == 1 else GradientAccumulation(
            args.accumulation_steps, self._exchange, lambda: self._state.stats,
            lambda: self.inner_optimizer.iterations)
        self._saving = keras_saving.KerasSaving()
        self._step = (self._local.step if self._local is not None else
                      self._accumulation.step if self._accumulation is not None else
                      self._exchange)

    # -- state ---------------------------------------------------------------------------
    @_compat.no_automatic_dependency_tracking
    def build(self, var_list: Sequence[keras.Variable]) -> None:
        self.inner_optimizer.build(var_list)
        owners = None if self._model is not None else discover_owners(var_list, self)
        self.layouts = blocks.layouts_for(var_list, self._model, self.block_rules, owners)
        if self.compression.sparse and not self.compression.auto and self._local is None:
            checks.warn_compressed_recurrent(self._compressor(range(len(self.layouts))))
        self._unit_axes = [layout_unit_axes(lay) for lay in self.layouts]  # AGC = blocks
        self._schedule.build(var_list, self._model)
        # an automatic exchange that stays dense for good keeps no state, as "dense" does
        dense_for_good = self._schedule.dense_for_good(var_list)
        state = create_state(
            var_list, residuals=self.exchange != "dense" and not dense_for_good,
            momentum=MomentumTransform(None) if dense_for_good else self._momentum,
            clip=self._clip, local=self._local, accumulation=self._accumulation,
            new_state=functools.partial(per_replica_variable, self._distribution_strategy,
                                        self._track_variable),
            add_variable=self.add_variable,
            add_variable_from_reference=self.add_variable_from_reference)
        self._state = state
        self._exchange.bind(state)
        every, self.accumulation_steps = self.accumulation_steps, 1  # Keras' build must not
        try:                                                          # add accumulators
            super().build(var_list)
        finally:
            self.accumulation_steps = every
        if self._local is not None:
            self._local.bind(state.window, self._distribution_strategy,
                             self._trainable_variables)
        if self._accumulation is not None:
            self._accumulation.window = state.window
        self._schedule.bind(self._distribution_strategy, self._trainable_variables)

    @property
    def variables(self) -> list[keras.Variable]:
        outer = [] if self.outer_optimizer is None else self.outer_optimizer.variables
        return self._variables + self.inner_optimizer.variables + outer

    @property
    def learning_rate(self) -> Any:
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, value: Any) -> None:
        self.inner_optimizer.learning_rate = value

    @property
    def iterations(self) -> Any:
        return self.inner_optimizer.iterations

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "loss_scale_factor" and "_saving" in self.__dict__:
            # set after construction: a loss-scale optimizer clearing it as it wraps this one
            if value is not None:
                raise ValueError(f"`loss_scale_factor`: got {value!r}; scale the loss with "
                                 "tfbs.LossScaleOptimizer(BlockSparseOptimizer(...)) instead")
            if self.loss_scaled_by is None:
                self.loss_scaled_by = "keras"
        super().__setattr__(name, value)

    def agreed_finite(self, grads: Sequence[Any]) -> tf.Tensor:
        """Whether no replica's ``grads`` hold an inf or NaN (the same on every replica: one
        scalar all-reduce).  An outer ``LossScaleOptimizer`` checks with it, so all replicas
        skip a step or none does; a skipped step counts in ``skipped_steps``."""
        finite = loss_scale.finite_on_every_replica(grads)
        if self.built:
            step.count_skipped(self._state.stats, finite)
        return finite

    # -- step ----------------------------------------------------------------------------
    # Like Keras' own steps, the step needs no AutoGraph (its control flow is tf.cond): a
    # custom loop's tf.function that calls apply() does not convert the library (seconds).
    @tf.autograph.experimental.do_not_convert
    def apply(self, grads: Sequence[Any], trainable_variables: Sequence[Any] | None = None
              ) -> None:
        """One step of this replica: its gradients go through the exchange (every step, or
        once per window of local steps or accumulated micro-steps), then the inner
        optimizer applies the exchanged update; see the module docstring."""
        if not self.built:
            self._build_in_apply(trainable_variables)
        loss_scale.check_outer_loss_scale(self.loss_scaled_by,
                                          self._distribution_strategy.num_replicas_in_sync)
        self.warn_missing_fit_callbacks()
        grads, tvs = replica_gradients(grads, list(
            self._trainable_variables if trainable_variables is None else trainable_variables))
        if grads:
            self._step(grads, tvs, [self._get_variable_index(v) for v in tvs])

    def _build_in_apply(self, trainable_variables: Sequence[Any] | None) -> None:
        if trainable_variables is None:
            raise ValueError("the optimizer is not built: pass `trainable_variables` or "
                             "call build() first")
        if tf.distribute.has_strategy() and tf.inside_function():
            raise ValueError(
                "BlockSparseOptimizer is not built: in a custom loop under a strategy, "
                "call opt.build(model.trainable_variables) inside strategy.scope() before "
                "the first step (its per-replica state cannot be created inside a "
                "tf.function; model.fit builds it by itself)")
        with keras.name_scope(self.name, caller=self):
            self.build(list(trainable_variables))
        self.built = True

    def _compressor(self, variables: Sequence[int]) -> BlockTopK:
        """The compressor of ``compression`` over the variables with indices ``variables``."""
        return compressor_for(self.compression, [self.layouts[i] for i in variables])

    # -- config --------------------------------------------------------------------------
    def get_config(self) -> dict[str, Any]:
        return wrapper_config(self, self._auto is not None and self._auto.inner_momentum)

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None
                    ) -> BlockSparseOptimizer:
        inner, config = from_wrapper_config(config, custom_objects)
        return cls(inner, **config)
