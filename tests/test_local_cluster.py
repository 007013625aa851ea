"""Tests of the local multi-worker launcher (``launch/cluster/local.py`` and its command line).

The worker commands are tiny ``python -c`` scripts (no TensorFlow), so the whole file runs in
a few seconds.  Workers write their pid to a file so that the tests can check that no worker
process survives the launcher.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from launch.cluster.local import make_tf_config, pick_ports, run_local_cluster

ROOT = Path(__file__).resolve().parent.parent
LAUNCHER = ["-m", "launch.local_cluster"]

# Common prologue of the worker scripts: index, and the pid written atomically to a file.
_PROLOGUE = """
import os, signal, subprocess, sys, time
i = int(os.environ["TF_BLOCKSPARSE_WORKER_INDEX"])
def write_pid(name, pid):
    tmp = os.path.join(PID_DIR, name + ".tmp")
    with open(tmp, "w") as f:
        f.write(str(pid))
    os.replace(tmp, os.path.join(PID_DIR, name))
"""


def _worker(pid_dir: Path, body: str) -> list[str]:
    """A ``python -c`` worker command running ``_PROLOGUE`` + ``body``."""
    code = f"PID_DIR = {str(pid_dir)!r}\n" + _PROLOGUE + textwrap.dedent(body)
    return [sys.executable, "-c", code]


def _wait_for_files(paths: list[Path], timeout_s: float = 15.0) -> list[int]:
    """Waits until every pid file exists and returns the pids."""
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"pid files not written: {paths}"
        time.sleep(0.02)
    return [int(p.read_text()) for p in paths]


def _assert_gone(pid: int) -> None:
    """The launcher reaps its direct children, so ``os.kill(pid, 0)`` must fail."""
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def _gone_eventually(pid: int, timeout_s: float = 5.0) -> bool:
    """For grandchildren (reaped by init, not by us): absent or a zombie within timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return True
        if state in ("Z", "X"):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def test_make_tf_config_and_ports():
    cfg = json.loads(make_tf_config([1234, 5678], 1))
    assert cfg == {"cluster": {"worker": ["localhost:1234", "localhost:5678"]},
                   "task": {"type": "worker", "index": 1}}
    with pytest.raises(ValueError, match="index"):
        make_tf_config([1234], 1)
    assert pick_ports(3, base_port=20000) == [20000, 20001, 20002]
    ports = pick_ports(3)
    assert len(set(ports)) == 3 and all(0 < p < 65536 for p in ports)


def test_two_workers_get_distinct_tf_configs_and_logs(tmp_path):
    body = """
    print("TF_CONFIG=" + os.environ["TF_CONFIG"])
    print("N=" + os.environ["TF_BLOCKSPARSE_NUM_WORKERS"], "CUDA=" +
          repr(os.environ["CUDA_VISIBLE_DEVICES"]), "EXTRA=" + os.environ["EXTRA"])
    print("to stderr", i, file=sys.stderr)
    """
    out = io.StringIO()
    logs = tmp_path / "logs"
    rc = run_local_cluster(_worker(tmp_path, body), num_workers=2, log_dir=logs,
                           env={"EXTRA": "x"}, stream=out, timeout_s=30)
    text = out.getvalue()
    assert rc == 0, text

    configs = {}
    for line in text.splitlines():
        m = re.fullmatch(r"\[worker (\d)\] TF_CONFIG=(.*)", line)
        if m:
            configs[int(m.group(1))] = json.loads(m.group(2))
    assert sorted(configs) == [0, 1], text
    assert [c["task"] for c in (configs[0], configs[1])] == [
        {"type": "worker", "index": 0}, {"type": "worker", "index": 1}]
    cluster = configs[0]["cluster"]
    assert cluster == configs[1]["cluster"]
    hosts = cluster["worker"]
    assert len(hosts) == 2 and len(set(hosts)) == 2
    assert all(re.fullmatch(r"localhost:\d+", h) for h in hosts)
    for i in range(2):
        assert f"[worker {i}] N=2 CUDA='' EXTRA=x" in text
        assert f"[worker {i}] to stderr {i}" in text
    # Every worker line carries a prefix; only launcher lines are unprefixed by a worker tag.
    assert all(re.match(r"\[(worker \d|launcher)\] ", line) for line in text.splitlines())

    for i in range(2):
        log = (logs / f"worker_{i}.log").read_text().splitlines()
        assert json.loads(log[0].removeprefix("TF_CONFIG="))["task"]["index"] == i
        assert f"to stderr {i}" in log
        assert not any(line.startswith("[worker") for line in log)


