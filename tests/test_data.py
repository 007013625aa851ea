"""Tests for the offline data loaders in launch/data.py."""

from __future__ import annotations

import gzip
import struct
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from launch import data

_TYPE_CODES = {
    np.dtype(np.uint8): 0x08,
    np.dtype(np.int8): 0x09,
    np.dtype(np.int16): 0x0B,
    np.dtype(np.int32): 0x0C,
    np.dtype(np.float32): 0x0D,
    np.dtype(np.float64): 0x0E,
}


def _idx_bytes(array: np.ndarray) -> bytes:
    """Encodes ``array`` as an IDX file (big-endian header and payload)."""
    header = bytes([0, 0, _TYPE_CODES[array.dtype], array.ndim])
    header += struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(array.dtype.newbyteorder(">")).tobytes()


def _write(path: Path, payload: bytes, compress: bool) -> Path:
    path.write_bytes(gzip.compress(payload) if compress else payload)
    return path


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "gzip"])
@pytest.mark.parametrize("dtype", list(_TYPE_CODES), ids=lambda d: d.name)
def test_read_idx_round_trip(tmp_path: Path, dtype: np.dtype, compress: bool) -> None:
    rng = np.random.default_rng(0)
    array = (rng.standard_normal((3, 4, 5)) * 50).astype(dtype)
    path = _write(tmp_path / "a.idx", _idx_bytes(array), compress)

    out = data.read_idx(path)

    assert out.dtype == dtype.newbyteorder("=")
    assert out.dtype.isnative
    assert out.shape == array.shape
    np.testing.assert_array_equal(out, array)
    out[0, 0, 0] = 0  # a writable copy, not a view of the file buffer


def test_read_idx_detects_gzip_by_magic_not_name(tmp_path: Path) -> None:
    labels = np.arange(10, dtype=np.uint8)
    path = _write(tmp_path / "labels.idx", _idx_bytes(labels), compress=True)
    np.testing.assert_array_equal(data.read_idx(path), labels)


def test_read_idx_empty_array(tmp_path: Path) -> None:
    empty = np.zeros((0, 28, 28), dtype=np.uint8)
    path = _write(tmp_path / "empty.idx", _idx_bytes(empty), compress=False)
    assert data.read_idx(path).shape == (0, 28, 28)


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        (b"\x01\x00\x08\x01" + struct.pack(">I", 2) + b"\x00\x00", "magic"),
        (b"\x00\x00\x07\x01" + struct.pack(">I", 2) + b"\x00\x00", "type code"),
        (b"\x00\x00", "too short"),
        (b"\x00\x00\x08\x03" + struct.pack(">I", 2), "truncated IDX header"),
        (b"\x00\x00\x08\x01" + struct.pack(">I", 4) + b"\x00\x00\x00", "payload"),
        (b"\x00\x00\x08\x01" + struct.pack(">I", 2) + b"\x00\x00\x00", "payload"),
        (b"\x00\x00\x0c\x01" + struct.pack(">I", 2) + b"\x00" * 7, "payload"),
    ],
    ids=["bad-magic", "bad-type", "short", "short-header", "truncated", "trailing", "int32-odd"],
)
@pytest.mark.parametrize("compress", [False, True], ids=["plain", "gzip"])
def test_read_idx_malformed_raises(
        tmp_path: Path, payload: bytes, match: str, compress: bool) -> None:
    path = _write(tmp_path / "bad.idx", payload, compress)
    with pytest.raises(ValueError, match=match) as info:
        data.read_idx(path)
    assert str(path) in str(info.value)


