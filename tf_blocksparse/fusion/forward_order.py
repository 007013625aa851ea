"""Derives the execution order of a model's gradients from its forward pass.

Gradients become ready in *backward* order, the reverse of the order in which the forward
pass first uses the variables.  ``model.trainable_variables`` lists variables in tracking
order (layer attribute order for a subclassed model, creation order of a layer's own
weights, graph order for a functional model), which need not be the use order, so the fusion
planner does not assume it.  How the order is derived:

1. The model's forward pass (``model(x, training=True)``) is traced once as a
   ``tf.function`` concrete function on a *symbolic* input spec: ``model.inputs`` /
   ``model.input`` of a Sequential or functional model, else the input shape the model was
   built with, or an explicit ``input_spec``.  Nothing runs; the trace happens under
   ``tf.init_scope()`` (eagerly), so it also works while an outer ``tf.function`` builds the
   optimizer lazily.
2. ``concrete.graph.captures`` pairs every captured external tensor with its placeholder in
   the graph; a variable is captured as its resource handle, so the placeholder of each
   handle (every replica's component of a distributed variable) maps back to a variable.
3. ``concrete.graph.get_operations()`` lists operations in creation order, which is the
   forward program order.  The first operation that consumes a variable's handle placeholder
   (a ``ReadVariableOp``, a ``ResourceGather`` of an embedding, or a ``While`` /
   ``PartitionedCall`` whose body reads it) is the variable's first use.

Variables the trace never reads (unused weights) go last, in their list order.  The planner's
execution order is then the reverse (:func:`tf_blocksparse.planning.execution_order`).
Without a model, or when no input spec can be found, callers fall back to the reverse of the
variable list (see :func:`derive_execution_order`).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from tf_blocksparse import _compat
from tf_blocksparse.fusion import execution_order

__all__ = ["backward_ranks", "derive_execution_order", "forward_use_order",
           "model_input_spec"]

logger = logging.getLogger("tf_blocksparse")


def _spec(x: Any) -> tf.TensorSpec:
    """A ``TensorSpec`` with a free batch dimension for a KerasTensor / shape-like ``x``."""
    shape = list(x.shape)
    if shape:
        shape[0] = None
    return tf.TensorSpec(shape, getattr(x, "dtype", None) or tf.float32)


def model_input_spec(model: keras.Model) -> Any:
    """The symbolic input structure of ``model``, or ``None`` when it cannot be known.

    Sequential: its single input; functional: ``model.input`` (a tensor, list or dict);
    any other built model whose ``call`` takes one input: the shape it was built with, and
    ``model.input_dtype``.

    Args:
        model: A Keras model.

    Returns:
        A (nest of) ``tf.TensorSpec`` with the batch dimension left free, or ``None``.
    """
    if isinstance(model, keras.Sequential):
        inputs = getattr(model, "inputs", None)
        return _spec(inputs[0]) if inputs else None
    try:
        struct = model.input
    except (AttributeError, ValueError):
        struct = None
    if struct is not None:
        return tf.nest.map_structure(_spec, struct)
    shapes = _compat.build_input_shapes(model)
    if len(shapes) == 1 and _required_call_args(model) == 1:
        shape = next(iter(shapes.values()))
        if isinstance(shape, (tuple, list)) and all(d is None or isinstance(d, int)
                                                    for d in shape):
            dtype = getattr(model, "input_dtype", None) or "float32"
            return _spec(tf.TensorSpec(shape, dtype))
    return None


def _required_call_args(model: keras.Model) -> int:
    """How many arguments ``model.call`` needs (``training`` and ``mask`` aside)."""
    params = inspect.signature(model.call).parameters.values()
    return sum(p.default is p.empty and p.name not in ("training", "mask")
               and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
               for p in params)


def _handles(variable: Any) -> list[Any]:
    """Every resource handle behind a Keras / TF / distributed variable."""
    value = getattr(variable, "value", variable)
    if callable(value):  # a tf.Variable's .value() method, not a Keras variable
        value = variable
    if not isinstance(value, tf.Variable):  # a Keras variable read under autocast
        value = _compat.variable_storage(variable)
    parts = getattr(value, "values", None)  # a distributed variable's per-replica components
    parts = parts if isinstance(parts, (tuple, list)) else (value,)
    return [p.handle for p in parts if isinstance(p, tf.Variable)]


@tf.autograph.experimental.do_not_convert
def forward_use_order(model: keras.Model, variables: Sequence[Any] | None = None,
                      input_spec: Any = None) -> tuple[int, ...]:
    """Indices into ``variables`` in the order the forward pass first uses them.

    Args:
        model: A built Keras model.
        variables: The variables to order (default ``model.trainable_variables``).
        input_spec: A (nest of) ``tf.TensorSpec`` to trace ``model`` with; default
            :func:`model_input_spec`.

    Returns:
        A permutation of ``range(len(variables))``: variables by first use, then those the
        forward pass never reads, in list order.

    Raises:
        ValueError: If ``input_spec`` is not given and cannot be derived from ``model``.
    """
    variables = list(model.trainable_variables if variables is None else variables)
    if input_spec is None:
        input_spec = model_input_spec(model)
    if input_spec is None:
        raise ValueError(f"`input_spec`: cannot tell the input of model {model.name!r}; "
                         "build it on a keras.Input or pass input_spec")
    handle_index = {id(h): i for i, v in enumerate(variables) for h in _handles(v)}
    with tf.init_scope():
        forward = tf.function(lambda x: model(x, training=True), autograph=False)
        graph = forward.get_concrete_function(input_spec).graph
    placeholder_index = {internal.name: handle_index[id(external)]
                         for external, internal in graph.captures
                         if id(external) in handle_index}
    seen: dict[int, None] = {}
    for op in graph.get_operations():
        for t in op.inputs:
            i = placeholder_index.get(t.name)
            if i is not None and i not in seen:
                seen[i] = None
    unused = [i for i in range(len(variables)) if i not in seen]
    return (*seen, *unused)


def derive_execution_order(model: keras.Model | None, variables: Sequence[Any],
                           input_spec: Any = None) -> tuple[int, ...] | None:
    """Backward (gradient-ready) order of ``variables`` from ``model``'s forward pass.

    Args:
        model: The Keras model owning the variables, or ``None``.
        variables: The variables whose gradients are planned, in list order.
        input_spec: Optional input spec (see :func:`forward_use_order`).

    Returns:
        The reverse of :func:`forward_use_order`, or ``None`` when there is no model or its
        input cannot be told: callers then use the reverse of the list order (the
        fallback of :func:`~tf_blocksparse.planning.execution_order`).
    """
    if model is None:
        return None
    if input_spec is None and model_input_spec(model) is None:
        return None
    variables = list(variables)
    return execution_order(len(variables), forward_use_order(model, variables, input_spec))


def backward_ranks(model: keras.Model | None, variables: Sequence[Any]) -> list[int] | None:
    """Each variable's position in the derived backward order, or ``None`` (fallback).

    For the adapters that plan fusion groups where a model may be known: ``None`` when there
    is no model, its input cannot be told, or its forward pass cannot be traced (logged as a
    warning); they then use the reverse of the variable order.  Deterministic, so every
    replica and worker takes the same branch and plans the same groups.

    Args:
        model: The Keras model owning ``variables``, or ``None``.
        variables: The variables whose gradients are planned.

    Returns:
        ``ranks[i]`` = position of ``variables[i]`` in the backward order, or ``None``.
    """
    variables = list(variables)
    try:
        order = derive_execution_order(model, variables)
    except Exception as err:  # noqa: BLE001 - any trace failure means: use the fallback
        logger.warning("tf_blocksparse: could not trace %r to derive the gradient order "
                       "(%s: %s); using the reverse of the variable order",
                       getattr(model, "name", model), type(err).__name__, err)
        return None
    if order is None:
        return None
    ranks = [0] * len(variables)
    for position, i in enumerate(order):
        ranks[i] = position
    return ranks
