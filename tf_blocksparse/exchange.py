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

Variables sent whole (``BlockTopK.whole``, below its ``dense_below``) need neither ids nor
scores: every block of theirs goes.  Both sparse modes sum them with one more ``all_reduce``
of their packed accumulations (``itemsize * sum size_v`` bytes), and the sums above run over
the compressed variables only; when every variable is whole that ``all_reduce`` is the only
collective.

Keras divides each replica's loss by the number of replicas, so a SUM is the mean.  Every
mode also returns a replica-identical ``finite`` flag without a collective of its own (the
flag rides in the id buffer; summed scores, summed whole variables or reduced gradients
show non-finite values as such).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import tensorflow as tf

from tf_blocksparse import codec, selection
from tf_blocksparse.feedback import BlockTopK, Prepared, take_blocks

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
        residual (``None`` for dense; ``range(num_blocks)`` for a variable sent whole); what
        momentum correction masks with.
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


def _pack_values(values: Sequence[tf.Tensor]) -> tf.Tensor:
    """One buffer of ``values``, in their common dtype (float32 when they mix)."""
    dtype = _values_dtype(values)
    return codec.pack([tf.cast(v, dtype) for v in values])


def _and(a: tf.Tensor | None, b: tf.Tensor) -> tf.Tensor:
    """``a and b``, where ``a`` may be absent (``None``)."""
    return b if a is None else tf.logical_and(a, b)


@dataclasses.dataclass(frozen=True)
class _Part:
    """One replica's share of an exchange over some of the variables.

    Attributes:
      updates: ``{position: summed update [*shape]}``.
      residuals: ``{position: new residual [*shape]}``.
      finite: Scalar bool, replica-identical; ``None`` when the part moved nothing.
      nbytes: Bytes handed to the part's collectives.
    """

    updates: dict[int, tf.Tensor]
    residuals: dict[int, tf.Tensor]
    finite: tf.Tensor | None
    nbytes: int


def _sum_whole(ctx: tf.distribute.ReplicaContext, comp: BlockTopK, prepared: Prepared
               ) -> _Part:
    """The variables sent whole: one ``all_reduce`` of their packed accumulations.

    Every block of theirs is sent, so neither ids nor scores travel; their residuals become
    zero.  A non-finite value anywhere shows in the summed buffer on every replica.
    """
    whole = [p for p, w in enumerate(comp.whole) if w]
    if not whole:
        return _Part({}, {}, None, 0)
    accs = [prepared.accs[p] for p in whole]
    buf = _pack_values(accs)
    summed = ctx.all_reduce(_SUM, buf)
    parts = codec.unpack(summed, [comp.layouts[p].shape for p in whole])
    return _Part({p: tf.cast(u, a.dtype) for p, u, a in zip(whole, parts, accs)},
                 {p: tf.zeros_like(a) for p, a in zip(whole, accs)},
                 tf.reduce_all(tf.math.is_finite(summed)), codec.buffer_nbytes(buf))


def _take(comp: BlockTopK, prepared: Prepared, ids: Sequence[tf.Tensor],
          sparse: Sequence[int]) -> tuple[list[tf.Tensor], dict[int, tf.Tensor]]:
    """The selected blocks [k_v, bs_v] of the compressed variables, and their residuals."""
    taken = [take_blocks(prepared.accs[p], comp.layouts[p], ids[p]) for p in sparse]
    return [v for v, _ in taken], {p: r for p, (_, r) in zip(sparse, taken)}


def _result(comp: BlockTopK, prepared: Prepared, ids: Sequence[tf.Tensor],
            parts: Sequence[_Part]) -> ExchangeResult:
    """Merges the whole and the compressed variables' parts, in variable order."""
    updates, residuals = {}, {}
    finite = None
    for part in parts:
        updates.update(part.updates)
        residuals.update(part.residuals)
        if part.finite is not None:
            finite = _and(finite, part.finite)
    order = range(len(comp.layouts))
    sparse = [p for p in order if not comp.whole[p]]
    return ExchangeResult(
        tuple(updates[p] for p in order), tuple(residuals[p] for p in order),
        tf.constant(True) if finite is None else finite, sum(p.nbytes for p in parts),
        dense_nbytes(prepared.accs), sum(comp.counts),
        _residual_norm([prepared.scores[p] for p in sparse], [ids[p] for p in sparse],
                       comp.metric), tuple(ids))


