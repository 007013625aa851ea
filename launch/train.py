"""Train a model from ``models/`` with dense, block-sparse or element top-k exchange.

    python -m launch.train --model=cnn_small --dataset=digits --strategy=mirrored
    python -m launch.local_cluster --num_workers=2 -- python -m launch.train \\
        --strategy=multiworker --dataset=digits --model=cnn_small --compression=block --k=1 \\
        --epochs=2 --model_dir=/tmp/run

Under ``--strategy=multiworker`` the cluster comes from ``TF_CONFIG`` (or SLURM's
environment), as for any TF job.  The chief prints progress and writes
``MODEL_DIR/metrics.json``; every worker backs up to ``MODEL_DIR/backup`` (resumed on restart).
"""

from __future__ import annotations

import json
import os
import time

from absl import app, flags

from launch import callbacks as cb
from launch import runtime, script
from launch.flags import define_flags, flag_names

FLAGS = flags.FLAGS


def make_strategy(name: str, num_devices: int):
    """The distribution strategy for ``--strategy``."""
    import tensorflow as tf

    import tf_blocksparse as tfbs

    if name == "multiworker":
        resolver = None
        if "TF_CONFIG" not in os.environ and "SLURM_JOB_ID" in os.environ:
            resolver = tf.distribute.cluster_resolver.SlurmClusterResolver()
        return tfbs.MultiWorkerMirroredStrategy(cluster_resolver=resolver)
    if name == "mirrored":
        gpus = tf.config.list_physical_devices("GPU")
        if gpus and num_devices > len(gpus):
            raise app.UsageError(f"--num_devices={num_devices}: this machine has only "
                                 f"{len(gpus)} GPUs")
        if gpus:
            return tf.distribute.MirroredStrategy([f"/gpu:{i}" for i in range(num_devices)])
        runtime.logical_cpus(num_devices)
        return tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(num_devices)])
    return tf.distribute.get_strategy()


def learning_rate(lr: float, schedule: str = "constant", total_steps: int = 0,
                  warmup_steps: int = 0):
    """``--lr`` as ``--lr_schedule`` asks: the float itself, or a Keras ``CosineDecay`` that
    warms up linearly from 0 to ``lr`` over ``warmup_steps`` and then decays to 0 at
    ``total_steps`` (optimizer steps, all epochs together).

    Raises:
      ValueError: ``schedule`` unknown, or a cosine schedule without ``total_steps >
        warmup_steps``.
    """
    if schedule == "constant":
        return lr
    if schedule != "cosine":
        raise ValueError(f"`schedule` must be 'constant' or 'cosine', got {schedule!r}")
    if total_steps <= warmup_steps:
        raise ValueError(f"`total_steps` ({total_steps}) must exceed `warmup_steps` "
                         f"({warmup_steps}) for a cosine schedule")
    import keras

    if not warmup_steps:
        return keras.optimizers.schedules.CosineDecay(lr, total_steps, alpha=0.0)
    return keras.optimizers.schedules.CosineDecay(
        0.0, total_steps - warmup_steps, alpha=0.0, warmup_target=lr, warmup_steps=warmup_steps)


def make_optimizer(compression: str, k: int | None, density: float | None, metric: str,
                   exchange: str, lr, momentum: float, global_momentum: bool = False,
                   dense_below: int | None = None, momentum_masking: str | None = None,
                   fusion_buffer_bytes: int = 0, sync_every: int = 0,
                   outer_lr: float | None = None, outer_momentum: float | None = None,
                   quantize: str = "none"):
    """``BlockSparseOptimizer(SGD(lr, momentum))`` as ``--compression`` asks, with the
    library's defaults for every option left ``None`` / ``False``.

    ``global_momentum`` keeps the momentum in the inner SGD, after the exchange (the literal
    form); by default the sparse methods move it before the exchange (DGC correction).
    """
    import keras

    import tf_blocksparse as tfbs

    inner = keras.optimizers.SGD(lr, momentum=momentum)
    extra: dict = {}
    if fusion_buffer_bytes:
        extra["fusion_buffer_bytes"] = fusion_buffer_bytes
    if sync_every:  # local steps: the inner SGD keeps its momentum on each worker
        extra["sync_every"] = sync_every
        if outer_lr is not None:  # else the library's default outer optimizer
            momentum = outer_momentum or 0.0
            extra["outer"] = keras.optimizers.SGD(outer_lr, momentum=momentum,
                                                  nesterov=momentum > 0)
    if compression == "dense":
        return tfbs.BlockSparseOptimizer(inner, exchange="dense", **extra)
    if global_momentum and not sync_every:
        extra["momentum_correction"] = None
    if dense_below is not None:
        extra["dense_below"] = dense_below
    if momentum_masking is not None:
        extra["momentum_masking"] = momentum_masking
    if quantize != "none":
        extra["quantize"] = quantize
    if compression == "topk":
        return tfbs.BlockSparseOptimizer(inner, k=k, density=density if k else density or 0.01,
                                         metric=metric, exchange=exchange,
                                         granularity="element", **extra)
    return tfbs.BlockSparseOptimizer(inner, k=k, density=density, metric=metric,
                                     exchange=exchange, **extra)


