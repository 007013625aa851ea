"""Every launch script as a user starts it: ``python -m launch.X`` from the repository root.

``--help`` lists the script's own flags (also those it shares through ``launch/flags.py``);
bad flag values stop the script at flag parsing with an error that names the flag; neither
imports TensorFlow or Keras (so both answer at once); a small
training run prints its progress lines and summary, not TensorFlow's INFO log.  The
processes run side by side (each imports TensorFlow).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2")

#: Script -> flags its ``--help`` must list.
OWN_FLAGS = {
    "train": ["model", "compression", "k", "density", "num_devices", "block_metrics", "epochs",
              "sync_every", "outer_lr", "quantize"],
    "demo": ["epochs", "methods", "num_workers", "out"],
    "bench_convergence": ["models", "seeds", "methods", "resume"],
    "bench_time_to_accuracy": ["bandwidths_mbit", "target_drop", "methods"],
    "bench_fusion": ["buffer_mib", "sections", "step_model"],
    "bench_clipping": ["trace_steps", "threshold", "inter_op_threads"],
    "bench_selection": ["repeats", "metric", "k"],
    "bench_pipeline": ["logical_devices", "plan_layers"],
    "bench_hybrid": ["fc_units", "conv_replicas"],
    "plan_pipeline": ["model", "topology", "num_devices"],
    "print_blocks": ["model", "input_shape", "json"],
    "project_scaling": ["workers", "bandwidths_gbit", "alpha_us"],
    "results_tables": ["results", "update_readme"],
    "train_hybrid": ["conv_replicas", "fc_replicas", "compression", "model", "workers"],
    "train_pipeline": ["workers", "topology", "model"],
    "local_cluster": ["num_workers", "grace_s", "bandwidth_mbit", "log_dir"],
    "netem": ["num_workers", "bandwidth_mbit", "seconds"],
    "local_steps_report": ["convergence", "wall_clock", "out"],
    "bench_wall_clock": ["models", "bandwidths_mbit", "timing_steps", "check"],
    "bench_backup": ["model", "bandwidth_mbit", "methods", "epochs"],
}

#: (script, arguments, the flag the error must name).
BAD_FLAGS = [
    ("train", ["--compression=dense", "--k=5"], "--k"),
    ("train", ["--compression=dense", "--recurrent=whole"], "--recurrent"),
    ("train", ["--compression=dense", "--embeddings=by_size"], "--embeddings"),
    ("train", ["--embeddings=rows"], "--embeddings"),
    ("train", ["--num_devices=0"], "num_devices"),
    ("demo", ["--methods=dense,nope"], "--methods"),
    ("demo", ["--num_workers=0"], "num_workers"),
    ("bench_convergence", ["--methods=dense,topk"], "--methods"),
    ("bench_convergence", ["--seeds=0,x"], "--seeds"),
    ("bench_time_to_accuracy", ["--density=0"], "--density"),
    ("bench_time_to_accuracy", ["--bandwidths_mbit=100,-1"], "--bandwidths_mbit"),
    ("bench_fusion", ["--sections=plans,nope"], "--sections"),
    ("bench_selection", ["--k=1", "--density=0.1"], "--k"),
    ("print_blocks", ["--input_shape=32,x"], "--input_shape"),
    ("print_blocks", ["--density=2"], "--density"),
    ("train_hybrid", ["--compression=dense", "--density=0.1"], "--density"),
    ("bench_pipeline", ["--micro_batches=0"], "micro_batches"),
    ("plan_pipeline", ["--spread=1"], "--spread"),
    ("train_pipeline", ["--bandwidth_mbit=0"], "--bandwidth_mbit"),
]


def _start(script: str, *args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", f"launch.{script}", *args], cwd=ROOT,
                            env=env or ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _without_tensorflow(root: Path) -> dict:
    """An environment where importing TensorFlow or Keras fails: ``--help`` and flag
    errors must not need them (they take seconds to import)."""
    for name in ("tensorflow", "keras"):
        (root / name).mkdir(parents=True, exist_ok=True)
        (root / name / "__init__.py").write_text(
            f"raise ImportError('{name} imported before the flags were parsed')\n")
    return dict(ENV, PYTHONPATH=f"{root}{os.pathsep}{ROOT}")


def _finish(procs: dict) -> dict:
    out = {}
    for key, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=600)
        out[key] = (proc.returncode, stdout, stderr)
    return out


@pytest.fixture(scope="module")
def no_tf(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _without_tensorflow(tmp_path_factory.mktemp("no_tf"))


@pytest.fixture(scope="module")
def helps(no_tf: dict) -> dict:
    return _finish({s: _start(s, "--help", env=no_tf) for s in OWN_FLAGS})


@pytest.fixture(scope="module")
def bad_runs(no_tf: dict) -> dict:
    return _finish({i: _start(script, *args, env=no_tf)
                    for i, (script, args, _) in enumerate(BAD_FLAGS)})


@pytest.mark.parametrize("script", sorted(OWN_FLAGS))
def test_help_lists_the_scripts_own_flags(helps: dict, script: str) -> None:
    _, out, err = helps[script]  # absl's --help exits with status 1
    assert "Try --helpfull" in out, err[-3000:]
    own = out.split("Try --helpfull", 1)[0]  # --help: only the script's own flags
    for name in OWN_FLAGS[script]:
        assert f"--{name}" in own or f"--[no]{name}" in own, (script, name, out[-2000:])


@pytest.mark.parametrize("case", range(len(BAD_FLAGS)))
def test_bad_flags_fail_at_parsing_naming_the_flag(bad_runs: dict, case: int) -> None:
    script, args, named = BAD_FLAGS[case]
    rc, _, err = bad_runs[case]
    assert rc != 0, (script, args)
    assert "Flags parsing error" in err and named in err, (script, args, err[-2000:])


TINY = ["--strategy=mirrored", "--num_devices=2", "--dataset=digits", "--model=cnn_small",
        "--epochs=2", "--steps_per_epoch=2", "--train_samples=512", "--test_samples=128",
        "--batch_size=32", "--compression=block"]


# Two training runs in subprocesses (~17 s): `make test-slow` (CI runs it).
@pytest.mark.slow
def test_training_output_is_quiet_unless_asked() -> None:
    """By default: one progress line per epoch and the summary, no INFO log lines and no
    block-sparse fields on the progress line; ``--verbosity=0 --block_metrics`` brings both
    back."""
    runs = _finish({"quiet": _start("train", *TINY),
                    "loud": _start("train", *TINY, "--verbosity=0", "--block_metrics")})
    rc, out, err = runs["quiet"]
    assert rc == 0, err[-3000:]
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 3, out  # two progress lines and the summary, nothing else
    progress = lines[:2]
    assert [line.split(" - ")[0] for line in progress] == ["epoch 1/2", "epoch 2/2"]
    assert all("val_accuracy: " in line and "loss: " in line for line in progress)
    assert all("payload_bytes" not in line for line in progress)
    assert "Using MirroredStrategy" not in err and "Using MirroredStrategy" not in out
    assert json.loads(out.strip().splitlines()[-1])["replicas"] == 2
    rc, out, err = runs["loud"]
    assert rc == 0, err[-3000:]
    progress = [line for line in out.splitlines() if line.startswith("epoch 1/2")]
    assert progress and "payload_bytes: " in progress[0] and "blocks_kept: " in progress[0]
    assert "Using MirroredStrategy" in err + out
