"""Sparse and dense gradient exchange between replicas, in replica context.

Three modes, each a fixed, small number of collectives per step whatever the number of
variables (all variables are packed into one buffer per buffer kind):

``"allgather"`` (the source patent's semantics)
    Every replica picks its own top-k blocks.  One ``all_gather`` of an int32 buffer (all
    block ids, plus one non-finite flag) and one of a float buffer (all block values); each
    replica then sums every replica's blocks.  Bytes per replica: ``4 * (sum k_v + 1) +
    itemsize * sum k_v * bs_v``; what a replica *receives* grows with the number of workers.
``"shared"`` (all-reduce compatible)
    One ``all_reduce`` of the packed block scores; every replica picks the same top-k from
    the summed scores; one ``all_reduce`` of those blocks' values.  Bytes per replica:
    ``4 * sum nb_v + itemsize * sum k_v * bs_v``, flat in the number of workers.
``"dense"``
    One ``all_reduce`` of the gradients, exactly the call Keras makes (bit-identical).

Keras divides each replica's loss by the number of replicas, so a SUM is the mean.  Every
mode also returns a replica-identical ``finite`` flag without an extra collective (the flag
rides in the id buffer; summed scores or reduced gradients show non-finite values as such).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import tensorflow as tf

from tf_blocksparse import codec, selection
from tf_blocksparse.feedback import BlockTopK, Prepared

EXCHANGES = ("allgather", "shared", "dense")
_SUM = tf.distribute.ReduceOp.SUM


@dataclasses.dataclass(frozen=True)
class ExchangeResult:
    """Outcome of one exchange on one replica.

    Attributes:
      updates: Per variable, the summed update [*shape] (identical on every replica).
      residuals: Per variable, this replica's new residual [*shape] (``None`` for dense).
      finite: Scalar bool, identical on every replica: no replica had a non-finite value.
      payload_bytes: Bytes this replica handed to the collectives (static, from the
        buffers' shapes and dtypes).
      dense_bytes: Bytes a dense all-reduce of the same gradients would hand over.
      blocks_kept: Blocks this replica selected, summed over variables.
      residual_norm: Scalar, the metric's norm (L1 or L2) of this replica's new residual,
        derived from the block scores without another pass over the tensors.
      sent_ids: Per variable, the block ids [k_v] int32 this replica moved out of its
        residual (``None`` for dense); what momentum correction masks with.
    """

    updates: tuple[tf.Tensor, ...]
    residuals: tuple[tf.Tensor, ...] | None
    finite: tf.Tensor
    payload_bytes: int
    dense_bytes: int
    blocks_kept: int
    residual_norm: tf.Tensor
    sent_ids: tuple[tf.Tensor, ...] | None = None


def dense_nbytes(tensors: Sequence[tf.Tensor]) -> int:
    """Bytes of a dense exchange of ``tensors`` (static)."""
    return sum(codec.buffer_nbytes(t) for t in tensors)


def _residual_norm(scores: Sequence[tf.Tensor], ids: Sequence[tf.Tensor], metric: str
                   ) -> tf.Tensor:
    """Norm of the residual from scores: all blocks minus the selected ones."""
    total = tf.constant(0.0)
    for s, i in zip(scores, ids):
        kept = tf.gather(s, i)
        if metric == "l2":
            total += tf.reduce_sum(tf.square(s)) - tf.reduce_sum(tf.square(kept))
        else:
            total += tf.reduce_sum(s) - tf.reduce_sum(kept)
    total = tf.maximum(total, 0.0)
    return tf.sqrt(total) if metric == "l2" else total


def _values_dtype(values: Sequence[tf.Tensor]) -> tf.DType:
    dtypes = {v.dtype for v in values}
    return dtypes.pop() if len(dtypes) == 1 else tf.float32


def exchange_allgather(ctx: tf.distribute.ReplicaContext, comp: BlockTopK,
                       prepared: Prepared) -> ExchangeResult:
    """Each replica sends its own top-k blocks; updates are the sum of everybody's."""
    ids = comp.select(prepared.scores)
    payload, residuals = comp.finish(prepared, ids)
    bad = tf.reshape(tf.cast(tf.logical_not(prepared.finite), tf.int32), (1,))
    id_buf = codec.pack([*payload.ids, bad])
    vdtype = _values_dtype(payload.values)
    val_buf = codec.pack([tf.cast(v, vdtype) for v in payload.values])
    n = ctx.num_replicas_in_sync
    all_ids = tf.reshape(ctx.all_gather(id_buf, axis=0), (n, -1))
    all_vals = tf.reshape(ctx.all_gather(val_buf, axis=0), (n, -1))
    finite = tf.equal(tf.reduce_sum(all_ids[:, -1]), 0)
    updates, i_off, v_off = [], 0, 0
    for lay, k, acc in zip(comp.layouts, comp.counts, prepared.accs):
        g_ids = tf.reshape(all_ids[:, i_off:i_off + k], (-1,))
        g_vals = tf.reshape(all_vals[:, v_off:v_off + k * lay.block_size], (-1, lay.block_size))
        updates.append(tf.cast(selection.scatter_blocks(g_vals, g_ids, lay), acc.dtype))
        i_off, v_off = i_off + k, v_off + k * lay.block_size
    return ExchangeResult(
        tuple(updates), residuals, finite,
        codec.buffer_nbytes(id_buf) + codec.buffer_nbytes(val_buf),
        dense_nbytes(prepared.accs), sum(comp.counts),
        _residual_norm(prepared.scores, ids, comp.metric), tuple(ids))


def exchange_shared(ctx: tf.distribute.ReplicaContext, comp: BlockTopK,
                    prepared: Prepared) -> ExchangeResult:
    """All replicas agree on the blocks with the highest summed score, then all-reduce them."""
    score_buf = codec.pack(prepared.scores)
    summed = ctx.all_reduce(_SUM, score_buf)
    finite = tf.reduce_all(tf.math.is_finite(summed))
    global_scores = codec.unpack(summed, [(lay.num_blocks,) for lay in comp.layouts])
    ids = comp.select(global_scores)
    payload, residuals = comp.finish(prepared, ids)
    vdtype = _values_dtype(payload.values)
    val_buf = codec.pack([tf.cast(v, vdtype) for v in payload.values])
    reduced = codec.unpack(ctx.all_reduce(_SUM, val_buf),
                           [(k, lay.block_size) for k, lay in zip(comp.counts, comp.layouts)])
    updates = tuple(tf.cast(selection.scatter_blocks(v, i, lay), a.dtype)
                    for lay, v, i, a in zip(comp.layouts, reduced, ids, prepared.accs))
    return ExchangeResult(
        updates, residuals, finite,
        codec.buffer_nbytes(score_buf) + codec.buffer_nbytes(val_buf),
        dense_nbytes(prepared.accs), sum(comp.counts),
        _residual_norm(prepared.scores, ids, comp.metric), tuple(ids))


def exchange_dense(ctx: tf.distribute.ReplicaContext, grads: Sequence[tf.Tensor]
                   ) -> ExchangeResult:
    """Plain all-reduce, the same call Keras' optimizer makes."""
    grads = list(grads)
    reduced = ctx.all_reduce(_SUM, grads)
    finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(r)) for r in reduced])
    nbytes = dense_nbytes(grads)
    return ExchangeResult(tuple(reduced), None, finite, nbytes, nbytes, 0, tf.constant(0.0))


