"""The block-rule table on real Keras layers, lookup order, overrides and the launch script."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import pathlib
import re
import sys

import keras
import numpy as np
import pytest
from absl import flags
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests import reference as ref
from tf_blocksparse import block_report, blocks

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _table(model) -> dict[str, block_report.BlockTableRow]:
    """Rows keyed by ``layer_name/var_name`` (the model's own prefix dropped)."""
    return {"/".join(r.path.split("/")[-2:]): r for r in block_report.block_table(model)}


def _model(input_shape, *layers) -> keras.Model:
    return keras.Sequential([keras.Input(input_shape), *layers])


def _check(row: block_report.BlockTableRow, rule: str, num_blocks: int, block_size: int,
           layer_class: str | None = None) -> None:
    assert row.rule == rule, row
    assert row.num_blocks == num_blocks, row
    assert row.block_size == block_size, row
    assert row.num_blocks * row.block_size == math.prod(row.shape), row
    if layer_class is not None:
        assert row.layer_class == layer_class, row


# ---------------------------------------------------------------------------------------
# The rule for every supported layer kind.
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("cls,input_shape,kernel_shape", [
    (keras.layers.Conv1D, (9, 3), (3, 3, 5)),
    (keras.layers.Conv2D, (9, 9, 3), (3, 3, 3, 5)),
    (keras.layers.Conv3D, (6, 6, 6, 3), (3, 3, 3, 3, 5)),
])
def test_conv_kernel_one_block_per_output_filter(cls, input_shape, kernel_shape):
    layer = cls(5, 3, name="c")
    t = _table(_model(input_shape, layer))
    _check(t["c/kernel"], "output_channel", 5, math.prod(kernel_shape[:-1]), cls.__name__)
    assert t["c/kernel"].shape == kernel_shape
    _check(t["c/bias"], "element", 5, 1, cls.__name__)


def test_dense_and_einsum_dense_one_block_per_output_unit():
    t = _table(_model((4,), keras.layers.Dense(6, name="d"),
                      keras.layers.EinsumDense("ab,bc->ac", output_shape=7, bias_axes="c",
                                               name="e")))
    _check(t["d/kernel"], "output_channel", 6, 4, "Dense")
    _check(t["d/bias"], "element", 6, 1, "Dense")
    _check(t["e/kernel"], "output_channel", 7, 6, "EinsumDense")
    _check(t["e/bias"], "element", 7, 1, "EinsumDense")


def test_norm_gamma_beta_one_block_per_element():
    t = _table(_model((5, 6), keras.layers.BatchNormalization(name="bn"),
                      keras.layers.LayerNormalization(name="ln")))
    for name, cls in (("bn", "BatchNormalization"), ("ln", "LayerNormalization")):
        _check(t[f"{name}/gamma"], "element", 6, 1, cls)
        _check(t[f"{name}/beta"], "element", 6, 1, cls)
    # Moving statistics are not trainable, so not in the table.
    assert not any("moving" in p for p in t)


def test_conv2d_transpose_blocks_are_filters_on_axis_minus_2():
    kh, kw, filters, cin = 3, 2, 5, 4
    t = _table(_model((6, 6, cin), keras.layers.Conv2DTranspose(filters, (kh, kw), name="up")))
    row = t["up/kernel"]
    assert row.shape == (kh, kw, filters, cin)
    _check(row, "transpose_filter", filters, kh * kw * cin, "Conv2DTranspose")
    _check(t["up/bias"], "element", filters, 1)


def test_depthwise_conv2d_one_block_per_channel_and_multiplier():
    t = _table(_model((6, 6, 3), keras.layers.DepthwiseConv2D(3, depth_multiplier=2,
                                                               name="dw")))
    assert t["dw/kernel"].shape == (3, 3, 3, 2)
    _check(t["dw/kernel"], "depthwise_channel", 3 * 2, 9, "DepthwiseConv2D")
    _check(t["dw/bias"], "element", 6, 1)


def test_separable_conv2d():
    t = _table(_model((6, 6, 3), keras.layers.SeparableConv2D(4, 3, depth_multiplier=2,
                                                               name="sep")))
    _check(t["sep/depthwise_kernel"], "depthwise_channel", 6, 9, "SeparableConv2D")
    assert t["sep/pointwise_kernel"].shape == (1, 1, 6, 4)
    _check(t["sep/pointwise_kernel"], "output_channel", 4, 6, "SeparableConv2D")
    _check(t["sep/bias"], "element", 4, 1)


def test_embedding_one_block_per_row():
    t = _table(_model((5,), keras.layers.Embedding(11, 3, name="emb")))
    _check(t["emb/embeddings"], "row", 11, 3, "Embedding")


class _MyEmbedding(keras.layers.Embedding):
    pass


def test_embedding_tables_are_known_by_class_or_path():
    """``BlockLayout.embedding``: an ``Embedding`` layer's table (subclasses through the
    MRO), or any variable named ``embeddings``; nothing else."""
    model = keras.Sequential([keras.Input((5,)), _MyEmbedding(11, 3, name="emb"),
                              keras.layers.Dense(2, name="fc")])
    layouts = blocks.layouts_for(model.trainable_variables, model)
    assert [lay.embedding for lay in layouts] == [True, False, False]
    assert blocks.rule_for("m/tok/embeddings", (7, 4)).embedding
    assert not blocks.rule_for("m/tok/kernel", (7, 4)).embedding
    assert "Embedding" in blocks.EMBEDDING_CLASSES
    assert not blocks.EMBEDDING_CLASSES & (blocks.RECURRENT_CLASSES
                                           | blocks.NORMALIZATION_CLASSES)


@pytest.mark.parametrize("cls,gates,cell", [(keras.layers.GRU, 3, "GRUCell"),
                                            (keras.layers.LSTM, 4, "LSTMCell")])
def test_recurrent_kernels_one_block_per_output_column(cls, gates, cell):
    units, features = 4, 3
    model = _model((5, features), cls(units, name="rnn"))
    t = _table(model)
    kernel = next(r for p, r in t.items() if p.endswith("/kernel") and "recurrent" not in p)
    recurrent = next(r for p, r in t.items() if p.endswith("/recurrent_kernel"))
    bias = next(r for p, r in t.items() if p.endswith("/bias"))
    _check(kernel, "output_channel", gates * units, features, cell)
    _check(recurrent, "output_channel", gates * units, units, cell)
    _check(bias, "element", math.prod(bias.shape), 1, cell)
    assert all(lay.recurrent for lay in blocks.layouts_for(model.trainable_variables, model))


def test_group_cost_counts_the_recurrent_layers_delayed_bytes():
    """What the automatic exchange weighs by ``recurrent_cost``: the bytes of recurrent
    layers' variables that a sparse mode delays (not those sent whole)."""
    from tf_blocksparse.exchange_bytes import group_cost
    from tf_blocksparse.feedback import BlockTopK
    model = keras.Sequential([keras.Input((5, 3)), keras.layers.GRU(40, name="rnn"),
                              keras.layers.Dense(30, name="fc")])
    layouts = blocks.layouts_for(model.trainable_variables, model)
    assert [lay.recurrent for lay in layouts] == [True, True, True, False, False]
    f32 = ["float32"] * len(layouts)
    cost = group_cost(BlockTopK(layouts, k=1, dense_below=1024), f32)
    # GRU kernel 3x120 sent whole (< 1024 elements), recurrent kernel 40x120 delayed,
    # bias whole; fc kernel 40x30 delayed
    assert cost.recurrent_bytes == 4 * 40 * 120
    assert cost.delayed_bytes == 4 * (40 * 120 + 40 * 30)
    assert group_cost(BlockTopK(layouts, density=1.0, dense_below=0), f32).recurrent_bytes == 0
    # recurrent="whole": the GRU's variables go whole (no ids, nothing delayed), fc as before
    whole = BlockTopK(layouts, k=1, dense_below=1024, recurrent="whole")
    assert whole.whole == (True, True, True, False, True)
    cost = group_cost(whole, f32)
    assert cost.recurrent_bytes == 0 and cost.delayed_bytes == 4 * 40 * 30
    assert cost.whole_bytes == 4 * (3 * 120 + 40 * 120 + 2 * 120 + 30)
    assert not blocks.rule_for("m/custom/kernel", (4, 8)).recurrent
    assert blocks.rule_for("m/custom/recurrent_kernel", (4, 8)).recurrent


class _Custom(keras.layers.Layer):
    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1], 3), name="mystery")
        self.v = self.add_weight(shape=(3,), name="vec")

    def call(self, x):
        return x @ self.w + self.v


