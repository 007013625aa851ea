"""Stages of a pipeline plan, checked against the model and resolved to device names.

A pipeline stage is a contiguous slice ``[first_layer, last_layer]`` of a chain model's layers
(see :func:`tf_blocksparse.pipeline.profiler.chain_layers`) run data-parallel on one or more
devices, each holding a :class:`~tf_blocksparse.runtime.replica.Replica` of the stage.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence
from typing import Any

from tf_blocksparse.runtime.devices import device_key

__all__ = ["StageSpec", "normalize_stages"]


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
