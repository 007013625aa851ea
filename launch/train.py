"""Train a model from ``models/`` with dense, block-sparse or element top-k exchange.

    python -m launch.train --model=cnn_small --dataset=digits --strategy=mirrored
    python -m launch.local_cluster --num_workers=2 -- python -m launch.train \\
        --strategy=multiworker --dataset=digits --model=cnn_small --compression=block --k=1 \\
        --epochs=2 --model_dir=/tmp/run

Under ``--strategy=multiworker`` the cluster comes from ``TF_CONFIG`` (or SLURM's
environment), as for any TF job.  The chief prints progress and writes
``MODEL_DIR/metrics.json``; every worker backs up to ``MODEL_DIR/backup`` (resumed on restart).

``main`` parses the flags (:mod:`launch.flags`) into a :class:`~launch.config.TrainConfig`;
:func:`run` trains one, in the steps of :mod:`launch.train_steps`.
"""

from __future__ import annotations

import os

from absl import app, flags

from launch import script
from launch.config import TrainConfig
from launch.flags import define_flags

FLAGS = flags.FLAGS


def save(config: TrainConfig, model: object) -> None:
    """Saves the trained model to ``MODEL_DIR/model.keras`` (with a model directory); every
    worker takes part (reading residuals is a collective)."""
    if config.model_dir:
        from tf_blocksparse.keras.backup import save_model

        save_model(model, os.path.join(config.model_dir, "model.keras"))


def run(config: TrainConfig) -> dict:
    """Trains as ``config`` says; returns the metrics record (the chief also writes it to
    ``MODEL_DIR/metrics.json`` and prints its summary)."""
    from launch import callbacks, train_record, train_steps

    since_launch = callbacks.launch_seconds()
    setup = train_steps.prepare(config)
    model, opt = train_steps.build_model(config, setup)
    watchers = train_steps.make_callbacks(config, setup, opt, since_launch)
    history, wall_s = train_steps.fit(config, setup, model, watchers)
    results = train_steps.evaluate(config, setup, model, watchers)
    figures = train_record.exchange_figures(config, opt)
    save(config, model)
    record = train_record.make_record(config, setup, watchers, model, opt, history, wall_s,
                                      results, figures, since_launch)
    train_record.publish(config, setup, record)
    return record


def main(argv: list[str]) -> None:
    """Trains the config of the parsed flags."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    run(TrainConfig.from_flags(FLAGS))


if __name__ == "__main__":
    script.run(main, define_flags)
