"""CompressionOptions and MomentumCorrection: validation, immutability, configs; the wrapper's
and the CrossDeviceOps' bad input named at construction."""

import dataclasses

import keras
import numpy as np
import pytest

import tf_blocksparse as tfbs
from tf_blocksparse import options as opts


def test_defaults_and_normalisation():
    o = tfbs.CompressionOptions()
    assert (o.k, o.density, o.metric, o.exchange, o.granularity, o.dense_below) == (
        1, None, "l1", tfbs.AutoExchange(), "block", opts.DEFAULT_DENSE_BELOW)
    assert o.block_rules == () and o.sparse and o.auto
    d = tfbs.CompressionOptions(density=1, dense_below=None, block_rules={"x": "single"})
    assert (d.k, d.density, d.dense_below) == (None, 1.0, 0)
    assert isinstance(d.density, float) and d.block_rules == (("x", "single"),)
    assert d.rules == {"x": "single"}
    assert not tfbs.CompressionOptions(exchange="dense").sparse


@pytest.mark.parametrize("kwargs, name", [
    ({"k": 0}, "`k`"), ({"k": 2.0}, "`k`"), ({"k": False}, "`k`"),
    ({"density": 0}, "`density`"), ({"density": 1.01}, "`density`"),
    ({"density": "0.5"}, "`density`"), ({"k": 2, "density": 0.5}, "`k` and `density`"),
    ({"metric": "linf"}, "`metric`"), ({"metric": None}, "`metric`"),
    ({"exchange": "ring"}, "`exchange`"), ({"granularity": "row"}, "`granularity`"),
    ({"dense_below": -1}, "`dense_below`"), ({"dense_below": 1.5}, "`dense_below`"),
    ({"block_rules": {"dense": "rows"}}, "block_rules"),
    ({"block_rules": {"conv[": "single"}}, r"`block_rules`: pattern 'conv\['"),
    ({"block_rules": "dense"}, "`block_rules`"),
    ({"block_rules": {3: "single"}}, "`block_rules`"),
    ({"recurrent": "dense"}, "`recurrent`"), ({"recurrent": True}, "`recurrent`"),
])
def test_bad_values_are_named(kwargs, name):
    with pytest.raises(ValueError, match=name):
        tfbs.CompressionOptions(**kwargs)


def test_frozen_hashable_and_replace_checks_again():
    o = tfbs.CompressionOptions(k=3, block_rules={"a": "single"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.k = 4
    assert hash(o) == hash(tfbs.CompressionOptions(k=3, block_rules=[("a", "single")]))
    assert o.replace(density=0.5).k is None and o.replace(density=0.5).density == 0.5
    assert o.replace(k=2).k == 2 and o.k == 3  # a copy
    assert o.replace(k=None).k == 1  # back to the default
    with pytest.raises(ValueError, match="`metric`"):
        o.replace(metric="max")


@pytest.mark.parametrize("o", [
    tfbs.CompressionOptions(),
    tfbs.CompressionOptions(density=0.1, metric="l2", exchange="shared", granularity="element",
                            dense_below=0, block_rules={"conv": "single", "dense": "row"}),
    tfbs.CompressionOptions(exchange="allgather", quantize="int8", recurrent="whole"),
])
def test_config_round_trip(o):
    config = o.get_config()
    assert tfbs.CompressionOptions.from_config(config) == o
    assert config["block_rules"] == o.rules and list(config["block_rules"]) == [
        p for p, _ in o.block_rules]  # order kept: the first match wins


def test_from_config_names_unknown_keys():
    with pytest.raises(ValueError, match="ratio"):
        tfbs.CompressionOptions.from_config({"k": 1, "ratio": 0.5})


def test_momentum_policy():
    p = tfbs.MomentumCorrection(0.9, masking="waited")
    assert p.get_config() == {"momentum": 0.9, "masking": "waited"}
    assert tfbs.MomentumCorrection.from_config(p.get_config()) == p and p.active
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.momentum = 0.5
    assert not tfbs.MomentumCorrection(0.0).active
    for bad, name in ((1.0, "`momentum`"), (float("nan"), "`momentum`"), ("0.9", "`momentum`"),
                      (True, "`momentum`")):
        with pytest.raises(ValueError, match=name):
            tfbs.MomentumCorrection(bad)
    with pytest.raises(ValueError, match="`masking`"):
        tfbs.MomentumCorrection(0.9, masking="some")


def test_auto_policy_resolves_against_the_inner_sgd():
    inner = keras.optimizers.SGD(0.1, momentum=0.8)
    opt = tfbs.BlockSparseOptimizer(inner, momentum_correction=tfbs.MomentumCorrection(
        masking="none"), exchange="allgather")
    assert opt.momentum_policy == tfbs.MomentumCorrection(0.8, masking="none")
    assert inner.momentum == 0.0 and opt.momentum_masking == "none"


# ---------------------------------------------------------------- the composed wrapper


def test_options_object_equals_keywords():
    o = tfbs.CompressionOptions(k=2, metric="l2", exchange="shared", dense_below=0,
                                block_rules={"dense": "single"})
    a = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1, name="s"), o, name="w")
    b = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1, name="s"), k=2, metric="l2",
                                  exchange="shared", dense_below=0,
                                  block_rules={"dense": "single"}, name="w")
    assert a.compression == b.compression == o
    assert a.get_config() == b.get_config()
    assert (a.k, a.density, a.metric, a.exchange, a.dense_below, a.block_rules) == (
        2, None, "l2", "shared", 0, {"dense": "single"})
    again = tfbs.BlockSparseOptimizer.from_config(a.get_config())
    assert again.compression == o and again.get_config() == a.get_config()


