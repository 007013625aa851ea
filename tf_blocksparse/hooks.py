"""Bucketed exchange hooks: the one exchange entry point of every shell, per fusion bucket.

In the manner of PyTorch's ``ddp_comm_hooks``: a gradient batch is cut into
:class:`Bucket`\\ s (the groups of a balanced fusion plan, :mod:`tf_blocksparse.fusion`,
or one bucket of every variable when there is no plan), and an exchange hook
``hook(state, bucket) -> results`` exchanges one bucket with its own packed buffers and
collectives.  The state is explicit (:class:`HookState`: the collectives, the mode, the
compressor and the residuals); a hook changes nothing, it returns the new residuals in its
:class:`~tf_blocksparse.exchange.ExchangeResult`\\ s and the shell commits them.

Two hooks, both one call of :func:`tf_blocksparse.exchange.run`:

:func:`dense_hook`
    The plain sum of the bucket's gradients (flushing residuals when the state has some).
:func:`block_sparse_hook`
    Error feedback, block top-k selection and the exchange of the state's mode.

:func:`exchange_buckets` runs a hook over every bucket and merges the results, per local
replica, in variable order.  The Keras optimizer wrapper (replica context),
``BlockSparseCrossDeviceOps`` and the hybrid trainer's group sync (device lists) all call it.

The compressors select blocks *per variable* (``k`` or ``density`` of each variable's own
blocks, from its own scores), so how variables are bucketed changes which collectives carry
them, not which blocks are sent nor the sums.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from tf_blocksparse.blocks import BlockLayout
from tf_blocksparse.exchange import ExchangeResult, run
from tf_blocksparse.feedback import BlockTopK
from tf_blocksparse.fusion import FusionPlan

__all__ = ["Bucket", "ExchangeHook", "HookState", "block_sparse_hook", "buckets_for",
           "dense_hook", "exchange_buckets", "merge_results"]


@dataclasses.dataclass(frozen=True)
class Bucket:
    """One fusion bucket of a gradient batch, exchanged with its own collectives.

    Attributes:
      index: The bucket's position in execution (backward) order.
      variables: The positions in the gradient batch of the bucket's variables [n_b].
      grads: ``grads[r][j]``: local replica ``r``'s gradient of ``variables[j]``
        [*shape_j].
      layouts: Per member, its :class:`~tf_blocksparse.blocks.BlockLayout`; empty when the
        shell builds its compressor from ``variables`` instead (a dense hook needs none).
    """

    index: int
    variables: tuple[int, ...]
    grads: tuple[tuple[tf.Tensor, ...], ...]
    layouts: tuple[BlockLayout, ...] = ()


@dataclasses.dataclass(frozen=True)
class HookState:
    """The explicit state an exchange hook reads.

    Attributes:
      comm: The collectives of the local replicas
        (:class:`~tf_blocksparse.collectives.ReplicaCollectives` or
        :class:`~tf_blocksparse.collectives.DeviceCollectives`).
      mode: One of :data:`~tf_blocksparse.exchange.EXCHANGES` for every bucket, or one per
        bucket (by :attr:`Bucket.index`).
      compressor: Builds a bucket's compressor; ``None`` for a dense exchange.
      residuals: ``residuals[r][v]``: local replica ``r``'s residual of batch position ``v``
        [*shape_v] (``None`` entries: no state there), or ``None`` for no state at all.
    """

    comm: Any
    mode: str | tuple[str, ...]
    compressor: Callable[[Bucket], BlockTopK | None] | None = None
    residuals: Sequence[Sequence[tf.Tensor | None]] | None = None

    def mode_of(self, bucket: Bucket) -> str:
        """The mode of ``bucket``."""
        return self.mode if isinstance(self.mode, str) else self.mode[bucket.index]

    def residuals_of(self, bucket: Bucket) -> list[list[tf.Tensor]] | None:
        """Per local replica the residuals of the bucket's variables, or ``None`` when the
        state holds none for them (a dense bucket that carries no state)."""
        if self.residuals is None:
            return None
        out = [[per_replica[v] for v in bucket.variables] for per_replica in self.residuals]
        if all(t is None for per_replica in out for t in per_replica):
            return None
        return out


#: ``hook(state, bucket)`` -> one :class:`~tf_blocksparse.exchange.ExchangeResult` per local
#: replica, over the bucket's variables in its order.
ExchangeHook = Callable[[HookState, Bucket], list[ExchangeResult]]


def dense_hook(state: HookState, bucket: Bucket) -> list[ExchangeResult]:
    """The sum of the bucket's gradients (``grad + residual`` when the state has residuals
    for it, which are then flushed to zero)."""
    return run(state.comm, "dense", None, bucket.grads, state.residuals_of(bucket))


def block_sparse_hook(state: HookState, bucket: Bucket) -> list[ExchangeResult]:
    """Error feedback, selection and the exchange of ``state.mode_of(bucket)`` (a
    ``"dense"`` bucket is :func:`dense_hook`)."""
    mode = state.mode_of(bucket)
    if mode == "dense":
        return dense_hook(state, bucket)
    return run(state.comm, mode, state.compressor(bucket), bucket.grads,
               state.residuals_of(bucket))


def buckets_for(grads: Sequence[Sequence[tf.Tensor]],
                groups: FusionPlan | Sequence[Sequence[int]] | None = None,
                layouts: Sequence[BlockLayout] = ()) -> list[Bucket]:
    """The buckets of a gradient batch.

    Args:
      grads: ``grads[r][v]``: local replica ``r``'s gradient of batch position ``v``.
      groups: A :class:`~tf_blocksparse.fusion.FusionPlan` over the batch (its
        groups' members are positions), the positions of each group, or ``None`` for one
        bucket of every variable.
      layouts: Per batch position its layout, or empty.

    Returns:
      One :class:`Bucket` per group, in the given (execution) order.
    """
    if groups is None:
        groups = [range(len(grads[0]))]
    elif isinstance(groups, FusionPlan):
        groups = [g.members for g in groups.groups]
    return [Bucket(b, tuple(group), tuple(tuple(g[v] for v in group) for g in grads),
                   tuple(layouts[v] for v in group) if layouts else ())
            for b, group in enumerate(groups)]


def merge_results(parts: Sequence[ExchangeResult], buckets: Sequence[Bucket], n: int,
                  stateful: bool, metric: str = "l1") -> ExchangeResult:
    """One replica's bucket results merged into one over the ``n`` batch positions.

    Args:
      parts: Per bucket, this replica's result.
      buckets: The buckets, covering every position exactly once.
      n: Positions in the batch.
      stateful: Whether the exchange had residuals (else ``residuals`` / ``sent_ids`` are
        ``None``).
      metric: ``"l1"`` or ``"l2"``, to combine the residual norms.

    Raises:
      ValueError: The buckets do not cover every position.
    """
    if len(parts) == 1 and list(buckets[0].variables) == list(range(n)):
        return parts[0]
    updates: list[tf.Tensor | None] = [None] * n
    residuals: list[tf.Tensor | None] = [None] * n
    sent: list[tf.Tensor | None] = [None] * n
    for r, bucket in zip(parts, buckets):
        for j, i in enumerate(bucket.variables):
            updates[i] = r.updates[j]
            if r.residuals is not None:
                residuals[i] = r.residuals[j]
            if r.sent_ids is not None:
                sent[i] = r.sent_ids[j]
    if any(u is None for u in updates):
        raise ValueError("the buckets must cover every gradient exactly once")
    norms = [p.residual_norm for p in parts]
    norm = tf.add_n(norms) if metric == "l1" else tf.sqrt(tf.add_n([x * x for x in norms]))
    return ExchangeResult(
        tuple(updates), tuple(residuals) if stateful else None,
        tf.reduce_all(tf.stack([p.finite for p in parts])),
        sum(p.payload_bytes for p in parts), sum(p.dense_bytes for p in parts),
        sum(p.blocks_kept for p in parts), norm, tuple(sent) if stateful else None)


def exchange_buckets(hook: ExchangeHook, state: HookState, buckets: Sequence[Bucket],
                     metric: str = "l1") -> list[ExchangeResult]:
    """Runs ``hook`` on every bucket (in order: a bucket's collectives depend only on its
    own members' gradients) and merges the results.

    Args:
      hook: :func:`dense_hook`, :func:`block_sparse_hook` or another
        :data:`ExchangeHook`.
      state: The hook's state; its ``residuals`` cover the whole batch.
      buckets: Every batch position exactly once.
      metric: ``"l1"`` or ``"l2"``, to combine the residual norms.

    Returns:
      Per local replica one result over the whole batch (``updates[v]`` [*shape_v] the same
      on every replica, ``finite`` true when every bucket was).

    Raises:
      ValueError: A mode per bucket whose count differs from the buckets', or buckets
        that do not cover every position.
    """
    if not isinstance(state.mode, str) and len(state.mode) != len(buckets):
        raise ValueError(f"got {len(state.mode)} modes for {len(buckets)} groups")
    n = sum(len(b.variables) for b in buckets)
    per_bucket = [hook(state, bucket) for bucket in buckets]
    replicas = len(buckets[0].grads)
    return [merge_results([p[r] for p in per_bucket], buckets, n, state.residuals is not None,
                          metric) for r in range(replicas)]