def test_custom_rank2_variable_single_block_fallback_with_warning(caplog):
    model = _model((4,), _Custom(name="custom"))
    with caplog.at_level(logging.WARNING, logger="tf_blocksparse"):
        t = _table(model)
    _check(t["custom/mystery"], "single", 1, 12)
    assert t["custom/mystery"].layer_class is None
    _check(t["custom/vec"], "element", 3, 1)  # rank 1: per element, no warning
    warnings = [r for r in caplog.records if r.name == "tf_blocksparse"]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert "custom/mystery" in warnings[0].getMessage()


class _MyDense(keras.layers.Dense):
    pass


def test_subclass_inherits_rule_through_mro():
    t = _table(_model((4,), _MyDense(3, name="mine")))
    _check(t["mine/kernel"], "output_channel", 3, 4, "Dense")


# ---------------------------------------------------------------------------------------
# Lookup order: class, then path, then rank.
# ---------------------------------------------------------------------------------------

def test_renamed_conv2d_transpose_needs_the_model():
    model = _model((6, 6, 4), keras.layers.Conv2DTranspose(5, 3, name="upsampler"))
    kernel = model.layers[-1].kernel
    with_model = blocks.layouts_for([kernel], model)[0]
    assert with_model.rule is blocks.TRANSPOSE_FILTER
    assert with_model.layer_class == "Conv2DTranspose"
    assert with_model.view_shape == (9, 5, 4)
    # Without the model (or owners) the name says nothing, so only the path rule for
    # ``kernel`` applies, which is documented as wrong for transposed convolutions.
    without = blocks.layouts_for([kernel])[0]
    assert without.layer_class is None
    assert without.rule is not blocks.TRANSPOSE_FILTER
    # Owners given explicitly work like the model.
    owned = blocks.layouts_for([kernel], owners={id(kernel): model.layers[-1]})[0]
    assert owned.rule is blocks.TRANSPOSE_FILTER


