"""The one validated, frozen options object of the block-sparse exchange, and its constants.

:class:`CompressionOptions` says *what* is exchanged (how many blocks, scored how, with
which collectives, which variables go whole, how variables split into blocks).  The Keras
optimizer wrapper, :class:`~tf_blocksparse.distribute.cross_device_ops.BlockSparseCrossDeviceOps`
and the hybrid trainer's group sync all take one, checked once at construction; a bad value
raises a ``ValueError`` naming the argument.  Like ``tf.distribute``'s
``collective_util.Options`` it is immutable: :meth:`CompressionOptions.replace` returns a
checked copy.

Every mode string of the project lives here (the exchanges, re-exported from the cost model
:mod:`~tf_blocksparse.planning.link_cost` that defines them, metrics, granularities,
non-finite policies and momentum maskings).  This module is pure Python (no TensorFlow).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from tf_blocksparse.checks import (
    check_choice,
    unknown_keywords_message,
    validate_block_rules,
    validate_dense_below,
    validate_dense_steps,
    validate_k_density,
)
from tf_blocksparse.planning.exchange_cost import AutoExchange

# The exchange modes are defined once, beside their cost model, and re-exported here.
from tf_blocksparse.planning.link_cost import EXCHANGES as EXCHANGES
from tf_blocksparse.planning.link_cost import SPARSE_EXCHANGES as SPARSE_EXCHANGES

#: ``exchange="auto"``: per fusion group, the mode a cost model of measured link and
#: compression times predicts fastest to accuracy (an :class:`AutoExchange` policy).
AUTO_EXCHANGE = "auto"
#: Block scores: L1 or L2 norm.
METRICS = ("l1", "l2")
#: ``"block"`` top-k, or ``"element"``-wise top-k (the DGC / GRACE baseline).
GRANULARITIES = ("block", "element")
#: What the optimizer wrapper does with a step whose gradients hold an inf or NaN.
NONFINITE = ("skip", "apply")
#: Which sent blocks momentum correction zeroes in the local momentum.
MASKINGS = ("all", "waited", "none", "compressed", "whole", "whole_except_norm",
            "whole_vectors")
#: The maskings that mask the variables sent whole (where ``whole_momentum`` applies).
WHOLE_MASKINGS = ("whole", "whole_except_norm", "whole_vectors")
#: The masking of a saved optimizer config that names none: DGC's, the only one when such
#: configs were written.
SAVED_MASKING = "all"
#: How the all-gather exchange sends selected block values: their own dtype, bfloat16, or
#: 8 / 4-bit integers with a float32 scale per block (:mod:`tf_blocksparse.quantize`).
QUANTIZATIONS = ("none", "bfloat16", "int8", "int4")
#: What the sparse modes do with recurrent layers' variables (GRU, LSTM, SimpleRNN and
#: their cells, any ``recurrent_kernel``): compress them like any other, or send them whole
#: every step (no residual, their momentum unmasked), as ``dense_below`` does small ones.
RECURRENT = ("compress", "whole")
#: What ``dense_below`` does with embedding tables (``Embedding``'s ``embeddings``):
#: ``"compress"`` them whatever their size (one row per block), or treat them ``"by_size"``
#: like any other variable.
EMBEDDINGS = ("compress", "by_size")
#: The embeddings rule of a saved config that names none: ``"by_size"``, the only one when
#: such configs were written.
SAVED_EMBEDDINGS = "by_size"
#: ``momentum_correction="auto"``: move an inner ``SGD``'s momentum before the exchange.
AUTO = "auto"
#: The one default ``dense_below`` (of :class:`CompressionOptions`, hence of every shell, and
#: of the compressors built without options): variables with fewer elements (biases,
#: normalisation vectors, first convolutions, small heads) are sent whole every step.
#: ``dense_below=0`` compresses every variable.
DEFAULT_DENSE_BELOW = 1024


def _check_exchange(exchange: Any) -> str | AutoExchange:
    """``exchange`` checked: a mode of :data:`EXCHANGES`, or ``"auto"`` / an
    :class:`AutoExchange` (or its ``{"auto": config}``) as the policy object."""
    if isinstance(exchange, AutoExchange):
        return exchange
    if exchange == AUTO_EXCHANGE:
        return AutoExchange()
    if isinstance(exchange, Mapping) and set(exchange) == {"auto"}:
        return AutoExchange.from_config(exchange["auto"])
    return check_choice(exchange, (*EXCHANGES, AUTO_EXCHANGE), "exchange")


@dataclasses.dataclass(frozen=True)
class CompressionOptions:
    """What the block-sparse exchange sends; validated on construction, immutable.

    Args:
      k: Blocks kept per variable and replica each step (int >= 1); default 1 when
        ``density`` is unset.
      density: Alternatively, a fraction in (0, 1]: ``ceil(density * num_blocks)`` blocks.
      metric: Block score, ``"l1"`` or ``"l2"``.
      exchange: ``"allgather"`` (each replica its own top-k), ``"shared"`` (top-k of the
        scores summed over replicas), ``"dense"`` (plain all-reduce, nothing selected), or
        ``"auto"`` / an :class:`AutoExchange` policy: per fusion group, whichever of those
        is predicted fastest to accuracy from measurements on the running cluster (stored
        as the policy object; only the Keras optimizer wrapper supports it).  Default
        ``"auto"``, as the wrapper's keyword arguments: the measured default.  The shells
        that cannot measure (``BlockSparseCrossDeviceOps``, the hybrid trainer's groups)
        reject it and take a sparse mode; their keyword and dict forms default to
        ``"allgather"``.
      granularity: ``"block"``, or ``"element"`` for element-wise top-k (use ``density``).
      dense_below: Variables with fewer elements are sent whole every step (a dense sum, no
        residual); ``None`` or 0 compresses every variable.
      block_rules: ``{path regex: rule name}`` overriding the block-rule table (first match
        wins); stored as ordered ``(pattern, rule)`` pairs.
      quantize: How each replica's selected block values travel in the all-gather
        exchange: ``"none"`` (default, their own dtype), ``"bfloat16"``, or ``"int8"`` /
        ``"int4"`` with a float32 scale per block (:mod:`~tf_blocksparse.quantize`).  The
        quantisation error stays in the residual, so nothing is lost.  Variables sent whole
        are summed unquantised.  Needs ``exchange="allgather"`` or the automatic exchange,
        which then chooses per group between ``"dense"`` and ``"allgather"`` (``"shared"``
        sums values in its collective, which codes cannot be): its candidates are stored
        without ``"shared"``.
      recurrent: ``"compress"`` (default) or ``"whole"``: recurrent layers' variables
        (GRU, LSTM, SimpleRNN and their cells) sent whole every step, with no residual and
        their local momentum never masked; the other variables compressed as set.  Error
        feedback's delay of recurrent weights costs far more steps than any other layer's
        (docs/exchange.md); ``"whole"`` is what a fixed sparse exchange on a recurrent
        model should use.  The automatic exchange keeps a group with compressed recurrent
        variables dense by itself; with ``"whole"`` it may compress the rest of the group.
      embeddings: ``"compress"`` (default): embedding tables are compressed (top-k rows)
        whatever their size; ``dense_below`` does not send a small one whole (with a large
        vocabulary a step's gradient is nonzero only in its tokens' rows).  On the GRU
        translation model this cuts the bytes per step by two fifths and keeps the
        accuracy within 0.3 points of dense (docs/results.md).  ``"by_size"``:
        ``dense_below`` applies to them as to any other variable.
      dense_steps: The first ``dense_steps`` optimizer steps (its ``iterations``) send the
        dense all-reduce whatever ``exchange`` says, as PowerSGD's ``start_powerSGD_iter``:
        the early, fast-changing gradients are not delayed by error feedback.  Then the
        exchange switches once, its state moved exactly (see
        :mod:`~tf_blocksparse.auto.mode_switch`); 0 (default): no dense phase.  Only the
        Keras optimizer wrapper counts steps (in ``model.fit`` its ``DensePhaseCallback``
        switches: ``tfbs.fit_callbacks(model)``).

    Raises:
      ValueError: A bad value; the message names the argument.
    """

    k: int | None = None
    density: float | None = None
    metric: str = "l1"
    exchange: str | AutoExchange = AUTO_EXCHANGE
    granularity: str = "block"
    dense_below: int = DEFAULT_DENSE_BELOW
    block_rules: tuple[tuple[str, Any], ...] = ()
    dense_steps: int = 0
    quantize: str = "none"
    recurrent: str = "compress"
    embeddings: str = "compress"

    def __post_init__(self) -> None:
        k, density = validate_k_density(self.k, self.density)
        object.__setattr__(self, "k", k)
        object.__setattr__(self, "density", density)
        check_choice(self.metric, METRICS, "metric")
        object.__setattr__(self, "exchange", _check_exchange(self.exchange))
        check_choice(self.granularity, GRANULARITIES, "granularity")
        object.__setattr__(self, "dense_below", validate_dense_below(self.dense_below))
        object.__setattr__(self, "block_rules", validate_block_rules(self.block_rules))
        object.__setattr__(self, "dense_steps", validate_dense_steps(self.dense_steps))
        check_choice(self.quantize, QUANTIZATIONS, "quantize")
        check_choice(self.recurrent, RECURRENT, "recurrent")
        check_choice(self.embeddings, EMBEDDINGS, "embeddings")
        if self.quantize != "none":
            self._check_quantized_exchange()
        if self.quantize in ("int8", "int4") and self.granularity == "element":
            raise ValueError("`quantize` with a scale per block needs granularity='block' (a "
                             "scale per element costs more than the value; use 'bfloat16')")

    def _check_quantized_exchange(self) -> None:
        """With ``quantize``: the all-gather exchange, or an automatic one narrowed to the
        modes that carry coded values (``"dense"`` sends its sum unquantised)."""
        policy = self.exchange
        if isinstance(policy, AutoExchange):
            carried = tuple(c for c in policy.candidates if c != "shared")
            if not carried:
                raise ValueError(f"`quantize={self.quantize!r}` needs 'allgather' or 'dense' "
                                 "among the automatic exchange's `candidates` ('shared' "
                                 f"sums values in its collective), got {policy.candidates!r}")
            if carried != policy.candidates:
                object.__setattr__(self, "exchange",
                                   dataclasses.replace(policy, candidates=carried))
        elif policy != "allgather":
            raise ValueError(f"`quantize={self.quantize!r}` needs exchange='allgather' or "
                             f"'auto' (the other modes sum values in the collective), got "
                             f"exchange={policy!r}")

    @property
    def sparse(self) -> bool:
        """Whether blocks may be selected (``exchange`` is not ``"dense"``)."""
        return self.exchange != "dense"

    @property
    def keeps_every_block(self) -> bool:
        """Whether every block of every variable is kept (``density=1.0``): the sparse modes
        then send the plain dense all-reduce (a ``k`` that reaches every block count does
        too, per fusion group, once the layouts are known)."""
        return self.density == 1.0

    @property
    def auto(self) -> bool:
        """Whether the exchange mode is chosen per fusion group at run time."""
        return isinstance(self.exchange, AutoExchange)

    @property
    def rules(self) -> dict[str, Any]:
        """``block_rules`` as the ``{regex: rule}`` mapping the block-rule table takes."""
        return dict(self.block_rules)

    def replace(self, **changes: Any) -> CompressionOptions:
        """A checked copy with ``changes`` applied (``k``/``density``: the one given wins)."""
        if "k" in changes and "density" not in changes and changes["k"] is not None:
            changes["density"] = None
        if "density" in changes and "k" not in changes and changes["density"] is not None:
            changes["k"] = None
        return dataclasses.replace(self, **changes)

    def get_config(self) -> dict[str, Any]:
        """JSON-friendly constructor arguments (``block_rules`` as a dict; ``embeddings``
        always, as a saved config without it means :data:`SAVED_EMBEDDINGS`)."""
        exchange = self.exchange
        if isinstance(exchange, AutoExchange):
            exchange = AUTO_EXCHANGE if exchange == AutoExchange() else \
                {"auto": exchange.get_config()}
        return {"k": self.k, "density": self.density,
                "metric": self.metric, "exchange": exchange,
                "granularity": self.granularity, "dense_below": self.dense_below,
                "block_rules": self.rules, "dense_steps": self.dense_steps,
                "embeddings": self.embeddings} | (
                    {"quantize": self.quantize} if self.quantize != "none" else {}) | (
                    {"recurrent": self.recurrent} if self.recurrent != "compress" else {})

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> CompressionOptions:
        """Inverse of :meth:`get_config`.

        Raises:
          ValueError: Unknown keys (named) or bad values.
        """
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = set(config) - set(known)
        if unknown:
            raise ValueError(unknown_keywords_message("CompressionOptions", unknown, known))
        return cls(**config)


#: The names :class:`CompressionOptions` takes as constructor arguments.
OPTION_NAMES = tuple(f.name for f in dataclasses.fields(CompressionOptions))


def as_options(options: Any, argument: str = "compression") -> CompressionOptions:
    """``options`` as :class:`CompressionOptions` (a mapping of its arguments works too).

    Raises:
      TypeError: Neither; names ``argument``.
    """
    if isinstance(options, CompressionOptions):
        return options
    if isinstance(options, Mapping):
        return CompressionOptions.from_config(options)
    raise TypeError(f"`{argument}` must be a tfbs.CompressionOptions, got {options!r}")


def option_view(name: str, attribute: str = "compression") -> property:
    """A read-only property exposing option ``name`` of the owner's ``attribute`` (a
    :class:`CompressionOptions`) under the name of its keyword argument."""
    return property(lambda self: getattr(getattr(self, attribute), name),
                    doc=f"``{attribute}.{name}`` (see ``CompressionOptions``).")


def options_from(compression: Any, keywords: Mapping[str, Any], owner: str
                 ) -> CompressionOptions:
    """The options of a constructor that takes ``compression`` or its arguments as keywords.

    Args:
      compression: ``None``, a :class:`CompressionOptions` or a mapping of its arguments.
      keywords: The constructor's remaining keyword arguments.
      owner: The constructor's name, for errors.

    Raises:
      ValueError: A keyword that is not an option (named, with the closest option), both
        forms given, or a bad value.
      TypeError: ``compression`` of the wrong type.
    """
    unknown = set(keywords) - set(OPTION_NAMES)
    if unknown:
        raise ValueError(unknown_keywords_message(owner, unknown, OPTION_NAMES))
    if compression is None:
        return CompressionOptions(**keywords)
    if keywords:
        raise ValueError(f"give either `compression` or {sorted(keywords)}, not both")
    return as_options(compression)
