"""launch/config.py and launch/method.py: a ``launch.train`` run as a frozen config that
its flags build and that renders back to them."""

from __future__ import annotations

import glob
import json
import pathlib

import pytest

from launch import flags as train_flags
from launch.config import TrainConfig
from launch.method import DENSE, METHOD_FLAGS, TOPK_DENSITY, Method
from tf_blocksparse.options import CompressionOptions

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: Command lines in the order ``TrainConfig.to_flags`` writes them: run flags by name, then
#: the method's.
COMMAND_LINES = [
    ["--compression=block"],
    ["--epochs=3", "--model=vgg_fc", "--compression=topk", "--density=0.01",
     "--exchange=shared"],
    ["--nobackup", "--batch_size=128", "--deterministic", "--fail_at_step=3",
     "--fail_worker=0", "--model_dir=/tmp/run", "--synthetic_shape=16,16,1", "--novalidate",
     "--compression=dense", "--metric=l1", "--exchange=auto", "--sync_every=8"],
    ["--dataset=tfds:mnist", "--lr=0.1", "--lr_schedule=cosine", "--stop_at_accuracy=0.9",
     "--tfds_data_dir=/data", "--warmup_epochs=0.5", "--compression=block", "--k=2",
     "--metric=l2", "--fusion_buffer_bytes=4096", "--noglobal_momentum",
     "--dense_below=1024", "--momentum_masking=none", "--density_warmup=0.5,0.25"],
    ["--compression=topk", "--k=3", "--exchange=allgather", "--quantize=bfloat16"],
    ["--model=gru_nmt", "--compression=block", "--exchange=allgather", "--recurrent=whole"],
    ["--compression=block", "--density=0.05", "--sync_every=16"],  # the automatic exchange
    ["--compression=block", "--exchange=allgather", "--momentum_masking=whole_vectors",
     "--whole_momentum=0.5"],
]


def test_the_fields_are_the_flags():
    """Every launch.train flag is a field of the config or of its method, and nothing else."""
    names = set(TrainConfig.run_flags()) | set(METHOD_FLAGS)
    assert names == set(train_flags.flag_names())
    assert not set(TrainConfig.run_flags()) & set(METHOD_FLAGS)


def test_the_default_config_is_launch_train_without_flags():
    config = TrainConfig.default()
    assert config == TrainConfig.from_flags(train_flags.parse([]))
    assert config.method == Method() and config.to_flags() == ["--compression=block"]
    assert config.flag_values() == train_flags.defaults()
    assert config.synthetic_shape == (32, 32, 3) and config.model == "cnn_small"


@pytest.mark.parametrize("args", COMMAND_LINES, ids=range(len(COMMAND_LINES)))
def test_flags_config_flags_round_trip(args: list[str]):
    parsed = train_flags.parse(args)
    config = TrainConfig.from_flags(parsed)
    assert config.to_flags() == args
    assert TrainConfig.from_args(config.to_flags()) == config
    # the record's flags are absl's values, exactly
    assert config.flag_values() == {n: parsed[n].value for n in train_flags.flag_names()}


def test_the_method_holds_the_library_options():
    topk = TrainConfig.from_args(["--compression=topk"]).method
    assert topk.options == CompressionOptions(density=TOPK_DENSITY, granularity="element")
    assert topk.flag_values()["density"] is None and topk.to_flags() == ["--compression=topk"]
    block = Method.from_args(["--compression=block", "--k=1", "--dense_below=0"])
    assert block.options == CompressionOptions(k=1, dense_below=0)
    assert block.stated == {"k"}  # --k=1 is the default k, written: it stays written
    assert Method.from_args(["--compression=dense"]).options == DENSE
    whole = Method.from_args(["--compression=block", "--exchange=allgather",
                              "--recurrent=whole"])
    assert whole.options == CompressionOptions(exchange="allgather", recurrent="whole")
    by_size = Method.from_args(["--compression=block", "--embeddings=by_size"])
    assert by_size.options == CompressionOptions(embeddings="by_size")
    assert by_size.to_flags() == ["--compression=block", "--embeddings=by_size"]


def test_stated_keeps_only_flags_at_their_default():
    assert Method(CompressionOptions(k=2), stated=frozenset({"k"})).stated == frozenset()
    assert Method(CompressionOptions(), stated=frozenset({"exchange"})).to_flags() == [
        "--compression=block", "--exchange=auto"]
    assert Method(CompressionOptions(), stated=frozenset({"density"})).stated == frozenset()
    with pytest.raises(ValueError, match="stated"):
        Method(stated=frozenset({"model"}))


@pytest.mark.parametrize("make, match", [
    (lambda: Method(CompressionOptions(exchange="dense", k=3)), "dense method"),
    (lambda: Method(CompressionOptions(block_rules={"kernel": "element"})), "flags"),
    (lambda: Method(CompressionOptions(dense_steps=10)), "flags"),
    (lambda: Method(DENSE, momentum_masking="waited"), "--momentum_masking"),
    (lambda: Method(CompressionOptions(exchange="allgather"), outer_momentum=0.5),
     "--outer_momentum"),
    (lambda: Method(DENSE, whole_momentum=0.5), "--whole_momentum"),
    (lambda: Method(CompressionOptions(), momentum_masking="none", whole_momentum=0.5),
     "--whole_momentum"),
    (lambda: Method(CompressionOptions(), whole_momentum=0.95), "--whole_momentum"),
    (lambda: Method(CompressionOptions(), global_momentum=True, whole_momentum=0.5),
     "--whole_momentum"),
], ids=["dense_k", "block_rules", "dense_steps", "dense_masking", "outer_momentum",
        "dense_whole_momentum", "none_whole_momentum", "whole_momentum_above",
        "global_whole_momentum"])
def test_a_method_launch_train_would_refuse_is_an_error(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_replace_checks_the_config():
    config = TrainConfig.default()
    assert config.replace(epochs=5).to_flags() == ["--epochs=5", "--compression=block"]
    method = Method(CompressionOptions(density=0.1, exchange="allgather"))
    assert config.replace(method=method).to_flags() == [
        "--compression=block", "--density=0.1", "--exchange=allgather"]
    with pytest.raises(ValueError, match="--stop_at_accuracy"):
        config.replace(stop_at_accuracy=0.5, validate=False)
    with pytest.raises(ValueError, match="model"):
        config.replace(model="resnet50")
    with pytest.raises(ValueError, match="Method"):
        config.replace(method="--compression=dense")


def _recorded_flags() -> list[dict]:
    found = []

    def walk(node):
        if isinstance(node, dict):
            if isinstance(node.get("flags"), dict) and "compression" in node["flags"]:
                found.append(node["flags"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    for path in sorted(glob.glob(str(ROOT / "benchmarks" / "results" / "*.json"))):
        walk(json.loads(pathlib.Path(path).read_text()))
    return found


def test_committed_run_records_round_trip():
    """The flags of every committed run record make a config whose flag values are the
    record's (flags added since a record was written take their defaults)."""
    records = _recorded_flags()
    assert len(records) > 50
    defaults = train_flags.defaults()
    for flags in records:
        known = {k: v for k, v in flags.items() if k in defaults}
        args = [train_flags.flag_text(k, v) for k, v in known.items()
                if v is not None and v != defaults[k]]
        values = TrainConfig.from_args(args).flag_values()
        assert {k: values[k] for k in known} == known