def test_default_names_infer_the_class_without_model():
    model = _model((6, 6, 4), keras.layers.Conv2DTranspose(5, 3),
                   keras.layers.Conv2DTranspose(2, 3))
    for lay in blocks.layouts_for(model.trainable_variables):
        assert lay.layer_class == "Conv2DTranspose"
        if lay.path.endswith("kernel"):
            assert lay.rule is blocks.TRANSPOSE_FILTER
    assert blocks.infer_layer_class("model/conv2d_transpose_3/kernel") == "Conv2DTranspose"
    assert blocks.infer_layer_class("conv2d_transpose/kernel") == "Conv2DTranspose"
    assert blocks.infer_layer_class("m/depthwise_conv2d_12/kernel") == "DepthwiseConv2D"
    assert blocks.infer_layer_class("m/gru_1/gru_cell/kernel") == "GRUCell"
    assert blocks.infer_layer_class("m/my_thing_3/kernel") is None
    assert blocks.infer_layer_class("kernel") is None


_CONSTRUCTORS = {
    "Conv1D": lambda: keras.layers.Conv1D(2, 3), "Conv2D": lambda: keras.layers.Conv2D(2, 3),
    "Conv3D": lambda: keras.layers.Conv3D(2, 3),
    "Conv1DTranspose": lambda: keras.layers.Conv1DTranspose(2, 3),
    "Conv2DTranspose": lambda: keras.layers.Conv2DTranspose(2, 3),
    "Conv3DTranspose": lambda: keras.layers.Conv3DTranspose(2, 3),
    "DepthwiseConv1D": lambda: keras.layers.DepthwiseConv1D(3),
    "DepthwiseConv2D": lambda: keras.layers.DepthwiseConv2D(3),
    "SeparableConv1D": lambda: keras.layers.SeparableConv1D(2, 3),
    "SeparableConv2D": lambda: keras.layers.SeparableConv2D(2, 3),
    "Dense": lambda: keras.layers.Dense(2),
    "EinsumDense": lambda: keras.layers.EinsumDense("ab,bc->ac", output_shape=2),
    "Embedding": lambda: keras.layers.Embedding(3, 2),
    "BatchNormalization": keras.layers.BatchNormalization,
    "LayerNormalization": keras.layers.LayerNormalization,
    "GroupNormalization": lambda: keras.layers.GroupNormalization(groups=1),
    "GRUCell": lambda: keras.layers.GRUCell(2), "LSTMCell": lambda: keras.layers.LSTMCell(2),
    "SimpleRNNCell": lambda: keras.layers.SimpleRNNCell(2),
    "GRU": lambda: keras.layers.GRU(2), "LSTM": lambda: keras.layers.LSTM(2),
    "SimpleRNN": lambda: keras.layers.SimpleRNN(2),
}


