"""Selection cost on ResNet-50-shaped gradients, against plain passes over the same tensors.

Prints one JSON object (milliseconds, median of ``--repeats`` rounds, all in one process;
every round times each measurement once, interleaved, so a drift of the machine hits all
alike):
``select_ms`` (score + top-k + gather), ``compress_ms`` (accumulate + select + residual +
pack: the wrapper's full per-step work on one replica), ``flat_topk_ms`` (``tf.math.top_k``
on each flattened tensor for the same number of elements), ``read_pass_ms`` (one
``reduce_sum(abs(g))`` over all tensors), ``accumulate_pass_ms`` (``residual += grad`` over
all tensors), ratios of the medians, the quartiles of each ratio over the rounds
(``*_quartiles``), and one step's ``payload_bytes`` / ``dense_bytes``.

    python -m launch.bench_selection [--k=1 | --density=0.01] [--metric=l1] [--repeats=7]
"""

from __future__ import annotations

import json

from absl import flags

from launch import script
from tf_blocksparse.options import METRICS

FLAGS = flags.FLAGS


def define_flags() -> None:
    """Defines the script's flags (only called when run as a script)."""
    flags.DEFINE_integer("k", None, "Blocks kept per variable (default 1).")
    flags.DEFINE_float("density", None, "Fraction of blocks kept per variable.")
    flags.DEFINE_enum("metric", "l1", list(METRICS), "Block score.")
    flags.DEFINE_integer("repeats", 15, "Timed runs per measurement (median reported).",
                         lower_bound=1)
    flags.DEFINE_enum("model", "resnet50", ["resnet50", "vgg16"], "Registry model whose "
                      "variables are selected from.")
    flags.register_validator("k", lambda k: k is None or k >= 1, "--k must be >= 1")
    flags.register_validator("density", lambda d: d is None or 0.0 < d <= 1.0,
                             "--density must be in (0, 1]")
    flags.register_multi_flags_validator(
        ["k", "density"], lambda f: f["k"] is None or f["density"] is None,
        "give at most one of --k and --density")


def main(argv: list[str]) -> None:
    """Prints :func:`launch.benches.selection.measure`'s record for the flags as one JSON
    object."""
    del argv
    from launch.benches import selection

    print(json.dumps(selection.measure(FLAGS.model, FLAGS.k, FLAGS.density, FLAGS.metric,
                                       FLAGS.repeats)))


if __name__ == "__main__":
    script.run(main, define_flags)
