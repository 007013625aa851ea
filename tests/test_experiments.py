"""launch/experiments.py: the one table of exchange methods the scripts compare."""

from __future__ import annotations

import pytest
from absl import flags

from launch import experiments
from launch.flags import define_flags


def _parse(args: list[str]) -> flags.FlagValues:
    fv = flags.FlagValues()
    define_flags(fv)
    fv(["train", *args])
    return fv


def test_every_script_draws_its_methods_from_the_one_table():
    names = [*experiments.DEMO_METHODS.values(), *experiments.CONVERGENCE_METHODS,
             *experiments.TIME_TO_ACCURACY_METHODS]
    assert set(names) <= set(experiments.METHODS)


@pytest.mark.parametrize("method", sorted(experiments.METHODS))
def test_every_method_is_a_valid_train_command_line(method: str):
    fv = _parse(experiments.method_flags(method, 0.05))
    if method == "dense":
        assert fv.compression == "dense" and fv.k is None and fv.density is None
    elif method.startswith("topk"):
        assert fv.compression == "topk" and fv.density in (0.05, 0.01)
    elif method == "local_dense":  # DiLoCo: a dense exchange of the progress
        assert fv.compression == "dense" and fv.sync_every == 32
    else:
        assert fv.compression == "block"


def test_the_literal_block_configuration():
    """k=1 on every variable with the momentum after the exchange: the demo's "block literal"
    and the convergence bench's block_source are the same run."""
    assert experiments.DEMO_METHODS["block literal"] == "block_source"
    fv = _parse(experiments.method_flags("block_source", 0.01))
    assert (fv.k, fv.global_momentum, fv.dense_below, fv.exchange) == (1, True, 0, "allgather")


def test_known_methods_validator():
    assert experiments.known_methods(["dense", "topk"], experiments.METHODS)
    assert not experiments.known_methods([], experiments.METHODS)
    assert not experiments.known_methods(["dense", "nope"], experiments.METHODS)
