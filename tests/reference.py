"""A pure NumPy reference of block top-k sparsification with error feedback (no TensorFlow).

Written from the method's description, independently of :mod:`tf_blocksparse`, so the TF
code can be checked against it.  A *layout* is anything with ``shape`` (the variable's shape) and
``view_shape`` (``(outer, num_blocks, inner)``), e.g. a ``tf_blocksparse.blocks.BlockLayout``;
this module never imports it (importing the package would import TensorFlow).

Per variable, per replica::

    acc          = grad + residual
    ids          = the k blocks of acc with the highest L1 / L2 score (ties: lower id)
    values       = acc's selected blocks, [k, outer * inner]
    new_residual = acc with the selected blocks set to zero

Exchange modes across replicas (:func:`np_step`): ``"allgather"`` (each replica its own
top-k, the update is the sum of everybody's scattered blocks), ``"shared"`` (one common
top-k from the scores summed over replicas) and ``"dense"`` (the update is the sum of the
gradients, residuals untouched).  Variables with fewer than ``dense_below`` elements are
sent whole: the update is the plain sum of the replicas' accumulations, their residual zero;
:func:`np_payload_bytes` gives the bytes a replica hands to the collectives.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from tf_blocksparse.planning.link_cost import EXCHANGES as MODES


def _view_shape(layout: Any) -> tuple[int, int, int]:
    if hasattr(layout, "view_shape"):
        return tuple(int(d) for d in layout.view_shape)
    outer, nb, inner = layout
    return int(outer), int(nb), int(inner)


def _shape(layout: Any) -> tuple[int, ...]:
    if hasattr(layout, "shape"):
        return tuple(int(d) for d in layout.shape)
    return _view_shape(layout)


def _score_dtype(dtype: np.dtype) -> np.dtype:
    """Scores are computed in (at least) float32, as the TF code does for half precision."""
    dtype = np.dtype(dtype)
    if dtype.kind == "f" and dtype.itemsize < 4:
        return np.dtype(np.float32)
    return dtype


def np_view(x: np.ndarray, layout: Any) -> np.ndarray:
    """Reshapes ``x`` [*shape] to its block view [outer, num_blocks, inner]."""
    return np.reshape(np.asarray(x), _view_shape(layout))


def np_scores(x: np.ndarray, layout: Any, metric: str = "l1") -> np.ndarray:
    """[num_blocks] block scores: L1 = sum |x| over the block, L2 = sqrt(sum x^2)."""
    v = np_view(x, layout)
    v = v.astype(_score_dtype(v.dtype))
    if metric == "l1":
        return np.sum(np.abs(v), axis=(0, 2))
    if metric == "l2":
        return np.sqrt(np.sum(v * v, axis=(0, 2)))
    raise ValueError(f"metric must be 'l1' or 'l2', got {metric!r}")


def np_topk(scores: np.ndarray, k: int) -> np.ndarray:
    """Ids of the ``k`` highest scores, highest first; ties go to the lower id."""
    scores = np.asarray(scores)
    return np.argsort(-scores, kind="stable")[:k].astype(np.int32)


def np_num_selected(nb: int, k: int | None = None, density: float | None = None) -> int:
    """Blocks kept: ``max(1, min(nb, ceil(density * nb)))`` or ``min(k, nb)`` (k default 1)."""
    if density is not None:
        return max(1, min(nb, math.ceil(density * nb)))
    return min(1 if k is None else k, nb)


def np_gather(x: np.ndarray, layout: Any, ids: np.ndarray) -> np.ndarray:
    """[k, outer * inner]: row i is block ``ids[i]`` in C order of (outer, inner)."""
    outer, _, inner = _view_shape(layout)
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    g = np_view(x, layout)[:, ids, :]                      # [outer, k, inner]
    return np.ascontiguousarray(np.transpose(g, (1, 0, 2))).reshape(ids.size, outer * inner)


def np_scatter(values: np.ndarray, ids: np.ndarray, layout: Any,
               dtype: Any = None) -> np.ndarray:
    """Dense [*shape] tensor, zero outside the given blocks; repeated ids add up."""
    outer, nb, inner = _view_shape(layout)
    values = np.asarray(values)
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    out = np.zeros((outer, nb, inner), dtype or values.dtype)
    for i, row in zip(ids, values.reshape(ids.size, outer * inner)):
        out[:, i, :] += row.reshape(outer, inner)
    return out.reshape(_shape(layout))


def np_zero_blocks(x: np.ndarray, layout: Any, ids: np.ndarray) -> np.ndarray:
    """A copy of ``x`` with the blocks ``ids`` set to zero."""
    v = np_view(x, layout).copy()
    v[:, np.asarray(ids, dtype=np.int64).reshape(-1), :] = 0
    return v.reshape(_shape(layout))


def np_is_normalization(layout: Any) -> bool:
    """True for a normalisation layer's scale or offset (the layer class the layout was
    found under; the reference's own list)."""
    return layout.layer_class in ("BatchNormalization", "LayerNormalization",
                                  "GroupNormalization")


