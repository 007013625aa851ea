"""Test set-up: two logical CPU devices so MirroredStrategy has two real replicas."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

_cpus = tf.config.list_physical_devices("CPU")
try:
    tf.config.set_logical_device_configuration(
        _cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)
except RuntimeError:  # already initialised by an earlier import
    pass

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def mirrored2() -> tf.distribute.MirroredStrategy:
    """One MirroredStrategy over the two logical CPUs for the whole session.

    TF gives every MirroredStrategy instance the same collective keys, so two instances
    in one process that both run collectives (``all_gather``) clash; tests share one.
    """
    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])