def run(argv_flags=FLAGS) -> dict:
    """Trains as the flags say; returns the metrics record (the chief also writes it)."""
    import keras
    import tensorflow as tf

    import tf_blocksparse as tfbs
    from launch import inputs
    from models import registry
    from tf_blocksparse.keras.backup import initial_epoch, save_model
    from tf_blocksparse.keras.evaluation import ExactValidation, evaluate_exactly

    f = argv_flags
    since_launch = cb.launch_seconds()
    if f.deterministic:  # the same seed gives the same accuracies on a re-run
        keras.utils.set_random_seed(f.seed)
        tf.config.experimental.enable_op_determinism()
    strategy = make_strategy(f.strategy, f.num_devices)
    from tf_blocksparse.distribute.strategy import worker_role

    num_workers, index, chief = worker_role(strategy)
    arrays = inputs.load_arrays(f.dataset, f.model, f.data_dir, f.tfds_data_dir,
                                  f.synthetic_shape, f.train_samples, f.seed, f.test_samples)
    steps = inputs.steps_per_epoch(arrays, f.batch_size, num_workers)
    if f.steps_per_epoch:
        steps = min(steps, f.steps_per_epoch)
    resumed = 0
    if f.model_dir and f.backup:  # a resumed run reads the batches not reached before
        from tf_blocksparse.keras.backup import resumed_epoch

        resumed = resumed_epoch(os.path.join(f.model_dir, "backup"))
    train_ds, _ = inputs.train_input(strategy, arrays, f.batch_size, num_workers, index,
                                     f.seed, start_batch=resumed * steps)
    sequence = registry.is_sequence_model(f.model)
    with strategy.scope():
        model = registry.build_model(f.model, arrays.input_shape, arrays.num_classes, seed=f.seed)
        lr = learning_rate(f.lr, f.lr_schedule, f.epochs * steps,
                           int(round(f.warmup_epochs * steps)))
        opt = make_optimizer(f.compression, f.k, f.density, f.metric, f.exchange, lr,
                             f.momentum, f.global_momentum, f.dense_below,
                             f.momentum_masking, f.fusion_buffer_bytes, f.sync_every,
                             f.outer_lr, f.outer_momentum, f.quantize)
        if sequence:
            from models import nmt
            loss, metrics = nmt.masked_sparse_ce, [nmt.token_accuracy]
        else:
            loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
            metrics = ["accuracy"]
        model.compile(optimizer=opt, loss=loss, metrics=metrics)
    callbacks = [tfbs.BlockSparseMetrics(
        log_dir=os.path.join(f.model_dir, "logs") if f.model_dir else None)]
    backup = None
    if f.model_dir and f.backup:  # timed: the backup's seconds per epoch go into the record
        backup = cb.timed(tfbs.BackupAndRestore(os.path.join(f.model_dir, "backup"),
                                                save_freq=f.save_freq or "epoch"))
        callbacks.append(backup)
        if chief:
            callbacks.append(keras.callbacks.TensorBoard(os.path.join(f.model_dir, "logs"),
                                                         update_freq="epoch"))
    if f.dump_restored:
        callbacks.append(cb.dump_restored(f.dump_restored, index))
    if f.fail_at_step >= 0 and index == f.fail_worker:
        callbacks.append(cb.fail_at(f.fail_at_step))
    auto = None
    if f.exchange == "auto" and f.compression != "dense":  # re-decides with step times
        auto = tfbs.AutoExchangeCallback()
        callbacks.append(auto)
    if f.density_warmup and f.compression != "dense":
        callbacks.append(tfbs.DensityWarmup([float(d) for d in f.density_warmup]))
    if f.stop_at_accuracy:
        callbacks.append(cb.stop_at_accuracy(
            f.stop_at_accuracy, f.min_epochs,
            "val_token_accuracy" if sequence else "val_accuracy"))
    def measuring_s() -> float:  # the automatic exchange's build-time measurements
        return 0.0 if opt.exchange_chooser is None else opt.exchange_chooser.measure_s

    from tf_blocksparse.auto.link_probe import barrier

    # count the build-time measurements as training time; start each epoch's clock once
    # every worker is done with the last epoch's evaluation and checkpoint (an all-reduce)
    clock = cb.epoch_clock(before_s=measuring_s,
                           barrier=lambda: barrier(strategy))
    callbacks.append(clock)
    wall_clock = cb.wall_clock(since_launch)  # after evaluation and backup: counts them
    callbacks.append(wall_clock)
    if chief:  # last: it prints what the callbacks before it added
        callbacks.append(cb.progress(f.epochs, f.block_metrics,
                                     out=lambda line: print(line, flush=True)))
    eval_kwargs = inputs.eval_kwargs(f.model)
    validation = None
    if f.validate:  # first: later callbacks (stop, TensorBoard, History) read its figures
        validation = ExactValidation(
            *arrays.test, batch_size=f.eval_batch_size, verbose=False,
            metric_name="token_accuracy" if sequence else "accuracy", **eval_kwargs)
        timed_validation = cb.timed(validation)
        callbacks.insert(0, timed_validation)
    t0 = time.perf_counter()
    hist = model.fit(train_ds, epochs=f.epochs, steps_per_epoch=steps, callbacks=callbacks,
                     shuffle=False, verbose=0)
    wall = time.perf_counter() - t0
    # the last epoch's evaluation is of these very weights; evaluate only if none ran
    results = validation.last if validation is not None and validation.last else \
        evaluate_exactly(model, *arrays.test, batch_size=f.eval_batch_size, **eval_kwargs)
    # local steps: bytes per step as the last epoch's mean (one exchange per window)
    m = opt.block_sparse_metrics(mean=bool(f.sync_every))
    chooser = opt.exchange_chooser
    if f.model_dir:  # every worker takes part (reading residuals is a collective)
        save_model(model, os.path.join(f.model_dir, "model.keras"))
    record = {
        "test_accuracy": results.accuracy, "test_loss": results.loss,
        "test_examples": results.examples, "test_correct": results.correct,
        "test_counted": results.counted,
        "epochs": f.epochs, "epochs_trained": len(clock.train_s),
        "initial_epoch": initial_epoch(model),
        "steps": int(opt.iterations.numpy()), "steps_per_epoch": steps,
        "wall_s": round(wall, 2), "payload_bytes_per_step": int(m["payload_bytes"]),
        "dense_bytes_per_step": int(m["dense_bytes"]),
        "compression_ratio": m["dense_bytes"] / m["payload_bytes"] if m["payload_bytes"] else 0,
        "skipped_steps": int(m["skipped_steps"]), "num_workers": num_workers,
        "syncs": (int(opt.outer_optimizer.iterations.numpy()) if f.sync_every
                  else int(opt.iterations.numpy())),
        # where a step's time goes: the wrapper's part (measured in the step), and of it
        # the compression (one replica's, timed locally after training)
        "exchange_s_per_step": m["exchange_s_total"] / max(1, int(opt.iterations.numpy())),
        "compress_s_per_step": opt.compression_seconds(),
        "auto_modes": None if chooser is None else list(chooser.modes),
        "auto_measure_s": round(measuring_s(), 3),  # measuring and deciding, all of it
        # the build-time choice (step 0) and each re-decision: modes and measured inputs
        "auto_decisions": None if auto is None else [
            {"step": s, "modes": list(d.modes), **d.summary()}
            for s, d in [(0, auto.initial)] * (auto.initial is not None) + auto.decisions],
        "replicas": strategy.num_replicas_in_sync, "dataset": arrays.name,
        "history": {k: [float(v) for v in vals] for k, vals in hist.history.items()},
        "train_s_per_epoch": clock.train_s,
        # what a user waits for: seconds since launch at every epoch's end (evaluation and
        # backup included), when training began, and per epoch the evaluation and backup
        "epoch_wall_s": wall_clock.epoch_wall_s, "start_s": wall_clock.start_s,
        "eval_s_per_epoch": timed_validation.seconds_per_epoch if f.validate else [],
        "backup_s_per_epoch": backup.seconds_per_epoch if backup is not None else [],
        "end_wall_s": round(since_launch(), 3),  # the final model saved
        "flags": {name: f[name].value for name in flag_names()},
        "tensorflow": tf.__version__,
        "provenance": runtime.provenance(),
    }
    if chief and f.model_dir:
        os.makedirs(f.model_dir, exist_ok=True)
        with open(os.path.join(f.model_dir, "metrics.json"), "w") as fh:
            json.dump(record, fh, indent=1)
    if chief:
        print(json.dumps({k: v for k, v in record.items() if k not in ("history", "flags")}))
    return record


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    run()


if __name__ == "__main__":
    script.run(main, define_flags)
