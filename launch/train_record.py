"""The metrics record of a ``launch.train`` run (``MODEL_DIR/metrics.json``), and where it
goes: the chief writes it and prints its summary line."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from launch import progress, runtime
from launch.config import TrainConfig
from launch.train_steps import Setup, Watchers

#: The record's fields left out of the printed summary line.
NOT_PRINTED = ("history", "flags")


def _auto_decisions(auto: Any) -> list[dict] | None:
    """The automatic exchange's build-time choice (step 0) and each re-decision: modes and
    measured inputs; ``None`` without the automatic exchange."""
    if auto is None:
        return None
    decisions = [(0, auto.initial)] * (auto.initial is not None) + auto.decisions
    return [{"step": s, "modes": list(d.modes), **d.summary()} for s, d in decisions]


def exchange_figures(config: TrainConfig, opt: Any) -> dict[str, float]:
    """The optimizer's exchange figures (bytes, seconds, skipped steps) for the record, read
    when training and evaluation are done, before the model is saved; with local steps the
    last epoch's mean per step (one exchange per window)."""
    return opt.block_sparse_metrics(mean=bool(config.method.sync_every))


def make_record(config: TrainConfig, setup: Setup, watchers: Watchers, model: Any, opt: Any,
                history: Any, wall_s: float, results: Any, figures: dict[str, float],
                since_launch: Callable[[], float]) -> dict:
    """The record of a finished run.

    Args:
      config: The run's config (its flag values are recorded).
      setup: What the run prepared (strategy, workers, data, steps per epoch).
      watchers: Its callbacks with figures (clocks, validation, backup, automatic exchange).
      model: The trained model.
      opt: Its ``BlockSparseOptimizer``.
      history: ``model.fit``'s history.
      wall_s: Seconds ``model.fit`` took.
      results: The final test figures (``EvalResult``).
      figures: The exchange figures (:func:`exchange_figures`).
      since_launch: Seconds since the job was launched.
    """
    import tensorflow as tf

    from tf_blocksparse.keras.backup import initial_epoch

    local_steps, m = bool(config.method.sync_every), figures
    chooser = opt.exchange_chooser
    steps = int(opt.iterations.numpy())
    resumed_at = initial_epoch(model)
    whole, epochs, history_from = progress.merge(
        watchers.saved_progress, resumed_at, history.history, watchers.epoch_fields())
    return {
        "test_accuracy": results.accuracy, "test_loss": results.loss,
        "test_examples": results.examples, "test_correct": results.correct,
        "test_counted": results.counted,
        "epochs": config.epochs, "epochs_trained": len(epochs["train_s_per_epoch"]),
        "initial_epoch": resumed_at,
        "history_from_epoch": history_from,  # 0: the history holds every epoch
        "steps": steps, "steps_per_epoch": setup.steps,
        "wall_s": round(wall_s, 2), "payload_bytes_per_step": int(m["payload_bytes"]),
        "dense_bytes_per_step": int(m["dense_bytes"]),
        "compression_ratio": m["dense_bytes"] / m["payload_bytes"] if m["payload_bytes"] else 0,
        "skipped_steps": int(m["skipped_steps"]), "num_workers": setup.num_workers,
        "syncs": int(opt.outer_optimizer.iterations.numpy()) if local_steps else steps,
        # where a step's time goes: the wrapper's part (measured in the step), and of it
        # the compression (one replica's, timed locally after training)
        "exchange_s_per_step": m["exchange_s_total"] / max(1, steps),
        "compress_s_per_step": opt.compression_seconds(),
        "auto_modes": None if chooser is None else list(chooser.modes),
        "auto_measure_s": round(watchers.measuring_s(), 3),  # measuring and deciding
        "auto_decisions": _auto_decisions(watchers.auto),
        "replicas": setup.strategy.num_replicas_in_sync, "dataset": setup.arrays.name,
        "history": {k: [float(v) for v in vals] for k, vals in whole.items()},
        "train_s_per_epoch": epochs["train_s_per_epoch"],
        # what a user waits for: seconds since launch at every epoch's end (evaluation and
        # backup included; a resumed run's continue from its saved epochs), when training
        # began, and per epoch the evaluation and backup
        "epoch_wall_s": epochs["epoch_wall_s"],
        "start_s": watchers.wall_clock.start_s,
        "eval_s_per_epoch": epochs["eval_s_per_epoch"],
        "backup_s_per_epoch": epochs["backup_s_per_epoch"],
        "end_wall_s": round(since_launch(), 3),  # the final model saved
        "flags": config.flag_values(),
        "tensorflow": tf.__version__,
        "provenance": runtime.provenance(),
    }


def publish(config: TrainConfig, setup: Setup, record: dict) -> None:
    """On the chief: writes the record to ``MODEL_DIR/metrics.json`` (with a model
    directory) and prints it as one JSON line, without its history and flags."""
    if not setup.chief:
        return
    if config.model_dir:
        os.makedirs(config.model_dir, exist_ok=True)
        with open(os.path.join(config.model_dir, "metrics.json"), "w") as fh:
            json.dump(record, fh, indent=1)
    print(json.dumps({k: v for k, v in record.items() if k not in NOT_PRINTED}))
