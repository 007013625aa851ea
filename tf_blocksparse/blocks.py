"""The block-rule table: the one place that says how a variable splits into blocks.

A *block* is a set of gradient entries whose storage is contiguous after at most one
transpose: a convolution filter, a dense neuron's incoming weights, a bias element, an
embedding row.  Every variable of shape ``S`` is viewed as a 3-D tensor
``[outer, num_blocks, inner]`` obtained by a reshape only (no data movement): the axes
``S[start:stop]`` index the blocks, the axes before them form ``outer`` and the axes after
them ``inner``.  A block is the ``[outer, inner]`` slice at one block index, i.e.
``block_size = outer * inner`` values.

Lookup order (first hit wins):

1. **layer class** (walking the class's MRO by name, so subclasses inherit), then the
   variable's own name inside the layer (``kernel``, ``bias``, ...);
2. **variable path**: the last path component (``.../gamma``, ``.../embeddings``, and
   ``.../kernel`` -> one block per output channel, right for Dense, Conv1D/2D/3D, EinsumDense
   and recurrent cells, *not* for transposed or depthwise convolutions);
3. **rank**: rank 0/1 -> one block per element; rank >= 2 -> the documented fallback, a
   single block per variable (the whole tensor is kept or dropped), with a logged warning.

Rank alone is wrong for ``Conv2DTranspose`` (kernel ``(kh, kw, filters, in)``: filters are
axis -2) and ``Embedding`` (rows are axis 0), which is why the class comes first.  When the
class is not known it is inferred from the layer's default name in the path
(``conv2d_transpose_3`` -> ``Conv2DTranspose``).  The Keras optimizer wrapper finds the
owning layer of every variable itself (see ``BlockSparseOptimizer``), so renamed layers are
looked up by their real class too.

This module is pure Python (no TensorFlow import).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tf_blocksparse import _compat

logger = logging.getLogger("tf_blocksparse")


@dataclasses.dataclass(frozen=True)
class BlockRule:
    """How a variable splits into blocks.

    Attributes:
      name: Stable identifier of the rule (used in tables and configs).
      axes: ``"last"`` (one block per index of the last axis), ``"second_last"``,
        ``"first"``, ``"last_two"`` (one block per (channel, multiplier) pair), ``"all"``
        (one block per element) or ``"none"`` (a single block).
      description: What a block is, for humans.
    """

    name: str
    axes: str
    description: str

    def span(self, rank: int) -> tuple[int, int]:
        """Returns ``(start, stop)``: the axes ``[start, stop)`` that index blocks."""
        if rank == 0:
            return (0, 0)
        spans = {
            "last": (rank - 1, rank),
            "second_last": (max(rank - 2, 0), max(rank - 1, 1)),
            "first": (0, 1),
            "last_two": (max(rank - 2, 0), rank),
            "all": (0, rank),
            "none": (0, 0),
        }
        return spans[self.axes]


OUTPUT_CHANNEL = BlockRule("output_channel", "last", "one block per output filter / unit / column")
TRANSPOSE_FILTER = BlockRule("transpose_filter", "second_last", "one block per filter (axis -2)")
DEPTHWISE = BlockRule("depthwise_channel", "last_two", "one block per (channel, multiplier)")
ROW = BlockRule("row", "first", "one block per row (axis 0)")
ELEMENT = BlockRule("element", "all", "one block per element")
SINGLE = BlockRule("single", "none", "fallback: the whole variable is one block")
OUTPUT_UNIT_2D = BlockRule("output_unit_2d", "last_two",
                           "one block per output unit spanning the last two axes")

RULES: dict[str, BlockRule] = {
    r.name: r for r in (OUTPUT_CHANNEL, TRANSPOSE_FILTER, DEPTHWISE, ROW, ELEMENT, SINGLE,
                        OUTPUT_UNIT_2D)
}

_NORM_VARS = {"gamma": ELEMENT, "beta": ELEMENT, "scale": ELEMENT, "offset": ELEMENT}
_CONV_VARS = {"kernel": OUTPUT_CHANNEL, "bias": ELEMENT}
_RNN_VARS = {"kernel": OUTPUT_CHANNEL, "recurrent_kernel": OUTPUT_CHANNEL, "bias": ELEMENT}

#: Layer class name -> {variable name -> rule}.  Looked up along the class's MRO.
LAYER_RULES: dict[str, dict[str, BlockRule]] = {
    "Conv1D": _CONV_VARS,
    "Conv2D": _CONV_VARS,
    "Conv3D": _CONV_VARS,
    "Conv1DTranspose": {"kernel": TRANSPOSE_FILTER, "bias": ELEMENT},
    "Conv2DTranspose": {"kernel": TRANSPOSE_FILTER, "bias": ELEMENT},
    "Conv3DTranspose": {"kernel": TRANSPOSE_FILTER, "bias": ELEMENT},
    "DepthwiseConv1D": {"kernel": DEPTHWISE, "bias": ELEMENT},
    "DepthwiseConv2D": {"kernel": DEPTHWISE, "bias": ELEMENT},
    "SeparableConv1D": {"depthwise_kernel": DEPTHWISE, "pointwise_kernel": OUTPUT_CHANNEL,
                        "bias": ELEMENT},
    "SeparableConv2D": {"depthwise_kernel": DEPTHWISE, "pointwise_kernel": OUTPUT_CHANNEL,
                        "bias": ELEMENT},
    "Dense": _CONV_VARS,
    "EinsumDense": _CONV_VARS,
    "Embedding": {"embeddings": ROW},
    "BatchNormalization": _NORM_VARS,
    "LayerNormalization": _NORM_VARS,
    "GroupNormalization": _NORM_VARS,
    "GRUCell": _RNN_VARS,
    "LSTMCell": _RNN_VARS,
    "SimpleRNNCell": _RNN_VARS,
    "GRU": _RNN_VARS,
    "LSTM": _RNN_VARS,
    "SimpleRNN": _RNN_VARS,
}

#: Recurrent layer classes: delaying them costs far more steps (``AutoExchange``).
RECURRENT_CLASSES = frozenset(c for c, rules in LAYER_RULES.items() if rules is _RNN_VARS)
#: Normalisation layer classes (their scales and offsets): the ``"whole_except_norm"``
#: momentum masking leaves their momentum whole.
NORMALIZATION_CLASSES = frozenset(c for c, rules in LAYER_RULES.items()
                                  if rules is _NORM_VARS)

#: Embedding layer classes (their tables): ``CompressionOptions.embeddings`` says whether
#: ``dense_below`` may send a small one whole.
EMBEDDING_CLASSES = frozenset(c for c, rules in LAYER_RULES.items() if "embeddings" in rules)

#: Last path component -> rule, for variables whose layer class is unknown.
PATH_RULES: dict[str, BlockRule] = {
    "kernel": OUTPUT_CHANNEL, "depthwise_kernel": DEPTHWISE, "pointwise_kernel": OUTPUT_CHANNEL,
    "bias": ELEMENT, "gamma": ELEMENT, "beta": ELEMENT, "scale": ELEMENT, "offset": ELEMENT,
    "embeddings": ROW, "recurrent_kernel": OUTPUT_CHANNEL,
}

_DEFAULT_NAMES = {re.sub(r"(?<!^)(?=[A-Z][a-z])", "_", c).lower().replace("1_d", "1d")
                  .replace("2_d", "2d").replace("3_d", "3d"): c for c in LAYER_RULES}
_DEFAULT_NAMES.update({"conv1d": "Conv1D", "conv2d": "Conv2D", "conv3d": "Conv3D",
                       "depthwise_conv2d": "DepthwiseConv2D", "gru_cell": "GRUCell",
                       "lstm_cell": "LSTMCell", "simple_rnn_cell": "SimpleRNNCell",
                       "simple_rnn": "SimpleRNN", "gru": "GRU", "lstm": "LSTM"})


@dataclasses.dataclass(frozen=True)
class BlockLayout:
    """A variable viewed as ``[outer, num_blocks, inner]``.

    Attributes:
      path: The variable's path (e.g. ``"sequential/conv2d/kernel"``).
      shape: The variable's shape.
      rule: The rule that produced this layout.
      layer_class: The layer class name the rule was found under, or ``None``.
    """

    path: str
    shape: tuple[int, ...]
    rule: BlockRule
    layer_class: str | None = None

    @property
    def recurrent(self) -> bool:
        """Whether it is a recurrent layer's (or any ``recurrent_kernel``)."""
        return self.layer_class in RECURRENT_CLASSES or \
            self.path.split("/")[-1] == "recurrent_kernel"

    @property
    def embedding(self) -> bool:
        """Whether it is an embedding table (an ``Embedding`` layer's, or any
        ``embeddings``)."""
        return self.layer_class in EMBEDDING_CLASSES or \
            self.path.split("/")[-1] == "embeddings"

    @property
    def normalization(self) -> bool:
        """Whether it is a normalisation layer's scale or offset (BatchNormalization,
        LayerNormalization, GroupNormalization and their subclasses)."""
        return self.layer_class in NORMALIZATION_CLASSES

    @property
    def _span(self) -> tuple[int, int]:
        return self.rule.span(len(self.shape))

    @property
    def outer(self) -> int:
        return math.prod(self.shape[: self._span[0]])

    @property
    def num_blocks(self) -> int:
        return math.prod(self.shape[self._span[0]: self._span[1]])

    @property
    def inner(self) -> int:
        return math.prod(self.shape[self._span[1]:])

    @property
    def block_size(self) -> int:
        return self.outer * self.inner

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def view_shape(self) -> tuple[int, int, int]:
        return (self.outer, self.num_blocks, self.inner)


