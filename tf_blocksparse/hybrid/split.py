"""Splitting a Keras CNN at its conv/FC boundary.

:func:`find_boundary` locates the tensor where a model's convolutional trunk ends and its
fully-connected head begins: the input of the first ``Dense`` / ``EinsumDense`` layer after the
last convolution (in a topological order of the layer graph), or the input of a layer the user
names.  :func:`split_model` cuts the model there into two functional models that share the
original layer objects (and so their variables): ``trunk`` maps the model input [b, ...] to the
boundary activation [b, ...], ``head`` maps that activation to the model output.
:func:`layer_memory` lists every layer's parameter, optimizer-state and activation bytes for
the placement planner (:mod:`tf_blocksparse.hybrid`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import keras
import numpy as np

from tf_blocksparse import _compat
from tf_blocksparse.hybrid import LayerMemory

__all__ = ["Boundary", "find_boundary", "layer_memory", "optimizer_slots", "split_model"]

_CONV_NAMES = ("Conv1D", "Conv2D", "Conv3D", "SeparableConv1D", "SeparableConv2D",
               "DepthwiseConv1D", "DepthwiseConv2D", "Conv1DTranspose", "Conv2DTranspose",
               "Conv3DTranspose")
CONV_TYPES = tuple(getattr(keras.layers, n) for n in _CONV_NAMES if hasattr(keras.layers, n))
DENSE_TYPES = (keras.layers.Dense, keras.layers.EinsumDense)


@dataclasses.dataclass(frozen=True)
class Boundary:
    """Where a model is split.

    Attributes:
        tensor: The boundary ``KerasTensor`` (the trunk's output, the head's input).
        head_layer: Name of the first head layer (the layer that consumes ``tensor``).
        producer: Name of the layer producing ``tensor`` (``None`` for a model input).
        last_conv: Name of the last convolution layer (``None`` when the split was named and
            the model has none).
    """

    tensor: Any
    head_layer: str
    producer: str | None
    last_conv: str | None


def _functional(model: keras.Model) -> keras.Model:
    if not isinstance(model, keras.Model) or not model.built:
        raise ValueError(f"model must be a built Keras model, got {model!r}")
    try:
        inputs, outputs = model.inputs, model.outputs
    except (AttributeError, ValueError) as err:
        raise ValueError(f"model {model.name!r} has no layer graph (a subclassed model?); "
                         "use a Sequential or functional model") from err
    if not inputs or not outputs or len(inputs) != 1 or len(outputs) != 1:
        raise ValueError(f"model {model.name!r} must have exactly one input and one output")
    if isinstance(model, keras.Sequential) or _compat.nodes_by_depth(model) is None:
        return keras.Model(inputs[0], outputs[0], name=f"{model.name}_graph")
    return model


def _topological_nodes(model: keras.Model) -> list[Any]:
    graph = _compat.nodes_by_depth(_functional(model))
    nodes = []
    for depth in sorted(graph, reverse=True):
        nodes.extend(n for n in graph[depth] if n.operation is not None and not n.is_input)
    return nodes


def _producer(tensor: Any) -> str | None:
    history = _compat.keras_history(tensor)
    if history is None or isinstance(history.operation, keras.layers.InputLayer):
        return None
    return history.operation.name


def find_boundary(model: keras.Model, layer_name: str | None = None) -> Boundary:
    """Finds the conv/FC boundary of ``model``.

    Args:
        model: A built Sequential or functional model with one input and one output.
        layer_name: Optional name of the first head layer; the boundary is its (single) input.
            Naming the last conv layer puts that layer in the head as well.

    Returns:
        The :class:`Boundary`: by default the input of the first ``Dense`` / ``EinsumDense``
        after the last convolution.

    Raises:
        ValueError: ``model`` is not a graph model, ``layer_name`` is unknown or takes several
            inputs, or the model has no convolution or no dense layer after it.
    """
    nodes = _topological_nodes(model)
    convs = [n.operation.name for n in nodes if isinstance(n.operation, CONV_TYPES)]
    last_conv = convs[-1] if convs else None
    if layer_name is not None:
        if not isinstance(layer_name, str):
            raise ValueError(f"layer_name must be a str, got {layer_name!r}")
        named = [n for n in nodes if n.operation.name == layer_name]
        if not named:
            raise ValueError(f"layer_name: model {model.name!r} has no layer {layer_name!r}; "
                             f"layers: {[n.operation.name for n in nodes]}")
        if len(named) > 1 or len(named[0].input_tensors) != 1:
            raise ValueError(f"layer_name: layer {layer_name!r} must be called once on one "
                             "input tensor to start the head")
        tensor = named[0].input_tensors[0]
        return Boundary(tensor, layer_name, _producer(tensor), last_conv)
    if last_conv is None:
        raise ValueError(f"model {model.name!r} has no convolution layer; name the first head "
                         "layer with layer_name")
    start = max(i for i, n in enumerate(nodes) if n.operation.name == last_conv)
    for node in nodes[start + 1:]:
        if isinstance(node.operation, DENSE_TYPES) and len(node.input_tensors) == 1:
            tensor = node.input_tensors[0]
            return Boundary(tensor, node.operation.name, _producer(tensor), last_conv)
    raise ValueError(f"model {model.name!r} has no Dense layer after its last convolution "
                     f"{last_conv!r}; name the first head layer with layer_name")


def split_model(model: keras.Model, boundary: Boundary | str | None = None
                ) -> tuple[keras.Model, keras.Model]:
    """Cuts ``model`` at ``boundary`` into a trunk and a head sharing its layer objects.

    Args:
        model: A built Sequential or functional model with one input and one output.
        boundary: A :class:`Boundary`, the name of the first head layer, or ``None`` to find
            the conv/FC boundary.

    Returns:
        ``(trunk, head)``: ``trunk`` maps inputs [b, ...] to the boundary activation
        [b, ...]; ``head`` maps that to the outputs; ``head(trunk(x))`` equals ``model(x)``.

    Raises:
        ValueError: The boundary is not a cut of the graph (the head needs another trunk
            tensor, e.g. a skip connection across it), or it leaves the trunk empty.
    """
    if boundary is None or isinstance(boundary, str):
        boundary = find_boundary(model, boundary)
    if not isinstance(boundary, Boundary):
        raise ValueError(f"boundary must be a Boundary, a layer name or None, got {boundary!r}")
    graph = _functional(model)
    if boundary.producer is None:
        raise ValueError(f"boundary: splitting at the model input leaves the trunk empty "
                         f"(head layer {boundary.head_layer!r})")
    try:
        trunk = keras.Model(graph.inputs[0], boundary.tensor, name=f"{model.name}_trunk")
        head = keras.Model(boundary.tensor, graph.outputs[0], name=f"{model.name}_head")
    except ValueError as err:
        raise ValueError(f"boundary: the input of {boundary.head_layer!r} is not a cut of "
                         f"model {model.name!r} ({err})") from err
    trunk_ids = {id(layer) for layer in _own_layers(trunk)}
    head_ids = {id(layer) for layer in _own_layers(head)}
    every = {id(layer) for layer in _own_layers(graph)}
    if trunk_ids & head_ids or trunk_ids | head_ids != every:
        raise ValueError(f"boundary: the input of {boundary.head_layer!r} is not a cut of model "
                         f"{model.name!r}: it does not split it into two disjoint parts")
    return trunk, head


def _own_layers(model: keras.Model) -> list[keras.layers.Layer]:
    return [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]


def optimizer_slots(optimizer: keras.optimizers.Optimizer) -> int:
    """Slot variables per trainable variable (SGD 0, SGD+momentum 1, Adam 2), by building a
    fresh copy of ``optimizer`` on one small probe variable."""
    probe = keras.Variable(np.zeros((3, 5), "float32"), name="slot_probe")
    opt = type(optimizer).from_config(optimizer.get_config())
    opt.build([probe])
    return sum(1 for v in opt.variables if tuple(v.shape) == (3, 5))


def _nbytes(shape: Any, dtype: Any, batch: int = 1) -> int:
    return batch * math.prod(int(d) for d in shape) * np.dtype(keras.backend.standardize_dtype(
        dtype)).itemsize


def layer_memory(model: keras.Model, boundary: Boundary | str | None, batch_size: int,
                 optimizer: keras.optimizers.Optimizer | None = None,
                 compute_s: Mapping[str, float] | None = None) -> list[LayerMemory]:
    """Per-layer bytes of ``model`` split at ``boundary``, for the placement planner.

    Args:
        model: The model.
        boundary: As for :func:`split_model`.
        batch_size: Global mini-batch size (activation bytes are for all of it).
        optimizer: Gives the optimizer-state bytes (``slots * param_bytes``); ``None``: 0.
        compute_s: Optional measured forward + backward seconds per layer name.

    Returns:
        Trunk layers then head layers (``is_fc=True``), each in topological order.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    slots = optimizer_slots(optimizer) if optimizer is not None else 0
    trunk, head = split_model(model, boundary)
    times = dict(compute_s or {})
    out = []
    for part, is_fc in ((trunk, False), (head, True)):
        for layer in _own_layers(part):
            params = sum(_nbytes(v.shape, v.dtype) for v in layer.trainable_variables)
            acts = sum(_nbytes(t.shape[1:], t.dtype, batch_size)
                       for t in keras.tree.flatten(layer.output))
            out.append(LayerMemory(layer.name, params, slots * params, acts,
                                   float(times.get(layer.name, 0.0)), is_fc))
    return out