@pytest.mark.parametrize("cls", sorted(blocks.LAYER_RULES))
def test_keras_default_layer_names_map_back_to_their_class(cls):
    layer = _CONSTRUCTORS[cls]()
    assert type(layer).__name__ == cls
    assert blocks.infer_layer_class(f"model/{layer.name}/kernel") == cls
    second = _CONSTRUCTORS[cls]()  # the second instance gets a numbered default name
    assert second.name != layer.name
    assert blocks.infer_layer_class(f"model/{second.name}/kernel") == cls


def test_explicit_class_beats_inferred_and_path_beats_rank():
    # The given class wins over the class inferred from the path.
    lay = blocks.rule_for("m/conv2d_transpose/kernel", (3, 3, 4, 5), layer="Conv2D")
    assert lay.rule is blocks.OUTPUT_CHANNEL and lay.layer_class == "Conv2D"
    # A class hit beats the path rule for the same variable name.
    lay = blocks.rule_for("m/whatever/bias", (4,), layer=keras.layers.Dense)
    assert lay.layer_class == "Dense"
    lay = blocks.rule_for("m/up/kernel", (3, 3, 5, 4), layer=keras.layers.Conv2DTranspose)
    assert lay.rule is blocks.TRANSPOSE_FILTER and lay.num_blocks == 5
    lay = blocks.rule_for("m/dw/kernel", (3, 3, 4, 2), layer="DepthwiseConv2D")
    assert lay.rule is blocks.DEPTHWISE and lay.num_blocks == 8
    # Unknown class: the path rule beats the rank fallback.
    lay = blocks.rule_for("m/custom/embeddings", (7, 3), layer="Custom")
    assert lay.rule is blocks.ROW and lay.num_blocks == 7 and lay.layer_class is None
    lay = blocks.rule_for("m/custom/recurrent_kernel", (4, 8))
    assert lay.rule is blocks.OUTPUT_CHANNEL and lay.num_blocks == 8
    # Rank: scalars and vectors are per element.
    assert blocks.rule_for("m/custom/s", ()).view_shape == (1, 1, 1)
    assert blocks.rule_for("m/custom/v", (5,)).view_shape == (1, 5, 1)


def test_undefined_shape_is_rejected():
    with pytest.raises(ValueError, match="fully defined"):
        blocks.rule_for("m/dense/kernel", (None, 3))


# ---------------------------------------------------------------------------------------
# Overrides.
# ---------------------------------------------------------------------------------------

def _dense_model() -> keras.Model:
    return _model((4,), keras.layers.Dense(6, name="d1"), keras.layers.Dense(3, name="d2"))


def test_overrides_by_name_and_by_rule():
    model = _dense_model()
    t = {"/".join(r.path.split("/")[-2:]): r
         for r in block_report.block_table(model, overrides={r"d1/kernel$": "single",
                                                       r"d2/kernel$": blocks.ROW})}
    _check(t["d1/kernel"], "single", 1, 24)
    assert t["d1/kernel"].layer_class is None
    _check(t["d2/kernel"], "row", 6, 3)
    _check(t["d1/bias"], "element", 6, 1, "Dense")  # not matched: the table as usual
    lay = blocks.layouts_for(model.trainable_variables, model, overrides={"bias": "single"})
    assert [x.rule.name for x in lay] == ["output_channel", "single"] * 2