def _class_names(layer_or_class: Any) -> list[str]:
    if isinstance(layer_or_class, str):
        return [layer_or_class]
    cls = layer_or_class if isinstance(layer_or_class, type) else type(layer_or_class)
    return [c.__name__ for c in cls.__mro__]


def infer_layer_class(path: str) -> str | None:
    """Guesses the layer class from default layer names in a variable path.

    Args:
      path: A Keras variable path such as ``"model/conv2d_transpose_2/kernel"``.

    Returns:
      The class name (``"Conv2DTranspose"``) or ``None`` when no component matches.
    """
    for part in reversed(path.split("/")[:-1]):
        base = re.sub(r"_\d+$", "", part)
        if base in _DEFAULT_NAMES:
            return _DEFAULT_NAMES[base]
    return None


def rule_for(path: str, shape: Sequence[int], layer: Any = None,
             overrides: Mapping[str, str | BlockRule] | None = None) -> BlockLayout:
    """Looks a variable up in the table: overrides, layer class, path, then rank.

    Args:
      path: Variable path; its last component is the variable's name in its layer.
      shape: Static shape of the variable.
      layer: The owning layer (instance, class or class name), or ``None`` to infer the
        class from the path.
      overrides: Optional ``{regex: rule or rule name}``; the first regex that
        ``re.search``-es the path wins over everything else.

    Returns:
      The variable's :class:`BlockLayout`.

    Raises:
      ValueError: If ``shape`` is not fully defined or an override names no rule.
    """
    shape = tuple(shape)
    if any(d is None or int(d) < 0 for d in shape):
        raise ValueError(f"shape of {path!r} must be fully defined, got {shape}")
    shape = tuple(int(d) for d in shape)
    if 0 in shape:
        raise ValueError(f"variable {path!r} has no elements (shape {shape}); nothing to split")
    for pattern, rule in (overrides or {}).items():
        if re.search(pattern, path):
            return BlockLayout(path, shape, as_rule(rule, "overrides"), None)
    var_name = path.split("/")[-1]
    classes = _class_names(layer) if layer is not None else []
    inferred = infer_layer_class(path)
    if inferred is not None:
        classes.append(inferred)
    for cls in classes:
        table = LAYER_RULES.get(cls)
        if table and var_name in table:
            rule = table[var_name]
            if cls == "EinsumDense" and var_name == "kernel":
                rule = _einsum_kernel_rule(getattr(layer, "equation", None), len(shape)) or rule
            return BlockLayout(path, shape, rule, cls)
    if var_name in PATH_RULES:
        return BlockLayout(path, shape, PATH_RULES[var_name], None)
    if len(shape) <= 1:
        return BlockLayout(path, shape, ELEMENT, None)
    logger.warning("tf_blocksparse: no block rule for %r (shape %s, layer %s); using the "
                   "single-block fallback", path, shape, classes[0] if classes else "unknown")
    return BlockLayout(path, shape, SINGLE, None)


