"""What the launch scripts share at run time: a distribution strategy, logical CPU devices,
timers, machine facts.

TensorFlow is imported only inside the functions that need it.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable, Mapping
from typing import Any

from tf_blocksparse import timing


def logical_cpus(count: int, skip_on_gpu: bool = False) -> None:
    """Splits the physical CPU into ``count`` logical devices ``/cpu:0 .. /cpu:count-1``.

    Call it before TensorFlow initialises its devices.  Calling it again (or after the
    devices were made with at least ``count`` logical CPUs) does nothing.

    Args:
        count: Logical CPUs wanted, >= 1.
        skip_on_gpu: Do nothing on a machine with GPUs (the scripts then use the GPUs).

    Raises:
        ValueError: ``count`` < 1.
        RuntimeError: TensorFlow is already initialised with fewer logical CPUs.
    """
    if not isinstance(count, int) or count < 1:
        raise ValueError(f"`count` must be an int >= 1, got {count!r}")
    import tensorflow as tf

    if skip_on_gpu and tf.config.list_physical_devices("GPU"):
        return
    cpu = tf.config.list_physical_devices("CPU")[0]
    if len(tf.config.get_logical_device_configuration(cpu) or []) >= count:
        return
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * count)
    except RuntimeError as err:  # TF is initialised already
        if len(tf.config.list_logical_devices("CPU")) < count:
            raise RuntimeError(f"need {count} logical CPUs; configure them before TensorFlow "
                               "initialises its devices") from err


def make_strategy(name: str, num_devices: int = 2, heartbeat_timeout_s: float | None = None
                  ) -> Any:
    """The ``tf.distribute`` strategy of ``launch.train --strategy``.

    Args:
        name: ``"multiworker"``: the library's ``MultiWorkerMirroredStrategy`` over the
            cluster of ``TF_CONFIG`` (or, without it, SLURM's environment);
            ``"mirrored"``: ``MirroredStrategy`` over ``num_devices`` local GPUs, or as many
            logical CPUs on a machine without GPUs; anything else: the default strategy.
        num_devices: Local devices of ``"mirrored"``.
        heartbeat_timeout_s: ``"multiworker"``'s coordination heartbeat timeout (``None``:
            TensorFlow's default).

    Raises:
        app.UsageError: ``"mirrored"`` asks for more GPUs than the machine has.
    """
    import tensorflow as tf

    import tf_blocksparse as tfbs

    if name == "multiworker":
        resolver = None
        if "TF_CONFIG" not in os.environ and "SLURM_JOB_ID" in os.environ:
            resolver = tf.distribute.cluster_resolver.SlurmClusterResolver()
        return tfbs.MultiWorkerMirroredStrategy(cluster_resolver=resolver,
                                                heartbeat_timeout_s=heartbeat_timeout_s)
    if name == "mirrored":
        gpus = tf.config.list_physical_devices("GPU")
        if gpus and num_devices > len(gpus):
            from absl import app

            raise app.UsageError(f"--num_devices={num_devices}: this machine has only "
                                 f"{len(gpus)} GPUs")
        if gpus:
            return tf.distribute.MirroredStrategy([f"/gpu:{i}" for i in range(num_devices)])
        logical_cpus(num_devices)
        return tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(num_devices)])
    return tf.distribute.get_strategy()


def fetch(out: Any) -> Any:
    """Waits for a result: ``.numpy()`` of every tensor in a (nested) list, tuple or dict."""
    if isinstance(out, list):
        return [fetch(o) for o in out]
    if isinstance(out, tuple):
        return tuple(fetch(o) for o in out)
    if isinstance(out, dict):
        return {k: fetch(v) for k, v in out.items()}
    return out.numpy() if hasattr(out, "numpy") else out


def time_call(fn: Callable[[], Any], sync: Callable[[], Any] | None = None) -> float:
    """Seconds of one call of ``fn``, its result fetched (:func:`fetch`) and ``sync()`` run."""
    start = time.perf_counter()
    fetch(fn())
    if sync is not None:
        sync()
    return time.perf_counter() - start


def median_seconds(fn: Callable[[], Any], repeats: int, warmup: int = 1,
                   sync: Callable[[], Any] | None = None) -> float:
    """Median of ``repeats`` timed calls after ``warmup`` untimed ones, each call's result
    fetched (:func:`fetch`): the library's timer (:func:`tf_blocksparse.timing.median_seconds`).

    Raises:
        ValueError: ``repeats`` < 1 or ``warmup`` < 0.
    """
    return timing.median_seconds(lambda: fetch(fn()), repeats, warmup, sync)


def interleaved_seconds(fns: Mapping[str, Callable[[], Any]], repeats: int, warmup: int = 0
                        ) -> dict[str, list[float]]:
    """Times several functions interleaved (A B C A B C ...), so drifts hit all alike.

    Returns:
        Per name the seconds of its ``repeats`` timed calls (the ``warmup`` rounds before
        them are not kept).
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need `repeats` >= 1 and `warmup` >= 0, got {repeats}, {warmup}")
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(warmup + repeats):
        for name, fn in fns.items():
            dt = time_call(fn)
            if r >= warmup:
                times[name].append(dt)
    return times


def replica_batch(strategy: Any, batch: int, image_size: int, classes: int
                  ) -> tuple[Any, Any]:
    """A fixed random batch per replica of ``strategy`` (a ``tf.distribute.Strategy``):
    images ``x`` [batch, image_size, image_size, 3] and labels ``y`` [batch] in
    ``[0, classes)``, each replica seeded by its replica id."""
    import numpy as np
    import tensorflow as tf

    def data(ctx: Any, labels: bool) -> Any:
        rng = np.random.default_rng(ctx.replica_id_in_sync_group)
        if labels:
            return tf.constant(rng.integers(0, classes, size=(batch,)), dtype=tf.int32)
        return tf.constant(rng.standard_normal((batch, image_size, image_size, 3),
                                               dtype=np.float32))

    x = strategy.experimental_distribute_values_from_function(lambda c: data(c, False))
    y = strategy.experimental_distribute_values_from_function(lambda c: data(c, True))
    return x, y


def machine_info() -> dict[str, Any]:
    """Platform, CPU count, TF / Keras versions, logical CPUs and the accelerator kind."""
    import keras
    import tensorflow as tf

    return {"platform": platform.platform(), "cpus": os.cpu_count(),
            "tensorflow": tf.__version__, "keras": keras.__version__,
            "logical_cpus": len(tf.config.list_logical_devices("CPU")),
            "device": "GPU" if tf.config.list_physical_devices("GPU") else "CPU"}


def provenance() -> dict[str, Any]:
    """What a results record needs to be reproduced: the repository's commit (with ``dirty``
    when the work tree differs from it; ``None`` outside a git checkout) and the versions of
    Python, TensorFlow, Keras and NumPy."""
    import subprocess
    import sys

    import keras
    import numpy as np
    import tensorflow as tf

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", root, *args], capture_output=True, text=True,
                                 timeout=10, check=True)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip()

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(status) if status is not None
            else None, "python": sys.version.split()[0], "tensorflow": tf.__version__,
            "keras": keras.__version__, "numpy": np.__version__}


def summed_step(strategy: Any, replica_fn: Any) -> Any:
    """A ``tf.function`` of ``(x, y)`` that runs ``replica_fn(x, y)`` on every replica of
    ``strategy`` and returns the sum of the replicas' results (e.g. their losses)."""
    import tensorflow as tf

    @tf.function
    def step(x: Any, y: Any) -> Any:
        per_replica = strategy.run(replica_fn, args=(x, y))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    return step
