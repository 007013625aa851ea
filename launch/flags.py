"""The flags of ``launch.train`` (shared with ``launch.train_hybrid``), each validated at parsing.

``launch.script.run`` makes them the running script's own, so its ``--help`` lists them;
the fault-injection flags of the tests (:mod:`launch.testing_flags`) stay out of ``--help``
(``--helpfull`` shows them).  Nothing here imports TensorFlow or Keras: ``--help`` and a
flag error answer at once.

They are the one place of the training settings' names, defaults and rules: a
:class:`launch.config.TrainConfig` is read from parsed flags, and checks itself by parsing
the command line it renders (:func:`parse`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from absl import flags

from launch.testing_flags import define_testing_flags
from models.registry import DATASET_MODELS
from tf_blocksparse.options import (
    AUTO_EXCHANGE,
    EMBEDDINGS,
    MASKINGS,
    METRICS,
    RECURRENT,
    SPARSE_EXCHANGES,
    WHOLE_MASKINGS,
)

#: The registry models ``--model`` accepts (those that train on the launch data sets).
MODELS = list(DATASET_MODELS)


def _valid_densities(values: list[str]) -> bool:
    try:
        return all(0.0 < float(v) <= 1.0 for v in values)
    except ValueError:
        return False


_SPARSE_ONLY = ("k", "density", "density_warmup", "dense_below", "momentum_masking",
                "whole_momentum", "quantize", "exchange", "metric", "recurrent", "embeddings")


#: Flags with a default that ``--compression=dense`` takes only at that default.
_SPARSE_CHOICES = {"quantize": "none", "exchange": AUTO_EXCHANGE, "metric": "l1",
                   "recurrent": "compress", "embeddings": "compress"}


def _dense_takes_no_sparse_options(values: dict) -> bool:
    if values["compression"] != "dense":
        return True
    return all(values[name] == _SPARSE_CHOICES[name] if name in _SPARSE_CHOICES
               else values[name] in (None, []) for name in _SPARSE_ONLY)


def _valid_shape(values: list[str]) -> bool:
    try:
        return bool(values) and all(int(v) >= 1 for v in values)
    except ValueError:
        return False


def flag_names() -> list[str]:
    """The names of the flags :func:`define_flags` defines, sorted."""
    return sorted(defaults())


def parse(args: Sequence[str]) -> flags.FlagValues:
    """The training flags of a fresh ``FlagValues``, set from ``args`` and validated.

    Args:
      args: Flags only (``["--model=vgg_fc", "--k=2"]``), no program name.

    Raises:
      flags.Error: An unknown flag, a bad value or combination (the message names the
        flag), or an argument that is not a flag.
    """
    values = flags.FlagValues()
    define_flags(values)
    rest = values(["launch.train", *args])
    if len(rest) > 1:
        raise flags.Error(f"not flags: {rest[1:]}")
    return values


def flag_text(name: str, value: Any) -> str:
    """``--name=value`` as a command line gives it: ``--name`` / ``--noname`` for a boolean,
    a list comma-separated."""
    if isinstance(value, bool):
        return f"--{name}" if value else f"--no{name}"
    if isinstance(value, list):
        return f"--{name}={','.join(value)}"
    return f"--{name}={value}"


@functools.cache
def _default_items() -> tuple[tuple[str, Any], ...]:
    values = parse([])
    return tuple((name, values[name].value) for name in sorted(values))


def defaults() -> dict[str, Any]:
    """Every training flag's default value as absl holds it (a list flag as a list of
    strings), by name, sorted."""
    return {name: list(v) if isinstance(v, list) else v for name, v in _default_items()}


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Defines the training flags (call once, before ``app.run``).

    Args:
      flag_values: Where to define them; absl's global ``FLAGS`` by default.
    """
    fv = {"flag_values": flag_values}
    flags.DEFINE_enum("model", "cnn_small", MODELS, "Model from models/.", **fv)
    flags.DEFINE_string(
        "dataset", "fashion_mnist",
        "fashion_mnist (Debian's IDX files under --data_dir), digits (8x8, shipped in "
        "datasets/), tfds:NAME (a TFDS data set already in --tfds_data_dir), synthetic (random "
        "data of --synthetic_shape, for throughput) or toy_translation (for gru_nmt and "
        "lstm_nmt; chosen automatically for those models).", **fv)
    flags.DEFINE_string("data_dir", "/usr/share/datasets/fashion-mnist",
                        "Directory of the Fashion-MNIST IDX files.", **fv)
    flags.DEFINE_string("tfds_data_dir", None, "TFDS data dir for tfds:NAME (no download).",
                        **fv)
    flags.DEFINE_list("synthetic_shape", ["32", "32", "3"],
                      "Image shape for --dataset=synthetic.", **fv)
    flags.DEFINE_integer("train_samples", 0, "Use only the first N training samples (0 = all).",
                         **fv)
    flags.DEFINE_integer("test_samples", 0, "Use only the first N test samples (0 = all).", **fv)
    flags.DEFINE_boolean("validate", True, "Evaluate on the test set after every epoch "
                         "(val_* curves in metrics.json and TensorBoard).", **fv)
    flags.DEFINE_integer("eval_batch_size", 256, "Global batch of the test evaluation (every "
                         "test example is counted exactly once, whatever the workers).",
                         lower_bound=1, **fv)
    flags.DEFINE_boolean("deterministic", False, "Seed Python/NumPy/TF with --seed and turn on "
                         "TF op determinism, so a re-run reproduces its accuracies (slower "
                         "on some devices).", **fv)
    flags.DEFINE_enum("strategy", "none", ["none", "mirrored", "multiworker"],
                      "none: default strategy; mirrored: MirroredStrategy over --num_devices "
                      "local devices; multiworker: MultiWorkerMirroredStrategy from TF_CONFIG "
                      "or SLURM's environment.", **fv)
    flags.DEFINE_integer("num_devices", 2, "Local devices for --strategy=mirrored (logical "
                         "CPUs are created when there are no GPUs).", lower_bound=1, **fv)
    flags.DEFINE_float("heartbeat_timeout_s", None, "--strategy=multiworker: seconds without "
                       "a heartbeat before a worker counts as dead (default: TensorFlow's, "
                       "10 s). Raise it on slow links, where the first weight broadcast can "
                       "hold heartbeats up longer.", lower_bound=0.001, **fv)
    flags.DEFINE_enum("compression", "block", ["dense", "block", "topk"],
                      "dense: plain all-reduce; block: block-wise top-k with error feedback; "
                      "topk: element-wise top-k with error feedback (DGC/GRACE baseline).", **fv)
    flags.DEFINE_integer("k", None, "Blocks kept per variable per step (default 1).", **fv)
    flags.DEFINE_float("density", None, "Fraction of blocks (elements for topk) kept per "
                       "variable; exclusive with --k. topk defaults to 0.01.", **fv)
    flags.DEFINE_enum("metric", "l1", list(METRICS), "Block score (block and topk only).",
                      **fv)
    flags.DEFINE_enum("exchange", AUTO_EXCHANGE, [*SPARSE_EXCHANGES, AUTO_EXCHANGE],
                      "Exchange mode (block and topk only); auto (the library's "
                      "default): per fusion group dense or sparse, whichever a cost model "
                      "of measured link and compression times predicts fastest to "
                      "accuracy; allgather / shared always compress.", **fv)
    flags.DEFINE_integer("fusion_buffer_bytes", 0, "Exchange the gradients in balanced "
                         "fusion groups of about this many bytes (one set of collectives per "
                         "group; --exchange=auto decides per group); 0: one group.",
                         lower_bound=0, **fv)
    flags.DEFINE_enum("quantize", "none", ["none", "bfloat16", "int8", "int4"],
                      "Sparse methods with --exchange=allgather: how the selected block "
                      "values travel (int8/int4: a float32 scale per block); the "
                      "quantisation error stays in the residual.", **fv)
    flags.DEFINE_enum("recurrent", "compress", list(RECURRENT),
                      "Sparse methods: whole sends recurrent layers' variables (GRU, LSTM, "
                      "SimpleRNN) whole every step, compressing the rest; compress treats "
                      "them like any other.", **fv)
    flags.DEFINE_enum("embeddings", "compress", list(EMBEDDINGS),
                      "Sparse methods: compress sends embedding tables as top-k rows "
                      "whatever their size; by_size sends those under --dense_below whole, "
                      "like any other variable.", **fv)
    flags.DEFINE_integer("sync_every", 0, "Local steps: every worker trains alone for this "
                         "many steps, then the workers' progress is exchanged (compressed as "
                         "--compression says) and applied by an outer Nesterov SGD; 0: every "
                         "step exchanges its gradients.", lower_bound=0, **fv)
    flags.DEFINE_float("outer_lr", None, "--sync_every: the outer SGD's learning rate "
                       "(default: the library's outer optimizer, SGD(1.0) for a sparse "
                       "exchange, Nesterov SGD(0.7, momentum 0.9) for a dense one).", **fv)
    flags.DEFINE_float("outer_momentum", None, "--sync_every: the outer SGD's Nesterov "
                       "momentum, in [0, 1) (with --outer_lr; default 0).", **fv)
    flags.DEFINE_integer("epochs", 2, "Training epochs.", lower_bound=1, **fv)
    flags.DEFINE_integer("steps_per_epoch", 0, "Cap on steps per epoch (0 = one pass over "
                         "this worker's shard).", lower_bound=0, **fv)
    flags.DEFINE_integer("batch_size", 64, "Global batch size (all workers together).",
                         lower_bound=1, **fv)
    flags.DEFINE_float("lr", 0.05, "Learning rate (> 0); the peak one under a schedule.", **fv)
    flags.DEFINE_enum("lr_schedule", "constant", ["constant", "cosine"],
                      "constant: --lr throughout; cosine: linear warm-up over "
                      "--warmup_epochs, then cosine decay to 0 at the last step of --epochs.",
                      **fv)
    flags.DEFINE_float("warmup_epochs", 0.0, "Epochs of linear learning-rate warm-up from 0 "
                       "(--lr_schedule=cosine only).", lower_bound=0.0, **fv)
    flags.DEFINE_float("momentum", 0.9, "SGD momentum, in [0, 1].  Sparse methods keep it "
                       "per worker before the exchange (DGC correction, the library's "
                       "default) unless --global_momentum.", **fv)
    flags.DEFINE_boolean("global_momentum", False, "Sparse methods: apply the momentum after "
                         "the exchange (the inner SGD's global momentum, the literal form) "
                         "instead of per worker before it.  Dense is unaffected (the two are "
                         "the same math).", **fv)
    flags.DEFINE_enum("momentum_masking", None, list(MASKINGS),
                      "Sparse methods with local momentum: which sent blocks leave the local "
                      "momentum (all: DGC factor masking; waited: only blocks that had "
                      "waited; none; compressed: only the compressed variables' blocks; "
                      "whole: only the variables sent whole every step; whole_except_norm: "
                      "those but the normalisation layers' scales and offsets; whole_vectors: "
                      "only the vectors (biases, scales, offsets) sent whole).  Default: the "
                      "library's (none with --recurrent=whole, else whole).", **fv)
    flags.DEFINE_float("whole_momentum", None, "Sparse methods under a whole masking "
                       "(--momentum_masking=whole, whole_except_norm, whole_vectors or the "
                       "default whole): the momentum factor the variables sent whole keep, "
                       "in [0, --momentum] (their velocity is scaled, not zeroed).  Default: 0 "
                       "(plain SGD on them).", **fv)
    flags.DEFINE_integer("dense_below", None, "Sparse methods: variables with fewer elements "
                         "are sent whole every step.  Default: the library's (1024); 0 "
                         "compresses every variable.", lower_bound=0, **fv)
    flags.DEFINE_list("density_warmup", [], "Sparse methods: densities for the first epochs "
                      "(DGC warm-up, e.g. 0.25,0.1); later epochs use --k/--density.", **fv)
    flags.DEFINE_integer("seed", 0, "Seed for model initialisation and data order.", **fv)
    flags.DEFINE_float("stop_at_accuracy", 0.0, "Stop once the per-epoch test accuracy "
                       "reaches this (and --min_epochs are done); 0 = never.  Needs "
                       "--validate.", lower_bound=0.0, upper_bound=1.0, **fv)
    flags.DEFINE_integer("min_epochs", 1, "Epochs always trained before --stop_at_accuracy "
                         "may stop the run.", lower_bound=1, **fv)
    flags.DEFINE_string("model_dir", None, "Checkpoints (backup/), TensorBoard logs (logs/) "
                        "and metrics.json (written by the chief).", **fv)
    flags.DEFINE_boolean("backup", True, "With --model_dir: back up (BackupAndRestore) and "
                         "resume from a backup; --nobackup trains without.", **fv)
    flags.DEFINE_integer("save_freq", 0, "Back up every N steps (0 = every epoch); needs "
                         "--model_dir.", lower_bound=0, **fv)
    flags.DEFINE_boolean("block_metrics", False, "Also print the block-sparse figures "
                         "(payload_bytes, dense_bytes, compression, blocks_kept, residual_norm, "
                         "skipped_steps) on the per-epoch progress line; metrics.json and "
                         "TensorBoard always have them.", **fv)
    define_testing_flags(flag_values)  # not key flags: --help leaves them out

    flags.register_validator(
        "density", lambda d: d is None or 0.0 < d <= 1.0, "--density must be in (0, 1]", **fv)
    flags.register_validator(
        "density_warmup", _valid_densities,
        "--density_warmup must be a comma-separated list of numbers in (0, 1]", **fv)
    flags.register_validator("k", lambda k: k is None or k >= 1, "--k must be >= 1", **fv)
    flags.register_multi_flags_validator(
        ["stop_at_accuracy", "validate"], lambda f: not f["stop_at_accuracy"] or f["validate"],
        "--stop_at_accuracy needs --validate (it reads the per-epoch test accuracy)", **fv)
    flags.register_multi_flags_validator(
        ["k", "density"], lambda f: f["k"] is None or f["density"] is None,
        "give at most one of --k and --density", **fv)
    flags.register_validator("lr", lambda lr: lr > 0, "--lr must be > 0", **fv)
    flags.register_validator("outer_lr", lambda lr: lr is None or lr > 0,
                             "--outer_lr must be > 0", **fv)
    flags.register_validator("outer_momentum", lambda m: m is None or 0.0 <= m < 1.0,
                             "--outer_momentum must be in [0, 1)", **fv)
    flags.register_multi_flags_validator(
        ["outer_lr", "outer_momentum"],
        lambda f: f["outer_momentum"] is None or f["outer_lr"] is not None,
        "--outer_momentum needs --outer_lr (without both the library's default applies)",
        **fv)
    flags.register_multi_flags_validator(
        ["lr_schedule", "warmup_epochs", "epochs"],
        lambda f: not f["warmup_epochs"] or (f["lr_schedule"] == "cosine"
                                             and f["warmup_epochs"] < f["epochs"]),
        "--warmup_epochs needs --lr_schedule=cosine and must be below --epochs", **fv)
    flags.register_validator("momentum", lambda m: 0.0 <= m <= 1.0,
                             "--momentum must be in [0, 1]", **fv)
    flags.register_multi_flags_validator(
        ["whole_momentum", "momentum", "momentum_masking", "global_momentum"],
        lambda f: f["whole_momentum"] is None or (
            0.0 <= f["whole_momentum"] <= f["momentum"] and not f["global_momentum"]
            and f["momentum_masking"] in (None, *WHOLE_MASKINGS)),
        "--whole_momentum must be in [0, --momentum], with the local momentum (no "
        "--global_momentum) under a whole masking (--momentum_masking unset, whole, "
        "whole_except_norm or whole_vectors)", **fv)
    flags.register_validator(
        "synthetic_shape", _valid_shape,
        "--synthetic_shape must be a comma-separated list of positive integers", **fv)
    flags.register_multi_flags_validator(
        ["compression", *_SPARSE_ONLY], _dense_takes_no_sparse_options,
        "--compression=dense sends every gradient whole: --k, --density, --density_warmup, "
        "--quantize, --dense_below, --momentum_masking, --whole_momentum, --exchange, "
        "--metric, --recurrent and --embeddings apply only to --compression=block or topk", **fv)
    flags.register_multi_flags_validator(
        ["save_freq", "model_dir"], lambda f: not f["save_freq"] or f["model_dir"],
        "--save_freq needs --model_dir (the backups go to MODEL_DIR/backup)", **fv)
    flags.register_validator(
        "dataset", lambda d: d in ("fashion_mnist", "digits", "synthetic", "toy_translation")
        or (d.startswith("tfds:") and len(d) > 5),
        "--dataset must be fashion_mnist, digits, synthetic, toy_translation or tfds:NAME", **fv)
