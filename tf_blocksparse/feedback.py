"""Block top-k compression with error feedback, as an explicit-state compressor.

Optax style: the compressor holds only static configuration; its state (one residual per
variable) is a value passed in and returned, so any owner can keep it where it likes (the
Keras adapter keeps it in per-replica variables).  Per variable, per replica::

    acc      = grad + residual                  # error feedback
    ids      = top-k blocks of acc by L1/L2 score
    payload  = (ids, acc[blocks ids])           # sent
    residual = acc with blocks ids set to zero  # kept: acc == scatter(payload) + residual

Conservation is exact: the residual keeps the bits of ``acc`` outside the selected blocks and
the payload carries the bits inside them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import tensorflow as tf

from tf_blocksparse import kernels, selection
from tf_blocksparse.blocks import ELEMENT, BlockLayout
from tf_blocksparse.checks import check_choice, validate_dense_below, validate_k_density
from tf_blocksparse.options import (
    DEFAULT_DENSE_BELOW,
    EMBEDDINGS,
    METRICS,
    QUANTIZATIONS,
    RECURRENT,
    CompressionOptions,
)

__all__ = ["DEFAULT_DENSE_BELOW", "BlockTopK", "ElementTopK", "Payload", "Prepared",
           "compressor_for", "take_blocks", "validate_dense_below", "validate_k_density"]


def take_blocks(acc: tf.Tensor, layout: BlockLayout, ids: tf.Tensor
                ) -> tuple[tf.Tensor, tf.Tensor]:
    """One variable: its blocks ``ids`` [k] and the residual without them.

    On CPU, for float32/64, one fused op (:mod:`tf_blocksparse.kernels`) does both in
    ``acc``'s buffer; the result is the same bits as the TensorFlow ops'.

    Returns:
      ``(values, residual)``: the blocks as rows [k, block_size], and ``acc`` [*shape] with
      those blocks set to zero (the rest bit-exact).
    """
    if kernels.fusable(acc):
        return kernels.take_blocks(acc, layout, ids)
    flat = selection.block_flat_indices(ids, layout)
    values = selection.gather_blocks(acc, layout, ids, flat)
    with tf.control_dependencies([values]):  # lets the scatter reuse acc's buffer
        residual = selection.zero_blocks(acc, layout, ids, flat)
    return values, residual


@dataclasses.dataclass(frozen=True)
class Payload:
    """What one replica sends: per variable, block ids [k_v] int32 and values [k_v, bs_v]."""

    ids: tuple[tf.Tensor, ...]
    values: tuple[tf.Tensor, ...]


@dataclasses.dataclass(frozen=True)
class Prepared:
    """Accumulated gradients and their block scores, before selection.

    Attributes:
      accs: Per variable ``grad + residual`` [*shape].
      scores: Per variable [num_blocks] float32 scores.
      finite: Scalar bool, true when every score is finite (so every ``acc`` entry is,
        those of the variables sent whole included).
    """

    accs: tuple[tf.Tensor, ...]
    scores: tuple[tf.Tensor, ...]
    finite: tf.Tensor


class BlockTopK:
    """Block-wise top-k sparsifier with error feedback over a fixed list of variables.

    Args:
      layouts: One :class:`BlockLayout` per variable.
      k: Blocks kept per variable (clipped to its block count).
      density: Alternatively, the fraction of blocks kept per variable.
      metric: ``"l1"`` or ``"l2"``.
      dense_below: Variables with fewer than this many elements keep all their blocks
        every step (sent whole, no residual), as DGC leaves small layers uncompressed;
        0 compresses every variable.  Default: the one default of the project,
        ``CompressionOptions``' (:data:`~tf_blocksparse.options.DEFAULT_DENSE_BELOW`);
        :func:`compressor_for` passes the options' value.
      quantize: How the all-gather exchange sends the selected blocks' values (see
        :mod:`~tf_blocksparse.quantize`); ``"none"`` sends them in their own dtype.
      recurrent: ``"compress"`` or ``"whole"`` (recurrent layers' variables sent whole, as
        ``CompressionOptions.recurrent`` says).
      embeddings: ``"compress"`` (embedding tables compressed whatever their size) or
        ``"by_size"`` (``dense_below`` applies to them), as ``CompressionOptions.embeddings``
        says.

    Attributes:
      counts: Per variable, the blocks kept each step.
      whole: Per variable, true when it is sent whole (under ``dense_below``, unless an
        embedding table with ``embeddings="compress"``; or a recurrent layer's with
        ``recurrent="whole"``); the exchanges sum those densely,
        without block ids or scores.
      momentum_kept: Per variable, true for a recurrent layer's sent whole: momentum
        correction's masking leaves its local momentum alone (momentum SGD on it), where a
        variable sent whole for being under ``dense_below`` counts every block as sent.
    """

    def __init__(self, layouts: Sequence[BlockLayout], k: int | None = None,
                 density: float | None = None, metric: str = "l1",
                 dense_below: int = DEFAULT_DENSE_BELOW, quantize: str = "none", *,
                 recurrent: str = "compress", embeddings: str = "compress"):
        check_choice(metric, METRICS, "metric")
        self.quantize = check_choice(quantize, QUANTIZATIONS, "quantize")
        self.recurrent = check_choice(recurrent, RECURRENT, "recurrent")
        self.embeddings = check_choice(embeddings, EMBEDDINGS, "embeddings")
        self.k, self.density = validate_k_density(k, density)
        self.dense_below = validate_dense_below(dense_below)
        self.metric = metric
        self.layouts = tuple(layouts)
        self.momentum_kept: tuple[bool, ...] = tuple(
            recurrent == "whole" and lay.recurrent for lay in self.layouts)
        under_dense_below = tuple(lay.size < self.dense_below and not (
            embeddings == "compress" and lay.embedding) for lay in self.layouts)
        self.whole: tuple[bool, ...] = tuple(
            small or kept for small, kept in zip(under_dense_below, self.momentum_kept))
        self.counts: tuple[int, ...] = tuple(
            lay.num_blocks if whole
            else selection.num_selected(lay.num_blocks, self.k, self.density)
            for lay, whole in zip(self.layouts, self.whole))

    def ids_to_mask(self, ids: Sequence[tf.Tensor]) -> tuple[tf.Tensor | None, ...]:
        """Per variable the sent block ids [k_v] that momentum correction masks with:
        ``None`` where the momentum is kept (:attr:`momentum_kept`)."""
        return tuple(None if kept else i for i, kept in zip(ids, self.momentum_kept))

    @property
    def keeps_all(self) -> bool:
        """Whether every block of every variable is kept each step (``density=1.0``, a ``k``
        of at least every block count, or every variable under ``dense_below``): nothing
        waits, so the exchanges send such a group as a plain dense sum."""
        return all(n == lay.num_blocks for n, lay in zip(self.counts, self.layouts))

    def init(self, dtypes: Sequence[tf.DType] | None = None) -> tuple[tf.Tensor, ...]:
        """Zero residuals, one [*shape] tensor per variable."""
        dtypes = dtypes or [tf.float32] * len(self.layouts)
        return tuple(tf.zeros(lay.shape, dt) for lay, dt in zip(self.layouts, dtypes))

    def prepare(self, grads: Sequence[tf.Tensor], state: Sequence[tf.Tensor]) -> Prepared:
        """Error feedback and scoring: ``acc = grad + residual`` and its block scores.

        A compressed float32/64 variable on CPU takes one fused pass
        (:func:`tf_blocksparse.kernels.accumulate_score`): the same ``acc`` bits, scores
        equal up to float summation order.
        """
        self._check(grads, "grads")
        self._check(state, "state")
        pairs = [self._accumulate(g, r, lay, whole)
                 for g, r, lay, whole in zip(grads, state, self.layouts, self.whole)]
        accs = tuple(a for a, _ in pairs)
        scores = tuple(s for _, s in pairs)
        finite = tf.reduce_all(tf.math.is_finite(tf.concat(scores, axis=0))) if scores \
            else tf.constant(True)
        return Prepared(accs, scores, finite)

    def _accumulate(self, grad: tf.Tensor, residual: tf.Tensor, layout: BlockLayout,
                    whole: bool) -> tuple[tf.Tensor, tf.Tensor]:
        """``(acc [*shape], scores [num_blocks])`` of one variable."""
        if not whole and isinstance(grad, tf.Tensor) and grad.dtype == residual.dtype \
                and kernels.fusable(grad):
            return kernels.accumulate_score(grad, residual, layout, self.metric)
        acc = grad + residual
        return acc, selection.block_scores(acc, layout, self.metric)

    def select(self, scores: Sequence[tf.Tensor]) -> tuple[tf.Tensor, ...]:
        """Top-k block ids [k_v] per variable from (local or globally summed) scores.

        A variable sent whole gets every block id in order, ``range(num_blocks)``.
        """
        return tuple(tf.range(n, dtype=tf.int32) if whole else selection.top_blocks(s, n)
                     for s, n, whole in zip(scores, self.counts, self.whole))

    def finish(self, prepared: Prepared, ids: Sequence[tf.Tensor]
               ) -> tuple[Payload, tuple[tf.Tensor, ...]]:
        """Gathers the selected blocks and zeroes them in the residual.

        Returns:
          ``(payload, new_state)``.
        """
        taken = [take_blocks(acc, lay, i)
                 for acc, lay, i in zip(prepared.accs, self.layouts, ids)]
        return (Payload(tuple(ids), tuple(v for v, _ in taken)),
                tuple(r for _, r in taken))

    def compress(self, grads: Sequence[tf.Tensor], state: Sequence[tf.Tensor]
                 ) -> tuple[Payload, tuple[tf.Tensor, ...]]:
        """Local selection: ``prepare``, ``select`` on local scores, ``finish``."""
        prepared = self.prepare(grads, state)
        return self.finish(prepared, self.select(prepared.scores))

    def decompress(self, payload: Payload) -> tuple[tf.Tensor, ...]:
        """Dense [*shape] tensors from a payload (repeated ids, e.g. gathered, add up)."""
        return tuple(selection.scatter_blocks(v, i, lay)
                     for v, i, lay in zip(payload.values, payload.ids, self.layouts))

    def _check(self, tensors: Sequence[tf.Tensor], name: str) -> None:
        if len(tensors) != len(self.layouts):
            raise ValueError(f"`{name}` has {len(tensors)} tensors, the compressor was built "
                             f"for {len(self.layouts)} variables")
        for t, lay in zip(tensors, self.layouts):
            if tuple(t.shape) != lay.shape:
                raise ValueError(f"`{name}`: tensor for {lay.path!r} has shape "
                                 f"{tuple(t.shape)}, expected {lay.shape}")


class ElementTopK(BlockTopK):
    """Element-wise top-k with error feedback (the DGC / GRACE baseline), same interface.

    Every element is its own block, so the score is ``|x|``, selection is ``top_k`` over the
    whole flattened variable, and every sent value carries its own int32 index.  Use
    ``density`` (``k`` then counts elements per variable).
    """

    def __init__(self, layouts: Sequence[BlockLayout], k: int | None = None,
                 density: float | None = None, metric: str = "l1",
                 dense_below: int = DEFAULT_DENSE_BELOW, quantize: str = "none",
                 *, recurrent: str = "compress", embeddings: str = "compress"):
        super().__init__([dataclasses.replace(lay, rule=ELEMENT) for lay in layouts],
                         k, density, metric, dense_below, quantize, recurrent=recurrent,
                         embeddings=embeddings)


def compressor_for(options: CompressionOptions, layouts: Sequence[BlockLayout]) -> BlockTopK:
    """The compressor ``options`` ask for (its ``granularity``) over ``layouts``."""
    cls = ElementTopK if options.granularity == "element" else BlockTopK
    return cls(layouts, options.k, options.density, options.metric, options.dense_below,
               options.quantize, recurrent=options.recurrent, embeddings=options.embeddings)
