"""Every use of a private TensorFlow or Keras API, in one place.

The rest of the package calls these functions instead of reaching into ``keras.src``,
``tf.__internal__`` or underscore attributes, so a TensorFlow / Keras upgrade that changes one
of them breaks one contract test (``tests/test_compat.py`` holds one per hook) instead of
training.  Tested with TensorFlow 2.19 / Keras 3.10 and TensorFlow 2.21 / Keras 3.15
(:data:`TESTED_PAIRS`).

TensorFlow and Keras are imported inside the functions, so TF-free modules (the block-rule
table) may import this module.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

#: The versions these hooks are checked against (``tests/test_compat.py``).
TESTED = {"tensorflow": "2.19-2.21", "keras": "3.10-3.15"}
#: The (TensorFlow, Keras) minor versions the whole test suite runs on (``make test`` and
#: ``make test-compat``).
TESTED_PAIRS = (("2.19", "3.10"), ("2.21", "3.15"))


# -- Keras optimizer -----------------------------------------------------------------------
def _pass_through(grads_and_vars: Any) -> list:
    return list(grads_and_vars)


def disable_gradient_all_reduce(optimizer: Any) -> None:
    """Makes a Keras optimizer apply gradients without its own cross-replica sum.

    Keras' TensorFlow optimizer sums the gradients over replicas in
    ``_all_reduce_sum_gradients`` before ``_backend_update_step``; a wrapper that already
    exchanged them replaces that step with the identity.
    """
    if not hasattr(optimizer, "_all_reduce_sum_gradients"):
        raise RuntimeError(
            f"{type(optimizer).__name__} has no `_all_reduce_sum_gradients`: this Keras "
            f"version is not supported (tested: Keras {TESTED['keras']})")
    optimizer._all_reduce_sum_gradients = _pass_through


def assign_replica_copies(variables: Sequence[Any], values: Sequence[Any]) -> None:
    """From replica context, gives each replica's copy of the mirrored ``tf.Variable``s
    ``variables`` that replica's ``values`` (no collective: the copies may then differ).

    A mirrored variable with no aggregation refuses ``assign`` in replica context; Keras'
    optimizers update theirs through the strategy's ``extended.update`` in a merge call
    (where the strategy needs one), and so does this.
    """
    import tensorflow as tf

    if not tf.distribute.has_strategy():
        for v, x in zip(variables, values):
            v.assign(x)
        return

    def update(distribution: Any, vals: Sequence[Any]) -> None:
        for v, x in zip(variables, vals):
            distribution.extended.update(v, lambda var, t: var.assign(t), args=(x,),
                                         group=False)

    tf.__internal__.distribute.interim.maybe_merge_call(update, tf.distribute.get_strategy(),
                                                        list(values))


def optimizer_strategy(optimizer: Any) -> Any:
    """The ``tf.distribute`` strategy a Keras optimizer was created under (Keras' TensorFlow
    optimizer records ``tf.distribute.get_strategy()`` at construction); ``None`` if it
    records none."""
    return getattr(optimizer, "_distribution_strategy", None)


def gradient_all_reduce_disabled(optimizer: Any) -> bool:
    """Whether :func:`disable_gradient_all_reduce` was applied to ``optimizer``."""
    return getattr(optimizer, "_all_reduce_sum_gradients", None) is _pass_through


def after_gradient_all_reduce(optimizer: Any, fn: Callable[[list], list]) -> None:
    """Makes a Keras optimizer pass its cross-replica gradient sum through ``fn``.

    ``fn`` takes and returns the list of ``(summed gradient, variable)`` pairs Keras' own
    all-reduce produced (identical on every replica), e.g. to clip the aggregated gradient.
    """
    if not hasattr(optimizer, "_all_reduce_sum_gradients"):
        raise RuntimeError(
            f"{type(optimizer).__name__} has no `_all_reduce_sum_gradients`: this Keras "
            f"version is not supported (tested: Keras {TESTED['keras']})")
    reduce = optimizer._all_reduce_sum_gradients

    def reduce_then(grads_and_vars: Any) -> list:
        return fn(list(reduce(grads_and_vars)))

    optimizer._all_reduce_sum_gradients = reduce_then


def momentum_only_where(optimizer: Any, keep: Callable[[int], bool]) -> None:
    """Makes a Keras ``SGD`` with momentum use it only for the variables ``keep`` accepts
    (by index in the optimizer's variable list).

    Keras' ``SGD.update_step`` reads ``self.momentum`` per variable (when it is traced);
    the others take the plain ``variable -= lr * gradient`` step and their momentum slot is
    left untouched.  Build the optimizer with its momentum set, so every slot exists.
    """
    if not callable(getattr(optimizer, "update_step", None)) or \
            not hasattr(optimizer, "momentum"):
        raise RuntimeError(
            f"{type(optimizer).__name__} has no `update_step` / `momentum`: this Keras "
            f"version is not supported (tested: Keras {TESTED['keras']})")
    update_step = type(optimizer).update_step
    momentum = optimizer.momentum

    def selective_update_step(gradient: Any, variable: Any, learning_rate: Any) -> Any:
        optimizer.momentum = momentum if keep(optimizer._get_variable_index(variable)) else 0.0
        try:
            return update_step(optimizer, gradient, variable, learning_rate)
        finally:
            optimizer.momentum = momentum

    optimizer.update_step = selective_update_step


def no_automatic_dependency_tracking(fn: Callable) -> Callable:
    """Keras' decorator that stops attribute assignments in ``fn`` from being tracked (lists
    assigned in an optimizer's ``build`` stay plain lists)."""
    from keras.src.utils import tracking

    return tracking.no_automatic_dependency_tracking(fn)


# -- tf.distribute -------------------------------------------------------------------------
def strategy_supports_no_merge_call() -> bool:
    """Whether the current strategy runs replica-context collectives without ``merge_call``
    (``MultiWorkerMirroredStrategy`` does; ``MirroredStrategy`` on CPUs does not)."""
    import tensorflow as tf

    return bool(tf.__internal__.distribute.strategy_supports_no_merge_call())


def strategy_cross_device_ops(strategy: Any) -> Any:
    """The ``CrossDeviceOps`` instance a ``MirroredStrategy`` reduces with."""
    return strategy.extended._cross_device_ops


def configure_coordination(cluster_spec: Any, heartbeat_timeout_s: float) -> bool:
    """Configures this process's coordination service as ``MultiWorkerMirroredStrategy``
    would (a standalone service led by the chief, or worker 0, coordinating the chief and
    worker jobs), with a heartbeat timeout of ``heartbeat_timeout_s``.  Call it before the
    strategy is created: the strategy configures the service only when nothing did.

    Returns:
      ``False`` (and changes nothing) when the service is configured already.
    """
    from tensorflow.python.distribute import collective_all_reduce_strategy as mwms
    from tensorflow.python.distribute import multi_worker_util
    from tensorflow.python.eager import context

    coordination_config_pb2 = mwms.coordination_config_pb2  # its place moves between versions

    ctx = context.context()
    if ctx.coordination_service is not None:
        return False
    jobs = [coordination_config_pb2.CoordinatedJob(name=job, num_tasks=cluster_spec.num_tasks(job))
            for job in ("chief", "worker") if job in cluster_spec.jobs]
    ctx.configure_coordination_service(
        service_type="standalone",
        service_leader=multi_worker_util.coordination_leader(cluster_spec),
        coordinated_jobs=jobs, heartbeat_timeout_in_ms=int(round(heartbeat_timeout_s * 1e3)))
    return True


def coordination_heartbeat_timeout_s() -> float | None:
    """The configured coordination service's heartbeat timeout in seconds (``None``: no
    service configured; 0: TensorFlow's default)."""
    from tensorflow.python.eager import context

    config = context.context().coordination_service
    return None if config is None else config.heartbeat_timeout_in_ms / 1e3


# -- Keras layers and models ---------------------------------------------------------------
def flatten_layers(model: Any) -> list[Any]:
    """Every layer inside ``model``, nested ones included (not ``model`` itself); a model
    without Keras' layer walk gives its ``layers``."""
    walk = getattr(model, "_flatten_layers", None)
    if walk is None:
        return list(getattr(model, "layers", []))
    return list(walk(include_self=False))


def own_trainable_variables(layer: Any) -> list[Any]:
    """The trainable variables ``layer`` created itself (not those of nested layers)."""
    return list(getattr(layer, "_trainable_variables", ()))


def variable_owners(variables: Iterable[Any], layers: Iterable[Any] | None = None
                    ) -> dict[int, Any]:
    """Maps ``id(variable)`` to the Keras layer that created it.

    Args:
      variables: The variables to look up.
      layers: Layers to search; ``None`` searches every live Keras layer (one pass over the
        garbage collector's objects), for an optimizer that only sees variables.
    """
    wanted = {id(v) for v in variables}
    if layers is None:
        import keras

        layers = (o for o in gc.get_objects() if isinstance(o, keras.layers.Layer))
    owners: dict[int, Any] = {}
    for layer in layers:
        for v in own_trainable_variables(layer):
            if id(v) in wanted:
                owners.setdefault(id(v), layer)
    return owners


def calling_model(optimizer: Any, depth: int = 16) -> Any:
    """The Keras model whose method (e.g. ``fit``'s symbolic build or its train step) is
    building ``optimizer``, found among the ``self`` of the callers' frames: a model whose
    ``optimizer`` is ``optimizer`` or wraps it (``inner_optimizer``); ``None`` if no caller
    within ``depth`` frames is one (a custom loop)."""
    import sys

    import keras

    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, keras.Model):
            opt = getattr(owner, "optimizer", None)
            if opt is optimizer or getattr(opt, "inner_optimizer", None) is optimizer:
                return owner
        frame = frame.f_back
    return None


