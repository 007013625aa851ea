"""launch/experiments.py: the one table of exchange methods the scripts compare, each a
``Method`` config that renders to the ``launch.train`` command line the results record."""

from __future__ import annotations

import json
import pathlib

import pytest
from absl import flags

from launch import experiments
from launch.flags import define_flags
from launch.method import Method
from tf_blocksparse.options import CompressionOptions

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: The command line of every method (``{density}``: the benchmark's ``--density``).  What a
#: method runs must not change: the results files hold the runs it made.  Where a library
#: default changed after them, the method states the old value (``--momentum_masking=all``:
#: DGC's masking, the default masking when those results were made; ``--embeddings=by_size``
#: on the methods with runs on the translation models, whose small embedding tables were
#: sent whole then).
COMMAND_LINES = {
    "dense": ("--compression=dense",),
    "block_auto_default": ("--compression=block", "--exchange=auto", "--momentum_masking=all",
                           "--embeddings=by_size"),
    "block_auto_maskwhole": ("--compression=block", "--exchange=auto",
                             "--momentum_masking=whole", "--embeddings=by_size"),
    "block_auto_embed": ("--compression=block", "--exchange=auto", "--momentum_masking=whole"),
    "block_auto_nomask": ("--compression=block", "--exchange=auto", "--momentum_masking=none"),
    "block_auto_masknorm": ("--compression=block", "--exchange=auto",
                            "--momentum_masking=whole_except_norm"),
    "block_auto_maskvec": ("--compression=block", "--exchange=auto",
                           "--momentum_masking=whole_vectors"),
    "block_default": ("--compression=block", "--exchange=allgather", "--momentum_masking=all",
                      "--embeddings=by_size"),
    "block_dense_below_512": ("--compression=block", "--exchange=allgather",
                              "--dense_below=512", "--momentum_masking=all"),
    "block_dense_below_512_maskwhole": ("--compression=block", "--exchange=allgather",
                                        "--dense_below=512", "--momentum_masking=whole"),
    "block_recurrent_whole": ("--compression=block", "--exchange=allgather",
                              "--momentum_masking=all", "--recurrent=whole",
                              "--embeddings=by_size"),
    "block_recurrent_whole_nomask": ("--compression=block", "--exchange=allgather",
                                     "--momentum_masking=none", "--recurrent=whole",
                                     "--embeddings=by_size"),
    "block_recurrent_whole_embed": ("--compression=block", "--exchange=allgather",
                                    "--momentum_masking=none", "--recurrent=whole"),
    "block_default_waited": ("--compression=block", "--exchange=allgather",
                             "--momentum_masking=waited"),
    "block_default_nomask": ("--compression=block", "--exchange=allgather",
                             "--momentum_masking=none"),
    "block_default_maskcomp": ("--compression=block", "--exchange=allgather",
                               "--momentum_masking=compressed"),
    "block_default_maskwhole": ("--compression=block", "--exchange=allgather",
                                "--momentum_masking=whole", "--embeddings=by_size"),
    "block_default_embed": ("--compression=block", "--exchange=allgather",
                            "--momentum_masking=whole"),
    "block_default_masknorm": ("--compression=block", "--exchange=allgather",
                               "--momentum_masking=whole_except_norm"),
    "block_default_maskvec": ("--compression=block", "--exchange=allgather",
                              "--momentum_masking=whole_vectors"),
    "block_default_wholem07": ("--compression=block", "--exchange=allgather",
                               "--momentum_masking=whole", "--whole_momentum=0.7"),
    "block_default_wholem08": ("--compression=block", "--exchange=allgather",
                               "--momentum_masking=whole", "--whole_momentum=0.8"),
    "block_default_wholem085": ("--compression=block", "--exchange=allgather",
                                "--momentum_masking=whole", "--whole_momentum=0.85"),
    "block_shared_maskwhole": ("--compression=block", "--exchange=shared",
                               "--momentum_masking=whole", "--embeddings=by_size"),
    "block_default_dgc_warmup": ("--compression=block", "--exchange=allgather",
                                 "--momentum_masking=all",
                                 "--density_warmup=0.25,0.0625,0.015625,0.004"),
    "block_allgather": ("--compression=block", "--density={density}", "--exchange=allgather",
                        "--momentum_masking=all"),
    "block_shared": ("--compression=block", "--density={density}", "--exchange=shared",
                     "--momentum_masking=all"),
    "block_auto": ("--compression=block", "--density={density}", "--exchange=auto",
                   "--fusion_buffer_bytes=262144", "--momentum_masking=all"),
    "block_k1": ("--compression=block", "--k=1", "--exchange=allgather",
                 "--momentum_masking=all"),
    "block_source": ("--compression=block", "--k=1", "--exchange=allgather",
                     "--global_momentum", "--dense_below=0"),
    "block_k1_dgc": ("--compression=block", "--k=1", "--exchange=allgather",
                     "--dense_below=0", "--momentum_masking=all"),
    "block_k1_waited": ("--compression=block", "--momentum_masking=waited"),
    "topk": ("--compression=topk", "--density={density}", "--exchange=allgather",
             "--momentum_masking=all"),
    "topk_1pct": ("--compression=topk", "--density=0.01", "--exchange=allgather",
                  "--momentum_masking=all"),
    "local_dense": ("--compression=dense", "--sync_every=32"),
    "local_block": ("--compression=block", "--density=0.05", "--exchange=allgather",
                    "--quantize=int8", "--sync_every=32", "--outer_lr=1.0",
                    "--outer_momentum=0.0"),
    "local_block_20pct": ("--compression=block", "--density=0.2", "--exchange=allgather",
                          "--quantize=int8", "--sync_every=32", "--outer_lr=1.0",
                          "--outer_momentum=0.0"),
    "local_block_20pct_nesterov": ("--compression=block", "--density=0.2",
                                   "--exchange=allgather", "--quantize=int8", "--sync_every=32",
                                   "--outer_lr=0.7", "--outer_momentum=0.9"),
    "local_block_40pct_int4_nesterov": ("--compression=block", "--density=0.4",
                                        "--exchange=allgather", "--quantize=int4",
                                        "--sync_every=32", "--outer_lr=0.7",
                                        "--outer_momentum=0.9"),
    "local_average": ("--compression=dense", "--sync_every=32", "--outer_lr=1.0",
                      "--outer_momentum=0.0"),
    "local_auto": ("--compression=block", "--density=0.05", "--exchange=auto",
                   "--quantize=int8", "--sync_every=32"),
    "local_block_nesterov": ("--compression=block", "--density=0.05", "--exchange=allgather",
                             "--quantize=int8", "--sync_every=32", "--outer_lr=0.7",
                             "--outer_momentum=0.9"),
}
DENSITIES = (0.01, 0.05, 0.1)


def _parse(args: list[str]) -> flags.FlagValues:
    fv = flags.FlagValues()
    define_flags(fv)
    fv(["train", *args])
    return fv


def test_the_table_has_every_recorded_method():
    assert set(experiments.METHODS) == set(COMMAND_LINES)


@pytest.mark.parametrize("method", sorted(COMMAND_LINES))
@pytest.mark.parametrize("density", DENSITIES)
def test_every_method_renders_its_recorded_command_line(method: str, density: float):
    recorded = [f.format(density=density) for f in COMMAND_LINES[method]]
    assert experiments.method_flags(method, density) == recorded


@pytest.mark.parametrize("method", sorted(COMMAND_LINES))
@pytest.mark.parametrize("density", DENSITIES)
def test_flags_config_flags_round_trip(method: str, density: float):
    """flags -> Method -> flags is the same command line, launch.train parses it, and the
    method read back from the flags is the table's."""
    args = experiments.method_flags(method, density)
    parsed = Method.from_flags(_parse(args))
    assert parsed.to_flags() == args
    assert parsed == experiments.method_config(method, density)


@pytest.mark.parametrize("method", sorted(COMMAND_LINES))
def test_every_sparse_method_states_its_momentum_masking(method: str):
    """A change of the library's default masking cannot change what a method runs: every
    method with a local momentum (sparse, no global momentum, no local steps) states it."""
    config = experiments.method_config(method, 0.05)
    if config.options.sparse and not config.global_momentum and not config.sync_every:
        assert config.momentum_masking is not None


def test_methods_are_built_from_the_library_options():
    for method in COMMAND_LINES:
        config = experiments.method_config(method, 0.05)
        assert isinstance(config.options, CompressionOptions)
    assert experiments.method_config("block_allgather", 0.05).options == CompressionOptions(
        density=0.05, exchange="allgather")
    topk = experiments.method_config("topk_1pct").options
    assert (topk.granularity, topk.density, topk.exchange) == ("element", 0.01, "allgather")
    assert not experiments.method_config("local_dense").options.sparse
    with pytest.raises(ValueError, match="density"):
        experiments.method_config("block_allgather")


def test_the_local_steps_report_records_the_table_command_lines():
    """``local_steps.json`` stores its methods' command lines; the table still renders them."""
    doc = json.loads((ROOT / "benchmarks" / "results" / "local_steps.json").read_text())
    for method, recorded in doc["budget"]["methods"].items():
        assert experiments.method_flags(method) == recorded, method


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
    elif method in ("local_dense", "local_average"):  # a dense exchange of the progress
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


def test_a_run_directory_of_the_same_command_is_kept_for_a_resume(tmp_path, capsys):
    run_dir = tmp_path / "partial" / "cnn_small-dense-seed0"
    cmd = ["--epochs=3", f"--model_dir={run_dir}"]  # the launch.train flags
    experiments._claim_run_dir(str(run_dir), cmd)  # new: created, the command recorded
    (run_dir / "backup").mkdir()
    experiments._claim_run_dir(str(run_dir), cmd)  # the same command: kept
    assert (run_dir / "backup").exists() and "resuming" in capsys.readouterr().out
    experiments._claim_run_dir(str(run_dir), [*cmd, "--lr=0.1"])  # another run: afresh
    assert not (run_dir / "backup").exists()
    assert json.loads((run_dir / "command.json").read_text())[-1] == "--lr=0.1"
    (run_dir / "command.json").write_text("{not json")  # unreadable: afresh too
    (run_dir / "backup").mkdir()
    experiments._claim_run_dir(str(run_dir), cmd)
    assert not (run_dir / "backup").exists()


# Three small training processes (~30 s): `make test-slow`.
@pytest.mark.slow
def test_a_run_killed_after_an_epoch_resumes_in_its_directory_with_every_epoch(tmp_path):
    """A one-process run killed in epoch 2 and called again resumes from its backup; its
    record holds all three epochs, equal to the uninterrupted run's (op determinism)."""
    config = experiments.TrainConfig.from_args([
        "--dataset=digits", "--model=cnn_small", "--batch_size=64", "--epochs=3",
        "--steps_per_epoch=6", "--compression=block", "--exchange=allgather"])
    whole = experiments.run_in_one_process("block", config, 2)
    run_dir = tmp_path / "partial" / "run"
    killed = config.replace(fail_at_step=8, fail_worker=0)
    with pytest.raises(RuntimeError, match="exited with 17"):
        experiments.run_in_one_process("block", killed, 2, run_dir=str(run_dir))
    assert (run_dir / "progress.json").exists()
    # the same call as the killed one, without the fault: its command is the run's
    plain = [a for a in json.loads((run_dir / "command.json").read_text())
             if not a.startswith("--fail_")]
    (run_dir / "command.json").write_text(json.dumps(plain))
    resumed = experiments.run_in_one_process("block", config, 2, run_dir=str(run_dir))
    assert resumed["initial_epoch"] == 1 and resumed["history_from_epoch"] == 0
    assert resumed["history"]["val_accuracy"] == whole["history"]["val_accuracy"]
    assert resumed["test_correct"] == whole["test_correct"]
    assert len(resumed["train_s_per_epoch"]) == 3 and not run_dir.parent.exists()
