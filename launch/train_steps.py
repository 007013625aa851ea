"""The steps of a ``launch.train`` run, each a function of its :class:`TrainConfig`.

:func:`prepare` (determinism, strategy, this worker's place, data), :func:`build_model`
(model, learning rate, ``BlockSparseOptimizer``, compiled), :func:`make_callbacks` (the
library's metrics, backup, stopping, clocks, progress), :func:`fit` and :func:`evaluate`;
``launch.train.run`` calls them in that order.  TensorFlow and Keras are imported inside
the functions, so importing this module loads neither.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

from launch import callbacks as cb
from launch import runtime
from launch.config import TrainConfig
from launch.optimizer import learning_rate, make_optimizer


@dataclasses.dataclass(frozen=True)
class Setup:
    """What a run has before its model is built.

    Attributes:
      strategy: The ``tf.distribute`` strategy.
      num_workers: Worker processes of the cluster (1 without one).
      index: This worker's index (0: the chief).
      chief: Whether this worker prints and writes the record.
      arrays: The data set (``launch.inputs.Arrays``).
      steps: Optimizer steps per epoch.
      train_ds: This worker's training input, from the first batch not yet trained.
      sequence: Whether the model is a sequence model (token accuracy).
    """

    strategy: Any
    num_workers: int
    index: int
    chief: bool
    arrays: Any
    steps: int
    train_ds: Any
    sequence: bool

    @property
    def accuracy_name(self) -> str:
        """The accuracy metric's name: ``token_accuracy`` or ``accuracy``."""
        return "token_accuracy" if self.sequence else "accuracy"


@dataclasses.dataclass(frozen=True)
class Watchers:
    """A run's callbacks (in ``model.fit``'s order) and those whose figures the record reads.

    Attributes:
      callbacks: Every callback of ``model.fit``.
      clock: The training clock (``train_s_per_epoch``).
      wall_clock: Seconds since launch at every epoch's end.
      validation: The per-epoch exact evaluation (``None`` without ``validate``).
      timed_validation: The same, timed (:func:`launch.callbacks.timed`).
      backup: The timed backup (``None`` without one).
      auto: The automatic exchange's callback (``None`` unless the exchange is automatic).
      measuring_s: The automatic exchange's build-time measurements so far, in seconds.
      saved_progress: The model directory's per-epoch figures from before this process
        (:mod:`launch.progress`; ``None``: none).
    """

    callbacks: list
    clock: Any
    wall_clock: Any
    validation: Any | None
    timed_validation: Any | None
    backup: Any | None
    auto: Any | None
    measuring_s: Callable[[], float]
    saved_progress: dict | None = None

    def epoch_fields(self) -> dict[str, list[float]]:
        """This process's per-epoch clocks (:data:`launch.progress.EPOCH_FIELDS`)."""
        return {"train_s_per_epoch": list(self.clock.train_s),
                "epoch_wall_s": list(self.wall_clock.epoch_wall_s),
                "eval_s_per_epoch": list(self.validation_s),
                "backup_s_per_epoch": list(self.backup_s)}

    @property
    def validation_s(self) -> list[float]:
        """The validation's seconds per epoch so far (empty without one)."""
        return [] if self.timed_validation is None else self.timed_validation.seconds_per_epoch

    @property
    def backup_s(self) -> list[float]:
        """The backup's seconds per epoch so far (empty without one)."""
        return [] if self.backup is None else self.backup.seconds_per_epoch


def backup_dir(config: TrainConfig) -> str | None:
    """Where the run backs up (``MODEL_DIR/backup``); ``None`` without backups."""
    return os.path.join(config.model_dir, "backup") if config.model_dir and config.backup \
        else None


def prepare(config: TrainConfig) -> Setup:
    """Seeds (``deterministic``), makes the strategy and reads the data; a resumed run's
    input starts at the first batch its backup has not trained."""
    import keras
    import tensorflow as tf

    from launch import inputs
    from models import registry
    from tf_blocksparse.distribute.strategy import worker_role
    from tf_blocksparse.keras.backup import resumed_epoch

    if config.deterministic:  # the same seed gives the same accuracies on a re-run
        keras.utils.set_random_seed(config.seed)
        tf.config.experimental.enable_op_determinism()
    strategy = runtime.make_strategy(config.strategy, config.num_devices,
                                     config.heartbeat_timeout_s)
    num_workers, index, chief = worker_role(strategy)
    arrays = inputs.load_arrays(config.dataset, config.model, config.data_dir,
                                config.tfds_data_dir, list(config.synthetic_shape),
                                config.train_samples, config.seed, config.test_samples)
    steps = inputs.steps_per_epoch(arrays, config.batch_size, num_workers)
    if config.steps_per_epoch:
        steps = min(steps, config.steps_per_epoch)
    resumed = resumed_epoch(backup_dir(config)) if backup_dir(config) else 0
    train_ds, _ = inputs.train_input(strategy, arrays, config.batch_size, num_workers, index,
                                     config.seed, start_batch=resumed * steps)
    return Setup(strategy, num_workers, index, chief, arrays, steps, train_ds,
                 registry.is_sequence_model(config.model))