def keras_history(tensor: Any) -> Any:
    """The ``(operation, node_index, tensor_index)`` record of a symbolic Keras tensor, or
    ``None`` for a tensor no layer produced."""
    return getattr(tensor, "_keras_history", None)


def nodes_by_depth(model: Any) -> dict[int, list[Any]] | None:
    """A functional model's layer graph ``{depth: [node]}`` (``None`` for subclassed ones)."""
    return getattr(model, "_nodes_by_depth", None)


def build_input_shapes(model: Any) -> dict[str, Any]:
    """The input shapes a built subclassed model recorded at ``build`` (may be empty)."""
    return getattr(model, "_build_shapes_dict", None) or {}


def variable_storage(variable: Any) -> Any:
    """The TF variable behind a Keras variable (what ``.value`` wraps under autocast)."""
    return getattr(variable, "_value", variable)


def is_on_read(variable: Any) -> bool:
    """Whether a Keras variable is per-replica state (``synchronization="on_read"``)."""
    import tensorflow as tf

    storage = variable_storage(variable)
    return getattr(storage, "synchronization", None) == tf.VariableSynchronization.ON_READ


def local_components(variable: Any) -> tuple[Any, ...]:
    """The per-replica ``tf.Variable`` components of an on-read Keras variable that live on
    this process's devices, in local replica order (one per local replica; the variable itself
    outside a strategy).  Reading or assigning them is local: no collective."""
    storage = variable_storage(variable)
    return tuple(getattr(storage, "values", (storage,)))


