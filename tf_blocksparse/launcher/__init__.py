"""Local multi-worker launcher: N processes of a ``tf.distribute`` job on this machine.

:func:`run_local_cluster` starts N copies of a command, each with its own ``TF_CONFIG``
(loopback cluster, its task index) in its own process group; it streams their output
prefixed ``[worker i] ``, stops them all as soon as one fails, and cleans up on every exit
path.  The command line is ``tfbs-run`` (:mod:`tf_blocksparse.launcher.cli`, also
``python -m tf_blocksparse.launcher``).  Standard library only: no TensorFlow is imported.

- :mod:`~tf_blocksparse.launcher.cluster`: the cluster spec, ports, worker environments and
  :func:`run_local_cluster`;
- :mod:`~tf_blocksparse.launcher.processes`: one worker process, its output stream and the
  teardown of a set of them.
"""

from __future__ import annotations

from tf_blocksparse.launcher.cluster import (
    INTERRUPTED_EXIT_CODE,
    START_FAILED_EXIT_CODE,
    TIMEOUT_EXIT_CODE,
    make_cluster,
    make_tf_config,
    pick_ports,
    run_local_cluster,
    worker_env,
)

__all__ = ["INTERRUPTED_EXIT_CODE", "START_FAILED_EXIT_CODE", "TIMEOUT_EXIT_CODE",
           "make_cluster", "make_tf_config", "pick_ports", "run_local_cluster", "worker_env"]
