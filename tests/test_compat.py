"""Contract tests of ``tf_blocksparse._compat``: one per private TF/Keras hook.

Each test checks the behaviour the package relies on, so a TensorFlow or Keras upgrade that
changes a private API fails here, by name, rather than somewhere inside training.
"""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_blocksparse import _compat
from tf_blocksparse.distribute import strategy as strategy_lib
from tf_blocksparse.keras import backup as backup_lib


def test_the_installed_versions_are_a_tested_pair():
    def minor(version):
        return ".".join(version.split(".")[:2])

    assert (minor(tf.__version__), minor(keras.__version__)) in _compat.TESTED_PAIRS


def _sgd_step_on_two_replicas(strategy, hook=None) -> list[float]:
    """One ``SGD(lr=1).apply`` of gradient 1 (replica 0) and 3 (replica 1) to a mirrored
    zero; ``hook(opt)`` may change the optimizer first.  Returns the per-replica weights."""
    with strategy.scope():
        w = keras.Variable(np.zeros((1,), "float32"))
        opt = keras.optimizers.SGD(1.0)
        opt.build([w])
    if hook is not None:
        hook(opt)

    @tf.function
    def step():
        def fn():
            rid = tf.distribute.get_replica_context().replica_id_in_sync_group
            opt.apply([tf.fill((1,), 1.0 + 2.0 * tf.cast(rid, tf.float32))], [w])
        strategy.run(fn)

    step()
    return [float(v.numpy()[0]) for v in strategy.experimental_local_results(w.value)]


def test_disable_gradient_all_reduce_stops_the_cross_replica_sum(mirrored2):
    """Keras sums the two replicas' gradients (w = -4); with the hook each replica's own
    gradient is applied (w = -1 / -3), which is what a wrapper that already exchanged
    relies on."""
    def disable(opt):
        _compat.disable_gradient_all_reduce(opt)
        assert _compat.gradient_all_reduce_disabled(opt)

    assert _sgd_step_on_two_replicas(mirrored2) == [-4.0, -4.0]
    assert sorted(_sgd_step_on_two_replicas(mirrored2, disable)) == [-3.0, -1.0]
    assert not _compat.gradient_all_reduce_disabled(keras.optimizers.SGD(1.0))


def test_after_gradient_all_reduce_sees_the_summed_gradients(mirrored2):
    """The hook receives Keras' cross-replica sum (1 + 3 = 4 on both replicas) and what it
    returns is applied (halved: w = -2)."""
    seen = []

    def halve(pairs):
        seen.append([float(g.numpy()[0]) if tf.executing_eagerly() else None
                     for g, _ in pairs])
        return [(g / 2.0, v) for g, v in pairs]

    weights = _sgd_step_on_two_replicas(
        mirrored2, lambda opt: _compat.after_gradient_all_reduce(opt, halve))
    assert seen and all(len(pairs) == 1 for pairs in seen)
    assert weights == [-2.0, -2.0]


def test_disable_gradient_all_reduce_names_an_unsupported_optimizer():
    class Plain:
        pass

    with pytest.raises(RuntimeError, match="_all_reduce_sum_gradients"):
        _compat.disable_gradient_all_reduce(Plain())
    with pytest.raises(RuntimeError, match="_all_reduce_sum_gradients"):
        _compat.after_gradient_all_reduce(Plain(), list)


def test_momentum_only_where_applies_momentum_to_the_chosen_variables():
    a, b = keras.Variable(np.zeros((2,), "float32")), keras.Variable(np.zeros((2,), "float32"))
    opt = keras.optimizers.SGD(1.0, momentum=0.5)
    opt.build([a, b])
    _compat.momentum_only_where(opt, lambda i: i == 0)

    @tf.function
    def step():
        opt.apply([tf.ones((2,)), tf.ones((2,))], [a, b])

    step()
    step()
    # a: momentum SGD, -1 then -(0.5 + 1); b: plain SGD, -1 twice, its slot untouched
    np.testing.assert_allclose(a.numpy(), [-2.5, -2.5])
    np.testing.assert_allclose(b.numpy(), [-2.0, -2.0])
    assert opt.momentum == 0.5
    np.testing.assert_array_equal(opt.momentums[1].numpy(), [0.0, 0.0])
    with pytest.raises(RuntimeError, match="update_step"):
        _compat.momentum_only_where(object(), lambda v: True)


def test_no_automatic_dependency_tracking_keeps_variables_out_of_the_tracker():
    """Variables assigned (in a list) inside the decorated method are not collected by
    Keras' attribute tracker; the optimizer relies on it for its per-replica state lists."""
    class Holder(keras.layers.Layer):
        @_compat.no_automatic_dependency_tracking
        def keep(self):
            self.kept = [keras.Variable(np.zeros((2,), "float32"), name="kept")]

        def track(self):
            self.tracked = [keras.Variable(np.zeros((2,), "float32"), name="tracked")]

    h = Holder()
    h.keep()
    assert [w.name for w in h.weights] == []
    h.track()
    assert [w.name for w in h.weights] == ["tracked"]


