"""One device's copy of a piece of a model, shared by the pipeline and hybrid trainers.

Both trainers run pieces of one Keras model data-parallel: a pipeline stage (a run of a chain
model's layers, :class:`~tf_blocksparse.pipeline.trainer.PipelineTrainer`) or a
model part (the conv trunk or the FC head,
:class:`~tf_blocksparse.hybrid.trainer.HybridTrainer`).  Every device of a piece
holds a :class:`Replica`: its own copies of the piece's variables (``keras.Variable``\\ s
created under ``tf.device``), while the *layer objects* are the original model's, called
inside a :class:`keras.StatelessScope` that maps the layers' variables to the replica's
copies.  The original model's variables are left untouched until :meth:`Replica.copy_to_refs`.

A copy lives on the replica's compute device unless ``device_of_layer`` names another device
for its layer (the hybrid trainer keeps the layers in "expanded" memory on the host device).

:func:`average_state` is the one place where the replicas of a piece agree on their
non-trainable state (e.g. BatchNorm moving statistics) after a step, and
:func:`clone_optimizer` makes each replica's own optimizer.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf

__all__ = ["Replica", "average_state", "clone_optimizer"]


def _safe_name(path: str) -> str:
    return path.replace("/", "_").replace(":", "_")


def _accepts_training(fn: Any) -> bool:
    return "training" in inspect.signature(fn.call).parameters


def _copy(ref: keras.Variable, device: str, trainable: bool) -> keras.Variable:
    with tf.device(device):  # from numpy: a Variable built from a Variable would alias it
        return keras.Variable(ref.numpy(), trainable=trainable, dtype=ref.dtype,
                              name=_safe_name(ref.path))


class Replica:
    """One device's copy of a piece of a model: the shared layer objects, its own variables.

    Attributes:
        device: The compute device.
        layers: The piece's layers (the original model's objects; a model part's layers
            include its ``InputLayer``).
        trainable_refs: The original model's trainable variables of the piece.
        non_trainable_refs: Its non-trainable variables (e.g. BatchNorm statistics, seeds).
        trainable: The replica's copies of ``trainable_refs``, same order.
        non_trainable: The replica's copies of ``non_trainable_refs``, same order.
        owners: ``owners[i]``: name of the layer owning ``trainable_refs[i]``.
        var_devices: ``var_devices[i]``: the device holding ``trainable[i]``.
        state_devices: ``state_devices[i]``: the device holding ``non_trainable[i]``.
    """

    def __init__(self, piece: keras.Model | Sequence[keras.layers.Layer], device: str,
                 device_of_layer: Callable[[str], str] | None = None) -> None:
        """Copies the piece's variables.

        Args:
            piece: A model part (a ``keras.Model`` over the original layers, called as one) or
                a run of a chain model's layers (called one after the other).
            device: The compute device.
            device_of_layer: Maps a layer name to the device holding that layer's variable
                copies; default: every copy on ``device``.
        """
        self.device = device
        if isinstance(piece, keras.Model):
            self.layers = list(piece.layers)
            self._calls: list[Any] = [piece]
            self.trainable_refs = list(piece.trainable_variables)
            self.non_trainable_refs = list(piece.non_trainable_variables)
        else:
            self.layers = list(piece)
            self._calls = list(piece)
            self.trainable_refs = [v for layer in self.layers for v in layer.trainable_variables]
            self.non_trainable_refs = [v for layer in self.layers
                                       for v in layer.non_trainable_variables]
        self._training = [_accepts_training(fn) for fn in self._calls]
        owner_of = {id(v): layer.name for layer in self.layers for v in layer.variables}
        place = device_of_layer or (lambda _name: device)
        self.owners = [owner_of[id(v)] for v in self.trainable_refs]
        self.var_devices = [place(o) for o in self.owners]
        self.state_devices = [place(owner_of[id(v)]) for v in self.non_trainable_refs]
        self.trainable = [_copy(v, d, True)
                          for v, d in zip(self.trainable_refs, self.var_devices)]
        self.non_trainable = [_copy(v, d, False)
                              for v, d in zip(self.non_trainable_refs, self.state_devices)]

    def forward(self, x: tf.Tensor, non_trainable: Sequence[Any] | None = None
                ) -> tuple[tf.Tensor, list[tf.Tensor]]:
        """Runs the piece in training mode on this replica's variables.

        Args:
            x: Piece input [b, ...] (on or copied to :attr:`device` by the caller's scope).
            non_trainable: Current values of the non-trainable state (variables or tensors,
                e.g. the state after the previous micro-batch); default: :attr:`non_trainable`.

        Returns:
            ``(y, new_non_trainable)``: the piece output [b, ...] and the updated state values.
        """
        state = self.non_trainable if non_trainable is None else non_trainable
        mapping = list(zip(self.trainable_refs, self.trainable)) + \
            list(zip(self.non_trainable_refs, state))
        with keras.StatelessScope(mapping) as scope:
            for fn, training in zip(self._calls, self._training):
                x = fn(x, training=True) if training else fn(x)
        return x, [scope.get_current_value(v) for v in self.non_trainable_refs]

    def copy_to_refs(self) -> None:
        """Writes this replica's variables into the original model's variables."""
        for ref, var in zip(self.trainable_refs + self.non_trainable_refs,
                            self.trainable + self.non_trainable):
            ref.assign(var.value)


def average_state(replicas: Sequence[Replica], states: Sequence[Sequence[tf.Tensor]]) -> None:
    """Assigns the replicas' mean non-trainable state to every replica of a piece.

    Floating state (e.g. BatchNorm moving statistics) is averaged on the first replica's
    device; other state (integer counters, seeds) takes the first replica's value.

    Args:
        replicas: The replicas of one piece (same variables, same order).
        states: ``states[r][i]``: replica ``r``'s new value of its ``i``-th non-trainable
            variable [*shape_i] (as returned by :meth:`Replica.forward`).
    """
    for i in range(len(replicas[0].non_trainable)):
        values = [st[i] for st in states]
        with tf.device(replicas[0].device):
            value = values[0]
            if len(values) > 1 and tf.as_dtype(values[0].dtype).is_floating:
                value = tf.add_n(values) / len(values)
        for rep in replicas:
            with tf.device(rep.state_devices[i]):
                rep.non_trainable[i].assign(value)


def clone_optimizer(optimizer: Any) -> keras.optimizers.Optimizer:
    """A fresh optimizer for one replica (and variable device).

    Args:
        optimizer: A Keras optimizer (copied via its config; the instance is not used) or a
            zero-argument function making one.

    Raises:
        ValueError: ``optimizer`` is neither.
    """
    if isinstance(optimizer, keras.optimizers.Optimizer):
        return type(optimizer).from_config(optimizer.get_config())
    if callable(optimizer):
        made = optimizer()
        if isinstance(made, keras.optimizers.Optimizer):
            return made
    raise ValueError("optimizer must be a keras Optimizer or a function returning one, got "
                     f"{optimizer!r}")
