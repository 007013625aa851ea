"""Run N copies of a command as a local multi-worker ``tf.distribute`` cluster.

Each worker gets its own ``TF_CONFIG`` (same loopback cluster, its own task index), its own
process group, and ``CUDA_VISIBLE_DEVICES=""`` unless ``--keep_gpus``.  Every worker's output
is streamed line by line to the launcher's stdout prefixed with ``[worker i] `` (and, with
``--log_dir``, written to ``DIR/worker_i.log``).  If any worker fails, the others are torn
down at once and the launcher exits with the failing worker's code; Ctrl-C (or SIGTERM)
tears everything down and exits 130.

With ``--bandwidth_mbit`` and/or ``--latency_ms`` (Linux, root only) every worker runs in its
own network namespace on a ``tc``-shaped bridge (:mod:`launch.cluster.netem`): the cluster
spec holds the workers' namespace addresses, each command is wrapped in ``ip netns exec``,
and the namespaces and links are removed when the launcher ends, whatever the reason.  Without root
the launcher says so and exits 1 before starting anything.

    python -m launch.local_cluster --num_workers=2 [--base_port=0] [--log_dir=DIR]
        [--grace_s=10] [--timeout_s=0] [--keep_gpus] [--bandwidth_mbit=100]
        [--latency_ms=0] -- python -m launch.train --strategy=multiworker ...

(one command line; ``--num_workers`` defaults to 2, ``--timeout_s=0`` means no timeout).

Everything after ``--`` is the worker command, passed through untouched.  The library
behind it is :mod:`launch.cluster.local` (``run_local_cluster``), over the package's own
launcher :mod:`tf_blocksparse.launcher`: without the network flags this command does what
the installed ``tfbs-run`` does.
"""


from __future__ import annotations

import signal
import sys
from collections.abc import Sequence

from absl import app, flags

from launch import script
from launch.cluster.local import (
    INTERRUPTED_EXIT_CODE,
    make_cluster,
    make_tf_config,
    pick_ports,
    run_local_cluster,
    worker_env,
)
from launch.cluster.netem import NetemError

__all__ = ["make_cluster", "make_tf_config", "pick_ports", "run_local_cluster", "worker_env"]


def define_flags() -> None:
    """Defines the launcher's command-line flags.

    ``--log_dir`` is not defined here: ``absl.logging`` (imported by ``absl.app``) already
    defines it (default ``""``), and the launcher reuses it as "also write each worker's
    output to ``DIR/worker_i.log``".  The launcher itself never logs to files through absl.
    """
    flags.DEFINE_integer("num_workers", 2, "Number of workers to start (>= 1).")
    flags.DEFINE_integer("base_port", 0,
                         "0: free ports picked by the system; else first of N consecutive ports.")
    flags.DEFINE_float("grace_s", 10.0, "Seconds between SIGTERM and SIGKILL on teardown.")
    flags.DEFINE_float("timeout_s", 0.0, "If > 0, kill everything after this long (exit 124).")
    flags.DEFINE_bool("keep_gpus", False, "Do not set CUDA_VISIBLE_DEVICES=\"\" for workers.")
    flags.DEFINE_float("bandwidth_mbit", None,
                       "Root only: each worker in its own network namespace on a bridge, its "
                       "link shaped to this many Mbit/s per direction (tc HTB).")
    flags.DEFINE_float("latency_ms", None,
                       "Root only: one-way delay per packet in ms (tc netem; the namespaces as "
                       "for --bandwidth_mbit, which may be left unset).")
    flags.declare_key_flag("log_dir")  # absl's own flag, listed with the launcher's


def _raise_interrupt(signum: int, frame: object) -> None:
    """SIGTERM handler: unwind like Ctrl-C so that the workers get torn down."""
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str]) -> int:
    """absl entry point; ``argv[1:]`` is the worker command (everything after ``--``)."""
    fl = flags.FLAGS
    command = list(argv[1:])
    if fl.num_workers < 1:
        raise app.UsageError(f"--num_workers must be >= 1, got {fl.num_workers}", exitcode=2)
    if not command:
        raise app.UsageError(
            "a worker command is required after '--' (e.g. -- python train.py)", exitcode=2)
    if fl.grace_s < 0:
        raise app.UsageError(f"--grace_s must be >= 0, got {fl.grace_s}", exitcode=2)
    if fl.timeout_s < 0:
        raise app.UsageError(f"--timeout_s must be >= 0, got {fl.timeout_s}", exitcode=2)
    if fl.bandwidth_mbit is not None and not fl.bandwidth_mbit > 0:
        raise app.UsageError(f"--bandwidth_mbit must be > 0, got {fl.bandwidth_mbit}",
                             exitcode=2)
    if fl.latency_ms is not None and not fl.latency_ms >= 0:
        raise app.UsageError(f"--latency_ms must be >= 0, got {fl.latency_ms}", exitcode=2)
    if fl.base_port and not 1 <= fl.base_port <= 65536 - fl.num_workers:
        raise app.UsageError(f"--base_port={fl.base_port} with --num_workers="
                             f"{fl.num_workers} leaves the port range", exitcode=2)

    # Explicit handlers: SIGINT may be inherited as ignored (background jobs), SIGTERM
    # would otherwise kill the launcher without tearing down the workers.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        return run_local_cluster(
            command,
            num_workers=fl.num_workers,
            log_dir=fl.log_dir or None,
            grace_s=fl.grace_s,
            stream=sys.stdout,
            timeout_s=fl.timeout_s if fl.timeout_s > 0 else None,
            base_port=fl.base_port,
            keep_gpus=fl.keep_gpus,
            bandwidth_mbit=fl.bandwidth_mbit,
            latency_ms=fl.latency_ms,
        )
    except NetemError as e:
        print(f"[launcher] shaped network unavailable or failed: {e}", file=sys.stderr,
              flush=True)
        return 1
    except KeyboardInterrupt:
        print("[launcher] interrupted; all workers terminated", flush=True)
        return INTERRUPTED_EXIT_CODE


if __name__ == "__main__":
    script.run(main, define_flags)
