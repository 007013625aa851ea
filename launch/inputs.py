"""Arrays for every ``--dataset`` and per-worker sharded ``tf.data`` input pipelines."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from launch import data


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


def _tfds_arrays(name: str, data_dir: str | None) -> tuple[tuple, tuple]:
    import tensorflow_datasets as tfds

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
    if model == "gru_nmt":
        from models import nmt

        if dataset not in ("toy_translation", "fashion_mnist"):
            raise ValueError(f"`dataset`: gru_nmt trains on toy_translation, got {dataset!r}")
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
        train, test = data.load_fashion_mnist(data_dir or "/usr/share/datasets/fashion-mnist")
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


def train_dataset(arrays: Arrays, global_batch: int, num_workers: int, worker_index: int,
                  seed: int) -> tuple[tf.data.Dataset, int]:
    """This worker's shard, shuffled, batched per worker and repeated.

    Every worker gets the same number of steps (``steps_per_epoch``) so no collective waits
    for a worker that ran out of data.

    Returns:
      ``(dataset, steps_per_epoch)``.

    Raises:
      ValueError: If ``global_batch`` is not a multiple of ``num_workers`` or exceeds a shard.
    """
    if global_batch % num_workers:
        raise ValueError(f"`batch_size` {global_batch} must be a multiple of the "
                         f"{num_workers} workers")
    per_worker = global_batch // num_workers
    steps = num_examples(arrays.train[0]) // num_workers // per_worker
    if steps < 1:
        raise ValueError(f"`batch_size` {global_batch} is larger than the training set allows")
    ds = tf.data.Dataset.from_tensor_slices(arrays.train).shard(num_workers, worker_index)
    ds = ds.shuffle(10_000, seed=seed + worker_index, reshuffle_each_iteration=True)
    ds = ds.batch(per_worker, drop_remainder=True).repeat().prefetch(tf.data.AUTOTUNE)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    return ds.with_options(options), steps


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