def test_override_with_unknown_rule_names_the_argument():
    with pytest.raises(ValueError, match="overrides") as err:
        block_report.block_table(_dense_model(), overrides={"d1": "per_neuron"})
    assert "per_neuron" in str(err.value)


# ---------------------------------------------------------------------------------------
# Formatting.
# ---------------------------------------------------------------------------------------

def test_format_block_table_has_rows_and_totals():
    model = _model((6, 6, 3), keras.layers.Conv2D(4, 3, name="c"),
                   keras.layers.BatchNormalization(name="bn"), keras.layers.Flatten(),
                   keras.layers.Dense(2, name="d"))
    rows = block_report.block_table(model)
    text = block_report.format_block_table(rows)
    lines = text.splitlines()
    assert lines[0].split() == ["path", "layer", "rule", "shape", "blocks", "block_size"]
    assert len(lines) == len(rows) + 2
    for r in rows:
        assert any(line.startswith(r.path) for line in lines)
    params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    total_blocks = 4 + 4 + 4 + 4 + 2 + 2
    assert sum(r.num_blocks for r in rows) == total_blocks
    assert lines[-1] == f"{len(rows)} variables, {total_blocks} blocks, {params} parameters"
    assert "3x3x3x4" in text and "Conv2D" in text


def test_format_scalar_variable():
    row = block_report.BlockTableRow("m/x/s", None, "element", (), 1, 1)
    text = block_report.format_block_table([row])
    assert "scalar" in text and text.splitlines()[-1] == "1 variables, 1 blocks, 1 parameters"


# ---------------------------------------------------------------------------------------
# Layout properties.
# ---------------------------------------------------------------------------------------

_SPAN_AXES = {"last": lambda r: (r - 1, r), "second_last": lambda r: (max(r - 2, 0), max(r - 1, 1)),
              "first": lambda r: (0, 1), "last_two": lambda r: (max(r - 2, 0), r),
              "all": lambda r: (0, r), "none": lambda r: (0, 0)}


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(1, 6), min_size=0, max_size=5),
       rule=st.sampled_from(sorted(blocks.RULES)))
def test_layout_properties(shape, rule):
    shape = tuple(shape)
    lay = blocks.BlockLayout("v", shape, blocks.RULES[rule])
    outer, nb, inner = lay.view_shape
    assert outer * nb * inner == lay.size == math.prod(shape)
    assert lay.block_size * lay.num_blocks == lay.size
    assert lay.block_size == outer * inner
    start, stop = (0, 0) if not shape else _SPAN_AXES[lay.rule.axes](len(shape))
    assert (outer, nb, inner) == (math.prod(shape[:start]), math.prod(shape[start:stop]),
                                  math.prod(shape[stop:]))
    # The view is a pure reshape: block b of the view is x[..., b, ...] on the block axes.
    x = np.arange(lay.size).reshape(shape)
    v = ref.np_view(x, lay)
    if stop - start == 1:
        np.testing.assert_array_equal(
            np.moveaxis(x, start, 0).reshape(nb, -1),
            np.transpose(v, (1, 0, 2)).reshape(nb, -1))


# ---------------------------------------------------------------------------------------
# launch/print_blocks.py, in-process.
# ---------------------------------------------------------------------------------------

