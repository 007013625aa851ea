"""Building blocks of the pipeline runtime: stage specs, per-device replicas, re-slicing.

A pipeline stage is a contiguous slice ``[first_layer, last_layer]`` of a chain model's layers
(see :func:`tf_blocksparse.keras.profiler.chain_layers`) run data-parallel on one or more
devices.  Each device of a stage holds a :class:`StageReplica`: its own copies of the stage's
variables (``keras.Variable``\\ s created under ``tf.device``), while the *layer objects* are
the original model's, called inside a :class:`keras.StatelessScope` that maps the layers'
variables to the replica's copies.  The original model's variables are left untouched.
"""

from __future__ import annotations

import dataclasses
import inspect
import numbers
from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

__all__ = ["StageReplica", "StageSpec", "default_devices", "device_key", "normalize_stages",
           "reslice", "split_sizes"]


@dataclasses.dataclass(frozen=True)
class StageSpec:
    """One validated stage.

    Attributes:
        first_layer: Index of the stage's first layer in the chain.
        last_layer: Index of its last layer (inclusive).
        devices: The replicas' device names, in the stage's order.
    """

    first_layer: int
    last_layer: int
    devices: tuple[str, ...]


def default_devices() -> list[str]:
    """The host's logical GPUs, or its logical CPUs when there is no GPU."""
    devices = tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("CPU")
    return [d.name for d in devices]


def device_key(name: str) -> tuple[str, int, int, str, int]:
    """``(job, replica, task, TYPE, index)`` of a device name; a local name without job or task
    (``/device:CPU:0``) is the same device as ``/job:localhost/replica:0/task:0/device:CPU:0``.
    """
    spec = tf.DeviceSpec.from_string(name)
    return (spec.job or "localhost", spec.replica or 0, spec.task or 0,
            (spec.device_type or "").upper(), spec.device_index or 0)


def _stage_fields(stage: Any) -> tuple[Any, Any, Any]:
    if all(hasattr(stage, a) for a in ("first_layer", "last_layer", "devices")):
        return stage.first_layer, stage.last_layer, stage.devices
    if isinstance(stage, (tuple, list)) and len(stage) == 3:
        return stage[0], stage[1], stage[2]
    raise ValueError(f"stages: each stage must be (first_layer, last_layer, devices) or have "
                     f"those attributes, got {stage!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def normalize_stages(stages: Sequence[Any], num_layers: int, devices: Sequence[str],
                     allow_device_reuse: bool = False) -> list[StageSpec]:
    """Checks ``stages`` and resolves their devices.

    Args:
        stages: Stages in pipeline order, each ``(first_layer, last_layer, devices)`` or an
            object with those attributes (e.g. a planner stage); ``devices`` holds ints (indices
            into ``devices``) or device name strings.
        num_layers: Layers of the chain; the stages must cover ``0 .. num_layers - 1`` in order
            without gaps or overlaps.
        devices: Device names the integer ids refer to.
        allow_device_reuse: Accept one device in several replicas / stages (for tests on hosts
            with few devices: those replicas then share the device's compute).

    Returns:
        The stages with device names.

    Raises:
        ValueError: ``stages`` do not tile the layers, a stage has no device, an id is out of
            range, or a device is reused without ``allow_device_reuse``.
    """
    if not stages:
        raise ValueError("stages must not be empty")
    result, used, expected = [], {}, 0
    for s, stage in enumerate(stages):
        first, last, devs = _stage_fields(stage)
        if not (_is_int(first) and _is_int(last)) or first != expected or last < first:
            raise ValueError(f"stages: stage {s} covers layers [{first}, {last}] but must start "
                             f"at layer {expected} and end at or after it (stages must tile "
                             f"layers 0..{num_layers - 1} in order)")
        if isinstance(devs, (str, int)) or not devs:
            raise ValueError(f"stages: stage {s} needs a non-empty sequence of devices, "
                             f"got {devs!r}")
        names = []
        for d in devs:
            if _is_int(d):
                if not 0 <= d < len(devices):
                    raise ValueError(f"stages: stage {s} device id {d} is out of range for "
                                     f"devices of length {len(devices)}")
                d = devices[int(d)]
            elif not isinstance(d, str):
                raise ValueError(f"stages: stage {s} has a device {d!r} that is neither an "
                                 "int nor a str")
            key = device_key(d)
            if key in used and not allow_device_reuse:
                raise ValueError(f"stages: device {d!r} is reused (stage {used[key]} and stage "
                                 f"{s}); give every replica its own device")
            used.setdefault(key, s)
            names.append(d)
        result.append(StageSpec(int(first), int(last), tuple(names)))
        expected = int(last) + 1
    if expected != num_layers:
        raise ValueError(f"stages cover layers 0..{expected - 1} but the model has "
                         f"{num_layers} layers")
    return result


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


class StageReplica:
    """One device's copy of a stage: the shared layer objects, its own variables.

    Attributes:
        device: The device name.
        layers: The stage's layers (the original model's objects).
        trainable: Copies of the layers' trainable variables, layer by layer, on ``device``.
        non_trainable: Copies of the layers' non-trainable variables, on ``device``.
    """

    def __init__(self, layers: Sequence[keras.layers.Layer], device: str) -> None:
        self.device = device
        self.layers = list(layers)
        self._refs_t = [v for layer in self.layers for v in layer.trainable_variables]
        self._refs_nt = [v for layer in self.layers for v in layer.non_trainable_variables]
        self._training = ["training" in inspect.signature(layer.call).parameters
                          for layer in self.layers]
        with tf.device(device):
            self.trainable = [self._copy(v, True) for v in self._refs_t]
            self.non_trainable = [self._copy(v, False) for v in self._refs_nt]

    @staticmethod
    def _copy(ref: keras.Variable, trainable: bool) -> keras.Variable:
        # from a numpy copy: a keras.Variable built from a tf.Variable would alias it
        return keras.Variable(ref.numpy(), trainable=trainable, dtype=ref.dtype, name=ref.name)

    @property
    def trainable_refs(self) -> list[keras.Variable]:
        """The original model's trainable variables that :attr:`trainable` copy."""
        return list(self._refs_t)

    @property
    def non_trainable_refs(self) -> list[keras.Variable]:
        """The original model's non-trainable variables that :attr:`non_trainable` copy."""
        return list(self._refs_nt)

    def forward(self, x: tf.Tensor, non_trainable: Sequence[Any]) -> tuple[tf.Tensor, list]:
        """Runs the stage's layers in training mode on this replica's variables.

        Args:
            x: Stage input [b, ...] (on or copied to :attr:`device` by the caller's scope).
            non_trainable: Current values of the non-trainable state (variables or tensors).

        Returns:
            ``(y, new_non_trainable)``: the stage output [b, ...] and the updated state values.
        """
        mapping = list(zip(self._refs_t, self.trainable)) + \
            list(zip(self._refs_nt, non_trainable))
        with keras.StatelessScope(mapping) as scope:
            for layer, training in zip(self.layers, self._training):
                x = layer(x, training=True) if training else layer(x)
        return x, [scope.get_current_value(v) for v in self._refs_nt]

    def assign_from(self, trainable: Sequence[Any], non_trainable: Sequence[Any]) -> None:
        """Assigns values (e.g. another replica's) to this replica's variables."""
        for var, value in zip(self.trainable, trainable):
            var.assign(value)
        for var, value in zip(self.non_trainable, non_trainable):
            var.assign(value)