def test_failing_worker_tears_down_the_others(tmp_path):
    body = """
    if i == 0:
        write_pid("pid_0", os.getpid())
        time.sleep(60)
    else:
        while not os.path.exists(os.path.join(PID_DIR, "pid_0")):
            time.sleep(0.01)
        for k in range(40):
            print("fail line", k, file=sys.stderr if k % 2 else sys.stdout)
        sys.exit(3)
    """
    out = io.StringIO()
    rc = run_local_cluster(_worker(tmp_path, body), num_workers=2, stream=out,
                           grace_s=5.0, timeout_s=30)
    text = out.getvalue()
    assert rc == 3, text  # not 124: the launcher did not wait for the 60 s sleeper
    head, _, tail = text.partition("worker 1 failed with exit code 3; last lines:")
    assert tail, text
    shown = [line.strip() for line in tail.splitlines() if line.strip()]
    assert shown == [f"fail line {k}" for k in range(10, 40)]
    _assert_gone(int((tmp_path / "pid_0").read_text()))


def test_failure_of_worker_killed_by_signal(tmp_path):
    body = """
    print("about to die")
    if i == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    """
    out = io.StringIO()
    rc = run_local_cluster(_worker(tmp_path, body), num_workers=2, stream=out, timeout_s=30)
    assert rc == 128 + signal.SIGKILL, out.getvalue()
    assert "worker 1 failed with exit code -9 (SIGKILL); last lines:" in out.getvalue()


def test_timeout_returns_124_and_kills_workers(tmp_path):
    body = """
    write_pid(f"pid_{i}", os.getpid())
    time.sleep(60)
    """
    out = io.StringIO()
    rc = run_local_cluster(_worker(tmp_path, body), num_workers=2, stream=out,
                           grace_s=5.0, timeout_s=2.0)
    assert rc == 124, out.getvalue()
    assert "timed out" in out.getvalue()
    for pid in _wait_for_files([tmp_path / "pid_0", tmp_path / "pid_1"], timeout_s=0.1):
        _assert_gone(pid)


def test_sigterm_ignoring_worker_and_grandchildren_are_killed(tmp_path):
    body = """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    write_pid(f"child_{i}", child.pid)
    write_pid(f"pid_{i}", os.getpid())
    time.sleep(60)
    """
    out = io.StringIO()
    rc = run_local_cluster(_worker(tmp_path, body), num_workers=2, stream=out,
                           grace_s=0.5, timeout_s=3.0)
    assert rc == 124, out.getvalue()
    for i in range(2):
        pid, child = _wait_for_files([tmp_path / f"pid_{i}", tmp_path / f"child_{i}"], 0.1)
        _assert_gone(pid)
        assert _gone_eventually(child), f"grandchild {child} of worker {i} survived"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_to_launcher_kills_workers_and_exits_130(tmp_path, sig):
    body = """
    write_pid(f"pid_{i}", os.getpid())
    print("ready", flush=True)
    time.sleep(60)
    """
    launcher = subprocess.Popen(
        [sys.executable, *LAUNCHER, "--num_workers=2", "--grace_s=5", "--",
         *_worker(tmp_path, body)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        pids = _wait_for_files([tmp_path / "pid_0", tmp_path / "pid_1"])
        time.sleep(0.2)  # let the launcher get into its wait loop
        launcher.send_signal(sig)
        output, _ = launcher.communicate(timeout=15)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 130, output
    assert "[worker 0] ready" in output and "[worker 1] ready" in output
    assert "interrupted" in output
    for pid in pids:
        _assert_gone(pid)


def test_cli_success_passes_command_untouched(tmp_path):
    # Flags after "--" belong to the worker, not to the launcher.
    code = "import sys; print('ARGS', sys.argv[1:])"
    proc = subprocess.run(
        [sys.executable, *LAUNCHER, "--num_workers=1", f"--log_dir={tmp_path}", "--",
         sys.executable, "-c", code, "--num_workers=7", "--", "x"],
        cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[worker 0] ARGS ['--num_workers=7', '--', 'x']" in proc.stdout
    assert (tmp_path / "worker_0.log").read_text() == "ARGS ['--num_workers=7', '--', 'x']\n"


def test_api_rejects_bad_arguments():
    with pytest.raises(ValueError, match="num_workers"):
        run_local_cluster(["true"], num_workers=0)
    with pytest.raises(ValueError, match="command"):
        run_local_cluster([], num_workers=2)
    with pytest.raises(ValueError, match="command"):
        run_local_cluster("python -c 1", num_workers=2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout_s"):
        run_local_cluster(["true"], num_workers=1, timeout_s=0)


def test_api_reports_unstartable_command():
    out = io.StringIO()
    rc = run_local_cluster(["/nonexistent/definitely-not-a-command"], num_workers=2, stream=out)
    assert rc == 127
    assert "failed to start worker 0" in out.getvalue()


@pytest.mark.parametrize(
    ("args", "name"),
    [(["--num_workers=0", "--", "true"], "--num_workers"), (["--num_workers=2"], "command")],
)
def test_cli_rejects_bad_arguments(args, name):
    proc = subprocess.run([sys.executable, *LAUNCHER, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert name in proc.stderr + proc.stdout
