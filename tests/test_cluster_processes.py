"""tf_blocksparse/launcher/processes.py and the working directory of run_local_cluster
(loopback only: tiny ``python -c`` workers, no TensorFlow, no namespaces)."""

from __future__ import annotations

import io
import os
import signal
import sys
import time

from launch.cluster.local import run_local_cluster
from tf_blocksparse.launcher import processes


def test_exit_descriptions_and_codes():
    assert processes.describe_exit(3) == "exit code 3"
    assert processes.describe_exit(-9) == "exit code -9 (SIGKILL)"
    assert processes.describe_exit(-200) == "exit code -200 (signal 200)"
    assert processes.launcher_exit_code(-int(signal.SIGTERM)) == 128 + int(signal.SIGTERM)
    assert processes.launcher_exit_code(17) == 17
    assert processes.launcher_exit_code(300) == 1


def test_worker_process_streams_watches_and_logs(tmp_path):
    out = io.StringIO()
    code = "print('hello'); print('READY 1', flush=True); import time; time.sleep(30)"
    w = processes.WorkerProcess(0, [sys.executable, "-c", code], dict(os.environ),
                                str(tmp_path / "w.log"), processes.Emitter(out),
                                label="server 0", watch="READY", cwd=tmp_path)
    try:
        assert w.seen.wait(30)
        assert w.poll() is None and w.group_alive()
    finally:
        processes.terminate([w], grace_s=5)
    w.join_reader(5)
    assert out.getvalue().splitlines()[:2] == ["[server 0] hello", "[server 0] READY 1"]
    assert list(w.tail)[:2] == ["hello", "READY 1"]
    assert w.poll() == -signal.SIGTERM and not w.group_alive()
    assert (tmp_path / "w.log").read_text().splitlines()[:2] == ["hello", "READY 1"]


def test_terminate_kills_what_ignores_sigterm():
    code = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('up', flush=True); time.sleep(60)")
    w = processes.WorkerProcess(0, [sys.executable, "-c", code], dict(os.environ), None,
                                lambda line: None, watch="up")
    assert w.seen.wait(30)
    start = time.monotonic()
    processes.terminate([w], grace_s=0.5)
    assert w.poll() == -signal.SIGKILL and time.monotonic() - start < 10


def test_run_local_cluster_starts_workers_in_cwd(tmp_path):
    out = io.StringIO()
    rc = run_local_cluster([sys.executable, "-c", "import os; print('cwd', os.getcwd())"], 2,
                           stream=out, cwd=tmp_path, timeout_s=60)
    assert rc == 0
    assert out.getvalue().count(f"cwd {tmp_path}") == 2