def np_is_embedding(layout: Any) -> bool:
    """True for an embedding table (an ``Embedding`` layer's, or a variable named
    ``embeddings``; the reference's own test)."""
    return getattr(layout, "layer_class", None) == "Embedding" or \
        str(getattr(layout, "path", "")).split("/")[-1] == "embeddings"


def np_is_whole(layout: Any, dense_below: int, embeddings: str = "compress") -> bool:
    """True when the variable has fewer than ``dense_below`` elements (sent whole), unless
    it is an embedding table and ``embeddings`` is ``"compress"``."""
    if embeddings == "compress" and np_is_embedding(layout):
        return False
    return math.prod(_shape(layout)) < dense_below


def np_payload_bytes(mode: str, layouts: Sequence[Any], k: int | None = None,
                     density: float | None = None, dense_below: int = 0,
                     itemsize: int = 4, embeddings: str = "compress") -> int:
    """Bytes one replica hands to the collectives in one step (float32 scores and ids).

    ``"allgather"``: ``4 * (sum k_v + 1)`` (ids and the non-finite flag) plus the values of
    the kept blocks; ``"shared"``: ``4 * sum nb_v`` (scores) plus the same values; both over
    the compressed variables only (none at all when there is none), plus every element of
    the variables sent whole (one dense sum).  ``"dense"``: every element.
    """
    sizes = [math.prod(_shape(lay)) for lay in layouts]
    if mode == "dense":
        return itemsize * sum(sizes)
    whole_flags = [np_is_whole(lay, dense_below, embeddings) for lay in layouts]
    whole = itemsize * sum(n for n, w in zip(sizes, whole_flags) if w)
    sparse = [_view_shape(lay) for lay, w in zip(layouts, whole_flags) if not w]
    if not sparse:
        return whole
    counts = [np_num_selected(nb, k, density) for _, nb, _ in sparse]
    values = itemsize * sum(c * outer * inner for c, (outer, _, inner) in zip(counts, sparse))
    side = 4 * (sum(counts) + 1) if mode == "allgather" else 4 * sum(nb for _, nb, _ in sparse)
    return side + values + whole


