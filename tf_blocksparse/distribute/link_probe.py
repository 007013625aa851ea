"""Measurements of the running cluster for the automatic exchange, agreed by every worker.

Run eagerly in cross-replica context (every worker of a ``MultiWorkerMirroredStrategy``
calls them together: they run collectives):

- :func:`time_collectives`: seconds of one all-reduce and one all-gather of the strategy's
  real collectives, per probe size;
- :func:`time_compression`: seconds of one replica's compression work per fusion group,
  timed locally;
- :func:`agree_mean` / :func:`from_first_replica`: the mean of every worker's measurements,
  and replica 0's decision, so every worker decides the same.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tf_blocksparse import codec
from tf_blocksparse.feedback import BlockTopK
from tf_blocksparse.timing import median_seconds

__all__ = ["agree_mean", "from_first_replica", "grown_probes", "time_collective",
           "time_collectives", "time_compression"]

_SUM = tf.distribute.ReduceOp.SUM


_PROBES: dict[tuple[int, int, int, str], Callable[[], Any]] = {}


def _chain(strategy: tf.distribute.Strategy, elements: int, repeats: int, kind: str
           ) -> tuple[Callable[[], Any], bool]:
    """A function running ``repeats`` dependent collectives of ``elements`` float32s (traced
    once per strategy and shape, so a re-measurement does not trace again), and whether it
    is new (not yet traced)."""
    key = (id(strategy), elements, repeats, kind)
    new = key not in _PROBES
    if new:
        _PROBES[key] = _make_chain(strategy, elements, repeats, kind)
    return _PROBES[key], new


def _make_chain(strategy: tf.distribute.Strategy, elements: int, repeats: int, kind: str
                ) -> Callable[[], Any]:

    def replica_fn() -> tf.Tensor:
        ctx = tf.distribute.get_replica_context()
        x = tf.ones((elements,), tf.float32)
        for _ in range(repeats):
            y = ctx.all_reduce(_SUM, x) if kind == "sum" else \
                ctx.all_gather(x, axis=0)[:elements]
            x = 0.5 * y
        return tf.reduce_sum(x)

    @tf.function(autograph=False)
    def probe() -> Any:
        return strategy.run(replica_fn)

    return lambda: [t.numpy() for t in strategy.experimental_local_results(probe())]


def time_collective(strategy: tf.distribute.Strategy, nbytes: int, repeats: int, kind: str
                    ) -> float:
    """Seconds of one all-reduce (``kind="sum"``) or all-gather (``"gather"``) of ``nbytes``
    per replica.

    The probe runs ``repeats`` collectives back to back in one function, so the per-call
    dispatch cost is shared; the median of three calls is taken.  Not agreed across workers
    (see :func:`agree_mean`).
    """
    if kind not in ("sum", "gather"):
        raise ValueError(f"`kind` must be 'sum' or 'gather', got {kind!r}")
    probe, new = _chain(strategy, max(1, int(nbytes) // 4), repeats, kind)
    return median_seconds(probe, 3, 1 if new else 0) / repeats  # warm-up: the trace


def time_collectives(strategy: tf.distribute.Strategy, sizes: Sequence[int], repeats: int
                     ) -> tuple[list[float], list[float]]:
    """:func:`time_collective` of both kinds per size (bytes per replica).

    Returns:
      ``(sum_s, gather_s)``, one entry per size.
    """
    sums = [time_collective(strategy, s, repeats, "sum") for s in sizes]
    gathers = [time_collective(strategy, s, repeats, "gather") for s in sizes]
    return sums, gathers


def grown_probes(strategy: tf.distribute.Strategy, sizes: Sequence[int], repeats: int,
                 kind: str, until_s: float, cap_bytes: int) -> tuple[list[int], list[float]]:
    """Times ``kind`` at ``sizes`` (capped at ``cap_bytes`` while two distinct sizes remain),
    then at 4x the largest size again and again while one collective (every worker's mean:
    all workers grow alike) took less than ``until_s`` and the size is below ``cap_bytes``
    (the last size is capped at it, and left out when that is less than twice the size
    before: a probe barely larger than the last adds a trace, not information).

    Returns:
      The sizes timed and their seconds (this worker's own figures).
    """
    capped = sorted({min(int(s), int(cap_bytes)) for s in sizes})
    sizes = capped if len(capped) >= 2 else list(sizes)  # nothing larger than needed
    times = [time_collective(strategy, s, repeats, kind) for s in sizes]
    last = agree_mean(strategy, times[-1:])[0]
    while last < until_s and min(int(cap_bytes), 4 * sizes[-1]) >= 2 * sizes[-1]:
        sizes.append(min(int(cap_bytes), 4 * sizes[-1]))
        # one collective per call: at these sizes the dispatch cost is noise
        times.append(time_collective(strategy, sizes[-1], 1, kind))
        last = agree_mean(strategy, times[-1:])[0]
    return sizes, times


def time_compression(comps: Sequence[BlockTopK | None], dtypes: Sequence[Sequence[Any]],
                     repeats: int = 5, cache: dict | None = None) -> list[float]:
    """Seconds of one replica's compression of each group on the current device.

    Accumulate, score, select, residual update and packing of what is sent, as the
    exchange does them, on random gradients of the group's shapes (``None``: 0 s).

    Args:
      comps: Per group its compressor (``None``: nothing to compress).
      dtypes: Per group its variables' dtypes.
      repeats: Timed calls per group (the median is taken).
      cache: Keeps each group's traced probe (keyed by the compressor's identity: keep the
        compressors alive as long as the cache), so a re-measurement traces nothing.
    """
    rng = np.random.default_rng(0)
    out = []
    for comp, types in zip(comps, dtypes):
        if comp is None or all(comp.whole):
            out.append(0.0)
            continue
        key = (id(comp), tuple(tf.as_dtype(dt).name for dt in types))
        cached = None if cache is None else cache.get(key)
        if cached is None:
            grads = [tf.constant(rng.standard_normal(lay.shape), tf.as_dtype(dt))
                     for lay, dt in zip(comp.layouts, types)]
            state = [tf.zeros_like(g) for g in grads]
            cached = _compress_probe(comp, grads, state)
            if cache is not None:
                cache[key] = cached
            out.append(median_seconds(cached, repeats))
        else:  # traced by an earlier measurement: no warm-up
            out.append(median_seconds(cached, repeats, warmup=0))
    return out


def _compress_probe(comp: BlockTopK, grads: list, state: list) -> Callable[[], Any]:
    """A call of ``comp``'s compression of ``grads`` over ``state``, its results fetched.

    State in and out as tensors, no variables: under a strategy's scope they would be
    mirrored, and the probe would time the strategy's bookkeeping.
    """

    @tf.function(autograph=False)
    def compress(grads: list, state: list) -> tuple[Any, Any]:
        payload, new = comp.compress(grads, state)
        return new, tf.size(codec.pack([tf.cast(v, tf.float32) for v in payload.values]))

    def run() -> Any:
        new, size = compress(grads, state)
        return size.numpy(), [t.shape for t in new]

    return run


_AGREE: dict[tuple[int, int, bool], Callable[[tf.Tensor], Any]] = {}


def _agreed_sum(strategy: tf.distribute.Strategy, values: Sequence[float], first: bool
                ) -> list[float]:
    """The sum over all replicas of ``values`` (of replica 0's alone if ``first``).

    One all-reduce in a function traced once per strategy, kind and padded length (a power
    of two >= 8), so the many small agreements of a decision share a few traced functions.
    """
    n = max(8, 1 << (len(values) - 1).bit_length())
    key = (id(strategy), n, first)
    if key not in _AGREE:

        def replica_fn(x: tf.Tensor) -> tf.Tensor:
            ctx = tf.distribute.get_replica_context()
            x = tf.identity(x)  # on the replica's device (an argument has none)
            if first:
                x = x * tf.cast(tf.equal(ctx.replica_id_in_sync_group, 0), x.dtype)
            return ctx.all_reduce(_SUM, x)

        @tf.function(autograph=False, input_signature=[tf.TensorSpec((n,), tf.float64)])
        def agree(x: tf.Tensor) -> Any:
            return strategy.run(replica_fn, args=(x,))

        _AGREE[key] = agree
    padded = tf.constant([*map(float, values), *[0.0] * (n - len(values))], tf.float64)
    out = strategy.experimental_local_results(_AGREE[key](padded))[0].numpy()
    return [float(v) for v in out[:len(values)]]


def agree_mean(strategy: tf.distribute.Strategy, values: Sequence[float]) -> list[float]:
    """The mean over all replicas of ``values`` (identical on every worker)."""
    if not values:
        return []
    replicas = strategy.num_replicas_in_sync
    return [v / replicas for v in _agreed_sum(strategy, values, first=False)]


def from_first_replica(strategy: tf.distribute.Strategy, values: Sequence[int]) -> list[int]:
    """Replica 0's ``values`` on every worker (a sum where the others contribute zeros)."""
    if not values:
        return []
    return [int(round(v)) for v in _agreed_sum(strategy, values, first=True)]
