"""Command line of the shaped local network: measure a link, or clean up.

    python -m launch.netem --bandwidth_mbit=100 [--latency_ms=5] [--num_workers=2]
    python -m launch.netem --cleanup          # remove the leftovers of killed runs

Sets up a :class:`~launch.cluster.netem.NetworkCluster` (Linux, root only), prints the
measured throughput and round trip from worker 0 to worker 1 as JSON and tears it down.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence

from absl import app, flags

from launch import script
from launch.cluster.netem import NetemUnavailableError, NetworkCluster, cleanup_stale
from launch.cluster.probe import measure_link, measure_rtt


def define_flags() -> None:
    """Flags of the stand-alone measurement / clean-up tool."""
    flags.DEFINE_integer("num_workers", 2, "Worker namespaces to create (>= 2 to measure).")
    flags.DEFINE_float("bandwidth_mbit", None, "Link rate per worker and direction (Mbit/s).")
    flags.DEFINE_float("latency_ms", 0.0, "One-way delay per packet (ms); needs netem.")
    flags.DEFINE_float("seconds", 2.0, "Throughput measurement window (s).")
    flags.DEFINE_bool("cleanup", False, "Only remove namespaces left by killed runs.")


def main(argv: Sequence[str]) -> int:
    """Sets up a cluster, prints throughput and RTT from worker 0 to 1 as JSON, tears down."""
    del argv
    fl = flags.FLAGS
    try:
        if fl.cleanup:
            print(json.dumps({"removed": cleanup_stale()}))
            return 0
        if fl.num_workers < 2:
            raise app.UsageError("--num_workers must be >= 2 to measure a link", exitcode=2)
        with NetworkCluster(fl.num_workers, fl.bandwidth_mbit, fl.latency_ms) as net:
            t0 = time.monotonic()
            mbit = measure_link(net, 0, 1, seconds=fl.seconds)
            rtt = measure_rtt(net, 0, 1)
            print(json.dumps({
                "bandwidth_mbit": fl.bandwidth_mbit, "latency_ms": fl.latency_ms,
                "measured_mbit": round(mbit, 2), "rtt_ms": round(rtt, 3),
                "addresses": [net.worker_address(i) for i in range(fl.num_workers)],
                "seconds": round(time.monotonic() - t0, 2)}))
        return 0
    except NetemUnavailableError as e:
        print(f"netem: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    script.run(main, define_flags)
