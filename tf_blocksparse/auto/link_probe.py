"""Measurements of the running cluster for the automatic exchange, agreed by every worker.

Run eagerly in cross-replica context (every worker of a ``MultiWorkerMirroredStrategy``
calls them together: they run collectives):

- :func:`time_collectives` / :func:`grown_probes`: seconds of one all-reduce or all-gather
  of the strategy's real collectives, per probe size;
- :func:`time_compression`: seconds of one replica's compression work per fusion group,
  timed locally;
- :func:`agree_mean` / :func:`from_first_replica`: the mean of every worker's measurements,
  and replica 0's decision, so every worker decides the same; :func:`barrier`: every
  worker arrived.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tf_blocksparse import codec
from tf_blocksparse.feedback import BlockTopK
from tf_blocksparse.timing import graph_clock

__all__ = ["Probe", "agree_mean", "barrier", "from_first_replica", "grown_probes",
           "time_collectives", "time_compression"]

_SUM = tf.distribute.ReduceOp.SUM
_KINDS = ("sum", "gather")

#: A probe: ``(kind, bytes per replica)``, kind ``"sum"`` (all-reduce) or ``"gather"``.
Probe = tuple[str, int]

#: Per strategy, its probe function: one trace and one set-up of its collectives, any size.
_PROBES: dict[int, Callable[[int, int], np.ndarray]] = {}


def _make_probe(strategy: tf.distribute.Strategy) -> Callable[[int, int], np.ndarray]:
    """A function ``(sum_elements, gather_elements) -> [sum_s, gather_s]`` timing one
    all-reduce and one all-gather of float32 buffers of those lengths, each inside the graph
    (the clock read before and after it), so neither the call's dispatch nor the workers'
    arrival skew (a small all-reduce first lines them up) is counted.

    The lengths are inputs, so one trace serves every size: each collective op is set up on
    its first run (tens of milliseconds), and a new size sets up nothing."""

    def replica_fn(sum_n: tf.Tensor, gather_n: tf.Tensor) -> tf.Tensor:
        ctx = tf.distribute.get_replica_context()
        ready = ctx.all_reduce(_SUM, tf.ones((1,), tf.float32))  # every worker arrived
        stamps = [graph_clock([ready])]
        for kind, n in (("sum", sum_n), ("gather", gather_n)):
            with tf.control_dependencies([stamps[-1]]):
                x = tf.ones(tf.reshape(n, [1]), tf.float32)
            y = ctx.all_reduce(_SUM, x) if kind == "sum" else ctx.all_gather(x, axis=0)
            stamps.append(graph_clock([y]))
        stacked = tf.stack(stamps)
        return stacked[1:] - stacked[:-1]

    spec = tf.TensorSpec((), tf.int32)

    @tf.function(autograph=False, input_signature=[spec, spec])
    def probe(sum_n: tf.Tensor, gather_n: tf.Tensor) -> Any:
        return strategy.run(replica_fn, args=(sum_n, gather_n))

    def call(sum_n: int, gather_n: int) -> np.ndarray:
        # this worker's first replica: the collectives make every replica wait for the slowest
        return strategy.experimental_local_results(
            probe(tf.constant(sum_n, tf.int32), tf.constant(gather_n, tf.int32)))[0].numpy()

    call.function = probe  # type: ignore[attr-defined]  # its traces can be counted
    return call


def time_collectives(strategy: tf.distribute.Strategy, probes: Sequence[Probe],
                     calls: int = 3) -> list[float]:
    """Seconds of one collective per probe, on this worker (not agreed: :func:`agree_mean`).

    Every probe runs in one traced function per strategy (traced and set up on the first
    call: the set-up of each collective op on its first run costs more than timing it),
    each collective timed inside the graph; the median over ``calls`` calls is taken.  An
    all-reduce and an all-gather share a call; a call that has only one of them times the
    other at one element and drops it.

    Args:
      strategy: Whose collectives are timed; call eagerly in cross-replica context, on
        every worker together.
      probes: ``(kind, nbytes)``: an all-reduce (``"sum"``) of ``nbytes`` or an all-gather
        (``"gather"``) of ``nbytes`` per replica.
      calls: Timed calls per probe (>= 1).

    Raises:
      ValueError: An unknown kind, a size below 1, or ``calls`` < 1.
    """
    probes = [(kind, int(nbytes)) for kind, nbytes in probes]
    bad = [p for p in probes if p[0] not in _KINDS or p[1] < 1]
    if bad or not probes:
        raise ValueError(f"`probes` must be (kind, nbytes) pairs, kind in {_KINDS} and "
                         f"nbytes >= 1; got {list(probes)!r}")
    _check_calls("calls", calls)
    probe = _PROBES.get(id(strategy))
    if probe is None:
        probe = _PROBES[id(strategy)] = _make_probe(strategy)
        probe(1, 1)  # trace and first run: each collective op's set-up
    sums = [i for i, (kind, _) in enumerate(probes) if kind == "sum"]
    gathers = [i for i, (kind, _) in enumerate(probes) if kind == "gather"]
    out = [0.0] * len(probes)
    for row in range(max(len(sums), len(gathers))):  # pairs: one sum, one gather per call
        s = sums[row] if row < len(sums) else None
        g = gathers[row] if row < len(gathers) else None
        lengths = [1 if i is None else max(1, probes[i][1] // 4) for i in (s, g)]
        timed = _median_of_calls(lambda n=lengths: probe(*n), calls)
        for i, t in zip((s, g), timed):
            if i is not None:
                out[i] = t
    return out


def _check_calls(name: str, calls: Any) -> None:
    if isinstance(calls, bool) or not isinstance(calls, int) or calls < 1:
        raise ValueError(f"`{name}` must be an int >= 1, got {calls!r}")


def _median_of_calls(probe: Callable[[], np.ndarray], calls: int) -> list[float]:
    """Per entry of ``probe``'s result (seconds timed in the graph), the median of
    ``calls`` calls."""
    return [float(t) for t in np.median(np.stack([probe() for _ in range(calls)]), axis=0)]


def grown_probes(strategy: tf.distribute.Strategy, sizes: Sequence[int], calls: int,
                 until_s: float, caps: dict[str, int]
                 ) -> dict[str, tuple[list[int], list[float]]]:
    """Times every kind of ``caps`` at ``sizes``, then grows each kind's largest size 4x
    at a time while one collective of it (every worker's mean: all workers grow alike)
    took less than ``until_s`` and the size is below the kind's cap.

    Sizes are capped at the kind's cap while two distinct sizes remain (nothing larger
    than needed is timed); a grown size is capped too, and left out when that is less
    than twice the size before (a probe barely larger than the last adds timed calls, not
    information).  Each round times all kinds in one :func:`time_collectives` call.

    Args:
      strategy: Whose collectives are timed (every worker calls together).
      sizes: Base sizes in bytes (two or more distinct).
      calls: Timed calls per round.
      until_s: Grow while the largest probe took less than this (seconds).
      caps: Per kind (``"sum"``, ``"gather"``), the most bytes a probe needs.

    Returns:
      Per kind, the sizes timed and their seconds (this worker's own figures).
    """
    out: dict[str, tuple[list[int], list[float]]] = {}
    for kind, cap in caps.items():
        capped = sorted({min(int(s), int(cap)) for s in sizes})
        out[kind] = (capped if len(capped) >= 2 else sorted(set(map(int, sizes))), [])
    todo = {kind: list(kind_sizes) for kind, (kind_sizes, _) in out.items()}
    while todo:
        probes = [(kind, s) for kind, kind_sizes in todo.items() for s in kind_sizes]
        times = time_collectives(strategy, probes, calls)
        for (kind, _), t in zip(probes, times):
            out[kind][1].append(t)
        kinds = list(todo)
        last = agree_mean(strategy, [out[kind][1][-1] for kind in kinds])
        todo = {}
        for kind, t in zip(kinds, last):
            kind_sizes, cap = out[kind][0], int(caps[kind])
            grown = min(cap, 4 * kind_sizes[-1])
            if t < until_s and grown >= 2 * kind_sizes[-1]:
                kind_sizes.append(grown)
                todo[kind] = [grown]
    return out


def time_compression(comps: Sequence[BlockTopK | None], dtypes: Sequence[Sequence[Any]],
                     repeats: int = 5, cache: dict | None = None) -> list[float]:
    """Seconds of one replica's compression of each group on the current device.

    Accumulate, score, select, residual update and packing of what is sent, as the
    exchange does them, on random gradients of the group's shapes (``None``, or every
    variable sent whole: 0 s).  Every group runs in one traced function, one after the
    other, each timed inside the graph (one trace for all groups, no dispatch counted);
    the median over ``repeats`` calls is taken.

    Args:
      comps: Per group its compressor (``None``: nothing to compress).
      dtypes: Per group its variables' dtypes.
      repeats: Timed calls (>= 1).
      cache: Keeps the traced probe (keyed by the compressors' identities: keep them
        alive as long as the cache), so a re-measurement traces nothing.
    """
    _check_calls("repeats", repeats)
    timed = [i for i, c in enumerate(comps) if c is not None and not all(c.whole)]
    out = [0.0] * len(comps)
    if not timed:
        return out
    key = tuple((id(comps[i]), tuple(tf.as_dtype(dt).name for dt in dtypes[i]))
                for i in timed)
    probe = None if cache is None else cache.get(key)
    if probe is None:
        probe = _compress_probe([comps[i] for i in timed], [dtypes[i] for i in timed])
        probe()  # trace and first run
        if cache is not None:
            cache[key] = probe
    for i, t in zip(timed, _median_of_calls(probe, repeats)):
        out[i] = t
    return out


def _compress_probe(comps: list[BlockTopK], dtypes: list[Sequence[Any]]
                    ) -> Callable[[], np.ndarray]:
    """A call compressing each group's random gradients in turn; returns each group's
    seconds (clock read in the graph before and after it).

    State in and out as tensors, no variables: under a strategy's scope they would be
    mirrored, and the probe would time the strategy's bookkeeping.
    """
    # TensorFlow's stateless generator: a few times faster than NumPy's on 4M elements
    grads = [[tf.cast(tf.random.stateless_normal(lay.shape, seed=[g, v]), tf.as_dtype(dt))
              for v, (lay, dt) in enumerate(zip(comp.layouts, types))]
             for g, (comp, types) in enumerate(zip(comps, dtypes))]

    @tf.function(autograph=False)
    def compress(grads: list) -> tf.Tensor:
        stamps = [graph_clock()]
        for comp, group in zip(comps, grads):
            with tf.control_dependencies([stamps[-1]]):  # starts when the last one ended
                group = [tf.identity(g) for g in group]
            payload, new = comp.compress(group, [tf.zeros_like(g) for g in group])
            sent = codec.pack([tf.cast(v, tf.float32) for v in payload.values])
            stamps.append(graph_clock([sent, *new]))
        stacked = tf.stack(stamps)
        return stacked[1:] - stacked[:-1]

    return lambda: compress(grads).numpy()


_AGREE: dict[tuple[int, int], Callable[[tf.Tensor], Any]] = {}


def _agreed_sums(strategy: tf.distribute.Strategy, values: Sequence[float]
                 ) -> tuple[list[float], list[float]]:
    """The sum over all replicas of ``values``, and replica 0's ``values`` (every replica's
    sum in which the others contribute zeros).

    One all-reduce of both halves in a function traced once per strategy and padded length
    (a power of two >= 8), so every agreement of a decision, the decision itself and a
    :func:`barrier` share a few traced functions and collective ops (each one's trace and
    first run cost tens of milliseconds).
    """
    n = max(8, 1 << (len(values) - 1).bit_length())
    key = (id(strategy), n)
    if key not in _AGREE:

        def replica_fn(x: tf.Tensor) -> tf.Tensor:
            ctx = tf.distribute.get_replica_context()
            x = tf.identity(x)  # on the replica's device (an argument has none)
            first = x * tf.cast(tf.equal(ctx.replica_id_in_sync_group, 0), x.dtype)
            return ctx.all_reduce(_SUM, tf.concat([x, first], 0))

        @tf.function(autograph=False, input_signature=[tf.TensorSpec((n,), tf.float64)])
        def agree(x: tf.Tensor) -> Any:
            return strategy.run(replica_fn, args=(x,))

        _AGREE[key] = agree
    padded = tf.constant([*map(float, values), *[0.0] * (n - len(values))], tf.float64)
    out = strategy.experimental_local_results(_AGREE[key](padded))[0].numpy()
    return ([float(v) for v in out[:len(values)]],
            [float(v) for v in out[n:n + len(values)]])


def agree_mean(strategy: tf.distribute.Strategy, values: Sequence[float]) -> list[float]:
    """The mean over all replicas of ``values`` (identical on every worker)."""
    if not values:
        return []
    replicas = strategy.num_replicas_in_sync
    return [v / replicas for v in _agreed_sums(strategy, values)[0]]


def from_first_replica(strategy: tf.distribute.Strategy, values: Sequence[int]) -> list[int]:
    """Replica 0's ``values`` on every worker."""
    if not values:
        return []
    return [int(round(v)) for v in _agreed_sums(strategy, values)[1]]


def barrier(strategy: tf.distribute.Strategy) -> None:
    """Returns once every worker of ``strategy`` called it (an all-reduce of one number;
    eagerly in cross-replica context)."""
    _agreed_sums(strategy, [0.0])