def np_compress(grad: np.ndarray, residual: np.ndarray, layout: Any, k: int | None = None,
                density: float | None = None, metric: str = "l1"
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One variable, one replica: ``(ids, values, new_residual)``.

    ``ids`` are in descending score order (ties: lower id first).
    """
    acc = np.asarray(grad) + np.asarray(residual)
    nb = _view_shape(layout)[1]
    ids = np_topk(np_scores(acc, layout, metric), np_num_selected(nb, k, density))
    return ids, np_gather(acc, layout, ids), np_zero_blocks(acc, layout, ids)


def np_step(mode: str, grads_per_replica: Sequence[Sequence[np.ndarray]],
            residuals_per_replica: Sequence[Sequence[np.ndarray]] | None,
            layouts: Sequence[Any], k: int | None = None, density: float | None = None,
            metric: str = "l1", sent: list | None = None, dense_below: int = 0,
            embeddings: str = "compress"
            ) -> tuple[list[np.ndarray], list[list[np.ndarray]], bool]:
    """One exchange step over all replicas.

    Args:
      mode: ``"allgather"``, ``"shared"`` or ``"dense"``.
      grads_per_replica: ``[replica][variable]`` gradients.
      residuals_per_replica: ``[replica][variable]`` residuals (may be ``None`` for dense;
        given to dense, they are sent with the gradients and come back zero).
      layouts: One layout per variable.
      k, density, metric: Selection parameters (see :func:`np_compress`).
      sent: If a list, it receives ``[replica][variable]`` the block ids each replica
        moved out of its residual.
      dense_below: Variables with fewer elements are sent whole: their update is the plain
        sum of the replicas' ``grad + residual``, their residual zero and their sent ids
        every block id in order.
      embeddings: ``"compress"``: embedding tables are compressed whatever their size;
        ``"by_size"``: ``dense_below`` applies to them too.

    Returns:
      ``(updates, new_residuals, finite)``: per variable the summed update (the same on
      every replica), ``[replica][variable]`` new residuals, and whether every value that
      took part was finite.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    n = len(grads_per_replica)
    nvars = len(layouts)
    if mode == "dense":  # residuals, when given, are flushed: grad + residual goes out
        held = residuals_per_replica
        updates = [sum(np.asarray(grads_per_replica[r][v]) +
                       (0 if held is None else np.asarray(held[r][v])) for r in range(n))
                   for v in range(nvars)]
        finite = all(bool(np.all(np.isfinite(u))) for u in updates)
        residuals = ([[np.zeros_like(np.asarray(x)) for x in rs] for rs in held]
                     if held is not None else [])
        return updates, residuals, finite

    accs = [[np.asarray(grads_per_replica[r][v]) + np.asarray(residuals_per_replica[r][v])
             for v in range(nvars)] for r in range(n)]
    scores = [[np_scores(accs[r][v], layouts[v], metric) for v in range(nvars)]
              for r in range(n)]
    finite = all(bool(np.all(np.isfinite(s))) for rs in scores for s in rs)
    updates = [np.zeros(_shape(lay), accs[0][v].dtype) for v, lay in enumerate(layouts)]
    residuals: list[list[np.ndarray]] = [[None] * nvars for _ in range(n)]
    sent_ids: list[list[np.ndarray]] = [[None] * nvars for _ in range(n)]
    for v, lay in enumerate(layouts):
        nb = _view_shape(lay)[1]
        if np_is_whole(lay, dense_below, embeddings):
            for r in range(n):
                updates[v] = updates[v] + accs[r][v]
                residuals[r][v] = np.zeros_like(accs[r][v])
                sent_ids[r][v] = np.arange(nb, dtype=np.int32)
            continue
        count = np_num_selected(nb, k, density)
        if mode == "shared":
            summed = sum(scores[r][v] for r in range(n))
            finite = finite and bool(np.all(np.isfinite(summed)))
            common = np_topk(summed, count)
        for r in range(n):
            ids = np_topk(scores[r][v], count) if mode == "allgather" else common
            updates[v] = updates[v] + np_scatter(np_gather(accs[r][v], lay, ids), ids, lay)
            residuals[r][v] = np_zero_blocks(accs[r][v], lay, ids)
            sent_ids[r][v] = ids
    if sent is not None:
        sent.extend(sent_ids)
    return updates, residuals, finite


def np_momentum_corrected_step(mode: str, grads_per_replica: Sequence[Sequence[np.ndarray]],
                               residuals_per_replica: Sequence[Sequence[np.ndarray]],
                               velocities_per_replica: Sequence[Sequence[np.ndarray]],
                               layouts: Sequence[Any], momentum: float, k: int | None = None,
                               density: float | None = None, metric: str = "l1",
                               masking: str = "all", dense_below: int = 0,
                               embeddings: str = "compress",
                               whole_momentum: float | None = None
                               ) -> tuple[list[np.ndarray], list[list[np.ndarray]],
                                          list[list[np.ndarray]], bool]:
    """DGC momentum correction + factor masking around :func:`np_step`.

    Per replica ``u = momentum * u + g``; ``u`` goes through error feedback, selection and
    exchange in place of ``g``; ``masking="all"`` zeroes the blocks a replica sent in its
    ``u`` too, ``"waited"`` only those whose residual block was non-zero before the step,
    ``"none"`` none, ``"compressed"`` the sent blocks of variables that do not send every
    block each step, ``"whole"`` only those of variables that do, ``"whole_except_norm"``
    those of ``"whole"`` that are no normalisation layer's scale or offset,
    ``"whole_vectors"`` those of ``"whole"`` whose blocks are single elements.
    Variables sent whole (``dense_below``) count every block as sent.  With a
    ``whole_momentum`` under a ``"whole"`` masking the masked variables' ``u`` is scaled by
    ``whole_momentum / momentum`` instead of zeroed.

    Returns:
      ``(updates, new_residuals, new_velocities, finite)``.
    """
    dt = np.asarray(grads_per_replica[0][0]).dtype.type
    us = [[np.asarray(u) * dt(momentum) + np.asarray(g) for u, g in zip(us_r, gs_r)]
          for us_r, gs_r in zip(velocities_per_replica, grads_per_replica)]
    sent: list = []
    updates, residuals, finite = np_step(mode, us, residuals_per_replica, layouts, k, density,
                                         metric, sent=sent, dense_below=dense_below,
                                         embeddings=embeddings)
    if mode == "dense" or masking == "none":
        return updates, residuals, us, finite
    if masking == "waited":
        sent = [[np.asarray([i for i in ids if np.any(np_view(np.asarray(r), lay)[:, i, :])],
                            dtype=np.int64)
                 for ids, lay, r in zip(ids_r, layouts, rs_r)]
                for ids_r, rs_r in zip(sent, residuals_per_replica)]
    if masking in ("compressed", "whole", "whole_except_norm", "whole_vectors"):
        # masks only the variables not / only sent whole (but no normalisation layer's, or
        # only those of one-element blocks)
        every = masking != "compressed"
        sent = [[ids if (len(ids) >= _view_shape(lay)[1]) == every
                 and not (masking == "whole_except_norm" and np_is_normalization(lay))
                 and not (masking == "whole_vectors"
                          and _view_shape(lay)[0] * _view_shape(lay)[2] > 1)
                 else np.asarray([], dtype=np.int64) for ids, lay in zip(ids_r, layouts)]
                for ids_r in sent]
        if every and whole_momentum:
            keep = dt(whole_momentum / momentum)
            return updates, residuals, [
                [u * keep if len(ids) else u for u, ids in zip(us_r, ids_r)]
                for us_r, ids_r in zip(us, sent)], finite
    velocities = [[np_zero_blocks(u, lay, ids) for u, lay, ids in zip(us_r, layouts, ids_r)]
                  for us_r, ids_r in zip(us, sent)]
    return updates, residuals, velocities, finite


def np_sgd_momentum(w: np.ndarray, m: np.ndarray, g: np.ndarray, lr: float, momentum: float
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Keras 3 SGD (no Nesterov): ``m = momentum * m - lr * g; w = w + m``.

    With ``momentum == 0`` it is plain ``w = w - lr * g`` and ``m`` is returned unchanged.
    Arithmetic stays in the arrays' dtype (Python floats do not promote float32).

    Returns:
      ``(new_w, new_m)``.
    """
    w, m = np.asarray(w), np.asarray(m)
    dt = w.dtype.type  # Keras casts the learning rate, momentum and gradient to w's dtype
    g = np.asarray(g).astype(w.dtype)
    if momentum == 0:
        return w - g * dt(lr), m
    m = m * dt(momentum) - g * dt(lr)
    return w + m, m