def build_model(config: TrainConfig, setup: Setup) -> tuple[Any, Any]:
    """The compiled model and its ``BlockSparseOptimizer``, built in the strategy's scope."""
    import keras

    from models import registry

    with setup.strategy.scope():
        model = registry.build_model(config.model, setup.arrays.input_shape,
                                     setup.arrays.num_classes, seed=config.seed)
        lr = learning_rate(config.lr, config.lr_schedule, config.epochs * setup.steps,
                           int(round(config.warmup_epochs * setup.steps)))
        opt = make_optimizer(config.method, lr, config.momentum)
        if setup.sequence:
            from models import nmt
            loss, metrics = nmt.masked_sparse_ce, [nmt.token_accuracy]
        else:
            loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
            metrics = ["accuracy"]
        model.compile(optimizer=opt, loss=loss, metrics=metrics)
    return model, opt


def make_callbacks(config: TrainConfig, setup: Setup, opt: Any,
                   since_launch: Callable[[], float]) -> Watchers:
    """The run's callbacks: the library's metrics, backup (and TensorBoard on the chief),
    the tests' fault injection, the automatic exchange, the density warm-up, the early
    stop, the clocks and the chief's progress line, with the exact validation first
    (later callbacks read its figures), then what else the optimizer needs in ``fit``."""
    import keras

    import tf_blocksparse as tfbs
    from launch import inputs, progress
    from tf_blocksparse.auto.link_probe import barrier
    from tf_blocksparse.keras.backup import initial_epoch
    from tf_blocksparse.keras.evaluation import ExactValidation

    method, logs = config.method, os.path.join(config.model_dir or "", "logs")
    callbacks = [tfbs.BlockSparseMetrics(log_dir=logs if config.model_dir else None)]
    backup = None
    if backup_dir(config):  # timed: the backup's seconds per epoch go into the record
        slow = config.slow_state_write_s > 0 and setup.index == config.fail_worker
        backup = cb.timed(tfbs.BackupAndRestore(
            backup_dir(config), save_freq=config.save_freq or "epoch",
            write_state=cb.slow_state_writes(config.slow_state_write_s) if slow else None))
        callbacks.append(backup)
        if setup.chief:
            callbacks.append(keras.callbacks.TensorBoard(logs, update_freq="epoch"))
    if config.dump_restored:
        callbacks.append(cb.dump_restored(config.dump_restored, setup.index))
    if config.fail_at_step >= 0 and setup.index == config.fail_worker:
        callbacks.append(cb.fail_at(config.fail_at_step))
    auto = None
    if method.options.auto:  # re-decides with step times
        auto = tfbs.AutoExchangeCallback()
        callbacks.append(auto)
    if method.density_warmup and method.options.sparse:
        callbacks.append(tfbs.DensityWarmup(list(method.density_warmup)))
    if config.stop_at_accuracy:
        callbacks.append(cb.stop_at_accuracy(config.stop_at_accuracy, config.min_epochs,
                                             f"val_{setup.accuracy_name}"))

    def measuring_s() -> float:  # the automatic exchange's build-time measurements
        return 0.0 if opt.exchange_chooser is None else opt.exchange_chooser.measure_s

    # count the build-time measurements as training time; start each epoch's clock once
    # every worker is done with the last epoch's evaluation and checkpoint (an all-reduce)
    clock = cb.epoch_clock(before_s=measuring_s, barrier=lambda: barrier(setup.strategy))
    wall_clock = cb.wall_clock(since_launch)  # after evaluation and backup: counts them
    callbacks += [clock, wall_clock]
    made: list[Watchers] = []  # the figures' owner, once made (below)
    saved = progress.read(config.model_dir) if backup_dir(config) else None
    if setup.chief and backup_dir(config):  # after the backup: a resumed run has every epoch
        callbacks.append(progress.progress_callback(
            config.model_dir, lambda: made[0].epoch_fields(), initial_epoch, saved))
    if setup.chief:  # last: it prints what the callbacks before it added
        callbacks.append(cb.progress(config.epochs, config.block_metrics,
                                     out=lambda line: print(line, flush=True)))
    validation = timed_validation = None
    if config.validate:  # first: later callbacks (stop, TensorBoard, History) read it
        validation = ExactValidation(
            *setup.arrays.test, batch_size=config.eval_batch_size, verbose=False,
            metric_name=setup.accuracy_name, **inputs.eval_kwargs(config.model))
        timed_validation = cb.timed(validation)
        callbacks.insert(0, timed_validation)
    callbacks += opt.fit_callbacks(callbacks)  # the dense phase's end, local steps' syncs
    made.append(Watchers(callbacks, clock, wall_clock, validation, timed_validation, backup,
                         auto, measuring_s, saved))
    return made[0]


def fit(config: TrainConfig, setup: Setup, model: Any, watchers: Watchers
        ) -> tuple[Any, float]:
    """``model.fit`` over the epochs; returns Keras' history and its wall seconds."""
    t0 = time.perf_counter()
    history = model.fit(setup.train_ds, epochs=config.epochs, steps_per_epoch=setup.steps,
                        callbacks=watchers.callbacks, shuffle=False, verbose=0)
    return history, time.perf_counter() - t0


def evaluate(config: TrainConfig, setup: Setup, model: Any, watchers: Watchers) -> Any:
    """The final test figures (``EvalResult``): the last epoch's validation, which is of
    these very weights, else one exact evaluation."""
    from launch import inputs
    from tf_blocksparse.keras.evaluation import evaluate_exactly

    if watchers.validation is not None and watchers.validation.last:
        return watchers.validation.last
    return evaluate_exactly(model, *setup.arrays.test, batch_size=config.eval_batch_size,
                            **inputs.eval_kwargs(config.model))
