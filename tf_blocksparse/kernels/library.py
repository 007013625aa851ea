"""Where the fused kernels' library lives and whether it is up to date, without TensorFlow.

The build (``build.py``, also run by path from ``make kernels``) and the loader
(``kernels/__init__``) share these rules; nothing here imports TensorFlow, so an up-to-date
library is recognised in a fraction of a second.
"""

from __future__ import annotations

import importlib.metadata
import pathlib

__all__ = ["DISTRIBUTIONS", "SOURCE", "library_path", "up_to_date"]

#: The kernels' C++ source.
SOURCE = pathlib.Path(__file__).with_name("blocksparse_ops.cc")
#: Distributions that install the ``tensorflow`` module, in the order they are looked up.
DISTRIBUTIONS = ("tensorflow", "tensorflow-cpu", "tensorflow-intel", "tensorflow-macos",
                 "tf-nightly", "tf-nightly-cpu")


def library_path(tf_version: str | None = None) -> pathlib.Path:
    """The library's path for a TensorFlow version (one library per major.minor: its ABI).

    Args:
      tf_version: e.g. ``"2.21.0"``; default: the installed TensorFlow's, read from package
        metadata (without importing TensorFlow), or from ``tf.__version__`` when no known
        distribution provides it.
    """
    if tf_version is None:
        tf_version = _installed_version()
    return SOURCE.with_name(
        "_blocksparse_ops-tf{}.so".format(".".join(tf_version.split(".")[:2])))


def _installed_version() -> str:
    for name in DISTRIBUTIONS:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    import tensorflow as tf

    return tf.__version__


def up_to_date(output: pathlib.Path) -> bool:
    """Whether ``output`` exists and is not older than the source."""
    return output.exists() and output.stat().st_mtime >= SOURCE.stat().st_mtime
