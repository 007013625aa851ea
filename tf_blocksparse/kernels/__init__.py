"""Fused CPU kernels of the compression step, with the pure-TensorFlow path as fallback.

Two custom ops (``blocksparse_ops.cc``, built by ``python -m tf_blocksparse.kernels.build``)
do a variable's compression work in about one ``residual += grad`` pass over memory:

- ``BlockAccumulateScore(grad, residual) -> (acc, scores)``: ``acc = grad + residual`` and
  the L1 / L2 norm of every block of ``acc``, in one pass;
- ``TakeBlocks(acc, ids) -> (values, residual)``: the selected blocks as rows and ``acc``
  with them zeroed, in ``acc``'s own buffer when nothing else holds it (no full copy);

and ``BlockScores(x)`` scores without accumulating.  The library is loaded the first time it
is needed.  When it is missing or does not load, the TensorFlow path is used and one warning
per process says how to build it; ``TF_BLOCKSPARSE_KERNELS=0`` forces the TensorFlow path.

The ops are registered for CPU only (no CUDA kernel is built yet): :func:`fusable` sends a
tensor to them only when it is float32/float64 and placed on a CPU (or unplaced with no GPU
visible).  ``acc``, ``values`` and the residual are bit-exact against the TensorFlow path;
scores may differ from it in the last bits (another summation order), and are deterministic
(the same for any thread count).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import threading
import warnings
from collections.abc import Iterator
from types import ModuleType

import tensorflow as tf

from tf_blocksparse.blocks import BlockLayout
from tf_blocksparse.kernels.library import library_path

__all__ = ["ENV", "LIBRARY", "accumulate_score", "block_scores", "enabled", "fusable",
           "load", "path_name", "register", "reset", "take_blocks", "tf_path"]

#: Environment variable; ``0`` forces the pure-TensorFlow path.
ENV = "TF_BLOCKSPARSE_KERNELS"
#: The built library, next to its source; one per TensorFlow minor version (its ABI), so
#: environments with different TensorFlow versions can share a checkout.
LIBRARY = library_path(tf.__version__)
BUILD_HINT = "python -m tf_blocksparse.kernels.build (or `make kernels`)"
_DTYPES = (tf.float32, tf.float64)
_OPS = ("BlockAccumulateScore", "BlockScores", "TakeBlocks")

_lock = threading.Lock()
_state: dict = {"tried": False, "module": None, "warned": False, "off": 0}


def enabled() -> bool:
    """False when ``TF_BLOCKSPARSE_KERNELS=0`` (or ``false`` / ``off``) forces the TF path,
    or inside :func:`tf_path`."""
    return not _state["off"] and \
        os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off", "no")


@contextlib.contextmanager
def tf_path() -> Iterator[None]:
    """Ops built (traced) inside this block take the pure-TensorFlow path (comparisons)."""
    with _lock:
        _state["off"] += 1
    try:
        yield
    finally:
        with _lock:
            _state["off"] -= 1


def _open(path: pathlib.Path) -> ModuleType:
    module = tf.load_op_library(str(path))
    for name in _OPS:
        tf.no_gradient(name)
    return module


def register(path: pathlib.Path | None = None) -> ModuleType | None:
    """Loads the library if it is built, ignoring :data:`ENV` and warning nothing.

    For processes that only serve ops to others (a ``tf.distribute.Server``), so that a
    client that places the fused ops on them finds the kernels.
    """
    try:
        return _open(path or LIBRARY) if (path or LIBRARY).exists() else None
    except (tf.errors.NotFoundError, OSError):
        return None


def load(path: pathlib.Path | None = None) -> ModuleType | None:
    """The op module, loading it on first use; ``None`` when the TF path must be used.

    Args:
      path: The library to load (default :data:`LIBRARY`); only the first call loads.

    Returns:
      The module from ``tf.load_op_library``, or ``None`` when :data:`ENV` disables the
      kernels or the library is missing or fails to load (one warning per process).
    """
    if not enabled():
        return None
    with _lock:
        if not _state["tried"]:
            _state["tried"] = True
            path = path or LIBRARY
            try:
                if not path.exists():
                    raise FileNotFoundError(f"{path} is not built")
                _state["module"] = _open(path)
            except (tf.errors.NotFoundError, OSError) as e:
                reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                if not _state["warned"]:
                    _state["warned"] = True
                    warnings.warn(
                        f"tf_blocksparse: fused CPU kernels unavailable ({reason}); using the "
                        f"pure-TensorFlow path (slower). Build them with {BUILD_HINT}.",
                        RuntimeWarning, stacklevel=3)
        return _state["module"]


def reset() -> None:
    """Forgets the load attempt and the warning (tests)."""
    with _lock:
        _state.update(tried=False, module=None, warned=False, off=0)


def path_name() -> str:
    """``"fused_cpu"`` when the kernels are used for CPU float tensors, else ``"tf"``."""
    return "fused_cpu" if load() is not None else "tf"


def _on_cpu(x: tf.Tensor) -> bool:
    device = x.device
    if device:
        return tf.DeviceSpec.from_string(device).device_type in (None, "CPU")
    return not tf.config.list_logical_devices("GPU")


def fusable(x: tf.Tensor) -> bool:
    """True when ``x`` goes to the fused ops: float32/64 on CPU, not empty (an empty
    variable has no blocks), and the kernels loaded."""
    return (x.dtype in _DTYPES and x.shape.num_elements() != 0 and _on_cpu(x)
            and load() is not None)


def _attrs(layout: BlockLayout) -> dict:
    outer, nb, inner = layout.view_shape
    return {"outer": outer, "num_blocks": nb, "inner": inner}


def _metric(layout: BlockLayout, metric: str) -> str:
    # A one-element block's norm is |x| for either metric (as on the TF path), also where
    # x * x would overflow.
    return "l1" if layout.block_size == 1 else metric


def accumulate_score(grad: tf.Tensor, residual: tf.Tensor, layout: BlockLayout,
                     metric: str) -> tuple[tf.Tensor, tf.Tensor]:
    """``(acc, scores)``: ``grad + residual`` [*shape] and its block norms [num_blocks]."""
    acc, scores = load().block_accumulate_score(grad, residual, metric=_metric(layout, metric),
                                                **_attrs(layout))
    return acc, scores


def block_scores(x: tf.Tensor, layout: BlockLayout, metric: str) -> tf.Tensor:
    """Block norms [num_blocks] of ``x`` [*shape]."""
    return load().block_scores(x, metric=_metric(layout, metric), **_attrs(layout))


def take_blocks(acc: tf.Tensor, layout: BlockLayout, ids: tf.Tensor
                ) -> tuple[tf.Tensor, tf.Tensor]:
    """``(values [k, block_size], residual [*shape])``: blocks ``ids`` [k] and the rest."""
    values, residual = load().take_blocks(acc, ids, **_attrs(layout))
    return values, residual
