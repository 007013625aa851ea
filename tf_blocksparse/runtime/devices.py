"""Device names of the step-based trainers: the default device list and device identity."""

from __future__ import annotations

import tensorflow as tf

__all__ = ["default_devices", "device_key"]


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
