"""Offline data loading for the launch scripts (no network access).

Two data sets are supported:

* ``fashion_mnist``: Debian's ``dataset-fashion-mnist`` package, which installs the
  gzipped IDX files under ``/usr/share/datasets/fashion-mnist``.
* ``digits``: the 8x8 digits (1,797 images, a copy of the test set of UCI's optical
  recognition of handwritten digits, as scikit-learn bundles it), shipped with the
  repository in ``datasets/digits.npz``; the fallback when the Debian files are not
  installed.

Every loader returns ``((x_train, y_train), (x_test, y_test))`` with images as
``float32`` in ``[0, 1]`` shaped ``[N, H, W, 1]`` and labels as ``int32`` shaped ``[N]``.
"""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import numpy as np

DEFAULT_FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"

FASHION_MNIST_FILES = {
    "x_train": "train-images-idx3-ubyte.gz",
    "y_train": "train-labels-idx1-ubyte.gz",
    "x_test": "t10k-images-idx3-ubyte.gz",
    "y_test": "t10k-labels-idx1-ubyte.gz",
}

#: The 8x8 digits with their one stratified 80/20 split (``datasets/make_digits.py``).
DIGITS_FILE = Path(__file__).resolve().parents[1] / "datasets" / "digits.npz"

# IDX type codes -> big-endian numpy dtypes.
_IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_GZIP_MAGIC = b"\x1f\x8b"

Split = tuple[np.ndarray, np.ndarray]
Dataset = tuple[Split, Split]


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """Reads an IDX file (plain or gzip-compressed) into a numpy array.

    The IDX header is two zero bytes, a type code byte, a byte giving the number of
    dimensions, then one big-endian ``uint32`` per dimension; the payload follows in
    big-endian C order. Compression is detected from the gzip magic bytes, not the
    file name.

    Args:
        path: Path to the IDX file.

    Returns:
        The array, shaped as the header's dimensions, with the native-endian dtype
        matching the IDX type code.

    Raises:
        FileNotFoundError: If ``path`` does not exist.
        ValueError: If the file is not a well-formed IDX file (bad magic number,
            unknown type code, corrupt gzip stream, or a payload whose length does not
            match the dimensions).
    """
    path = Path(path)
    raw = path.read_bytes()
    if raw[:2] == _GZIP_MAGIC:
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as e:
            raise ValueError(f"{path}: corrupt gzip stream: {e}") from e

    if len(raw) < 4:
        raise ValueError(f"{path}: too short for an IDX header ({len(raw)} bytes)")
    zero0, zero1, type_code, ndim = raw[0], raw[1], raw[2], raw[3]
    if zero0 != 0 or zero1 != 0:
        raise ValueError(
            f"{path}: bad IDX magic number {raw[:4].hex()} (expected 0000<type><ndim>)")
    if type_code not in _IDX_DTYPES:
        raise ValueError(f"{path}: unknown IDX type code 0x{type_code:02x}")
    dtype = _IDX_DTYPES[type_code]

    header_len = 4 + 4 * ndim
    if len(raw) < header_len:
        raise ValueError(
            f"{path}: truncated IDX header: {ndim} dimensions need {header_len} bytes, "
            f"file has {len(raw)}")
    dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))

    expected = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    payload_len = len(raw) - header_len
    if payload_len != expected:
        raise ValueError(
            f"{path}: IDX payload is {payload_len} bytes but dimensions {dims} of "
            f"{dtype.str} need {expected}")

    data = np.frombuffer(raw, dtype=dtype, offset=header_len).reshape(dims)
    return data.astype(dtype.newbyteorder("="))


def fashion_mnist_available(data_dir: str | os.PathLike[str] = DEFAULT_FASHION_MNIST_DIR) -> bool:
    """Tells whether all four Fashion-MNIST IDX files are present.

    Args:
        data_dir: Directory expected to hold the Debian ``dataset-fashion-mnist`` files.

    Returns:
        True if every file in ``FASHION_MNIST_FILES`` exists under ``data_dir``.
    """
    root = Path(data_dir)
    return all((root / name).is_file() for name in FASHION_MNIST_FILES.values())


def _to_images(x: np.ndarray, scale: float) -> np.ndarray:
    """Scales images to float32 in [0, 1] and adds a trailing channel axis."""
    return (x.astype(np.float32) / np.float32(scale))[..., np.newaxis]


def load_fashion_mnist(data_dir: str | os.PathLike[str] = DEFAULT_FASHION_MNIST_DIR) -> Dataset:
    """Loads Fashion-MNIST from Debian's IDX files.

    Args:
        data_dir: Directory holding the four gzipped IDX files.

    Returns:
        ``((x_train, y_train), (x_test, y_test))`` with ``x`` float32 in ``[0, 1]``
        shaped ``[N, 28, 28, 1]`` (60000 train, 10000 test) and ``y`` int32 in
        ``[0, 10)``.

    Raises:
        FileNotFoundError: If any of the files is missing from ``data_dir``.
        ValueError: If a file is malformed or images and labels disagree in count.
    """
    root = Path(data_dir)
    missing = [name for name in FASHION_MNIST_FILES.values() if not (root / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"Fashion-MNIST not found in {str(data_dir)!r} (missing: {', '.join(missing)}). "
            "Install it with `apt-get install dataset-fashion-mnist`, or use the "
            "'digits' data set instead.")

    arrays = {key: read_idx(root / name) for key, name in FASHION_MNIST_FILES.items()}
    splits = []
    for part in ("train", "test"):
        x, y = arrays[f"x_{part}"], arrays[f"y_{part}"]
        if x.ndim != 3 or y.ndim != 1 or x.shape[0] != y.shape[0]:
            raise ValueError(
                f"Fashion-MNIST {part} split in {str(data_dir)!r} has inconsistent shapes: "
                f"images {x.shape}, labels {y.shape}")
        splits.append((_to_images(x, 255.0), y.astype(np.int32)))
    return splits[0], splits[1]


def load_digits() -> Dataset:
    """Loads the 8x8 digits with the stratified 80/20 train/test split every run uses
    (:data:`DIGITS_FILE`; no scikit-learn needed).

    Returns:
        ``((x_train, y_train), (x_test, y_test))`` with ``x`` float32 in ``[0, 1]``
        shaped ``[N, 8, 8, 1]`` (1,437 and 360 images) and ``y`` int32 in ``[0, 10)``.
    """
    with np.load(DIGITS_FILE) as f:
        images = _to_images(f["images"], 16.0)  # pixel values are 0..16
        labels = f["labels"].astype(np.int32)
        train, test = f["train_index"], f["test_index"]
    return (images[train], labels[train]), (images[test], labels[test])


def load_dataset(name: str, data_dir: str | os.PathLike[str] | None = None) -> Dataset:
    """Loads a data set by name.

    Args:
        name: ``"fashion_mnist"`` or ``"digits"``.
        data_dir: Directory for Fashion-MNIST; ``None`` means the Debian location.
            Ignored for ``digits``.

    Returns:
        ``((x_train, y_train), (x_test, y_test))`` as described in the module docstring.

    Raises:
        ValueError: If ``name`` is not a known data set.
        FileNotFoundError: If Fashion-MNIST is requested but not installed.
    """
    if name == "fashion_mnist":
        return load_fashion_mnist(DEFAULT_FASHION_MNIST_DIR if data_dir is None else data_dir)
    if name == "digits":
        return load_digits()
    raise ValueError(f"unknown data set {name!r}; expected 'fashion_mnist' or 'digits'")