def test_k_and_density_assignment_replaces_the_options():
    opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1), k=3, exchange="allgather")
    first = opt.compression
    opt.k, opt.density = None, 0.25
    assert (opt.k, opt.density) == (None, 0.25) and first.k == 3
    opt.k, opt.density = 2, None
    assert (opt.k, opt.density) == (2, None)
    with pytest.raises(ValueError, match="`density`"):
        opt.density = 2.0
    assert (opt.k, opt.density) == (2, None)  # a failed assignment changes nothing


def test_compression_and_keywords_not_both():
    with pytest.raises(ValueError, match="not both"):
        tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1), tfbs.CompressionOptions(), k=2)
    with pytest.raises(TypeError, match="`compression`"):
        tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1), 3)
    with pytest.raises(ValueError, match="momentum_masking"):
        tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1),
                                  momentum_correction=tfbs.MomentumCorrection(0.5),
                                  momentum_masking="none", exchange="allgather")


def test_learning_rate_on_the_wrapper_is_an_error():
    inner = keras.optimizers.SGD(0.1, momentum=0.9)
    with pytest.raises(ValueError, match="`learning_rate` is the inner optimizer's"):
        tfbs.BlockSparseOptimizer(inner, learning_rate=0.5, exchange="allgather")
    assert inner.momentum == 0.9  # untouched
    assert float(np.asarray(inner.learning_rate)) == pytest.approx(0.1)


def test_invalid_block_rules_regex_fails_at_construction():
    with pytest.raises(ValueError, match=r"`block_rules`: pattern 'dense\(' is not a valid"):
        tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1), block_rules={"dense(": "single"},
                                  exchange="allgather")
    with pytest.raises(ValueError, match=r"`block_rules`: pattern '\*conv'"):
        tfbs.BlockSparseCrossDeviceOps(block_rules={"*conv": "single"})


def test_gradient_accumulation_in_the_inner_optimizer_points_to_the_wrapper(mirrored2):
    """The inner optimizer would accumulate exchanged updates; the wrapper accumulates
    before its exchange, and the message says so (the inner is left unchanged)."""
    with mirrored2.scope():
        inner = keras.optimizers.SGD(0.1, momentum=0.9, gradient_accumulation_steps=2)
        with pytest.raises(ValueError, match="give it to the wrapper instead"):
            tfbs.BlockSparseOptimizer(inner, exchange="allgather")
    assert inner.momentum == 0.9


