"""``tfbs-run``: N local worker processes of a ``tf.distribute`` multi-worker job.

    tfbs-run --num_workers=2 [--log_dir=DIR] [--base_port=0] [--grace_s=10] \\
        [--timeout_s=0] [--keep_gpus] -- python train.py --epochs=3

Every worker runs the command after ``--`` (passed through untouched) with its own
``TF_CONFIG``, so a script using ``tfbs.MultiWorkerMirroredStrategy`` (or TF's own) runs as
a 2-worker cluster on this machine; its output comes back prefixed ``[worker i] ``.  If a
worker fails, the others are stopped at once and ``tfbs-run`` exits with that worker's code;
Ctrl-C (or SIGTERM) stops everything and exits 130.  Usage errors exit 2.  Installed with
the package (``pip install tf_blocksparse``); ``python -m tf_blocksparse.launcher`` is the
same command.  TensorFlow is not imported here: the launcher starts at once.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence

from tf_blocksparse.launcher.cluster import INTERRUPTED_EXIT_CODE, run_local_cluster


def _raise_interrupt(signum: int, frame: object) -> None:
    """SIGTERM handler: unwind like Ctrl-C so that the workers get torn down."""
    raise KeyboardInterrupt(f"signal {signum}")


def parser(prog: str = "tfbs-run") -> argparse.ArgumentParser:
    """The command line's parser (options only; the worker command follows ``--``)."""
    p = argparse.ArgumentParser(
        prog=prog, usage=f"{prog} [options] -- COMMAND [ARGS...]",
        description="Run N copies of COMMAND as a local multi-worker tf.distribute cluster: "
                    "each worker gets its own TF_CONFIG (loopback addresses, its task index) "
                    "and its output is streamed prefixed with [worker i].")
    p.add_argument("--num_workers", "--num-workers", "-n", type=int, default=2, metavar="N",
                   help="number of workers to start (>= 1; default 2)")
    p.add_argument("--log_dir", "--log-dir", default=None, metavar="DIR",
                   help="also write each worker's output to DIR/worker_i.log")
    p.add_argument("--base_port", "--base-port", type=int, default=0, metavar="PORT",
                   help="0: free ports picked by the system (default); else the first of N "
                        "consecutive ports")
    p.add_argument("--grace_s", "--grace-s", type=float, default=10.0, metavar="S",
                   help="seconds between SIGTERM and SIGKILL on teardown (default 10)")
    p.add_argument("--timeout_s", "--timeout-s", type=float, default=0.0, metavar="S",
                   help="if > 0, stop everything after this many seconds (exit 124)")
    p.add_argument("--keep_gpus", "--keep-gpus", action="store_true",
                   help='leave CUDA_VISIBLE_DEVICES as is (default: "" for every worker, '
                        "so that the workers share no GPU)")
    return p


def parse(argv: Sequence[str], prog: str = "tfbs-run") -> tuple[argparse.Namespace, list[str]]:
    """Splits ``argv`` (without the program name) at the first ``--`` into the launcher's
    options and the worker command, and checks both.

    Exits with status 2 (argparse's usage error) on a bad option or a missing command.
    """
    argv = list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    p = parser(prog)
    args = p.parse_args(argv[:split])
    command = argv[split + 1:]
    if not command:
        p.error("a worker command is required after '--' (e.g. -- python train.py)")
    if args.num_workers < 1:
        p.error(f"--num_workers must be >= 1, got {args.num_workers}")
    if args.grace_s < 0:
        p.error(f"--grace_s must be >= 0, got {args.grace_s}")
    if args.timeout_s < 0:
        p.error(f"--timeout_s must be >= 0, got {args.timeout_s}")
    if args.base_port and not 1 <= args.base_port <= 65536 - args.num_workers:
        p.error(f"--base_port={args.base_port} with --num_workers={args.num_workers} "
                "leaves the port range")
    return args, command


def main(argv: Sequence[str] | None = None, prog: str = "tfbs-run") -> int:
    """Runs the launcher; returns its exit status (the console script's entry point).

    Args:
        argv: The arguments after the program name; ``None``: ``sys.argv[1:]``.
        prog: The program name in usage and error messages.
    """
    args, command = parse(sys.argv[1:] if argv is None else argv, prog)
    # Explicit handlers: SIGINT may be inherited as ignored (background jobs), SIGTERM
    # would otherwise kill the launcher without tearing down the workers.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        return run_local_cluster(
            command, num_workers=args.num_workers, log_dir=args.log_dir,
            grace_s=args.grace_s, stream=sys.stdout,
            timeout_s=args.timeout_s if args.timeout_s > 0 else None,
            base_port=args.base_port, keep_gpus=args.keep_gpus)
    except KeyboardInterrupt:
        print("[launcher] interrupted; all workers terminated", flush=True)
        return INTERRUPTED_EXIT_CODE


if __name__ == "__main__":
    sys.exit(main())
