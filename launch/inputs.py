"""Arrays for every ``--dataset`` and per-worker sharded ``tf.data`` input pipelines."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from launch import data
from launch.script import UserError


@dataclasses.dataclass
class Arrays:
    """Training and test arrays of one data set.

    Attributes:
      name: Data set name.
      train: ``(x, y)``; ``x`` may be a tuple of arrays (sequence models).
      test: ``(x, y)``.
      input_shape: Shape of one example (vocabulary size for translation).
      num_classes: Number of classes (target vocabulary for translation).
    """

    name: str
    train: tuple
    test: tuple
    input_shape: tuple[int, ...]
    num_classes: int


class DatasetUnavailableError(UserError, ValueError):
    """The ``--dataset`` asked for is not on this machine (the scripts never download).

    The message names the flags to change; a launch script prints it alone, without a
    traceback (:class:`launch.script.UserError`).
    """


def _tfds_arrays(name: str, data_dir: str | None) -> tuple[tuple, tuple]:
    """The train and test splits of TFDS data set ``name``, already prepared in ``data_dir``.

    Raises:
      DatasetUnavailableError: TFDS is not installed, knows no such data set, or has not
        prepared it in ``data_dir`` (TFDS's default directory when ``None``).
    """
    flag = f"--dataset=tfds:{name}"
    try:
        import tensorflow_datasets as tfds
    except ImportError as err:
        raise DatasetUnavailableError(
            f"{flag} needs the tensorflow-datasets package (pip install "
            f"'tf_blocksparse[launch]'), or choose another --dataset") from err
    try:  # TFDS loads its core lazily: an install that does not fit fails here
        not_found = tfds.core.DatasetNotFoundError
    except Exception as err:  # e.g. a protobuf older than tensorflow-metadata's generated code
        first = (str(err).splitlines() or [""])[0]
        raise DatasetUnavailableError(
            f"{flag}: tensorflow-datasets is installed but does not load "
            f"({type(err).__name__}: {first}); install versions that fit this TensorFlow "
            f"(with TensorFlow 2.19's protobuf 5: tensorflow-metadata<1.18), or choose "
            f"another --dataset") from err
    try:
        builder = tfds.builder(name, data_dir=data_dir)
    except not_found as err:
        raise DatasetUnavailableError(
            f"{flag}: TFDS has no data set {name!r} ({str(err).splitlines()[0]})") from err
    if not builder.is_prepared():
        where = f"--tfds_data_dir={data_dir}" if data_dir else \
            "TFDS's default directory (no --tfds_data_dir given)"
        raise DatasetUnavailableError(
            f"{flag}: the data set is not in {where} (looked for {builder.data_dir}).  "
            f"The launch scripts never download: download and prepare it once on a machine "
            f"with network access, e.g. `python -c \"import tensorflow_datasets as tfds; "
            f"tfds.builder('{name}', data_dir='DIR').download_and_prepare()\"`, then pass "
            f"--tfds_data_dir=DIR (or use --dataset=digits, always offline)")
    splits = tfds.load(name, split=["train", "test"], as_supervised=True, data_dir=data_dir,
                       download=False, batch_size=-1)
    out = []
    for x, y in splits:
        x = np.asarray(x, dtype=np.float32)
        out.append(((x / 255.0 if x.max() > 1.5 else x), np.asarray(y, dtype=np.int32)))
    return out[0], out[1]


def load_arrays(dataset: str, model: str, data_dir: str | None = None,
                tfds_data_dir: str | None = None, synthetic_shape: Sequence[int] = (32, 32, 3),
                train_samples: int = 0, seed: int = 0, test_samples: int = 0) -> Arrays:
    """Loads ``dataset`` as arrays (offline), optionally cut to the first samples.

    Raises:
      DatasetUnavailableError: ``dataset`` is not on this machine (Fashion-MNIST's files
        missing from ``data_dir``, a TFDS data set not prepared in ``tfds_data_dir``).
      ValueError: Unknown ``dataset`` or a sequence model with an image data set.
    """
    arrays = _load(dataset, model, data_dir, tfds_data_dir, synthetic_shape, train_samples, seed)
    if test_samples:
        x, y = arrays.test
        x = tuple(a[:test_samples] for a in x) if isinstance(x, tuple) else x[:test_samples]
        arrays.test = (x, y[:test_samples])
    return arrays


def _load(dataset: str, model: str, data_dir: str | None, tfds_data_dir: str | None,
          synthetic_shape: Sequence[int], train_samples: int, seed: int) -> Arrays:
    from models import registry

    if registry.is_sequence_model(model):
        from models import nmt

        if dataset not in ("toy_translation", "fashion_mnist"):
            raise ValueError(f"`dataset`: {model} trains on toy_translation, got {dataset!r}")
        n = train_samples or 4000
        (enc, dec), tgt = nmt.make_toy_translation(n + 1000, seed=seed)
        vocab = int(max(enc.max(), tgt.max())) + 1
        return Arrays("toy_translation", ((enc[:n], dec[:n]), tgt[:n]),
                      ((enc[n:], dec[n:]), tgt[n:]), (vocab,), vocab)
    if dataset == "synthetic":
        rng = np.random.default_rng(seed)
        shape = tuple(int(s) for s in synthetic_shape)
        n = train_samples or 4096
        x = rng.random((n + 512, *shape), dtype=np.float32)
        y = rng.integers(0, 10, n + 512).astype(np.int32)
        return Arrays("synthetic", (x[:n], y[:n]), (x[n:], y[n:]), shape, 10)
    if dataset.startswith("tfds:"):
        train, test = _tfds_arrays(dataset[5:], tfds_data_dir)
    elif dataset == "fashion_mnist":
        data_dir = data_dir or data.DEFAULT_FASHION_MNIST_DIR
        try:
            train, test = data.load_fashion_mnist(data_dir)
        except FileNotFoundError as err:
            raise DatasetUnavailableError(
                f"--dataset=fashion_mnist --data_dir={data_dir}: {err}") from err
    elif dataset == "digits":
        train, test = data.load_digits()
    else:
        raise ValueError(f"`dataset`: unknown data set {dataset!r}")
    if train_samples:
        train = (train[0][:train_samples], train[1][:train_samples])
    num_classes = int(max(train[1].max(), test[1].max())) + 1
    return Arrays(dataset, train, test, tuple(train[0].shape[1:]), num_classes)


def num_examples(x) -> int:
    return len(x[0]) if isinstance(x, tuple) else len(x)


def steps_per_epoch(arrays: Arrays, global_batch: int, num_workers: int) -> int:
    """Steps in one pass over a worker's shard (the smallest shard: every worker the same).

    Raises:
      ValueError: If ``global_batch`` is not a multiple of ``num_workers`` or exceeds a shard.
    """
    if global_batch % num_workers:
        raise ValueError(f"`batch_size` {global_batch} must be a multiple of the "
                         f"{num_workers} workers")
    steps = num_examples(arrays.train[0]) // num_workers // (global_batch // num_workers)
    if steps < 1:
        raise ValueError(f"`batch_size` {global_batch} is larger than the training set allows")
    return steps


def train_dataset(arrays: Arrays, global_batch: int, num_workers: int, worker_index: int,
                  seed: int, start_batch: int = 0) -> tuple[tf.data.Dataset, int]:
    """This worker's shard, reshuffled every epoch, batched per worker, endless.

    The order is a pure function of ``(seed, worker_index, epoch)``: epoch ``e`` reads the
    shard in a stateless permutation seeded by ``[seed + worker_index, e]``.  So every new
    iterator over the data set starts at the same batch (Keras iterates a training data set
    more than once), and a resumed run that passes ``start_batch`` = the batches already
    trained reads exactly the batches the interrupted run had not reached.  Every worker gets
    the same number of steps per epoch so no collective waits for a worker that ran out.

    Args:
      arrays: The data set (``arrays.train`` is read).
      global_batch: Examples per step, all workers together.
      num_workers: Workers; worker ``i`` reads examples ``i, i + num_workers, ...``.
      worker_index: This worker's index.
      seed: The run's seed.
      start_batch: Batches of the endless stream to skip (a resumed run's trained steps).

    Returns:
      ``(dataset, steps_per_epoch)``; the data set yields this worker's batches of
      ``global_batch / num_workers`` examples.

    Raises:
      ValueError: If ``global_batch`` is not a multiple of ``num_workers`` or exceeds a shard,
        or ``start_batch`` < 0.
    """
    steps = steps_per_epoch(arrays, global_batch, num_workers)
    if start_batch < 0:
        raise ValueError(f"`start_batch` must be >= 0, got {start_batch}")
    per_worker = global_batch // num_workers
    shard = np.arange(worker_index, num_examples(arrays.train[0]), num_workers)
    shard_t = tf.constant(shard, tf.int64)
    data_t = tf.nest.map_structure(tf.convert_to_tensor, arrays.train)
    stream_seed = tf.constant(seed + worker_index, tf.int64)

    def epoch(e: tf.Tensor) -> tf.data.Dataset:
        order = tf.random.experimental.stateless_shuffle(shard_t, tf.stack([stream_seed, e]))
        return tf.data.Dataset.from_tensor_slices(order[:steps * per_worker]).batch(per_worker)

    def gather(idx: tf.Tensor):
        return tf.nest.map_structure(lambda a: tf.gather(a, idx), data_t)

    ds = tf.data.Dataset.range(2**62).flat_map(epoch).skip(start_batch)  # indices: cheap
    ds = ds.map(gather, num_parallel_calls=tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    options.deterministic = True
    return ds.with_options(options), steps


def train_input(strategy: tf.distribute.Strategy, arrays: Arrays, global_batch: int,
                num_workers: int, worker_index: int, seed: int, start_batch: int = 0):
    """What ``model.fit`` trains on: :func:`train_dataset` as the strategy needs it.

    On several workers every worker's pipeline goes through
    ``distribute_datasets_from_function`` with per-replica batches, so a step trains on
    ``global_batch`` examples: ``global_batch / num_workers`` from each worker's own shard.
    (Handing a per-worker data set to ``model.fit`` directly would make the strategy split
    each worker's batch over all replicas of the cluster: each step would train on
    ``global_batch / num_workers`` examples in all.)  On one worker the data set itself.

    Returns:
      ``(input, steps_per_epoch)``.

    Raises:
      ValueError: ``global_batch`` is not a multiple of the replicas.
    """
    dataset, steps = train_dataset(arrays, global_batch, num_workers, worker_index, seed,
                                   start_batch)
    replicas = strategy.num_replicas_in_sync
    if num_workers == 1:
        return dataset, steps
    if global_batch % replicas:
        raise ValueError(f"`batch_size` {global_batch} must be a multiple of the {replicas} "
                         f"replicas")
    per_replica = global_batch // replicas

    def per_worker(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        return dataset.rebatch(per_replica, drop_remainder=True)

    return strategy.distribute_datasets_from_function(per_worker), steps


def eval_kwargs(model: str) -> dict:
    """Keyword arguments of ``evaluate_exactly`` / ``ExactValidation`` for ``model``.

    Sequence models count non-PAD target tokens with a per-token cross-entropy; image models
    use the compiled loss (no arguments).
    """
    from models import registry

    if not registry.is_sequence_model(model):
        return {}
    import keras

    from models import nmt

    def token_ce(y_true: tf.Tensor, y_pred: tf.Tensor) -> tf.Tensor:
        return keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)

    return {"loss": token_ce, "ignore_label": nmt.PAD}