def test_read_idx_corrupt_gzip_raises(tmp_path: Path) -> None:
    good = gzip.compress(_idx_bytes(np.arange(100, dtype=np.uint8)))
    path = _write(tmp_path / "cut.idx.gz", good[: len(good) // 2], compress=False)
    with pytest.raises(ValueError, match="gzip") as info:
        data.read_idx(path)
    assert str(path) in str(info.value)


def test_load_digits_shapes_and_ranges() -> None:
    (x_train, y_train), (x_test, y_test) = data.load_digits()

    assert x_train.shape[1:] == (8, 8, 1) and x_test.shape[1:] == (8, 8, 1)
    assert x_train.dtype == np.float32 and x_test.dtype == np.float32
    assert y_train.dtype == np.int32 and y_test.dtype == np.int32
    assert len(x_train) == len(y_train) and len(x_test) == len(y_test)
    assert len(x_train) + len(x_test) == 1797
    assert len(x_test) == pytest.approx(0.2 * 1797, abs=1)
    for x in (x_train, x_test):
        assert x.min() >= 0.0 and x.max() <= 1.0
    assert x_train.max() == 1.0
    # Stratified: every class appears in both splits.
    assert set(np.unique(y_train)) == set(range(10)) == set(np.unique(y_test))


def test_load_digits_is_deterministic() -> None:
    first, second = data.load_digits(), data.load_digits()
    for (xa, ya), (xb, yb) in zip(first, second, strict=True):
        np.testing.assert_array_equal(xa, xb)
        np.testing.assert_array_equal(ya, yb)


def test_digits_split_is_stratified_and_uses_every_image_once() -> None:
    with np.load(data.DIGITS_FILE) as f:
        images, labels = f["images"], f["labels"]
        train, test = f["train_index"], f["test_index"]
    assert images.shape == (1797, 8, 8) and images.max() == 16 and labels.shape == (1797,)
    assert sorted(np.concatenate([train, test]).tolist()) == list(range(1797))
    # every class holds 20% of its images out, to within one image
    for c in range(10):
        n = int(np.sum(labels == c))
        assert abs(int(np.sum(labels[test] == c)) - 0.2 * n) <= 1, c


def test_digits_file_is_scikit_learns_split() -> None:
    """Where scikit-learn is installed: the shipped file is what ``make_digits.py`` writes."""
    pytest.importorskip("sklearn")
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    (x_train, y_train), (x_test, y_test) = data.load_digits()
    xa, xb, ya, yb = train_test_split(bunch.images, bunch.target, test_size=0.2,
                                      random_state=0, stratify=bunch.target)
    np.testing.assert_array_equal(x_train[..., 0] * 16, xa)
    np.testing.assert_array_equal(x_test[..., 0] * 16, xb)
    np.testing.assert_array_equal(y_train, ya)
    np.testing.assert_array_equal(y_test, yb)


def test_load_dataset_dispatch_digits() -> None:
    (x_train, _), (x_test, _) = data.load_dataset("digits")
    assert x_train.shape[1:] == (8, 8, 1) and x_test.shape[1:] == (8, 8, 1)


def test_load_dataset_unknown_name() -> None:
    with pytest.raises(ValueError, match="'no_such_set'"):
        data.load_dataset("no_such_set")


def test_load_fashion_mnist_missing_dir(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    assert not data.fashion_mnist_available(missing)
    with pytest.raises(FileNotFoundError) as info:
        data.load_fashion_mnist(missing)
    message = str(info.value)
    assert str(missing) in message
    assert "apt-get install dataset-fashion-mnist" in message
    with pytest.raises(FileNotFoundError):
        data.load_dataset("fashion_mnist", data_dir=missing)


def test_load_fashion_mnist_synthetic(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    sizes = {"train": 6, "test": 4}
    for part, n in sizes.items():
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, size=(n,), dtype=np.uint8)
        _write(tmp_path / data.FASHION_MNIST_FILES[f"x_{part}"], _idx_bytes(images), True)
        _write(tmp_path / data.FASHION_MNIST_FILES[f"y_{part}"], _idx_bytes(labels), True)
    assert data.fashion_mnist_available(tmp_path)

    (x_train, y_train), (x_test, y_test) = data.load_fashion_mnist(tmp_path)

    assert x_train.shape == (6, 28, 28, 1) and x_test.shape == (4, 28, 28, 1)
    assert x_train.dtype == np.float32 and y_train.dtype == np.int32
    assert y_train.shape == (6,) and y_test.shape == (4,)
    assert 0.0 <= x_train.min() and x_train.max() <= 1.0


def test_load_fashion_mnist_label_count_mismatch(tmp_path: Path) -> None:
    for part in ("train", "test"):
        images = np.zeros((3, 28, 28), dtype=np.uint8)
        labels = np.zeros((2 if part == "test" else 3,), dtype=np.uint8)
        _write(tmp_path / data.FASHION_MNIST_FILES[f"x_{part}"], _idx_bytes(images), True)
        _write(tmp_path / data.FASHION_MNIST_FILES[f"y_{part}"], _idx_bytes(labels), True)
    with pytest.raises(ValueError, match="inconsistent"):
        data.load_fashion_mnist(tmp_path)


@pytest.mark.skipif(
    not data.fashion_mnist_available(),
    reason=f"Debian dataset-fashion-mnist not installed in {data.DEFAULT_FASHION_MNIST_DIR}",
)
def test_load_fashion_mnist_debian_files() -> None:
    (x_train, y_train), (x_test, y_test) = data.load_dataset("fashion_mnist")

    assert x_train.shape == (60000, 28, 28, 1) and x_test.shape == (10000, 28, 28, 1)
    assert y_train.shape == (60000,) and y_test.shape == (10000,)
    assert x_train.dtype == np.float32 and y_train.dtype == np.int32
    assert x_train.min() >= 0.0 and x_train.max() <= 1.0
    assert set(np.unique(y_train)) == set(range(10)) == set(np.unique(y_test))


def test_tfds_data_set_not_downloaded_names_the_flags(tmp_path: Path):
    """Offline, a TFDS data set missing from --tfds_data_dir is a clear error, not TFDS's
    own assertion; nothing is written there."""
    pytest.importorskip("tensorflow_datasets")
    from launch import inputs

    with pytest.raises(inputs.DatasetUnavailableError,
                       match=r"--dataset=tfds:mnist.*--tfds_data_dir=.*download") as err:
        inputs.load_arrays("tfds:mnist", "cnn_small", tfds_data_dir=str(tmp_path))
    assert isinstance(err.value, ValueError)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(inputs.DatasetUnavailableError, match="no data set 'no_such_set'"):
        inputs.load_arrays("tfds:no_such_set", "cnn_small", tfds_data_dir=str(tmp_path))


class _BrokenTFDS(types.ModuleType):
    """Stands in for a tensorflow-datasets install whose lazily loaded core fails (as with a
    protobuf older than tensorflow-metadata's generated code)."""

    def __getattr__(self, name: str):
        raise AttributeError(f"module 'tensorflow_datasets' has no attribute {name!r}")


def test_tfds_that_does_not_load_is_one_clear_error(monkeypatch, tmp_path: Path):
    from launch import inputs

    monkeypatch.setitem(sys.modules, "tensorflow_datasets", _BrokenTFDS("tensorflow_datasets"))
    with pytest.raises(inputs.DatasetUnavailableError,
                       match=r"--dataset=tfds:mnist: tensorflow-datasets is installed but does "
                             r"not load \(AttributeError: .*'core'\).*another --dataset"):
        inputs.load_arrays("tfds:mnist", "cnn_small", tfds_data_dir=str(tmp_path))


def test_missing_fashion_mnist_names_the_flags(tmp_path: Path):
    from launch import inputs

    with pytest.raises(inputs.DatasetUnavailableError,
                       match=r"--dataset=fashion_mnist --data_dir=.*digits"):
        inputs.load_arrays("fashion_mnist", "cnn_small", data_dir=str(tmp_path))
