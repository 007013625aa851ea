"""An exchange method of ``launch.train`` as one frozen config, and its command line.

A :class:`Method` says how a run exchanges its gradients: the library's validated
:class:`~tf_blocksparse.options.CompressionOptions` (what is sent: dense, block or
element top-k, how many, with which collectives), and the few settings ``launch.train``
adds around the optimizer wrapper (fusion buffers, local steps and their outer SGD, where
the momentum lives, a density warm-up).  The benchmarks start ``launch.train`` as worker
processes, so a method renders to the flags that select it (:meth:`Method.to_flags`), and
parsed flags give the method back (:meth:`Method.from_flags`): flags -> method -> flags is
the same command line (flags in :data:`METHOD_FLAGS` order).

The flags and their rules stay in :mod:`launch.flags`; a method checks itself by parsing
the flags it renders.  No TensorFlow here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from absl import flags

from launch import flags as train_flags
from tf_blocksparse.options import DEFAULT_DENSE_BELOW, CompressionOptions
from tf_blocksparse.planning.exchange_cost import AutoExchange

#: The ``launch.train`` flags of a method, in the order :meth:`Method.to_flags` writes them.
METHOD_FLAGS = ("compression", "k", "density", "metric", "exchange", "fusion_buffer_bytes",
                "quantize", "sync_every", "outer_lr", "outer_momentum", "global_momentum",
                "dense_below", "momentum_masking", "whole_momentum", "density_warmup", "recurrent",
                "embeddings")
#: The fraction ``--compression=topk`` keeps when neither ``--k`` nor ``--density`` is given.
TOPK_DENSITY = 0.01
#: What the options of a dense method hold: the plain all-reduce, nothing selected.
DENSE = CompressionOptions(exchange="dense")


def options_from_flags(compression: str, k: int | None, density: float | None, metric: str,
                       exchange: str, dense_below: int | None, quantize: str,
                       recurrent: str = "compress", embeddings: str = "compress"
                       ) -> CompressionOptions:
    """The library's options for ``launch.train``'s compression flags.

    ``dense`` sends every gradient whole (:data:`DENSE`; the flags forbid the sparse
    settings with it); ``topk`` is element-wise top-k, keeping :data:`TOPK_DENSITY` unless
    ``k`` or ``density`` says otherwise; a ``None`` ``dense_below`` is the library's default.

    Raises:
      ValueError: A combination the library refuses (named by it).
    """
    if compression == "dense":
        return DENSE
    topk = compression == "topk"
    if topk and k is None and density is None:
        density = TOPK_DENSITY
    return CompressionOptions(
        k=k, density=density, metric=metric, exchange=exchange,
        granularity="element" if topk else "block", quantize=quantize, recurrent=recurrent,
        embeddings=embeddings,
        dense_below=DEFAULT_DENSE_BELOW if dense_below is None else dense_below)


@dataclasses.dataclass(frozen=True)
class Method:
    """How one ``launch.train`` run exchanges its gradients; validated, immutable.

    ``Method()`` is the library's one-line default: ``BlockSparseOptimizer(SGD(lr,
    momentum))`` with the automatic exchange, k=1 when sparse.

    Args:
      options: What is exchanged (the ``compression`` of ``BlockSparseOptimizer``);
        :data:`DENSE` for the plain all-reduce, ``granularity="element"`` for element-wise
        top-k.  Only what the flags can say: no ``block_rules``, no ``dense_steps``, the
        automatic exchange only with its default policy.
      fusion_buffer_bytes: Fusion groups of about this many bytes; 0: one group.
      sync_every: Local steps per exchange (0: every step exchanges its gradients).
      outer_lr: With ``sync_every``: the outer SGD's learning rate (``None``: the library's
        outer optimizer).
      outer_momentum: With ``outer_lr``: the outer SGD's Nesterov momentum (``None``: 0).
      global_momentum: Sparse methods: the inner SGD's momentum after the exchange (the
        literal form) instead of per worker before it (DGC correction, the default).
      momentum_masking: Sparse methods: which sent blocks leave the local momentum
        (``None``: the library's).
      whole_momentum: Sparse methods under a ``"whole"`` masking: the momentum factor the
        variables sent whole keep (``None``: 0, plain SGD on them).
      density_warmup: Sparse methods: the densities of the first epochs.
      stated: Flags the command line writes although they say what the default would
        (``--k=1``, ``--exchange=auto``): the results record a run's command line, so a
        method renders exactly the one it was read from.  Names that change nothing (a
        flag not at its default anyway, or one without a value) are dropped.

    Raises:
      ValueError: A setting the flags cannot express or refuse (the message names it).
    """

    options: CompressionOptions = dataclasses.field(default_factory=CompressionOptions)
    fusion_buffer_bytes: int = 0
    sync_every: int = 0
    outer_lr: float | None = None
    outer_momentum: float | None = None
    global_momentum: bool = False
    momentum_masking: str | None = None
    whole_momentum: float | None = None
    density_warmup: tuple[float, ...] = ()
    stated: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        o = self.options
        if not isinstance(o, CompressionOptions):
            raise ValueError(f"`options` must be a CompressionOptions, got {o!r}")
        # the automatic exchange that --exchange=auto gives (narrowed by --quantize)
        if o.block_rules or o.dense_steps or (
                o.auto and o.exchange != o.replace(exchange=AutoExchange()).exchange):
            raise ValueError("launch.train has no flags for `block_rules`, `dense_steps` or "
                             f"a custom automatic exchange: {o.get_config()}")
        if not o.sparse and o != DENSE:
            raise ValueError(f"a dense method takes no compression options, got {o}")
        object.__setattr__(self, "density_warmup",
                           tuple(float(d) for d in self.density_warmup))
        unknown = set(self.stated) - set(METHOD_FLAGS[1:])
        if unknown:
            raise ValueError(f"`stated` names no method flag: {sorted(unknown)}")
        plain, given = self._flag_values(frozenset()), self._flag_values(self.stated)
        defaults = train_flags.defaults()
        object.__setattr__(self, "stated", frozenset(
            n for n in self.stated if plain[n] == defaults[n] and given[n] is not None))
        try:
            train_flags.parse(self.to_flags())
        except flags.Error as err:
            raise ValueError(f"{self.to_flags()}: {err}") from err

    @property
    def compression(self) -> str:
        """``--compression``: ``"dense"``, ``"topk"`` (element-wise) or ``"block"``."""
        if not self.options.sparse:
            return "dense"
        return "topk" if self.options.granularity == "element" else "block"

    def _flag_values(self, stated: frozenset[str]) -> dict[str, Any]:
        o, compression = self.options, self.compression
        implied_k = o.k == 1 and compression != "topk" and "k" not in stated
        implied_density = (compression == "topk" and o.k is None and o.density == TOPK_DENSITY
                           and "density" not in stated)
        implied_dense_below = o.dense_below == DEFAULT_DENSE_BELOW and "dense_below" not in stated
        return {
            "compression": compression,
            "k": None if implied_k or not o.sparse else o.k,
            "density": None if implied_density else o.density,
            "metric": o.metric,
            "exchange": "auto" if o.auto or not o.sparse else o.exchange,
            "fusion_buffer_bytes": self.fusion_buffer_bytes, "quantize": o.quantize,
            "sync_every": self.sync_every, "outer_lr": self.outer_lr,
            "outer_momentum": self.outer_momentum, "global_momentum": self.global_momentum,
            "dense_below": None if implied_dense_below or not o.sparse else o.dense_below,
            "momentum_masking": self.momentum_masking,
            "whole_momentum": self.whole_momentum,
            "density_warmup": [str(d) for d in self.density_warmup],
            "recurrent": o.recurrent, "embeddings": o.embeddings,
        }

    def flag_values(self) -> dict[str, Any]:
        """The values of :data:`METHOD_FLAGS` for this method, as absl holds them (``None``
        where the library's default applies, a list flag as strings)."""
        return self._flag_values(self.stated)

    def to_flags(self) -> list[str]:
        """The ``launch.train`` flags of this method: ``--compression``, then every method
        flag that is not at its default or is :attr:`stated`, in :data:`METHOD_FLAGS`
        order."""
        values, defaults = self.flag_values(), train_flags.defaults()
        return [train_flags.flag_text("compression", values["compression"])] + [
            train_flags.flag_text(name, values[name]) for name in METHOD_FLAGS[1:]
            if values[name] != defaults[name] or name in self.stated]

    @classmethod
    def from_flags(cls, values: flags.FlagValues) -> Method:
        """The method of parsed ``launch.train`` flags (those a command line gives at their
        default are :attr:`stated`)."""
        f = values
        options = options_from_flags(f.compression, f.k, f.density, f.metric, f.exchange,
                                     f.dense_below, f.quantize, f.recurrent,
                                     f.embeddings)
        return cls(options, fusion_buffer_bytes=f.fusion_buffer_bytes,
                   sync_every=f.sync_every, outer_lr=f.outer_lr,
                   outer_momentum=f.outer_momentum, global_momentum=f.global_momentum,
                   momentum_masking=f.momentum_masking, whole_momentum=f.whole_momentum,
                   density_warmup=f.density_warmup,
                   stated=frozenset(n for n in METHOD_FLAGS[1:] if f[n].present))

    @classmethod
    def from_args(cls, args: Iterable[str]) -> Method:
        """The method of a ``launch.train`` command line's flags (others are ignored).

        Raises:
          flags.Error: A flag ``launch.train`` refuses.
        """
        return cls.from_flags(train_flags.parse(list(args)))

    def replace(self, **changes: Any) -> Method:
        """A checked copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)