# -- Keras callbacks -----------------------------------------------------------------------
#: The files Keras' ``BackupAndRestore`` writes in its directory, by the attribute holding each.
BACKUP_FILES = {"_weights_path": "latest.weights.h5",
                "_training_metadata_path": "training_metadata.json"}


@contextlib.contextmanager
def previous_backup(callback: Any) -> Iterator[None]:
    """Within it, a ``keras.callbacks.BackupAndRestore`` reads its previous checkpoint (the
    ``.bkp`` files ``double_checkpoint`` keeps) as if it were the latest one.

    The files are copied to a private temporary folder first (Keras loads weights only from
    names ending in ``.weights.h5``), so workers reading at once never write shared files.
    """
    import os
    import shutil
    import tempfile

    names = (*BACKUP_FILES, "_prev_weights_path", "_prev_training_metadata_path")
    for attr in names:
        if not hasattr(callback, attr):
            raise RuntimeError(f"keras.callbacks.BackupAndRestore has no `{attr}`: this Keras "
                               f"version is not supported (tested: Keras {TESTED['keras']})")
    latest = (callback._weights_path, callback._training_metadata_path)
    with tempfile.TemporaryDirectory(prefix="tfbs_prev_backup_") as tmp:
        weights = os.path.join(tmp, BACKUP_FILES["_weights_path"])
        metadata = os.path.join(tmp, BACKUP_FILES["_training_metadata_path"])
        shutil.copyfile(callback._prev_weights_path, weights)
        if os.path.exists(callback._prev_training_metadata_path):
            shutil.copyfile(callback._prev_training_metadata_path, metadata)
        callback._weights_path, callback._training_metadata_path = weights, metadata
        try:
            yield
        finally:
            callback._weights_path, callback._training_metadata_path = latest


def resumed_epoch(model: Any) -> int:
    """The epoch a ``BackupAndRestore`` callback made ``model.fit`` resume from (0 if none)."""
    return int(getattr(model, "_initial_epoch", 0) or 0)


# -- Profiler traces -----------------------------------------------------------------------
def xplane_proto() -> Any:
    """TensorFlow's ``xplane_pb2`` module (the profiler's trace format)."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    return xplane_pb2


__all__: Sequence[str] = [
    "TESTED", "TESTED_PAIRS", "after_gradient_all_reduce", "build_input_shapes",
    "disable_gradient_all_reduce", "flatten_layers", "gradient_all_reduce_disabled",
    "assign_replica_copies", "calling_model", "is_on_read", "keras_history",
    "local_components", "no_automatic_dependency_tracking", "nodes_by_depth",
    "own_trainable_variables", "previous_backup", "resumed_epoch",
    "optimizer_strategy", "strategy_cross_device_ops", "strategy_supports_no_merge_call",
    "variable_owners",
    "variable_storage", "xplane_proto",
]