def test_strategy_supports_no_merge_call(mirrored2):
    assert _compat.strategy_supports_no_merge_call()  # default strategy
    seen = []

    def fn():
        seen.append(_compat.strategy_supports_no_merge_call())

    mirrored2.run(tf.function(fn))
    assert seen and not any(seen)  # MirroredStrategy on CPUs uses merge_call


def test_strategy_cross_device_ops():
    ops = tf.distribute.ReductionToOneDevice()
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"], cross_device_ops=ops)
    assert _compat.strategy_cross_device_ops(strategy) is ops
    assert strategy_lib.cross_device_ops(strategy) is ops  # the library's public face


def _nested_model() -> keras.Model:
    inner = keras.Sequential([keras.layers.Dense(3, name="inner_dense")], name="inner")
    inputs = keras.Input((4,))
    x = keras.layers.Dense(5, name="first")(inputs)
    outputs = inner(x)
    return keras.Model(inputs, outputs)


def test_flatten_layers_includes_nested_layers():
    names = {layer.name for layer in _compat.flatten_layers(_nested_model())}
    assert {"first", "inner", "inner_dense"} <= names


def test_own_trainable_variables_and_owners():
    model = _nested_model()
    inner = model.get_layer("inner")
    dense = inner.get_layer("inner_dense")
    assert _compat.own_trainable_variables(inner) == []  # only its sub-layer's
    assert [v.name for v in _compat.own_trainable_variables(dense)] == ["kernel", "bias"]
    owners = _compat.variable_owners(model.trainable_variables)
    assert owners[id(dense.kernel)] is dense
    assert owners[id(model.get_layer("first").bias)] is model.get_layer("first")
    scoped = _compat.variable_owners([dense.kernel], layers=[model.get_layer("first")])
    assert scoped == {}


def test_keras_history_and_nodes_by_depth():
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(2, name="head")(inputs)
    model = keras.Model(inputs, outputs)
    assert _compat.keras_history(outputs).operation.name == "head"
    assert _compat.keras_history(tf.zeros(1)) is None
    graph = _compat.nodes_by_depth(model)
    ops = {n.operation.name for nodes in graph.values() for n in nodes
           if n.operation is not None}
    assert "head" in ops

    class Sub(keras.Model):
        def call(self, x):
            return x

    assert _compat.nodes_by_depth(Sub()) is None


