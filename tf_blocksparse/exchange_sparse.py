"""The two sparse modes of :func:`tf_blocksparse.exchange.run`, ``"allgather"`` and
``"shared"``, and the result every mode returns.

Both take the replicas' prepared accumulations (error feedback applied, blocks scored:
:meth:`~tf_blocksparse.feedback.BlockTopK.prepare`), select, pack everything of a kind into
one buffer and call the collectives of a :mod:`~tf_blocksparse.collectives` object; the
module docstring of :mod:`tf_blocksparse.exchange` gives their collectives and bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tf_blocksparse import codec, quantize, selection
from tf_blocksparse.exchange_bytes import dense_nbytes
from tf_blocksparse.feedback import BlockTopK, Prepared, take_blocks

__all__ = ["ExchangeResult", "allgather", "shared"]


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
        residual; what momentum correction masks with.  ``range(num_blocks)`` for a variable
        sent whole under ``dense_below``; ``None`` for dense and for a recurrent layer's sent
        whole (``BlockTopK.momentum_kept``: its momentum carries on, momentum SGD on it).
    """

    updates: tuple[tf.Tensor, ...]
    residuals: tuple[tf.Tensor, ...] | None
    finite: tf.Tensor
    payload_bytes: int
    dense_bytes: int
    blocks_kept: int
    residual_norm: tf.Tensor
    sent_ids: tuple[tf.Tensor | None, ...] | None = None


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


def _pack_values(values: Sequence[tf.Tensor]) -> tf.Tensor:
    """One buffer of ``values``, in their common dtype (float32 when they mix)."""
    dtypes = {v.dtype for v in values}
    dtype = dtypes.pop() if len(dtypes) == 1 else tf.float32
    return codec.pack([tf.cast(v, dtype) for v in values])


@dataclasses.dataclass(frozen=True)
class _Part:
    """The local replicas' share of an exchange over some of the variables.

    Attributes:
      updates: ``{position: summed update [*shape]}``.
      residuals: Per local replica ``{position: new residual [*shape]}``.
      finite: Scalar bool, replica-identical; ``None`` when the part moved nothing.
      nbytes: Bytes one replica handed to the part's collectives.
    """

    updates: dict[int, tf.Tensor]
    residuals: tuple[dict[int, tf.Tensor], ...]
    finite: tf.Tensor | None
    nbytes: int


def _sum_whole(comm: Any, comp: BlockTopK, prepared: Sequence[Prepared]) -> _Part:
    """The variables sent whole: one sum of their packed accumulations.

    Every block of theirs is sent, so neither ids nor scores travel; their residuals become
    zero.  A non-finite value anywhere shows in the summed buffer on every replica.
    """
    whole = [p for p, w in enumerate(comp.whole) if w]
    if not whole:
        return _Part({}, tuple({} for _ in prepared), None, 0)
    bufs, residuals = [], []
    for r, prep in enumerate(prepared):
        with comm.local(r):
            bufs.append(_pack_values([prep.accs[p] for p in whole]))
            residuals.append({p: tf.zeros_like(prep.accs[p]) for p in whole})
    summed = comm.sum(bufs)
    with comm.combine():
        parts = codec.unpack(summed, [comp.layouts[p].shape for p in whole])
        updates = {p: tf.cast(u, prepared[0].accs[p].dtype) for p, u in zip(whole, parts)}
        finite = tf.reduce_all(tf.math.is_finite(summed))
    return _Part(updates, tuple(residuals), finite, codec.buffer_nbytes(bufs[0]))


def _take(comp: BlockTopK, prepared: Prepared, ids: Sequence[tf.Tensor],
          sparse: Sequence[int]) -> tuple[list[tf.Tensor], dict[int, tf.Tensor]]:
    """The selected blocks [k_v, bs_v] of the compressed variables, and their residuals."""
    taken = [take_blocks(prepared.accs[p], comp.layouts[p], ids[p]) for p in sparse]
    return [v for v, _ in taken], {p: r for p, (_, r) in zip(sparse, taken)}


def _results(comm: Any, comp: BlockTopK, prepared: Sequence[Prepared],
             ids: Sequence[Sequence[tf.Tensor]], parts: Sequence[_Part]
             ) -> list[ExchangeResult]:
    """Merges the parts, in variable order, into one result per local replica."""
    updates: dict[int, tf.Tensor] = {}
    finite = None
    for part in parts:
        updates.update(part.updates)
        if part.finite is not None:
            finite = part.finite if finite is None else tf.logical_and(finite, part.finite)
    order = range(len(comp.layouts))
    sparse = [p for p in order if not comp.whole[p]]
    out = []
    for r, prep in enumerate(prepared):
        residuals = {p: t for part in parts for p, t in part.residuals[r].items()}
        with comm.local(r):
            norm = _residual_norm([prep.scores[p] for p in sparse], [ids[r][p] for p in sparse],
                                  comp.metric)
        out.append(ExchangeResult(
            tuple(updates[p] for p in order), tuple(residuals[p] for p in order),
            tf.constant(True) if finite is None else finite, sum(p.nbytes for p in parts),
            dense_nbytes(prep.accs), sum(comp.counts), norm,
            comp.ids_to_mask(ids[r])))
    return out