def run_exchange(mode: str, ctx: tf.distribute.ReplicaContext, comp: BlockTopK | None,
                 grads: Sequence[tf.Tensor], state: Sequence[tf.Tensor] | None
                 ) -> ExchangeResult:
    """Error feedback + selection + exchange for one step, in replica context.

    Args:
      mode: One of :data:`EXCHANGES`.
      ctx: The replica context (the default one works without a strategy).
      comp: The compressor (unused for ``"dense"``).
      grads: Per variable local gradients [*shape].
      state: Per variable residuals [*shape] (unused for ``"dense"``).
    """
    if mode == "dense":
        return exchange_dense(ctx, grads)
    if mode not in EXCHANGES:
        raise ValueError(f"`exchange` must be one of {EXCHANGES}, got {mode!r}")
    prepared = comp.prepare(grads, state)
    fn = exchange_allgather if mode == "allgather" else exchange_shared
    return fn(ctx, comp, prepared)


def run_grouped_exchange(mode: str, ctx: tf.distribute.ReplicaContext,
                         make_comp: Callable[[Sequence[int]], BlockTopK | None],
                         grads: Sequence[tf.Tensor], state: Sequence[tf.Tensor] | None,
                         groups: Sequence[Sequence[int]], metric: str = "l1"
                         ) -> ExchangeResult:
    """One exchange per fusion group (its own packed buffers and collectives), combined.

    Groups come in execution (backward) order, so a group's collectives depend only on its
    own members' gradients and can start while earlier layers' backward still runs.

    Args:
      mode: One of :data:`EXCHANGES`.
      ctx: The replica context.
      make_comp: Builds the compressor for a group from its positions in ``grads``.
      grads: Per variable local gradients [*shape].
      state: Per variable residuals, or ``None`` for ``"dense"``.
      groups: Positions in ``grads``; every position exactly once.
      metric: ``"l1"`` or ``"l2"`` (to combine the residual norms).
    """
    n = len(grads)
    updates: list[tf.Tensor | None] = [None] * n
    residuals: list[tf.Tensor | None] = [None] * n
    sent: list[tf.Tensor | None] = [None] * n
    parts = []
    for group in groups:
        sub_state = None if state is None else [state[i] for i in group]
        r = run_exchange(mode, ctx, make_comp(group), [grads[i] for i in group], sub_state)
        parts.append(r)
        for j, i in enumerate(group):
            updates[i] = r.updates[j]
            if r.residuals is not None:
                residuals[i] = r.residuals[j]
            if r.sent_ids is not None:
                sent[i] = r.sent_ids[j]
    if len(parts) == 1:
        return parts[0]
    if any(u is None for u in updates):
        raise ValueError("`groups` must cover every gradient exactly once")
    norms = [p.residual_norm for p in parts]
    norm = tf.add_n(norms) if metric == "l1" else tf.sqrt(tf.add_n([x * x for x in norms]))
    return ExchangeResult(
        tuple(updates), None if state is None else tuple(residuals),
        tf.reduce_all(tf.stack([p.finite for p in parts])),
        sum(p.payload_bytes for p in parts), sum(p.dense_bytes for p in parts),
        sum(p.blocks_kept for p in parts), norm,
        None if state is None else tuple(sent))
