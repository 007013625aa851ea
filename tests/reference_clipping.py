"""NumPy reference of the clipping rules (issue 5), written from the formulas, no TensorFlow.

- value: ``clip(g, lower, upper)`` element-wise;
- DGC local norm: ``g * min(1, (t / sqrt(N)) / ||g||)``;
- AGC (NFNets): per unit ``g_u * min(1, lam * max(||w_u||, eps) / max(||g_u||, 1e-6))``, units:
  the whole tensor for rank <= 1, per output (norm over axis 0) for rank 2-3, per output filter
  (norm over all axes but the last) for rank >= 4;
- variance / momentum: running statistics of the layer's clipped norm with weight
  ``max(1 / (t + 1), 1 - decay)``; thresholds ``mean + c * std`` / ``factor * average``
  once ``warmup`` norms were seen.
"""

from __future__ import annotations

import numpy as np


def np_value_clip(g: np.ndarray, lower: float, upper: float) -> np.ndarray:
    return np.minimum(np.maximum(g, lower), upper)


def np_local_norm_clip(g: np.ndarray, threshold: float, workers: int) -> np.ndarray:
    t = threshold / np.sqrt(workers)
    n = np.sqrt(np.sum(g.astype(np.float64) ** 2))
    return g * min(1.0, t / max(n, 1e-6))


def np_agc(g: np.ndarray, w: np.ndarray, lam: float = 0.01, eps: float = 1e-3) -> np.ndarray:
    g64, w64 = g.astype(np.float64), w.astype(np.float64)
    if g.ndim <= 1:
        gn, wn = np.sqrt((g64 ** 2).sum()), np.sqrt((w64 ** 2).sum())
        return (g64 * min(1.0, lam * max(wn, eps) / max(gn, 1e-6))).astype(g.dtype)
    out = np.empty_like(g64)
    if g.ndim <= 3:  # units along every axis but 0
        for idx in np.ndindex(*g.shape[1:]):
            sl = (slice(None),) + idx
            gn, wn = np.linalg.norm(g64[sl]), np.linalg.norm(w64[sl])
            out[sl] = g64[sl] * min(1.0, lam * max(wn, eps) / max(gn, 1e-6))
    else:  # one unit per output filter (last axis)
        for c in range(g.shape[-1]):
            gn, wn = np.linalg.norm(g64[..., c]), np.linalg.norm(w64[..., c])
            out[..., c] = g64[..., c] * min(1.0, lam * max(wn, eps) / max(gn, 1e-6))
    return out.astype(g.dtype)


def _clip_norm(g: np.ndarray, t: float) -> tuple[np.ndarray, float]:
    n = float(np.sqrt(np.sum(g.astype(np.float64) ** 2)))
    return g * min(1.0, t / max(n, 1e-6)), min(n, t)


def np_variance_clip_sequence(grads: list[np.ndarray], c: float, decay: float, warmup: int
                              ) -> tuple[list[np.ndarray], tuple[float, float, int]]:
    mean = var = 0.0
    out = []
    for t, g in enumerate(grads):
        thr = mean + c * np.sqrt(max(var, 0.0)) if t >= warmup else np.inf
        g, n = _clip_norm(g, thr)
        a = max(1.0 / (t + 1), 1.0 - decay)
        d = n - mean
        mean, var = mean + a * d, (1 - a) * (var + a * d * d)
        out.append(g)
    return out, (mean, var, len(grads))


def np_momentum_clip_sequence(grads: list[np.ndarray], factor: float, decay: float, warmup: int
                              ) -> tuple[list[np.ndarray], tuple[float, int]]:
    avg = 0.0
    out = []
    for t, g in enumerate(grads):
        thr = factor * avg if t >= warmup else np.inf
        g, n = _clip_norm(g, thr)
        a = max(1.0 / (t + 1), 1.0 - decay)
        avg += a * (n - avg)
        out.append(g)
    return out, (avg, len(grads))
