"""Per-layer profiles of Keras models by real runs (the first step of planning).

:func:`profile_model` runs the model once layer by layer on a real batch to collect every
layer's input activations, then times, per layer and on those activations, two ``tf.function``\\ s:
the forward alone, and the forward plus ``tape.gradient`` of its outputs with respect to its
floating-point inputs and its trainable variables.  After ``warmup`` untimed calls the median
of ``repeats`` timed calls is kept; ``backward_s = max(median(fwd + bwd) - median(fwd), 0)``
and ``compute_s = forward_s + backward_s``; by default the forward time is net of the
``tf.function`` call overhead (timed on a trivial function of the same inputs).  Layers run
in training mode inside a :class:`keras.StatelessScope`, so the model's state (e.g. BatchNorm
statistics) is unchanged.

Layer order and activation bytes:

- A *chain* model (``keras.Sequential``, or a functional model whose layers each take the
  previous layer's single output) gives one :class:`LayerProfile` per layer in forward order
  (the ``InputLayer`` is skipped); ``activation_bytes`` are the bytes of the layer's output for
  the whole profiled batch (``batch x per-sample elements x dtype size``).
- Any other functional model (``allow_non_chain=True``, e.g. ``keras.applications.ResNet50``)
  is profiled in a topological order of its layers, and ``activation_bytes`` of position ``i``
  are the bytes of **all** tensors live across the cut after position ``i``: tensors produced
  at a position ``<= i`` (model inputs count as position ``-1``) and consumed at a position
  ``> i`` or being a model output.  This is what a stage boundary placed there must send.

``param_bytes`` counts the layer's trainable variables (non-trainable state such as BatchNorm
moving statistics is not all-reduced and is left out).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tf_blocksparse import _compat
from tf_blocksparse.pipeline.profile import LayerProfile, ModelProfile
from tf_blocksparse.timing import median_seconds

__all__ = ["LayerMeasurement", "chain_layers", "measure_layers", "profile_model"]


@dataclasses.dataclass(frozen=True)
class LayerMeasurement:
    """What :func:`measure_layers` measured for one layer.

    Attributes:
        name: The layer's name.
        forward_s: Median forward seconds on the profiled batch.
        backward_s: Median ``(forward + backward) - forward`` seconds, clipped at 0.
        output_bytes: Bytes of the layer's own outputs for the profiled batch.
        activation_bytes: Bytes crossing a cut after this layer (``output_bytes`` for chains).
        param_bytes: Bytes of the layer's trainable variables.
    """

    name: str
    forward_s: float
    backward_s: float
    output_bytes: int
    activation_bytes: int
    param_bytes: int

    @property
    def compute_s(self) -> float:
        """Forward + backward seconds."""
        return self.forward_s + self.backward_s


@dataclasses.dataclass
class _Step:
    """One layer call of the model graph: ``outputs = layer(*args, **kwargs)``."""

    layer: keras.layers.Layer
    fill: Callable[[dict[int, Any]], tuple[list, dict]]
    inputs: list[int]   # ids of the reference tensors consumed
    outputs: list[int]  # ids of the reference tensors produced


def _graph_steps(model: keras.Model) -> tuple[list[int], list[_Step], list[int]]:
    """Model input ids, the layer calls in a topological order, and model output ids."""
    if isinstance(model, keras.Sequential):
        layers = list(model.layers)
        steps = []
        for i, layer in enumerate(layers):
            steps.append(_Step(layer, lambda d, i=i: ([d[i]], {}), [i], [i + 1]))
        return [0], steps, [len(layers)]
    graph = _compat.nodes_by_depth(model)
    if graph is None:
        raise ValueError(f"model {model.name!r} is not a Sequential or functional model; "
                         "subclassed models have no layer graph to profile")
    steps, seen = [], set()
    for depth in sorted(graph, reverse=True):
        for node in graph[depth]:
            if node.operation is None or node.is_input:
                continue
            if id(node.operation) in seen:
                raise ValueError(f"model {model.name!r}: layer {node.operation.name!r} is "
                                 "called more than once (shared layers are not supported)")
            seen.add(id(node.operation))

            def fill(d: dict[int, Any], node: Any = node) -> tuple[list, dict]:
                args, kwargs = node.arguments.fill_in(d)
                return list(args), dict(kwargs)

            steps.append(_Step(node.operation, fill, [id(t) for t in node.input_tensors],
                               [id(t) for t in node.outputs]))
    return [id(t) for t in model.inputs], steps, [id(t) for t in model.outputs]


def _is_chain(model_inputs: list[int], steps: list[_Step], model_outputs: list[int]) -> bool:
    prev = model_inputs
    for step in steps:
        if len(prev) != 1 or step.inputs != prev or len(step.outputs) != 1:
            return False
        prev = step.outputs
    return prev == model_outputs


def chain_layers(model: keras.Model) -> list[keras.layers.Layer]:
    """The layers of a chain model in forward order, without the ``InputLayer``.

    Args:
        model: A built ``keras.Sequential`` or a functional model whose layers form a chain.

    Returns:
        The layers; calling them in order on the model input gives the model output.

    Raises:
        ValueError: ``model`` is not built, or its layers do not form a chain.
    """
    if not model.built:
        raise ValueError(f"model {model.name!r} is not built; give it an Input first")
    inputs, steps, outputs = _graph_steps(model)
    if not steps or not _is_chain(inputs, steps, outputs):
        raise ValueError(f"model {model.name!r} is not a chain of layers (one input, one output, "
                         "each layer consuming only the previous layer's output); pass "
                         "allow_non_chain=True to profile it in topological order")
    return [s.layer for s in steps]


def _nbytes(tensors: Sequence[Any]) -> int:
    return sum(int(np.prod(t.shape, dtype=np.int64)) * tf.as_dtype(t.dtype).size
               for t in tensors)


def _param_bytes(layer: keras.layers.Layer) -> int:
    return _nbytes(layer.trainable_variables)


def _with_training(layer: keras.layers.Layer, kwargs: dict) -> dict:
    if "training" in inspect.signature(layer.call).parameters:
        kwargs = {**kwargs, "training": True}
    return kwargs


def _time_layer(layer: keras.layers.Layer, args: list, kwargs: dict, warmup: int,
                repeats: int, subtract_dispatch: bool) -> tuple[float, float]:
    """Median forward and backward seconds of one layer call on real inputs.

    With ``subtract_dispatch`` the median time of a trivial ``tf.function`` call on the same
    inputs (the per-call dispatch overhead, which a whole-step graph does not pay per layer) is
    taken off the forward time.
    """
    flat = tf.nest.flatten(args)
    wrt = [i for i, t in enumerate(flat) if tf.is_tensor(t) and t.dtype.is_floating]

    def call(flat_in: list) -> list:
        with keras.StatelessScope():
            out = layer(*tf.nest.pack_sequence_as(args, flat_in), **kwargs)
        return tf.nest.flatten(out)

    @tf.function
    def forward(flat_in: list) -> list:
        return call(flat_in)

    @tf.function
    def forward_backward(flat_in: list) -> list:
        with tf.GradientTape() as tape:
            tape.watch([flat_in[i] for i in wrt])
            outs = call(flat_in)
        sources = [flat_in[i] for i in wrt] + list(layer.trainable_variables)
        grads = tape.gradient(outs, sources, output_gradients=[tf.ones_like(o) for o in outs])
        return [g for g in grads if g is not None]

    @tf.function
    def dispatch(flat_in: list) -> list:
        return [tf.identity(flat_in[i]) for i in wrt[:1]]

    sync = tf.test.experimental.sync_devices
    base = median_seconds(lambda: dispatch(flat), repeats, warmup, sync) \
        if subtract_dispatch else 0.0
    fwd = median_seconds(lambda: forward(flat), repeats, warmup, sync)
    both = median_seconds(lambda: forward_backward(flat), repeats, warmup, sync)
    return max(fwd - base, 0.0), max(both - fwd, 0.0)


def _sample_inputs(model: keras.Model, inputs: Any, batch_size: int | None, seed: int) -> list:
    """The profiled batch as a flat list of tensors, one per model input."""
    if inputs is None or (isinstance(inputs, (tuple, list))
                          and all(isinstance(d, (int, np.integer)) for d in inputs)):
        if batch_size is None or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int when inputs is a shape, "
                             f"got {batch_size!r}")
        if len(model.inputs) != 1:
            raise ValueError("inputs: a model with several inputs needs a sample batch")
        shape = tuple(inputs) if inputs is not None else tuple(model.inputs[0].shape[1:])
        if any(d is None for d in shape):
            raise ValueError(f"inputs: model {model.name!r} has an input shape with unknown "
                             f"dimensions {shape}; pass the per-sample shape")
        rng = np.random.default_rng(seed)
        batch = rng.standard_normal((batch_size, *shape)).astype(model.inputs[0].dtype)
        return [tf.convert_to_tensor(batch)]
    flat = [tf.convert_to_tensor(t) for t in tf.nest.flatten(inputs)]
    if len(flat) != len(model.inputs):
        raise ValueError(f"inputs: model {model.name!r} takes {len(model.inputs)} inputs, "
                         f"got {len(flat)}")
    if batch_size is not None and any(t.shape[0] != batch_size for t in flat):
        raise ValueError(f"batch_size={batch_size} differs from the sample batch's leading "
                         "dimension")
    return flat


def measure_layers(model: keras.Model, inputs: Any = None, batch_size: int | None = None, *,
                   warmup: int = 2, repeats: int = 5, allow_non_chain: bool = False,
                   subtract_dispatch: bool = True, seed: int = 0) -> list[LayerMeasurement]:
    """Times every layer of ``model`` on real activations (see the module docstring).

    Args:
        model: A built Sequential or functional Keras model.
        inputs: A sample batch (array or tensor, or a list of them for several inputs) or the
            per-sample input shape (a tuple of ints); ``None`` uses the model's input shape.
            Shapes are filled with standard-normal data.
        batch_size: The batch size when ``inputs`` is a shape (required then).
        warmup: Untimed calls per timed function.
        repeats: Timed calls per timed function (the median is kept).
        allow_non_chain: Profile non-chain functional models in topological order.
        subtract_dispatch: Take the ``tf.function`` call overhead (timed on a trivial function)
            off each layer's forward time.
        seed: Seed of the generated data.

    Returns:
        One :class:`LayerMeasurement` per layer (``InputLayer``\\ s excluded), in forward order.

    Raises:
        ValueError: Bad ``model`` (not a chain without ``allow_non_chain``, unbuilt, shared
            layers), ``inputs``, ``batch_size``, ``warmup`` or ``repeats``.
    """
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if not allow_non_chain:
        chain_layers(model)  # raises if not a chain
    elif not model.built:
        raise ValueError(f"model {model.name!r} is not built; give it an Input first")
    input_ids, steps, output_ids = _graph_steps(model)
    values: dict[int, Any] = dict(zip(input_ids, _sample_inputs(model, inputs, batch_size, seed)))
    produced = {t: -1 for t in input_ids}
    last_use = {t: len(steps) for t in output_ids}
    measured = []
    for pos, step in enumerate(steps):
        args, kwargs = step.fill(values)
        kwargs = _with_training(step.layer, kwargs)
        fwd, bwd = _time_layer(step.layer, args, kwargs, warmup, repeats, subtract_dispatch)
        with keras.StatelessScope():
            outs = tf.nest.flatten(step.layer(*args, **kwargs))
        for ref, out in zip(step.outputs, outs):
            values[ref] = out
            produced[ref] = pos
        for ref in step.inputs:
            last_use[ref] = max(last_use.get(ref, pos), pos)
        measured.append((step.layer.name, fwd, bwd, _nbytes(outs), _param_bytes(step.layer)))
    sizes = {ref: _nbytes([values[ref]]) for ref in produced}
    result = []
    for pos, (name, fwd, bwd, out_bytes, p_bytes) in enumerate(measured):
        live = sum(sizes[ref] for ref, p in produced.items()
                   if p <= pos < last_use.get(ref, p))
        result.append(LayerMeasurement(name, fwd, bwd, out_bytes, live, p_bytes))
    return result


def profile_model(model: keras.Model, inputs: Any = None, batch_size: int | None = None, *,
                  warmup: int = 2, repeats: int = 5, allow_non_chain: bool = False,
                  subtract_dispatch: bool = True, seed: int = 0) -> ModelProfile:
    """Profiles ``model`` for the pipeline planner: one :class:`LayerProfile` per layer.

    Arguments are those of :func:`measure_layers`.  ``compute_s`` is forward + backward seconds
    and ``forward_s`` the forward part, both for the profiled batch (pass the micro-batch size
    the pipeline will use); ``activation_bytes`` and ``param_bytes`` as in the module docstring.

    Returns:
        The :class:`~tf_blocksparse.planning.ModelProfile` in forward order.

    Raises:
        ValueError: As :func:`measure_layers`.
    """
    layers = measure_layers(model, inputs, batch_size, warmup=warmup, repeats=repeats,
                            allow_non_chain=allow_non_chain,
                            subtract_dispatch=subtract_dispatch, seed=seed)
    batch = _sample_inputs(model, inputs, batch_size, seed)[0].shape[0]
    meta = {"batch_size": int(batch), "chain": not allow_non_chain or _is_chain(
        *_graph_steps(model)), "device": "GPU" if tf.config.list_logical_devices("GPU") else "CPU",
        "warmup": warmup, "repeats": repeats, "subtract_dispatch": subtract_dispatch}
    return ModelProfile([LayerProfile(m.name, m.compute_s, m.activation_bytes, m.param_bytes,
                                      forward_s=m.forward_s) for m in layers],
                        name=model.name, metadata=meta)
