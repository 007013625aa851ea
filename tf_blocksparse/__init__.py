"""tf_blocksparse: block-wise top-k gradient exchange with error feedback for tf.distribute.

Core: :mod:`~tf_blocksparse.blocks` (block-rule table), :mod:`~tf_blocksparse.options` (the
one options object), :mod:`~tf_blocksparse.selection`, :mod:`~tf_blocksparse.feedback`,
:mod:`~tf_blocksparse.codec`, :mod:`~tf_blocksparse.collectives`,
:mod:`~tf_blocksparse.exchange` (the one exchange), :mod:`~tf_blocksparse.hooks` (its entry
point per fusion bucket), :mod:`~tf_blocksparse.clipping`, and the
TensorFlow-free planners, whose public names :mod:`tf_blocksparse.planning` gathers.
Products, each with its planner and its runtime: :mod:`tf_blocksparse.fusion`,
:mod:`tf_blocksparse.pipeline` and :mod:`tf_blocksparse.hybrid` (the two trainers share
:mod:`tf_blocksparse.runtime`).  Adapters: :mod:`tf_blocksparse.keras`,
:mod:`tf_blocksparse.distribute` and the automatic exchange :mod:`tf_blocksparse.auto`.  The
local multi-worker launcher :mod:`tf_blocksparse.launcher` is the command ``tfbs-run``.

Importing the package imports no TensorFlow: the public names below are loaded on first
use, so ``import tf_blocksparse.planning`` stays light.  Keras must still find
``BlockSparseOptimizer`` when it loads a ``.keras`` file after ``import tf_blocksparse``:
the optimizer registers itself with Keras as soon as Keras is imported (at once if it
already is), or, when a tf_blocksparse module imports Keras itself, as soon as that module
is imported.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import threading
from typing import Any

from tf_blocksparse import planning as planning  # TensorFlow-free, imported eagerly

#: Public name -> module that defines it.
_EXPORTS = {
    "AutoExchange": "tf_blocksparse.planning.exchange_cost",
    "AutoExchangeCallback": "tf_blocksparse.auto.auto_callback",
    "BackupAndRestore": "tf_blocksparse.keras.backup",
    "BlockLayout": "tf_blocksparse.blocks",
    "BlockRule": "tf_blocksparse.blocks",
    "BlockSparseCrossDeviceOps": "tf_blocksparse.distribute.cross_device_ops",
    "BlockSparseMetrics": "tf_blocksparse.keras.callbacks",
    "BlockSparseOptimizer": "tf_blocksparse.keras.optimizer",
    "BlockTopK": "tf_blocksparse.feedback",
    "CompressionOptions": "tf_blocksparse.options",
    "DensePhaseCallback": "tf_blocksparse.keras.dense_phase",
    "DensityWarmup": "tf_blocksparse.keras.warmup",
    "ElementTopK": "tf_blocksparse.feedback",
    "EvalResult": "tf_blocksparse.keras.evaluation",
    "ExactValidation": "tf_blocksparse.keras.evaluation",
    "FusedCrossDeviceOps": "tf_blocksparse.distribute.fused_ops",  # deprecated name
    "HybridTrainer": "tf_blocksparse.hybrid.trainer",
    "LocalStepsCallback": "tf_blocksparse.keras.local_steps",
    "LossScaleOptimizer": "tf_blocksparse.keras.loss_scale",
    "MomentumCorrection": "tf_blocksparse.keras.momentum",
    "MissingFitCallbackWarning": "tf_blocksparse.keras.fit_loop",
    "MultiWorkerMirroredStrategy": "tf_blocksparse.distribute.strategy",
    "Payload": "tf_blocksparse.feedback",
    "PipelineTrainer": "tf_blocksparse.pipeline.trainer",
    "block_table": "tf_blocksparse.block_report",
    "clipping": "tf_blocksparse.clipping",
    "evaluate_exactly": "tf_blocksparse.keras.evaluation",
    "find_boundary": "tf_blocksparse.hybrid.split",
    "fit_callbacks": "tf_blocksparse.keras.fit_loop",
    "format_block_table": "tf_blocksparse.block_report",
    "profile_model": "tf_blocksparse.pipeline.profiler",
    "save_model": "tf_blocksparse.keras.backup",
    "split_model": "tf_blocksparse.hybrid.split",
}
#: Modules whose import registers Keras-serialisable classes.
_KERAS_REGISTERED = ("tf_blocksparse.keras.optimizer",)

__all__ = sorted([*_EXPORTS, "planning"])
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tf_blocksparse' has no attribute {name!r}")
    imported = importlib.import_module(module)
    value = imported if module.rsplit(".", 1)[-1] == name else getattr(imported, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


def _register_with_keras() -> None:
    for module in _KERAS_REGISTERED:
        importlib.import_module(module)


def _warn_unregistered(err: Exception) -> None:
    import warnings

    warnings.warn(f"tf_blocksparse could not register its Keras classes: {err}", stacklevel=3)


class _RegisterAfterKeras(importlib.abc.MetaPathFinder):
    """Runs :func:`_register_with_keras` once ``keras`` is imported and no tf_blocksparse
    module is being imported.

    After a user's ``import keras`` that is right away.  When a tf_blocksparse module imports
    Keras itself (``tfbs.BlockSparseOptimizer`` touched first, or any module of
    :mod:`tf_blocksparse.keras`), registering at once would import the optimizer module in
    the middle of its own imports (a circular import): the finder counts the tf_blocksparse
    modules executing and registers when the outermost of them is done.
    """

    def __init__(self) -> None:
        self._executing = 0  # tf_blocksparse modules whose code is running
        self._keras_imported = False
        self._lock = threading.Lock()

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != "keras" and not fullname.startswith("tf_blocksparse."):
            return None
        spec = self._others_spec(fullname, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module
        is_keras = fullname == "keras"

        def exec_then_register(module: Any) -> None:
            with self._lock:
                self._executing += not is_keras
            try:
                exec_module(module)
            except BaseException:
                with self._lock:
                    self._executing -= not is_keras
                raise
            with self._lock:
                self._executing -= not is_keras
                self._keras_imported |= is_keras
                ready = self._keras_imported and not self._executing and self in sys.meta_path
                if ready:
                    sys.meta_path.remove(self)
            if ready:
                try:
                    _register_with_keras()
                except Exception as err:  # never break `import keras` for planning-only users
                    _warn_unregistered(err)

        spec.loader.exec_module = exec_then_register  # type: ignore[method-assign]
        return spec

    def _others_spec(self, fullname: str, path: Any, target: Any) -> Any:
        """The spec the finders after this one give ``fullname``."""
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                return spec
        return None


if "keras" in sys.modules:
    _register_with_keras()
elif not any(isinstance(f, _RegisterAfterKeras) for f in sys.meta_path):
    sys.meta_path.insert(0, _RegisterAfterKeras())