def _load_print_blocks():
    path = ROOT / "launch" / "print_blocks.py"
    spec = importlib.util.spec_from_file_location("_print_blocks_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def print_blocks():
    return _load_print_blocks()


def _strip_layer_names(text: str) -> str:
    """Default layer names count up per process (conv2d_3, ...): drop counters and padding."""
    return re.sub(r" +", " ", re.sub(r"_\d+/", "/", text))


def test_print_blocks_cnn_small_table(print_blocks):
    text = print_blocks.render("cnn_small")
    model = print_blocks.build_model("cnn_small", (32, 32, 3))
    table = block_report.format_block_table(block_report.block_table(model))
    assert _strip_layer_names(text).strip().endswith(_strip_layer_names(table))
    assert text.splitlines()[0] == "model cnn_small, input shape 32x32x3"
    assert "Conv2D" in text and "Dense" in text
    assert "kept" not in text


def test_print_blocks_uses_the_registry_networks(print_blocks):
    """One network per name: print_blocks builds the registry's models."""
    from models import registry

    for name in ("cnn_small", "cnn_bn"):
        ours = print_blocks.build_model(name, (16, 16, 3))
        theirs = registry.build_model(name, (16, 16, 3), 10)
        assert [v.shape for v in ours.weights] == [v.shape for v in theirs.weights]
    text = print_blocks.render("cnn_bn")
    assert "Conv2D" in text and "BatchNormalization" in text and "Dense" in text


def test_print_blocks_cnn_small_with_k_via_flags(print_blocks):
    fv = flags.FlagValues()
    print_blocks.define_flags(fv)
    fv(["print_blocks", "--model=cnn_small", "--input_shape=16,16,3", "--k=2"])
    text = print_blocks.render_from_flags(fv)
    model = print_blocks.build_model("cnn_small", (16, 16, 3))
    rows = block_report.block_table(model)
    kept = sum(min(2, r.num_blocks) for r in rows)
    kept_values = sum(min(2, r.num_blocks) * r.block_size for r in rows)
    params = sum(math.prod(r.shape) for r in rows)
    assert f"{kept} of {sum(r.num_blocks for r in rows)} blocks" in text
    assert f"{kept_values} of {params} values" in text
    assert f"{kept_values / params:.4f}" in text


def test_print_blocks_json_with_density(print_blocks):
    out = json.loads(print_blocks.render("cnn_small", density=0.25, as_json=True))
    assert out["model"] == "cnn_small" and out["input_shape"] == [32, 32, 3]
    model = print_blocks.build_model("cnn_small", (32, 32, 3))
    rows = block_report.block_table(model)
    assert ([_strip_layer_names(v["path"]) for v in out["variables"]]
            == [_strip_layer_names(r.path) for r in rows])
    for v, r in zip(out["variables"], rows):
        assert v["num_blocks"] == r.num_blocks and v["block_size"] == r.block_size
        assert v["shape"] == list(r.shape) and v["rule"] == r.rule
        assert v["kept"] == ref.np_num_selected(r.num_blocks, density=0.25)
        assert v["payload_fraction"] == pytest.approx(v["kept"] * r.block_size
                                                      / math.prod(r.shape))
    totals = out["totals"]
    assert totals["variables"] == len(rows)
    assert totals["blocks"] == sum(r.num_blocks for r in rows)
    assert totals["kept"] == sum(v["kept"] for v in out["variables"])


def test_print_blocks_rejects_bad_arguments(print_blocks):
    with pytest.raises(ValueError, match="model"):
        print_blocks.render("alexnet")
    with pytest.raises(ValueError, match="density"):
        print_blocks.render("cnn_small", density=2.0)
    with pytest.raises(ValueError, match="input_shape"):
        print_blocks.parse_input_shape("32,x,3")


def test_einsum_dense_multi_axis_output_units():
    import keras

    from tf_blocksparse import blocks as b

    layer = keras.layers.EinsumDense("abc,cde->abde", output_shape=(None, 2, 4), bias_axes="de")
    layer.build((None, 3, 8))
    lay = b.layouts_for([layer.kernel], owners={id(layer.kernel): layer})[0]
    assert (lay.rule.name, lay.num_blocks, lay.block_size) == ("output_unit_2d", 8, 8)
    assert b._einsum_kernel_rule("ab,bc->ac", 2).name == "output_channel"
    assert b._einsum_kernel_rule("abc,dce->abde", 3) is None  # output axes not trailing


def test_zero_size_variable_is_rejected():
    import pytest

    from tf_blocksparse import blocks as b

    with pytest.raises(ValueError, match="no elements"):
        b.rule_for("m/dense/kernel", (3, 0))


@settings(max_examples=60, deadline=None)
@example(specs=[([1], None, "embeddings")], dense_below=16, k=1, recurrent="compress")
@given(specs=st.lists(st.tuples(st.lists(st.integers(1, 40), min_size=1, max_size=3),
                                st.sampled_from([None, "Embedding", "Dense", "GRU"]),
                                st.sampled_from(["kernel", "embeddings", "bias"])),
                      min_size=1, max_size=6),
       dense_below=st.sampled_from([0, 16, 1024]), k=st.integers(1, 4),
       recurrent=st.sampled_from(["compress", "whole"]))
def test_embeddings_compress_takes_exactly_the_small_tables_out_of_dense_below(
        specs, dense_below, k, recurrent):
    """``embeddings="compress"`` (default) sends whole what ``"by_size"`` does, except the
    embedding tables under ``dense_below``: those keep ``k`` blocks and count as delayed,
    unless the whole group then keeps every block (it runs as dense)."""
    from tf_blocksparse.exchange_bytes import group_cost
    from tf_blocksparse.feedback import BlockTopK, ElementTopK
    layouts = [blocks.BlockLayout(f"m/l{i}/{name}", tuple(shape), blocks.RULES["row"], cls)
               for i, (shape, cls, name) in enumerate(specs)]
    for kind in (BlockTopK, ElementTopK):
        by_size = kind(layouts, k=k, dense_below=dense_below, recurrent=recurrent,
                       embeddings="by_size")
        compress = kind(layouts, k=k, dense_below=dense_below, recurrent=recurrent)
        assert compress.embeddings == "compress"
        for lay, a, b, na, nb, in zip(by_size.layouts, by_size.whole, compress.whole,
                                      by_size.counts, compress.counts):
            small_table = lay.embedding and lay.size < dense_below and not (
                recurrent == "whole" and lay.recurrent)
            assert b == (a and not small_table)
            assert lay.size >= dense_below or lay.embedding or (b and a)
            assert nb == (min(k, lay.num_blocks) if small_table else na)
        f32 = ["float32"] * len(layouts)

        def delayed(comp):  # a group keeping every block runs as dense: nothing waits
            return 0 if comp.keeps_all else sum(
                4 * lay.size for lay, w in zip(comp.layouts, comp.whole) if not w)

        for comp in (by_size, compress):
            assert group_cost(comp, f32).delayed_bytes == delayed(comp)
        if not (by_size.keeps_all or compress.keeps_all):
            moved = sum(4 * lay.size for lay, a, b in zip(by_size.layouts, by_size.whole,
                                                        compress.whole) if a != b)
            assert group_cost(compress, f32).delayed_bytes == \
                group_cost(by_size, f32).delayed_bytes + moved


def test_bad_embeddings_rule_is_named():
    from tf_blocksparse.feedback import BlockTopK
    with pytest.raises(ValueError, match="`embeddings`"):
        BlockTopK([blocks.rule_for("m/e/embeddings", (4, 2))], k=1, embeddings="whole")


@settings(max_examples=60, deadline=None)
@given(specs=st.lists(st.tuples(st.lists(st.integers(1, 40), min_size=1, max_size=3),
                                st.sampled_from([None, "GRU", "LSTMCell", "Dense"]),
                                st.booleans()), min_size=1, max_size=6),
       dense_below=st.sampled_from([0, 16, 1024]), k=st.integers(1, 4))
def test_recurrent_whole_sends_exactly_the_recurrent_variables_whole_too(specs, dense_below,
                                                                        k):
    """``recurrent="whole"`` adds the recurrent layouts to the variables sent whole (all
    their blocks, no ids) and changes nothing else; the bytes nothing delays are theirs."""
    from tf_blocksparse.exchange_bytes import group_cost
    from tf_blocksparse.feedback import BlockTopK
    layouts = [blocks.BlockLayout(f"m/l{i}/{'recurrent_kernel' if rk else 'kernel'}",
                                  tuple(shape), blocks.RULES["output_channel"], cls)
               for i, (shape, cls, rk) in enumerate(specs)]
    plain = BlockTopK(layouts, k=k, dense_below=dense_below)
    whole = BlockTopK(layouts, k=k, dense_below=dense_below, recurrent="whole")
    for lay, a, b, na, nb in zip(layouts, plain.whole, whole.whole, plain.counts,
                                 whole.counts):
        assert b == (a or lay.recurrent)
        assert nb == (lay.num_blocks if b else na)
    f32 = ["float32"] * len(layouts)
    cost = group_cost(whole, f32)
    assert cost.recurrent_bytes == 0
    assert cost.dense_bytes == group_cost(plain, f32).dense_bytes
