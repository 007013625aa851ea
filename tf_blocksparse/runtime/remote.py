"""One training step across worker processes, on TensorFlow's own distributed runtime.

Every worker process runs a ``tf.distribute.Server`` (:func:`serve`); one *client* process
connects to them (:func:`connect`) and builds the trainers with the devices it gets back,
``/job:worker/replica:0/task:<i>/device:CPU:0``.  Variables created under such a device live
in task ``i``; a ``tf.function`` whose ops carry those device scopes is partitioned by TF and
runs on every task at once, TF moving the tensors between tasks over gRPC.  So
:class:`~tf_blocksparse.pipeline.trainer.PipelineTrainer` and
:class:`~tf_blocksparse.hybrid.trainer.HybridTrainer` span processes (or machines)
unchanged: pass them these device names.

The cluster is a ``{"worker": ["host:port", ...], "chief": ["host:port"]}`` mapping (the
``chief`` entry is the client's own address, which the workers must be able to reach).  A
launcher hands it to the processes it starts through the :data:`CLUSTER_ENV` environment
variable (JSON, plus the task index for workers)::

    # on each worker machine i
    python -c "from tf_blocksparse.runtime import remote; remote.serve(SPEC, i).join()"
    # on the client
    devices = remote.connect(SPEC)
    trainer = tfbs.PipelineTrainer(model, stages, loss, opt, micro_batches=4, devices=devices)
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["CLUSTER_ENV", "TASK_ENV", "check_cluster", "cluster_from_env", "connect", "serve",
           "worker_device"]

#: Environment variable holding the cluster as JSON.
CLUSTER_ENV = "TFBS_CLUSTER"
#: Environment variable holding a worker's task index.
TASK_ENV = "TFBS_TASK"


def check_cluster(cluster: Mapping[str, Sequence[str]]) -> dict[str, list[str]]:
    """Validates a cluster mapping and returns it as plain lists.

    Raises:
        ValueError: ``cluster`` lacks a non-empty ``worker`` job or one ``chief`` address, or
            an address is not ``host:port``.
    """
    if not isinstance(cluster, Mapping):
        raise ValueError(f"cluster must be a mapping of job name to addresses, got {cluster!r}")
    out = {}
    for job in ("worker", "chief"):
        addrs = cluster.get(job)
        if isinstance(addrs, str) or not addrs:
            raise ValueError(f"cluster[{job!r}] must be a non-empty list of 'host:port' "
                             f"addresses, got {addrs!r}")
        for a in addrs:
            host, sep, port = str(a).rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"cluster[{job!r}]: address {a!r} is not 'host:port'")
        out[job] = [str(a) for a in addrs]
    if len(out["chief"]) != 1:
        raise ValueError(f"cluster['chief'] must hold exactly one address (the client), got "
                         f"{out['chief']}")
    extra = sorted(set(cluster) - {"worker", "chief"})
    if extra:
        raise ValueError(f"cluster: unknown jobs {extra}; only 'worker' and 'chief' are used")
    return out


def cluster_from_env() -> dict[str, list[str]] | None:
    """The cluster in :data:`CLUSTER_ENV`, or ``None`` when the variable is not set."""
    text = os.environ.get(CLUSTER_ENV)
    if not text:
        return None
    try:
        return check_cluster(json.loads(text))
    except json.JSONDecodeError as e:
        raise ValueError(f"{CLUSTER_ENV} is not valid JSON: {e}") from None


def worker_device(task: int, job: str = "worker") -> str:
    """The CPU device name of worker ``task``."""
    return f"/job:{job}/replica:0/task:{int(task)}/device:CPU:0"


def serve(cluster: Mapping[str, Sequence[str]], task_index: int) -> Any:
    """Starts worker ``task_index``'s server (returns the ``tf.distribute.Server``; call
    ``join()`` to serve until killed).

    Raises:
        ValueError: Bad ``cluster`` or ``task_index``.
    """
    import tensorflow as tf

    from tf_blocksparse import kernels

    # A client places the fused ops on the workers' CPUs: register their kernels here too.
    kernels.register()
    spec = check_cluster(cluster)
    if isinstance(task_index, bool) or not isinstance(task_index, int) \
            or not 0 <= task_index < len(spec["worker"]):
        raise ValueError(f"task_index must be in [0, {len(spec['worker'])}), got {task_index!r}")
    return tf.distribute.Server(tf.train.ClusterSpec(spec), job_name="worker",
                                task_index=task_index, protocol="grpc", start=True)


def connect(cluster: Mapping[str, Sequence[str]]) -> list[str]:
    """Connects this (client) process to the workers; returns their device names.

    The client's own server takes the ``chief`` address; ops without a device scope stay on
    the client (``make_master_device_default=False``).

    Returns:
        ``worker_device(i)`` for every worker, in task order.

    Raises:
        ValueError: Bad ``cluster``.
    """
    import tensorflow as tf

    spec = check_cluster(cluster)
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(spec), task_type="chief", task_id=0, rpc_layer="grpc")
    tf.config.experimental_connect_to_cluster(resolver, job_name="chief", task_index=0,
                                              make_master_device_default=False)
    return [worker_device(i) for i in range(len(spec["worker"]))]


#: First word of the line a worker prints once its server listens.
READY = "TFBS_WORKER_READY"


def main() -> None:
    """Worker process: serve task :data:`TASK_ENV` of the cluster in :data:`CLUSTER_ENV`.

    Prints ``TFBS_WORKER_READY task=<i> pid=<pid>`` once the server listens, then serves
    until killed.
    """
    cluster = cluster_from_env()
    task = os.environ.get(TASK_ENV, "")
    if cluster is None or not task.isdigit():
        raise SystemExit(f"{CLUSTER_ENV} and {TASK_ENV} must be set (a launcher sets them)")
    server = serve(cluster, int(task))
    print(f"{READY} task={task} pid={os.getpid()}", flush=True)
    server.join()


if __name__ == "__main__":
    main()
