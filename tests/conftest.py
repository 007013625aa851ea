"""Test set-up: two logical CPU devices so MirroredStrategy has two real replicas, and one
2-process MultiWorkerMirroredStrategy launch that the cluster tests share."""

from __future__ import annotations

import fcntl
import os
import sys
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import tensorflow as tf

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def pytest_configure(config: pytest.Config) -> None:
    """Two logical CPU devices in every process that runs tests, set before any test module
    imports TensorFlow's devices.  A pytest-xdist controller runs no test and skips
    TensorFlow's import (about 5 CPU-seconds)."""
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return
    import tensorflow as tf

    cpus = tf.config.list_physical_devices("CPU")
    try:
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)
    except RuntimeError:  # already initialised by an earlier import
        pass


@pytest.fixture(scope="session")
def mirrored2() -> tf.distribute.MirroredStrategy:
    """One MirroredStrategy over the two logical CPUs for the whole session.

    TF gives every MirroredStrategy instance the same collective keys, so two instances
    in one process that both run collectives (``all_gather``) clash; tests share one.
    """
    import tensorflow as tf

    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


#: The scenarios of ``tests/mwms_worker.py`` that ``mwms_runs`` runs, in this order (the
#: mixed-precision one last: it sets a global policy, restored after it).
MWMS_SCENARIOS = ("allgather:0", "shared:100", "auto", "dtypes", "accumulation",
                  "evaluation", "batch_count", "mixed_precision")


@pytest.fixture(scope="session")
def mwms_runs(tmp_path_factory, request):
    """The output folder of one 2-worker launch of ``tests/mwms_worker.py`` that ran every
    scenario of :data:`MWMS_SCENARIOS` (a subfolder each).

    Starting TensorFlow and the cluster is most of a scenario's time, so the tests of
    several files share the launch: the first test process of the session to ask runs it
    (its output goes to that test's log), the others wait for it under a file lock.
    """
    from launch.local_cluster import run_local_cluster

    base = tmp_path_factory.getbasetemp()
    if hasattr(request.config, "workerinput"):  # pytest-xdist: the session's shared folder
        base = base.parent
    out = base / "mwms_runs"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(base / "mwms_runs.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "rc").exists():
            out.mkdir(exist_ok=True)
            cmd = [sys.executable, os.path.join(root, "tests", "mwms_worker.py"), str(out),
                   *MWMS_SCENARIOS]
            rc = run_local_cluster(cmd, 2, env={"PYTHONPATH": root}, timeout_s=600)
            (out / "rc").write_text(str(rc))
    rc = int((out / "rc").read_text())
    assert rc == 0, f"the 2-worker cluster exited with {rc} (worker logs in the log of " \
                    "the test that ran it; 124: it hung)"
    return out
