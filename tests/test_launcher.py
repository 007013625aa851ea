"""The package's launcher (``tf_blocksparse.launcher``, the ``tfbs-run`` console script).

One-worker runs of tiny ``python -c`` commands and usage errors: no TensorFlow, a few
seconds in all.  The multi-worker behaviour (tear-down, signals, timeouts) is tested through
``launch.cluster.local`` in ``tests/test_local_cluster.py``, which runs this launcher.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tf_blocksparse.launcher import cli

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
LAUNCHER = [sys.executable, "-m", "tf_blocksparse.launcher"]


def test_parse_splits_at_the_first_double_dash():
    args, command = cli.parse(["-n", "3", "--log-dir=/tmp/l", "--keep_gpus", "--",
                               "python", "train.py", "--num_workers=7", "--", "x"])
    assert (args.num_workers, args.log_dir, args.keep_gpus) == (3, "/tmp/l", True)
    assert command == ["python", "train.py", "--num_workers=7", "--", "x"]


@pytest.mark.parametrize(("argv", "named"), [
    (["--num_workers=2"], "worker command"),
    (["--num_workers=0", "--", "true"], "--num_workers"),
    (["--grace_s=-1", "--", "true"], "--grace_s"),
    (["--timeout_s=-1", "--", "true"], "--timeout_s"),
    (["--base_port=65535", "-n", "2", "--", "true"], "--base_port"),
    (["--nope", "--", "true"], "--nope"),
])
def test_usage_errors_exit_2_naming_the_option(argv, named, capsys):
    with pytest.raises(SystemExit) as stop:
        cli.parse(argv)
    assert stop.value.code == 2
    assert named in capsys.readouterr().err


def test_one_worker_gets_tf_config_and_its_arguments_untouched(tmp_path):
    code = ("import os, sys; print('CFG', os.environ['TF_CONFIG']); "
            "print('ARGS', sys.argv[1:]); print('CUDA', repr(os.environ['CUDA_VISIBLE_DEVICES']))")
    proc = subprocess.run([*LAUNCHER, "--num_workers=1", f"--log_dir={tmp_path}", "--",
                           sys.executable, "-c", code, "--num_workers=7", "--", "x"],
                          capture_output=True, text=True, env=ENV, cwd=tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("[launcher] starting 1 worker(s)")
    cfg = json.loads(next(ln for ln in lines if ln.startswith("[worker 0] CFG ")).split(" ", 3)[3])
    assert cfg["task"] == {"type": "worker", "index": 0} and len(cfg["cluster"]["worker"]) == 1
    assert "[worker 0] ARGS ['--num_workers=7', '--', 'x']" in lines
    assert "[worker 0] CUDA ''" in lines
    assert "ARGS ['--num_workers=7', '--', 'x']" in (tmp_path / "worker_0.log").read_text()


def test_a_failing_worker_sets_the_exit_status():
    code = "import sys; print('going down'); sys.exit(3)"
    proc = subprocess.run([*LAUNCHER, "-n", "1", "--", sys.executable, "-c", code],
                          capture_output=True, text=True, env=ENV, timeout=60)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "[launcher] worker 0 failed with exit code 3; last lines:" in proc.stdout
    assert "    going down" in proc.stdout


def test_the_launcher_imports_no_tensorflow():
    code = ("import sys; from tf_blocksparse.launcher import cli; "
            "bad = [m for m in ('tensorflow', 'keras', 'absl', 'portpicker') "
            "if m in sys.modules]; assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=ENV, timeout=60)
    assert proc.returncode == 0, proc.stderr
