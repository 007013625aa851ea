"""NumPy reference of the clipping rules, written from the formulas, no TensorFlow.

- value: ``clip(g, lower, upper)`` element-wise;
- DGC local norm: ``g * min(1, (t / sqrt(N)) / ||g||)``;
- AGC (NFNets): per unit ``g_u * min(1, lam * max(||w_u||, eps) / max(||g_u||, 1e-6))``, units:
  the whole tensor for rank <= 1, per output (norm over axis 0) for a rank-2 dense kernel, per
  output filter (norm over all axes but the last) for rank >= 3 (Conv1D/2D/3D kernels); or the
  units indexed by explicit ``unit_axes`` (one unit per index tuple of those axes);
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


def np_agc(g: np.ndarray, w: np.ndarray, lam: float = 0.01, eps: float = 1e-3,
           unit_axes: tuple[int, ...] | None = None) -> np.ndarray:
    if unit_axes is None:  # NFNets: whole (rank <= 1), else one unit per index of the last axis
        unit_axes = () if g.ndim <= 1 else (g.ndim - 1,)
    unit_axes = tuple(a % g.ndim for a in unit_axes)
    g64, w64 = g.astype(np.float64), w.astype(np.float64)
    out = np.empty_like(g64)
    for unit in np.ndindex(*[g.shape[a] for a in unit_axes]):
        sl = [slice(None)] * g.ndim
        for a, i in zip(unit_axes, unit):
            sl[a] = i
        sl = tuple(sl)
        gn, wn = np.sqrt((g64[sl] ** 2).sum()), np.sqrt((w64[sl] ** 2).sum())
        out[sl] = g64[sl] * min(1.0, lam * max(wn, eps) / max(gn, 1e-6))
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
