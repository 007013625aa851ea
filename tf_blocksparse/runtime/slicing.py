"""Row slices of a mini-batch held by the replicas of a piece, and moving them between pieces.

A piece with ``k`` replicas holds a batch as ``k`` consecutive slices whose sizes differ by at
most one row (:func:`split_sizes`); between two pieces, :func:`reslice` re-cuts the slices for
the receiving replicas so that only the overlapping rows travel.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

__all__ = ["reslice", "split_sizes"]


def split_sizes(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` sizes differing by at most one, larger ones first."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def reslice(pieces: Sequence[tf.Tensor], src_sizes: Sequence[int], dst_sizes: Sequence[int],
            dst_devices: Sequence[str]) -> list[tf.Tensor]:
    """Re-splits a batch held as pieces on some devices into other pieces on other devices.

    Args:
        pieces: Consecutive slices of one batch, ``pieces[i]`` [src_sizes[i], ...].
        src_sizes: Leading sizes of ``pieces``.
        dst_sizes: Leading sizes wanted (same total).
        dst_devices: Device of each output piece.

    Returns:
        ``out[j]`` [dst_sizes[j], ...], built on ``dst_devices[j]`` from the overlapping source
        slices (only those rows travel).
    """
    if list(src_sizes) == list(dst_sizes):
        out = []
        for piece, dev in zip(pieces, dst_devices):
            with tf.device(dev):
                out.append(tf.identity(piece))
        return out
    src_start = [sum(src_sizes[:i]) for i in range(len(src_sizes))]
    out, start = [], 0
    for size, dev in zip(dst_sizes, dst_devices):
        parts = []
        for piece, a, n in zip(pieces, src_start, src_sizes):
            lo, hi = max(a, start), min(a + n, start + size)
            if lo < hi and (lo, hi) == (a, a + n):
                parts.append(piece)
            elif lo < hi:
                with tf.device(piece.device):  # slice where the rows are, send only those
                    parts.append(piece[lo - a:hi - a])
        with tf.device(dev):
            out.append(tf.identity(parts[0]) if len(parts) == 1 else tf.concat(parts, axis=0))
        start += size
    return out
