"""What a per-epoch backup costs on a slow link: dense vs block-sparse, side by side.

Per method, ``--repeats`` runs of a ``--num_workers``-process cluster of ``launch.train``
with every worker's link shaped to ``--bandwidth_mbit`` (needs root), backing up after every
epoch (``BackupAndRestore``), and one run without (``--nobackup``), the same seed, epochs and
steps.  The runs with backups alternate between the methods (the order rotating each
repeat), so that a machine's drift falls on every method alike.  From them come the backup
seconds of every epoch (timed around the callback on the chief, which writes the model
checkpoint besides its replica's state); from the first of them and the run without, the
bytes the backups put on each worker's link (the kernel's ``eth0`` counters of the run with
backups minus those of the run without, per backup).

Prints one JSON object and writes ``OUT/backup.json``: per method ``backup_s_steady`` (mean
over every run's epochs after its first) with its spread, ``link_bytes_per_backup`` (per
worker, mean), and ``backup_s_ratio_vs_dense``.

    python -m launch.bench_backup [--model=vgg_fc] [--bandwidth_mbit=100]
        [--methods=dense,block_shared,block_default] [--epochs=5] [--steps_per_epoch=10]
        [--repeats=2]
"""

from __future__ import annotations

import io
import json
import os
import statistics

from absl import flags

from launch import experiments, runtime, script
from launch import flags as train_flags
from launch.config import TrainConfig

FLAGS = flags.FLAGS
_TRAFFIC = "[launcher] network traffic (eth0 bytes per worker): "


def define_flags() -> None:
    """The script's flags."""
    flags.DEFINE_enum("model", "vgg_fc", train_flags.MODELS, "Model (launch.train --model).")
    flags.DEFINE_float("bandwidth_mbit", 100.0, "Link rate of every worker.", lower_bound=0.1)
    flags.DEFINE_list("methods", ["dense", "block_shared", "block_default"],
                      "Methods (dense first).")
    flags.register_validator(
        "methods", lambda m: experiments.known_methods(m, list(experiments.METHODS)),
        f"--methods must be a non-empty list of {sorted(experiments.METHODS)}")
    flags.DEFINE_integer("num_workers", 4, "Worker processes.", lower_bound=1)
    flags.DEFINE_integer("epochs", 5, "Epochs (one backup after each).", lower_bound=2)
    flags.DEFINE_integer("repeats", 2, "Runs with backups per method, interleaved across the "
                         "methods (their order rotating), plus one run without.", lower_bound=1)
    flags.DEFINE_integer("steps_per_epoch", 10, "Training steps per epoch.", lower_bound=1)
    flags.DEFINE_integer("batch_size", 128, "Global batch size.", lower_bound=1)
    flags.DEFINE_float("density", 0.05, "Fraction of blocks the sparse methods keep.")
    flags.DEFINE_float("lr", 0.01, "Learning rate.")
    flags.DEFINE_integer("seed", 0, "Seed.", lower_bound=0)
    flags.DEFINE_string("dataset", "fashion_mnist", "Dataset (launch.train --dataset).")
    flags.DEFINE_string("out", "benchmarks/results", "Output directory.")


def link_bytes(output: str) -> list[int]:
    """Per worker, the bytes its link sent plus received, from the launcher's traffic line
    of ``output`` (``[]`` when absent)."""
    for line in output.splitlines():
        if line.startswith(_TRAFFIC):
            return [w["tx_bytes"] + w["rx_bytes"] for w in json.loads(line[len(_TRAFFIC):])]
    return []


def _run(method: str, config: TrainConfig, backup: bool) -> tuple[dict, list[int]]:
    f = FLAGS
    out = io.StringIO()
    record = experiments.run_training(
        method, config.replace(backup=backup), f.num_workers,
        bandwidth_mbit=f.bandwidth_mbit, timeout_s=1800, stream=out)
    return record, link_bytes(out.getvalue())


def summarise(method: str, with_backup: list[dict], bytes_with: list[int],
              bytes_without: list[int], epochs: int) -> dict:
    """One method's row from its runs with backups and the link bytes of one pair of runs.

    Args:
        method: The method's name.
        with_backup: The run records with a backup after every epoch (one per repeat).
        bytes_with: Per worker, the link bytes of the first run with backups.
        bytes_without: Per worker, the link bytes of the run without backups.
        epochs: Epochs (backups) per run.
    """
    # the first backup of a run also builds the state writer: steady = epochs 2..N
    steady = [s for r in with_backup for s in r["backup_s_per_epoch"][1:]]
    per_backup = [(a - b) / epochs for a, b in zip(bytes_with, bytes_without)]
    first = with_backup[0]
    return {"method": method,
            "backup_s_per_epoch": [r["backup_s_per_epoch"] for r in with_backup],
            "backup_s_steady": round(statistics.fmean(steady), 3),
            "backup_s_steady_spread": experiments.spread(steady, 3),
            "link_bytes_per_backup": round(statistics.fmean(per_backup)) if per_backup
            else None,
            "link_bytes_with_backup": bytes_with, "link_bytes_without_backup": bytes_without,
            "payload_bytes_per_step": first["payload_bytes_per_step"],
            "flags": first["flags"], "provenance": first.get("provenance")}


def main(argv: list[str]) -> None:
    script.require_root(argv)
    f = FLAGS
    configs = {m: experiments.train_config(
        m, f.density, model=f.model, dataset=f.dataset, epochs=f.epochs,
        steps_per_epoch=f.steps_per_epoch, batch_size=f.batch_size, lr=f.lr, seed=f.seed,
        test_samples=500) for m in f.methods}
    runs: dict[str, list[tuple[dict, list[int]]]] = {m: [] for m in f.methods}
    for r in range(f.repeats):  # interleaved, the order rotating: drift hits every method
        shift = r % len(f.methods)
        for m in [*f.methods[shift:], *f.methods[:shift]]:
            runs[m].append(_run(m, configs[m], True))
    rows = []
    for m in f.methods:
        _, bytes_without = _run(m, configs[m], False)
        rows.append(summarise(m, [rec for rec, _ in runs[m]], runs[m][0][1], bytes_without,
                              f.epochs))
    dense = next((r for r in rows if r["method"] == "dense"), None)
    for r in rows:
        if dense is not None and dense["backup_s_steady"] > 0:
            r["backup_s_ratio_vs_dense"] = round(r["backup_s_steady"] / dense["backup_s_steady"],
                                                 3)
    doc = {"budget": {"model": f.model, "bandwidth_mbit": f.bandwidth_mbit,
                      "num_workers": f.num_workers, "epochs": f.epochs,
                      "steps_per_epoch": f.steps_per_epoch, "density": f.density,
                      "repeats": f.repeats},
           "rows": rows, "machine": runtime.machine_info()}
    os.makedirs(f.out, exist_ok=True)
    with open(os.path.join(f.out, "backup.json"), "w") as fh:
        json.dump(doc, fh, indent=1)
    print(json.dumps({r["method"]: {k: r[k] for k in ("backup_s_steady", "link_bytes_per_backup",
                                                      "backup_s_ratio_vs_dense") if k in r}
                      for r in rows}))


if __name__ == "__main__":
    script.run(main, define_flags)
