"""``BlockSparseOptimizer``: block top-k exchange with error feedback around any Keras optimizer.

Per step, on every replica (``model.fit`` and ``strategy.run`` both call ``apply`` in replica
context with the replica's own, un-aggregated gradients)::

    grad = clip(grad)                                        # optional, per variable
    acc = grad + residual; select blocks; exchange (allgather | shared | dense)
    residual = acc with the selected blocks zeroed          # per-replica state
    inner.apply(summed update)                               # identical on every replica

The inner optimizer's own all-reduce is switched off (the wrapper's exchange replaces it).
With ``SGD(momentum=m)`` inside and a sparse exchange, the momentum is by default moved
*before* the exchange (``momentum_correction="auto"``: DGC's local momentum with factor
masking); ``momentum_correction=None`` keeps it in the inner SGD, applied to the exchanged
update (*global momentum*).  Keras options of the inner optimizer (``clipnorm``,
``weight_decay``, EMA) act on the exchanged update, not per replica.

Non-finite gradients (``nonfinite="skip"``, the default): if any replica's accumulated
gradient holds an inf or NaN, every replica skips the step: weights, inner optimizer state,
``iterations`` and residuals stay exactly as they were; ``skipped_steps`` counts it.
``nonfinite="apply"`` applies whatever arrives (for debugging).

Mixed precision: wrap this optimizer in ``keras.optimizers.LossScaleOptimizer`` (outside);
a ``LossScaleOptimizer`` *inside* is rejected because residuals would mix loss scales.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import keras
import tensorflow as tf

from tf_blocksparse import blocks, codec
from tf_blocksparse import clipping as clipping_lib
from tf_blocksparse import exchange as exchange_lib
from tf_blocksparse.feedback import BlockTopK
from tf_blocksparse.keras import optimizer_step as step
from tf_blocksparse.keras.forward_order import backward_ranks
from tf_blocksparse.keras.optimizer_args import (
    AUTO,
    DENSE_BELOW,
    GRANULARITIES,
    NONFINITE,
    densify,
    discover_owners,
    no_all_reduce,
    validate_arguments,
)
from tf_blocksparse.planning.fusion import FusionPlan, plan_backward
from tf_blocksparse.unitwise import layout_unit_axes

__all__ = ["BlockSparseOptimizer", "GRANULARITIES", "NONFINITE", "STAT_NAMES",
           "discover_owners"]

STAT_NAMES = ("payload_bytes", "dense_bytes", "blocks_kept", "residual_norm", "skipped_steps")


@keras.saving.register_keras_serializable(package="tf_blocksparse")
class BlockSparseOptimizer(keras.optimizers.Optimizer):
    """Wraps a Keras optimizer with block-wise top-k gradient exchange and error feedback.

    Args:
      inner: The Keras optimizer that applies the exchanged update (e.g. ``SGD(0.1,
        momentum=0.9)``).  It becomes owned by the wrapper (its all-reduce is disabled).
      k: Blocks kept per variable per step (int >= 1).  Default 1 when ``density`` is unset.
      density: Alternatively, fraction in (0, 1]: ``ceil(density * num_blocks)`` blocks.
      metric: Block score, ``"l1"`` or ``"l2"``.
      exchange: ``"allgather"``, ``"shared"`` or ``"dense"`` (see
        :mod:`tf_blocksparse.exchange`).
      nonfinite: ``"skip"`` (default) or ``"apply"``.
      block_rules: Optional ``{path regex: rule name}`` overriding the block-rule table.
      model: Optional Keras model whose layers own the variables.  Without it the owning
        layers are found among the live Keras layers at build time; either way every
        variable is looked up by its layer's class (see :mod:`tf_blocksparse.blocks`).
        With it (and ``fusion_buffer_bytes``) the gradients' backward order is derived
        from a trace of its forward pass at build time
        (:mod:`tf_blocksparse.keras.forward_order`).
      granularity: ``"block"`` (default) or ``"element"``: element-wise top-k with error
        feedback, the DGC/GRACE baseline (use with ``density``).
      fusion_buffer_bytes: Optional fusion buffer size: variables are exchanged in balanced
        groups (contiguous in backward order, see :mod:`tf_blocksparse.planning.fusion`),
        one set of collectives per group, so the last layers' exchange can start while
        backward still runs.  The backward order is derived from ``model`` when given, else
        taken as the reverse of the variable order.  Default: one group for all variables.
      clipping: Optional rule or list of rules of :mod:`tf_blocksparse.clipping`, applied
        to each replica's local gradient of each variable before error feedback and the
        exchange (their state is per replica and saved with the optimizer).
      momentum_correction: Where the momentum lives.  ``"auto"`` (default): with an inner
        ``SGD(momentum=m)`` (not Nesterov) and a sparse exchange, ``m`` is moved before the
        exchange as below and the inner SGD's momentum is set to 0; otherwise as ``None``.
        A float ``m`` in [0, 1): momentum kept *per replica before* the exchange, with
        DGC's momentum correction and factor masking (Lin et al., ICLR 2018): ``u = m u +
        grad`` goes through error feedback and selection in place of ``grad``, and the
        blocks a replica sent are zeroed in its ``u`` too; the inner optimizer must then
        have no momentum of its own.  ``None``: no local momentum; an inner
        ``SGD(momentum=m)`` applies *global* momentum to the exchanged update, which with
        aggressive sparsification releases residuals late into a running velocity and can
        oscillate or collapse.  With ``exchange="dense"`` the two are the same math.
      momentum_masking: With ``momentum_correction``, which sent blocks are zeroed in the
        local momentum: ``"all"`` (DGC's factor masking, default); ``"none"`` keeps the
        momentum whole (every block receives momentum SGD's total update, only later; a
        block sent every step trains as plain momentum SGD, whereas ``"all"`` takes its
        momentum away); ``"waited"`` zeroes only blocks that had waited (a non-zero
        residual before this step), so blocks sent step after step keep their momentum
        and a block released after a wait does not carry its burst on.
      dense_below: Size in elements: variables smaller than this are sent whole every
        step (a dense sum, no residual), as DGC leaves small layers uncompressed.  E.g. a
        10-class ``Dense`` kernel has only 10 blocks, so ``k=1`` would update one class per
        step.  Default 1024 (biases, normalisation vectors, first convolutions, small
        heads); 0 compresses every variable.
      name: Optimizer name.
    """

    def __init__(self, inner: keras.optimizers.Optimizer, k: int | None = None,
                 density: float | None = None, metric: str = "l1",
                 exchange: str = "allgather", nonfinite: str = "skip",
                 block_rules: Mapping[str, str] | None = None, model: Any = None,
                 granularity: str = "block", fusion_buffer_bytes: int | None = None,
                 clipping: Any = None, momentum_correction: float | str | None = AUTO,
                 dense_below: int | None = DENSE_BELOW, momentum_masking: str = "all",
                 name: str | None = None, **kwargs: Any):
        if isinstance(inner, BlockSparseOptimizer):
            raise TypeError("`inner` is already a BlockSparseOptimizer")
        k, density, rules, momentum_correction, dense_below = validate_arguments(
            inner, k, density, metric, exchange, nonfinite, block_rules, granularity,
            fusion_buffer_bytes, clipping, momentum_correction, dense_below, momentum_masking,
            kwargs)
        super().__init__(learning_rate=0.0, name=name)
        self.dense_below = dense_below
        self.momentum_masking = momentum_masking
        self.inner_optimizer = inner
        self.k, self.density = k, density
        self.metric = metric
        self.exchange = exchange
        self.nonfinite = nonfinite
        self.granularity = granularity
        self.fusion_buffer_bytes = fusion_buffer_bytes
        self.clipping = rules
        self.momentum_correction = momentum_correction
        self.block_rules = dict(block_rules or {})
        self._model = model
        inner._all_reduce_sum_gradients = no_all_reduce
        self.layouts: list[blocks.BlockLayout] = []
        self._unit_axes: list[tuple[int, ...] | None] = []
        self._backward_ranks: list[int] | None = None
        self._residuals: list[keras.Variable] = []
        self._clip_states: list[list[keras.Variable]] = []
        self._velocities: list[keras.Variable] = []

    # -- state ---------------------------------------------------------------------------
    @keras.src.utils.tracking.no_automatic_dependency_tracking
    def build(self, var_list: Sequence[keras.Variable]) -> None:
        self.inner_optimizer.build(var_list)
        owners = None if self._model is not None else discover_owners(var_list)
        self.layouts = blocks.layouts_for(var_list, self._model, self.block_rules, owners)
        self._unit_axes = [layout_unit_axes(lay) for lay in self.layouts]  # AGC = blocks
        self._backward_ranks = (backward_ranks(self._model, var_list)
                                if self.fusion_buffer_bytes is not None else None)
        self._residuals = []
        if self.exchange != "dense":
            self._residuals = [self._per_replica_variable(v, v.shape, v.dtype, "residual_")
                               for v in var_list]
        self._velocities = []
        if self.momentum_correction:
            self._velocities = [self._per_replica_variable(v, v.shape, v.dtype, "velocity_")
                                for v in var_list]
        self._clip_states = [[self._per_replica_variable(v, (rule.state_size,), "float32",
                                                         f"clip{j}_{type(rule).__name__}_")
                              for j, rule in enumerate(self.clipping) if rule.state_size]
                             for v in var_list]
        self._stats = keras.Variable(
            initializer=keras.initializers.Zeros(), shape=(len(STAT_NAMES),), dtype="float32",
            trainable=False, synchronization="on_read", aggregation="mean",
            name="blocksparse_stats")
        super().build(var_list)

    def _per_replica_variable(self, v: Any, shape: tuple[int, ...], dtype: str, prefix: str
                              ) -> keras.Variable:
        """A zero-initialised per-replica (on-read, sum) state variable next to ``v``."""
        with self._distribution_strategy.extended.colocate_vars_with(
                v.value if isinstance(v, keras.Variable) else v):
            s = keras.Variable(
                initializer=keras.initializers.Zeros(), shape=shape, dtype=dtype,
                trainable=False, synchronization="on_read", aggregation="sum",
                name=prefix + (getattr(v, "path", None) or v.name).replace("/", "_"))
        self._track_variable(s)
        return s

    @property
    def clip_states(self) -> list[list[keras.Variable]]:
        """Per variable, the state of each stateful clipping rule (per replica)."""
        return [list(s) for s in self._clip_states]

    @property
    def velocities(self) -> list[keras.Variable]:
        """Per-variable local momentum of ``momentum_correction`` (per replica; else [])."""
        return list(self._velocities)

    @property
    def residuals(self) -> list[keras.Variable]:
        """Per-variable residuals (per replica; a cross-replica read returns their sum)."""
        return list(self._residuals)

    @property
    def variables(self) -> list[keras.Variable]:
        return self._variables + self.inner_optimizer.variables

    @property
    def learning_rate(self) -> Any:
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, value: Any) -> None:
        self.inner_optimizer.learning_rate = value

    @property
    def iterations(self) -> Any:
        return self.inner_optimizer.iterations

    def finalize_variable_values(self, var_list: Sequence[keras.Variable]) -> None:
        self.inner_optimizer.finalize_variable_values(var_list)

    # -- step ----------------------------------------------------------------------------
    def apply(self, grads: Sequence[Any], trainable_variables: Sequence[Any] | None = None
              ) -> None:
        if not self.built:
            if trainable_variables is None:
                raise ValueError("the optimizer is not built: pass `trainable_variables` or "
                                 "call build() first")
            with keras.name_scope(self.name, caller=self):
                self.build(list(trainable_variables))
            self.built = True
        tvs = list(self._trainable_variables if trainable_variables is None
                   else trainable_variables)
        if len(grads) != len(tvs):
            raise ValueError(f"got {len(grads)} gradients for {len(tvs)} variables")
        if tf.distribute.has_strategy() and tf.distribute.in_cross_replica_context():
            raise ValueError("apply() must be called in a replica context (inside "
                             "strategy.run or model.fit)")
        pairs = [(densify(g, v), v) for g, v in zip(grads, tvs) if g is not None]
        if not pairs:
            return
        grads, tvs = [p[0] for p in pairs], [p[1] for p in pairs]
        idx = [self._get_variable_index(v) for v in tvs]
        ctx = tf.distribute.get_replica_context()
        commits: list[tuple[Any, tf.Tensor]] = []
        if self.clipping:
            clip_vars = [self._clip_states[i] for i in idx]
            grads, new = clipping_lib.apply_rules(
                self.clipping, grads, [tf.convert_to_tensor(v) for v in tvs],
                [[tf.convert_to_tensor(s.value) for s in vs] for vs in clip_vars],
                ctx.num_replicas_in_sync, [self._unit_axes[i] for i in idx])
            commits += [(s, n) for vs, ns in zip(clip_vars, new) for s, n in zip(vs, ns)]
        velocities = [self._velocities[i] for i in idx] if self._velocities else []
        if velocities:  # DGC momentum correction: u = m u + g is what gets exchanged
            m = self.momentum_correction
            grads = [tf.cast(m, g.dtype) * tf.convert_to_tensor(u.value) + g
                     for u, g in zip(velocities, grads)]
        groups = self._fusion_groups(grads, idx)
        state = None
        if self.exchange == "dense":
            result = exchange_lib.run_grouped_exchange(
                "dense", ctx, lambda g: None, grads, None, groups, self.metric)
        else:
            def make_comp(group: Sequence[int]) -> BlockTopK:
                return self._compressor([idx[i] for i in group])

            residuals = [self._residuals[i] for i in idx]
            state = [tf.convert_to_tensor(r.value) for r in residuals]
            result = exchange_lib.run_grouped_exchange(
                self.exchange, ctx, make_comp, grads, state, groups, self.metric)
            commits += list(zip(residuals, result.residuals))
        if velocities:  # factor masking: what a replica sent leaves its velocity too
            waited = state if self.momentum_masking == "waited" else None
            kept = (grads if self.momentum_masking == "none"
                    else self._mask_sent(grads, idx, result.sent_ids, waited))
            commits += list(zip(velocities, kept))
        if commits:
            self._when_finite(result.finite,
                              lambda: tf.group([v.value.assign(s) for v, s in commits]))
        self._record(result)
        self._apply_inner(result.updates, tvs, result.finite)

    def _compressor(self, variables: Sequence[int]) -> BlockTopK:
        """The compressor (of ``granularity``) over the variables with indices ``variables``."""
        return GRANULARITIES[self.granularity](
            [self.layouts[i] for i in variables], self.k, self.density, self.metric,
            self.dense_below)

    def _mask_sent(self, us: Sequence[tf.Tensor], idx: Sequence[int],
                   sent_ids: Sequence[tf.Tensor] | None,
                   residuals: Sequence[tf.Tensor] | None = None) -> list[tf.Tensor]:
        return step.mask_sent(us, self._compressor(idx).layouts, sent_ids, residuals)

    def _fusion_groups(self, grads: Sequence[tf.Tensor], idx: Sequence[int]
                       ) -> list[list[int]]:
        """Positions of ``grads`` (of variables ``idx``) per fusion group, in backward order
        (one group if ``fusion_buffer_bytes`` is unset)."""
        if self.fusion_buffer_bytes is None:
            return [list(range(len(grads)))]
        return [list(group.members) for group in self._plan(grads, idx).groups]

    def _plan(self, tensors: Sequence[Any], idx: Sequence[int]) -> FusionPlan:
        """Balanced plan of ``tensors`` (of variables ``idx``) in the derived backward order
        when a model is known, else the reverse of their order."""
        order = None
        if self._backward_ranks is not None:
            order = sorted(range(len(tensors)), key=lambda p: self._backward_ranks[idx[p]])
        return plan_backward([codec.buffer_nbytes(t) for t in tensors],
                             [tf.as_dtype(t.dtype).name for t in tensors],
                             self.fusion_buffer_bytes, order=order)

    @property
    def fusion_plan(self) -> FusionPlan | None:
        """The plan over every built variable (members = variable indices), or ``None``."""
        if self.fusion_buffer_bytes is None or not self.built:
            return None
        specs = [tf.TensorSpec(v.shape, v.dtype) for v in self._trainable_variables]
        return self._plan(specs, range(len(specs)))

    def _when_finite(self, finite: tf.Tensor, fn: Any) -> None:
        step.when_finite(self.nonfinite, finite, fn)

    def _record(self, result: exchange_lib.ExchangeResult) -> None:
        step.record_stats(self._stats, result)

    def _apply_inner(self, updates: Sequence[tf.Tensor], tvs: Sequence[Any],
                     finite: tf.Tensor) -> None:
        step.apply_inner(self.inner_optimizer, self.nonfinite, updates, tvs, finite)

    # -- observability -------------------------------------------------------------------
    def block_sparse_metrics(self) -> dict[str, float]:
        """Last step's figures, averaged over replicas (a collective under multi-worker).

        Returns:
          ``payload_bytes`` and ``dense_bytes`` handed to collectives per replica,
          ``blocks_kept``, ``residual_norm`` (in the selection metric), ``skipped_steps``.
        """
        if not self.built:
            return {}
        values = self._stats.numpy()
        return {n: float(v) for n, v in zip(STAT_NAMES, values)}

    # -- config --------------------------------------------------------------------------
    def get_config(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "inner": keras.saving.serialize_keras_object(self.inner_optimizer),
            "k": self.k if self.density is None else None, "density": self.density,
            "metric": self.metric, "exchange": self.exchange, "nonfinite": self.nonfinite,
            "block_rules": dict(self.block_rules), "granularity": self.granularity,
            "fusion_buffer_bytes": self.fusion_buffer_bytes,
            "clipping": [clipping_lib.rule_config(r) for r in self.clipping],
            "momentum_correction": self.momentum_correction,
            "dense_below": self.dense_below, "momentum_masking": self.momentum_masking,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None
                    ) -> BlockSparseOptimizer:
        config = dict(config)
        # Files from before these defaults changed hold the behaviour they were saved with:
        # no key means global momentum and every variable compressed.
        config.setdefault("momentum_correction", None)
        config.setdefault("dense_below", 0)
        inner = keras.saving.deserialize_keras_object(config.pop("inner"),
                                                      custom_objects=custom_objects)
        return cls(inner, **config)