def test_build_input_shapes_of_a_subclassed_model():
    class Sub(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(2)

        def build(self, input_shape):
            self.dense.build(input_shape)

        def call(self, x):
            return self.dense(x)

    model = Sub()
    model.build((None, 3))
    assert list(_compat.build_input_shapes(model).values()) == [(None, 3)]


def test_variable_storage_is_a_tf_variable():
    v = keras.Variable(np.ones((2,), "float32"))
    assert isinstance(_compat.variable_storage(v), tf.Variable)


def test_on_read_variables_and_their_local_components():
    """A per-replica (on-read) Keras variable is recognised, and its components are this
    process's replicas' own tf.Variables: assigning one changes only that replica's value."""
    devices = [d.name for d in tf.config.list_logical_devices("CPU")[:2]]
    strategy = tf.distribute.MirroredStrategy(devices)
    with strategy.scope():
        state = keras.Variable(np.zeros((3,), "float32"), trainable=False,
                               synchronization="on_read", aggregation="sum")
        mirrored = keras.Variable(np.zeros((3,), "float32"))
    assert _compat.is_on_read(state) and not _compat.is_on_read(mirrored)
    parts = _compat.local_components(state)
    assert len(parts) == len(devices) and all(isinstance(p, tf.Variable) for p in parts)
    parts[-1].assign(np.full((3,), 2.0, "float32"))
    np.testing.assert_array_equal(parts[0].numpy(), np.zeros(3))
    with strategy.scope():
        np.testing.assert_array_equal(state.numpy(), np.full(3, 2.0))  # the sum over replicas
    plain = keras.Variable(np.ones((2,), "float32"))
    assert not _compat.is_on_read(plain)
    assert [p.numpy().tolist() for p in _compat.local_components(plain)] == [[1.0, 1.0]]


def test_backup_files_are_the_ones_keras_writes(tmp_path):
    cb = keras.callbacks.BackupAndRestore(str(tmp_path / "b"))
    for attr, name in _compat.BACKUP_FILES.items():
        assert getattr(cb, attr) == os.path.join(tmp_path, "b", name), attr


def test_previous_backup_points_keras_at_copies_of_the_bkp_files(tmp_path):
    cb = keras.callbacks.BackupAndRestore(str(tmp_path))
    open(cb._prev_weights_path, "w").write("previous")
    open(cb._prev_training_metadata_path, "w").write('{"epoch": 1}')
    latest = cb._weights_path
    with _compat.previous_backup(cb):
        assert cb._weights_path.endswith(".weights.h5") and cb._weights_path != latest
        assert open(cb._weights_path).read() == "previous"
        assert open(cb._training_metadata_path).read() == '{"epoch": 1}'
    assert cb._weights_path == latest and not os.path.exists(latest)


def test_xplane_proto_parses_a_space():
    pb = _compat.xplane_proto()
    space = pb.XSpace()
    space.planes.add().name = "/host:CPU"
    assert pb.XSpace.FromString(space.SerializeToString()).planes[0].name == "/host:CPU"


def test_resumed_epoch_after_backup_and_restore(tmp_path):
    """Keras' BackupAndRestore makes a second fit resume at the epoch it was cut at."""
    x, y = np.ones((8, 2), "float32"), np.zeros((8, 1), "float32")

    class Stop(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                raise RuntimeError("interrupted")

    def fit(callbacks):
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
        backup = keras.callbacks.BackupAndRestore(str(tmp_path), delete_checkpoint=False)
        model.fit(x, y, epochs=4, verbose=0, callbacks=[backup, *callbacks])
        return model

    with pytest.raises(RuntimeError, match="interrupted"):
        fit([Stop()])
    resumed = fit([])
    assert _compat.resumed_epoch(resumed) == 2
    assert backup_lib.initial_epoch(resumed) == 2  # the library's public face
    fresh = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    assert _compat.resumed_epoch(fresh) == 0


def test_optimizer_strategy_is_the_strategy_at_construction(mirrored2):
    outside = keras.optimizers.SGD(0.1)
    with mirrored2.scope():
        inside = keras.optimizers.SGD(0.1)
    assert _compat.optimizer_strategy(inside) is mirrored2
    assert _compat.optimizer_strategy(outside) is tf.distribute.get_strategy()
    assert _compat.optimizer_strategy(object()) is None


def test_assign_replica_copies_gives_each_replica_its_own_value(mirrored2):
    with mirrored2.scope():
        v = keras.Variable(np.zeros(3, "float32"))

    @tf.function
    def assign():
        def fn():
            ctx = tf.distribute.get_replica_context()
            value = tf.fill([3], tf.cast(ctx.replica_id_in_sync_group, tf.float32) + 1.0)
            _compat.assign_replica_copies([v.value], [value])
        mirrored2.run(fn)

    assign()
    copies = [c.numpy() for c in mirrored2.experimental_local_results(v.value)]
    np.testing.assert_array_equal(copies[0], [1.0, 1.0, 1.0])
    np.testing.assert_array_equal(copies[1], [2.0, 2.0, 2.0])
    outside = tf.Variable(np.zeros(2, "float32"))  # no strategy: a plain assign
    _compat.assign_replica_copies([outside], [tf.ones(2)])
    np.testing.assert_array_equal(outside.numpy(), [1.0, 1.0])


def test_configure_coordination_sets_the_heartbeat_timeout_once():
    """In a fresh process (the coordination service is configured once per process): the
    hook configures it with the timeout, refuses a second time, and TF's multi-worker
    strategy reads the same configuration (``coordination_service``)."""
    code = (
        "import tensorflow as tf\n"
        "from tf_blocksparse import _compat\n"
        "assert _compat.coordination_heartbeat_timeout_s() is None\n"
        "spec = tf.train.ClusterSpec({'worker': ['localhost:1', 'localhost:2']})\n"
        "assert _compat.configure_coordination(spec, 7.5)\n"
        "assert not _compat.configure_coordination(spec, 9.0)\n"
        "from tensorflow.python.eager import context\n"
        "c = context.context().coordination_service\n"
        "assert c.service_type == 'standalone' and c.heartbeat_timeout_in_ms == 7500, c\n"
        "assert c.service_leader == '/job:worker/replica:0/task:0', c.service_leader\n"
        "assert [(j.name, j.num_tasks) for j in c.coordinated_job_list] == [('worker', 2)]\n"
        "print(_compat.coordination_heartbeat_timeout_s())\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-1] == "7.5"


def test_calling_model_is_the_model_building_the_optimizer(monkeypatch):
    """Under ``model.fit`` the optimizer finds its variables' layers in the model that builds
    it, with no pass over the garbage collector's objects; without a model up the stack
    (a custom loop) there is none and the pass finds them."""
    import tf_blocksparse as tfbs

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="d")])
    opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1))
    model.compile(opt, "mse")

    def no_scan(*args, **kwargs):
        raise AssertionError("a pass over the garbage collector's objects")

    with monkeypatch.context() as patched:
        patched.setattr(_compat.gc, "get_objects", no_scan)
        model.fit(np.zeros((4, 4), "float32"), np.zeros((4, 3), "float32"), verbose=0)
    assert [lay.layer_class for lay in opt.layouts] == ["Dense", "Dense"]
    assert _compat.calling_model(opt) is None
    loop = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1))
    loop.build(model.trainable_variables)
    assert [lay.layer_class for lay in loop.layouts] == ["Dense", "Dense"]