def exchange_allgather(ctx: tf.distribute.ReplicaContext, comp: BlockTopK,
                       prepared: Prepared) -> ExchangeResult:
    """Each replica sends its own top-k blocks; updates are the sum of everybody's.

    Variables sent whole are summed densely instead (one ``all_reduce``, no ids).  The
    non-finite flag rides in the id buffer and covers every variable; with no compressed
    variable there is no id buffer and the summed whole buffer carries it.
    """
    whole = _sum_whole(ctx, comp, prepared)
    ids = comp.select(prepared.scores)
    sparse = [p for p, w in enumerate(comp.whole) if not w]
    if not sparse:
        return _result(comp, prepared, ids, [whole])
    values, residuals = _take(comp, prepared, ids, sparse)
    bad = tf.reshape(tf.cast(tf.logical_not(prepared.finite), tf.int32), (1,))
    id_buf = codec.pack([*(ids[p] for p in sparse), bad])
    val_buf = _pack_values(values)
    n = ctx.num_replicas_in_sync
    all_ids = tf.reshape(ctx.all_gather(id_buf, axis=0), (n, -1))
    all_vals = tf.reshape(ctx.all_gather(val_buf, axis=0), (n, -1))
    updates, i_off, v_off = {}, 0, 0
    for p in sparse:
        lay, k = comp.layouts[p], comp.counts[p]
        g_ids = tf.reshape(all_ids[:, i_off:i_off + k], (-1,))
        g_vals = tf.reshape(all_vals[:, v_off:v_off + k * lay.block_size], (-1, lay.block_size))
        updates[p] = tf.cast(selection.scatter_blocks(g_vals, g_ids, lay), prepared.accs[p].dtype)
        i_off, v_off = i_off + k, v_off + k * lay.block_size
    gathered = _Part(updates, residuals, tf.equal(tf.reduce_sum(all_ids[:, -1]), 0),
                     codec.buffer_nbytes(id_buf) + codec.buffer_nbytes(val_buf))
    return _result(comp, prepared, ids, [whole, gathered])


def exchange_shared(ctx: tf.distribute.ReplicaContext, comp: BlockTopK,
                    prepared: Prepared) -> ExchangeResult:
    """All replicas agree on the blocks with the highest summed score, then all-reduce them.

    Variables sent whole are summed densely instead (one ``all_reduce``, no scores).
    """
    whole = _sum_whole(ctx, comp, prepared)
    sparse = [p for p, w in enumerate(comp.whole) if not w]
    if not sparse:
        return _result(comp, prepared, comp.select(prepared.scores), [whole])
    score_buf = codec.pack([prepared.scores[p] for p in sparse])
    summed = ctx.all_reduce(_SUM, score_buf)
    scores = list(prepared.scores)
    for p, s in zip(sparse, codec.unpack(summed, [(comp.layouts[p].num_blocks,)
                                                  for p in sparse])):
        scores[p] = s
    ids = comp.select(scores)
    values, residuals = _take(comp, prepared, ids, sparse)
    val_buf = _pack_values(values)
    reduced = codec.unpack(ctx.all_reduce(_SUM, val_buf),
                           [(comp.counts[p], comp.layouts[p].block_size) for p in sparse])
    updates = {p: tf.cast(selection.scatter_blocks(v, ids[p], comp.layouts[p]),
                          prepared.accs[p].dtype) for p, v in zip(sparse, reduced)}
    agreed = _Part(updates, residuals, tf.reduce_all(tf.math.is_finite(summed)),
                   codec.buffer_nbytes(score_buf) + codec.buffer_nbytes(val_buf))
    return _result(comp, prepared, ids, [whole, agreed])


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
