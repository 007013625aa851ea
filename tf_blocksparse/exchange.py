"""The one exchange of the project: error feedback, block selection and the collectives.

:func:`run` does one step for the local replicas of a :mod:`~tf_blocksparse.collectives`
object.  Every shell reaches it through the bucketed exchange hooks of
:mod:`tf_blocksparse.hooks`, one call per fusion bucket: the Keras optimizer wrapper in
replica context, ``BlockSparseCrossDeviceOps`` and the hybrid trainer's group sync over a
device list (:mod:`tf_blocksparse.distribute.device_exchange`).  Three modes, each a
fixed, small number of collectives per step whatever the number of variables (all variables
are packed into one buffer per kind):

``"allgather"``
    Every replica picks its own top-k blocks.  One gather of an int32 buffer (all block ids,
    plus one non-finite flag) and one of a float buffer (all block values); each replica then
    sums every replica's blocks.  Bytes per replica: ``4 * (sum k_v + 1) + itemsize * sum
    k_v * bs_v``; what a replica *receives* grows with the number of workers.
``"shared"`` (all-reduce compatible)
    One sum of the packed block scores; every replica picks the same top-k from the summed
    scores; one sum of those blocks' values.  Bytes per replica: ``4 * sum nb_v + itemsize *
    sum k_v * bs_v``, flat in the number of workers.
``"dense"``
    One all-reduce of the gradients, exactly the call Keras makes (bit-identical).  Given
    residuals (a group the automatic exchange switched to dense), it sends ``grad +
    residual`` and returns zero residuals: error feedback is flushed, nothing is lost.

Variables sent whole (``BlockTopK.whole``: below its ``dense_below`` unless embedding tables
with ``embeddings="compress"``, or recurrent ones with ``recurrent="whole"``) need neither
ids nor
scores: both sparse modes sum them with one more sum of their packed accumulations
(``itemsize * sum size_v`` bytes).

A sparse mode whose compressor keeps every block of every variable (``BlockTopK.keeps_all``:
``density=1.0``, a ``k`` at least every block count, or every variable whole) selects nothing,
so it runs as ``"dense"`` with its residuals (the dense bytes exactly, the weights of
``"dense"``); its result still says every block was sent (``blocks_kept``, ``sent_ids``), so
momentum correction masks as in the sparse modes (there, as here, nothing of a recurrent
layer's variable sent whole with ``recurrent="whole"``: its momentum carries on).

Keras divides each replica's loss by the number of replicas, so a SUM is the mean.  Every
mode also returns a replica-identical ``finite`` flag without a collective of its own (the
flag rides in the id buffer; summed scores, summed whole variables or reduced gradients
show non-finite values as such).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tf_blocksparse.checks import check_choice
from tf_blocksparse.collectives import ReplicaCollectives
from tf_blocksparse.exchange_bytes import dense_nbytes
from tf_blocksparse.exchange_sparse import ExchangeResult, allgather, shared
from tf_blocksparse.feedback import BlockTopK
from tf_blocksparse.options import EXCHANGES

__all__ = ["EXCHANGES", "ExchangeResult", "run", "run_exchange"]


def _dense(comm: Any, grads: Sequence[Sequence[tf.Tensor]],
           state: Sequence[Sequence[tf.Tensor]] | None = None) -> list[ExchangeResult]:
    """Plain sum, in replica context the same call Keras' optimizer makes.

    With ``state`` the residuals are flushed: each replica sends ``grad + residual`` and
    keeps zero residuals.
    """
    residuals: list[tuple[tf.Tensor, ...] | None] = [None] * len(grads)
    if state is not None:
        sent = []
        for r, (g, s) in enumerate(zip(grads, state)):
            with comm.local(r):
                sent.append([a + b for a, b in zip(g, s)])
                residuals[r] = tuple(tf.zeros_like(b) for b in s)
        grads = sent
    reduced = comm.sum_each(grads)
    with comm.combine():
        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(r)) for r in reduced])
    nbytes = dense_nbytes(grads[0])
    return [ExchangeResult(tuple(reduced), res, finite, nbytes, nbytes, 0, tf.constant(0.0))
            for res in residuals]


def _dense_keeping_all(comm: Any, comp: BlockTopK, grads: Sequence[Sequence[tf.Tensor]],
                       state: Sequence[Sequence[tf.Tensor]]) -> list[ExchangeResult]:
    """A sparse mode whose compressor keeps every block: the dense sum of ``grad +
    residual`` (zero residuals after), reported as every block sent."""
    all_ids = []
    for r in range(len(grads)):
        with comm.local(r):
            all_ids.append(comp.ids_to_mask([tf.range(lay.num_blocks, dtype=tf.int32)
                                             for lay in comp.layouts]))
    return [dataclasses.replace(result, blocks_kept=sum(comp.counts), sent_ids=ids)
            for result, ids in zip(_dense(comm, grads, state), all_ids)]


def run(comm: Any, mode: str, comp: BlockTopK | None, grads: Sequence[Sequence[tf.Tensor]],
        state: Sequence[Sequence[tf.Tensor]] | None) -> list[ExchangeResult]:
    """Error feedback + selection + exchange for one step of the local replicas.

    Args:
      comm: A :class:`~tf_blocksparse.collectives.ReplicaCollectives` (one local replica)
        or :class:`~tf_blocksparse.collectives.DeviceCollectives` (one per device).
      mode: One of :data:`EXCHANGES`; a sparse one whose ``comp`` keeps every block runs as
        ``"dense"`` (module docstring).
      comp: The compressor (unused for ``"dense"``).
      grads: ``grads[r][v]``: local replica ``r``'s gradient of variable ``v`` [*shape_v].
      state: ``state[r][v]``: its residual [*shape_v]; ``"dense"`` flushes it when given.

    Returns:
      One :class:`ExchangeResult` per local replica (the same ``updates`` and ``finite``).
    """
    check_choice(mode, EXCHANGES, "exchange")
    if mode == "dense":
        return _dense(comm, grads, state)
    if comp.keeps_all:
        return _dense_keeping_all(comm, comp, grads, state)
    prepared = []
    for r, (g, s) in enumerate(zip(grads, state)):
        with comm.local(r):
            prepared.append(comp.prepare(g, s))
    return (allgather if mode == "allgather" else shared)(comm, comp, prepared)


def run_exchange(mode: str, ctx: tf.distribute.ReplicaContext, comp: BlockTopK | None,
                 grads: Sequence[tf.Tensor], state: Sequence[tf.Tensor] | None
                 ) -> ExchangeResult:
    """:func:`run` for this replica, in replica context (the default context works without
    a strategy): ``grads`` and ``state`` are per variable [*shape]."""
    return run(ReplicaCollectives(ctx), mode, comp, [grads],
               None if state is None else [state])[0]