def _quantised(comp: BlockTopK, values: Sequence[tf.Tensor], residuals: dict[int, tf.Tensor],
               ids: Sequence[tf.Tensor], sparse: Sequence[int]) -> list[tf.Tensor]:
    """Encodes the selected blocks ``values`` [k_v, bs_v] as int32 words and adds each
    value's quantisation error (what was taken minus what is sent) to its residual."""
    words = []
    for p, v in zip(sparse, values):
        w, sent = quantize.encode(v, comp.quantize)
        words.append(w)
        residuals[p] = residuals[p] + selection.scatter_blocks(v - sent, ids[p],
                                                               comp.layouts[p])
    return words


def allgather(comm: Any, comp: BlockTopK, prepared: Sequence[Prepared]
               ) -> list[ExchangeResult]:
    """Each replica sends its own top-k blocks; updates are the sum of everybody's.

    Variables sent whole are summed densely instead (no ids).  The non-finite flag rides in
    the id buffer and covers every variable; with no compressed variable there is no id
    buffer and the summed whole buffer carries it.  With ``comp.quantize`` the values ride
    in the id buffer too, encoded as int32 words (one gather).
    """
    whole = _sum_whole(comm, comp, prepared)
    sparse = [p for p, w in enumerate(comp.whole) if not w]
    quantised = comp.quantize != "none"
    ids, residuals, id_bufs, val_bufs = [], [], [], []
    for r, prep in enumerate(prepared):
        with comm.local(r):
            ids.append(comp.select(prep.scores))
            if sparse:
                values, res = _take(comp, prep, ids[r], sparse)
                bad = tf.reshape(tf.cast(tf.logical_not(prep.finite), tf.int32), (1,))
                words = _quantised(comp, values, res, ids[r], sparse) if quantised else []
                id_bufs.append(codec.pack([*(ids[r][p] for p in sparse), bad, *words]))
                if not quantised:
                    val_bufs.append(_pack_values(values))
                residuals.append(res)
    if not sparse:
        return _results(comm, comp, prepared, ids, [whole])
    all_ids = comm.gather(id_bufs)
    all_vals = None if quantised else comm.gather(val_bufs)
    flag = sum(comp.counts[p] for p in sparse)  # the non-finite flag's column
    updates, i_off, v_off = {}, 0, flag + 1 if quantised else 0
    with comm.combine():
        for p in sparse:
            lay, k = comp.layouts[p], comp.counts[p]
            g_ids = tf.reshape(all_ids[:, i_off:i_off + k], (-1,))
            if quantised:
                n = quantize.num_words(k, lay.block_size, comp.quantize)
                g_vals = quantize.decode(all_ids[:, v_off:v_off + n], k, lay.block_size,
                                         comp.quantize)
            else:
                n = k * lay.block_size
                g_vals = tf.reshape(all_vals[:, v_off:v_off + n], (-1, lay.block_size))
            updates[p] = tf.cast(selection.scatter_blocks(g_vals, g_ids, lay),
                                 prepared[0].accs[p].dtype)
            i_off, v_off = i_off + k, v_off + n
        finite = tf.equal(tf.reduce_sum(all_ids[:, flag]), 0)
    gathered = _Part(updates, tuple(residuals), finite,
                     codec.buffer_nbytes(id_bufs[0]) + sum(codec.buffer_nbytes(b)
                                                           for b in val_bufs[:1]))
    return _results(comm, comp, prepared, ids, [whole, gathered])


def shared(comm: Any, comp: BlockTopK, prepared: Sequence[Prepared]) -> list[ExchangeResult]:
    """All replicas agree on the blocks with the highest summed score, then sum them.

    Variables sent whole are summed densely instead (no scores).
    """
    whole = _sum_whole(comm, comp, prepared)
    sparse = [p for p, w in enumerate(comp.whole) if not w]
    if not sparse:
        ids = []
        for r, prep in enumerate(prepared):
            with comm.local(r):
                ids.append(comp.select(prep.scores))
        return _results(comm, comp, prepared, ids, [whole])
    score_bufs = []
    for r, prep in enumerate(prepared):
        with comm.local(r):
            score_bufs.append(codec.pack([prep.scores[p] for p in sparse]))
    summed = comm.sum(score_bufs)
    with comm.combine():
        scores = list(prepared[0].scores)
        for p, s in zip(sparse, codec.unpack(summed, [(comp.layouts[p].num_blocks,)
                                                      for p in sparse])):
            scores[p] = s
        common = comp.select(scores)
    residuals, val_bufs = [], []
    for r, prep in enumerate(prepared):
        with comm.local(r):
            values, res = _take(comp, prep, common, sparse)
            val_bufs.append(_pack_values(values))
            residuals.append(res)
    reduced = comm.sum(val_bufs)
    with comm.combine():
        rows = codec.unpack(reduced, [(comp.counts[p], comp.layouts[p].block_size)
                                      for p in sparse])
        updates = {p: tf.cast(selection.scatter_blocks(v, common[p], comp.layouts[p]),
                              prepared[0].accs[p].dtype) for p, v in zip(sparse, rows)}
        finite = tf.reduce_all(tf.math.is_finite(summed))
    agreed = _Part(updates, tuple(residuals), finite,
                   codec.buffer_nbytes(score_bufs[0]) + codec.buffer_nbytes(val_bufs[0]))
    return _results(comm, comp, prepared, [common] * len(prepared), [whole, agreed])