def _einsum_kernel_rule(equation: str | None, rank: int) -> BlockRule | None:
    """EinsumDense: blocks are the kernel's trailing axes that appear in the output.

    ``"abc,cde->abde"`` has kernel ``cde`` with output axes ``de``: one block per (d, e)
    unit.  Returns ``None`` when the equation is unknown or its output axes are not trailing.
    """
    if not equation or "->" not in equation or "," not in equation:
        return None
    inputs, output = equation.split("->")
    kernel = inputs.split(",")[1].strip()
    if len(kernel) != rank:
        return None
    trailing = 0
    for axis in reversed(kernel):
        if axis not in output:
            break
        trailing += 1
    if any(a in output for a in kernel[: rank - trailing]):
        return None
    return {1: OUTPUT_CHANNEL, 2: OUTPUT_UNIT_2D}.get(trailing)


def as_rule(rule: str | BlockRule, argument: str) -> BlockRule:
    """``rule`` as a :class:`BlockRule` (a rule, or the name of one in the table).

    Raises:
      ValueError: An unknown name; the message starts with ``argument``.
    """
    if isinstance(rule, BlockRule):
        return rule
    if rule not in RULES:
        raise ValueError(f"{argument}: unknown block rule {rule!r}; "
                         f"expected one of {sorted(RULES)}")
    return RULES[rule]


def layouts_for(variables: Iterable[Any], model: Any = None,
                overrides: Mapping[str, str | BlockRule] | None = None,
                owners: Mapping[int, Any] | None = None) -> list[BlockLayout]:
    """Returns the layout of each variable (objects with ``.path``/``.name`` and ``.shape``).

    Args:
      variables: Keras or TF variables.
      model: Optional Keras model owning them; gives the exact layer class of each.
      overrides: See :func:`rule_for`.
      owners: Optional ``{id(variable): layer}`` (used where ``model`` does not say).
    """
    variables = list(variables)
    owners = {**(owners or {}), **(_compat.variable_owners(variables, _compat.flatten_layers(
        model)) if model is not None else {})}
    return [rule_for(getattr(v, "path", None) or v.name.split(":")[0], tuple(v.shape),
                     owners.get(id(v)), overrides) for v in variables]