def test_cross_device_ops_take_the_options_object():
    o = tfbs.CompressionOptions(density=0.5, exchange="shared", dense_below=0)
    ops = tfbs.BlockSparseCrossDeviceOps(o)
    assert ops.options == o and (ops.k, ops.density, ops.exchange, ops.dense_below) == (
        None, 0.5, "shared", 0)
    assert tfbs.BlockSparseCrossDeviceOps(density=0.5, exchange="shared",
                                          dense_below=0).options == o
    with pytest.raises(ValueError, match="`exchange`"):
        tfbs.BlockSparseCrossDeviceOps(tfbs.CompressionOptions(exchange="dense"))
    with pytest.raises(ValueError, match="nonfinite"):
        tfbs.BlockSparseCrossDeviceOps(nonfinite="skip")


def test_both_forms_default_to_the_same_exchange():
    """The keyword form and the options object default alike (the measured "auto"); the
    CrossDeviceOps, which cannot measure, default their keyword form to "allgather" and name
    the options' "auto" as the reason an options object without a mode is refused."""
    inner = keras.optimizers.SGD(0.1)
    keywords = tfbs.BlockSparseOptimizer(inner, k=1, dense_below=0)
    options = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1),
                                        tfbs.CompressionOptions(k=1, dense_below=0))
    assert keywords.compression == options.compression == tfbs.CompressionOptions(
        k=1, exchange="auto", dense_below=0)
    assert tfbs.BlockSparseCrossDeviceOps(k=1).exchange == "allgather"
    with pytest.raises(ValueError, match="`exchange`.*'auto' \\(the CompressionOptions default"):
        tfbs.BlockSparseCrossDeviceOps(tfbs.CompressionOptions(k=1))


@pytest.mark.parametrize("kwargs,match", [
    ({"dnesity": 0.1}, r"unknown keyword argument: `dnesity` \(did you mean 'density'\?\)$"),
    ({"nonfinte": "skip"}, r"`nonfinte` \(did you mean 'nonfinite'\?\)$"),
    ({"metrik": "l2", "exchnage": "shared"},
     r"unknown keyword arguments: `exchnage` \(did you mean 'exchange'\?\), `metrik` "
     r"\(did you mean 'metric'\?\)$"),
    ({"zzz": 1},
     r"`zzz`; known keywords: compression, momentum_correction, .*block_rules, "
     r"dense_steps, quantize, recurrent, embeddings$"),
    ({"clipnorm": 1.0}, r"^`clipnorm` is an argument of the inner optimizer, not of "
                        r"BlockSparseOptimizer: set it there, e.g. .*SGD\(\.\.\., clipnorm="),
])
def test_unknown_keywords_are_named_with_the_closest(kwargs, match):
    """A typo gets the keyword it resembles; only the inner optimizer's own arguments are sent
    there (a typo is not)."""
    with pytest.raises(ValueError, match=match) as err:
        tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1), **kwargs)
    if "clipnorm" not in kwargs:
        assert "inner optimizer" not in str(err.value)


def test_the_keyword_list_is_the_constructors():
    import inspect

    from tf_blocksparse.keras.optimizer_args import KEYWORDS

    own = set(inspect.signature(tfbs.BlockSparseOptimizer.__init__).parameters) - {
        "self", "inner", "options"}
    assert own | set(opts.OPTION_NAMES) | {"momentum_masking"} == set(KEYWORDS)


def test_cross_device_ops_and_configs_name_the_closest_option():
    with pytest.raises(ValueError, match=r"`dnsity` \(did you mean 'density'\?\)"):
        tfbs.BlockSparseCrossDeviceOps(dnsity=0.5)
    with pytest.raises(ValueError, match=r"CompressionOptions got an unknown keyword argument: "
                                         r"`metirc` \(did you mean 'metric'\?\)"):
        tfbs.CompressionOptions.from_config({"k": 1, "metirc": "l2"})
