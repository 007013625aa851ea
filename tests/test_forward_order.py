"""Execution order derived from the forward pass: tracer, optimizer and ops wiring."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_blocksparse as tfbs
from tests.test_optimizer import train_lazily
from tf_blocksparse.fusion.forward_order import (
    backward_ranks,
    derive_execution_order,
    forward_use_order,
    model_input_spec,
)
from tf_blocksparse.planning import execution_order, plan_backward

L = keras.layers
CALLS: list[str] = []


class Recorded(L.Dense):
    """A Dense layer that records when its ``call`` runs (the ground truth of use order)."""

    def call(self, inputs):
        CALLS.append(self.name)
        return super().call(inputs)


class OutOfOrder(keras.Model):
    """Creates Dense ``b`` before Dense ``a`` but calls ``a`` first: ``b(a(x))``."""

    def __init__(self, unused: bool = False):
        super().__init__()
        self.b = L.Dense(3, name="b")  # kernel (5, 3)
        self.a = L.Dense(5, name="a")  # kernel (4, 5)
        self.unused = L.Dense(2, name="unused") if unused else None

    def call(self, x):
        return self.b(self.a(x))


def _out_of_order(unused: bool = False) -> keras.Model:
    keras.utils.set_random_seed(1)
    model = OutOfOrder(unused)
    if unused:
        model.unused.build((None, 4))
    model(np.ones((2, 4), "float32"))
    return model


def _paths(model, order):
    """``layer/variable`` of each variable index in ``order``."""
    return ["/".join(model.trainable_variables[i].path.split("/")[-2:]) for i in order]


def test_subclassed_model_order_follows_use_not_creation():
    model = _out_of_order()
    assert _paths(model, range(4)) == ["b/kernel", "b/bias", "a/kernel", "a/bias"]
    assert forward_use_order(model) == (2, 3, 0, 1)
    assert derive_execution_order(model, model.trainable_variables) == (1, 0, 3, 2)
    assert backward_ranks(model, model.trainable_variables) == [1, 0, 3, 2]


def test_branching_functional_model_follows_keras_execution():
    # The ResNet shortcut pattern: Keras lists the variables by graph depth (a, b, s, c), but
    # runs the branches in another order; the recorded calls are the ground truth.
    inp = keras.Input((4,))
    h = Recorded(4, name="a")(inp)
    s = L.LayerNormalization(name="sn")(Recorded(3, name="s")(h))
    m = L.LayerNormalization(name="cn")(Recorded(3, name="c")(Recorded(3, name="b")(h)))
    model = keras.Model(inp, L.Add()([s, m]))
    CALLS.clear()
    order = forward_use_order(model)
    dense = [i for i in order if "/kernel" in model.trainable_variables[i].path]
    assert [p.split("/")[0] for p in _paths(model, dense)] == CALLS
    listed = [p.split("/")[0] for p in _paths(model, range(len(order))) if "kernel" in p]
    assert listed != CALLS  # the derivation matters here: list order is not use order
    assert sorted(order) == list(range(len(model.trainable_variables)))


def test_functional_chain_created_out_of_order():
    b, a = L.Dense(3, name="b"), L.Dense(5, name="a")  # created b, then a
    inp = keras.Input((4,))
    model = keras.Model(inp, b(a(inp)))  # used a, then b
    ids = [id(v) for v in model.trainable_variables]
    want = [ids.index(id(v)) for v in (a.kernel, a.bias, b.kernel, b.bias)]
    assert list(forward_use_order(model)) == want


def test_sequential_order_is_variable_order():
    model = keras.Sequential([
        keras.Input((8, 8, 3)), L.Conv2D(4, 3), L.BatchNormalization(), L.ReLU(),
        L.Conv2D(6, 3, use_bias=False), L.Flatten(), L.Dense(7), L.Dense(2)])
    n = len(model.trainable_variables)
    assert forward_use_order(model) == tuple(range(n))
    assert derive_execution_order(model, model.trainable_variables) == execution_order(n)


def test_embedding_and_recurrent_reads_are_found():
    model = keras.Sequential([keras.Input((5,), dtype="int32"), L.Embedding(10, 4),
                              L.LSTM(3), L.Dense(2)])
    assert forward_use_order(model) == tuple(range(len(model.trainable_variables)))


def test_unused_variables_go_last_in_list_order():
    model = _out_of_order(unused=True)
    assert _paths(model, range(6))[4:] == ["unused/kernel", "unused/bias"]
    assert forward_use_order(model) == (2, 3, 0, 1, 4, 5)


def test_no_model_or_no_input_falls_back():
    class TwoInputs(keras.Model):
        def __init__(self):
            super().__init__()
            self.d = L.Dense(2)

        def call(self, x, y):
            return self.d(x) + y

    model = TwoInputs()
    model(np.ones((1, 3), "float32"), np.ones((1, 2), "float32"))
    assert model_input_spec(model) is None
    with pytest.raises(ValueError, match="`input_spec`"):
        forward_use_order(model)
    assert derive_execution_order(model, model.trainable_variables) is None
    assert derive_execution_order(None, model.trainable_variables) is None
    assert backward_ranks(None, model.trainable_variables) is None


# ------------------------------------------------------------------ wired into the planners

NBYTES = [60, 12, 80, 20]  # b/kernel, b/bias, a/kernel, a/bias (float32)


def test_optimizer_plans_groups_in_reverse_use_order():
    model = _out_of_order()
    derived = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1), k=1, model=model,
                                        fusion_buffer_bytes=100, exchange="allgather")
    derived.build(model.trainable_variables)
    plan = derived.fusion_plan
    assert plan.order == (1, 0, 3, 2)  # b's bias, b's kernel, then a's: reverse of use
    assert plan == plan_backward(NBYTES, ["float32"] * 4, 100, order=(1, 0, 3, 2))
    assert [g.members for g in plan.groups] == [(1, 0, 3), (2,)]  # 92 B, 80 B
    fallback = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1), k=1,
                                         fusion_buffer_bytes=100, exchange="allgather")
    fallback.build(model.trainable_variables)
    assert fallback.fusion_plan.order == (3, 2, 1, 0)  # no model: reverse of the list
    assert fallback.fusion_plan.groups != plan.groups


def test_optimizer_derives_while_built_lazily_inside_a_tf_function():
    model = _out_of_order()
    opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1), k=1, model=model,
                                    fusion_buffer_bytes=100, exchange="allgather")
    train_lazily(model, opt)
    assert opt.fusion_plan.order == (1, 0, 3, 2)


def test_optimizer_derives_for_mirrored_variables(mirrored2):
    with mirrored2.scope():
        model = _out_of_order()
        opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1), k=1, model=model,
                                        fusion_buffer_bytes=100, exchange="allgather")
        opt.build(model.trainable_variables)
    assert opt.fusion_plan.order == (1, 0, 3, 2)

    @tf.function
    def step():
        def fn():
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(model(tf.ones((2, 4))) ** 2)
            opt.apply(tape.gradient(loss, model.trainable_variables),
                      model.trainable_variables)
        mirrored2.run(fn)

    before = model.get_weights()
    step()
    assert int(opt.iterations.numpy()) == 1
    assert all(not np.array_equal(a, b) for a, b in zip(before, model.get_weights()))


def _reduce(strategy, model):
    rng = np.random.default_rng(0)
    grads = [[rng.standard_normal(v.shape).astype("float32") for v in model.trainable_variables]
             for _ in range(2)]
    values = [strategy.experimental_distribute_values_from_function(
        lambda ctx, i=i: tf.constant(grads[ctx.replica_id_in_sync_group][i]))
        for i in range(len(grads[0]))]
    out = strategy.extended.batch_reduce_to("SUM", [(v, v) for v in values])
    for o, g0, g1 in zip(out, *grads):
        np.testing.assert_array_equal(strategy.experimental_local_results(o)[0].numpy(),
                                      g0 + g1)


def test_fused_ops_bound_model_gives_the_order():
    ops = tfbs.BlockSparseCrossDeviceOps(fusion=100)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"], cross_device_ops=ops)
    with strategy.scope():
        model = _out_of_order()
    _reduce(strategy, model)
    assert ops.last_plan.order == (3, 2, 1, 0)  # not bound: reverse of the batch
    ops.bind_model(model)
    _reduce(strategy, model)
    assert ops.last_plan.order == (1, 0, 3, 2)
    assert ops.collectives_per_step == len(ops.last_plan.groups) == 2
    with pytest.raises(TypeError, match="`model`"):
        ops.bind_model(object())
