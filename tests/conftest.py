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


#: The test files that take longest (multi-process clusters, many traced steps), heaviest
#: first, as measured with ``--junitxml`` on 2 cores.  They are collected first so that
#: ``pytest-xdist --dist loadfile`` hands them out before the light files (longest job first):
#: a heavy file left to the end would run alone on one worker while the other idles.
HEAVY_FIRST = ("test_train", "test_local_steps_cluster", "test_auto_exchange", "test_kernels",
               "test_dense_phase", "test_hybrid", "test_momentum_correction",
               "test_optimizer", "test_cross_device_ops", "test_optimizer_reference",
               "test_models", "test_cluster_scripts", "test_multiworker",
               "test_bench_clipping", "test_launch_scripts", "test_replica_state",
               "test_accumulation", "test_scaling", "test_tf_cluster", "test_warmup")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Orders the collected tests by :data:`HEAVY_FIRST` (the rest keep their order after)."""
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    order = {id(item): n for n, item in enumerate(items)}
    items.sort(key=lambda item: (rank.get(item.path.stem, len(rank)), order[id(item)]))
