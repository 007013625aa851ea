"""Projected scaling efficiency of dense, allgather and shared exchange at 8 ... 1024 workers.

Feeds the alpha-beta model of :mod:`tf_blocksparse.planning.scaling` with figures measured
here: per-variable gradient sizes of ``keras.applications`` ResNet-50 / VGG-16 (weights=None,
built at ``--image_size``), the block-sparse payload of the real variables for ``k=1`` and
``density=1%`` (``BlockTopK`` + ``layouts_for``, sizes from ``codec.buffer_nbytes`` of the
tensors one compress step produces), the selection time (accumulate + select + residual +
pack, as ``launch/bench_selection.py``) and one forward + backward step on this CPU at
``--cpu_batch``.  Two compute figures are projected:

- ``cpu_measured``: the step time measured here (slow, so communication looks cheap);
- ``gpu_assumed``: published single-GPU step times, an *assumption*, not measured here:
  TensorFlow's benchmark page (tf_cnn_benchmarks, NVIDIA DGX-1, one Tesla P100, batch 64,
  synthetic data, May 2017): ResNet-50 219 img/s (0.292 s/step), VGG-16 154 img/s (0.416 s);
  ResNet-101 is not listed there and is interpolated by FLOPs between ResNet-50 and ResNet-152
  (91.8 img/s): about 129 img/s (0.495 s).  Override with ``--gpu_compute_s``.  The selection
  time on that GPU is *estimated*: the CPU's measured ratio (compress time / one
  ``residual += grad`` pass) times that pass modelled on the GPU
  (3 x gradient bytes / ``--gpu_mem_gbps``), unless ``--gpu_select_s`` gives it.

Writes ``--out`` (JSON: inputs, assumptions, every projection, a sanity check of the dense
case against Horovod's published 512-GPU / 25 Gbit/s figures, a summary) and a markdown
table next to it (same name, ``.md``), and prints the table.

    python -m launch.project_scaling [--models=resnet50,vgg16] [--cpu_batch=4]
        [--workers=8,16,...] [--bandwidths_gbit=1,10,25,100] [--alpha_us=25]
        [--gpu_compute_s=resnet50=0.292,vgg16=0.416] [--out=benchmarks/results/scaling.json]
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from absl import app, flags

from launch import script
from launch.scaling_report import (
    DEFAULT_BANDWIDTHS,
    DEFAULT_WORKERS,
    GPU_COMPUTE_S,
    markdown_table,
)
from models import registry

FLAGS = flags.FLAGS
#: The flags' defaults (those of :func:`launch.benches.scaling.run` too).


def define_flags() -> None:
    """Defines the script's flags."""
    flags.DEFINE_list("models", ["resnet50", "vgg16"],
                      f"Models to project: {sorted(registry.IMAGENET_MODELS)}.")
    flags.DEFINE_list("workers", [str(w) for w in DEFAULT_WORKERS], "Cluster sizes.")
    flags.DEFINE_list("bandwidths_gbit", [f"{b:g}" for b in DEFAULT_BANDWIDTHS],
                      "Link rates per worker and direction (Gbit/s).")
    flags.DEFINE_float("alpha_us", 25.0, "Latency per message (microseconds).")
    flags.DEFINE_float("overlap", 2 / 3, "Optimistic fraction of compute that hides "
                       "communication (the backward pass).")
    flags.DEFINE_integer("image_size", 224, "Input height/width the models are built at.",
                         lower_bound=32)
    flags.DEFINE_integer("cpu_batch", 4, "Batch of the CPU forward+backward timing.")
    flags.DEFINE_integer("repeats", 3, "Timed runs per measurement (median).", lower_bound=1)
    flags.DEFINE_integer("k", 1, "Blocks per variable of the k selection.")
    flags.DEFINE_float("density", 0.01, "Block fraction of the density selection.")
    flags.DEFINE_list("gpu_compute_s", [f"{m}={s:.3f}" for m, s in GPU_COMPUTE_S.items()],
                      "MODEL=SECONDS per step on one GPU (assumed; default: P100, batch 64).")
    flags.DEFINE_float("gpu_mem_gbps", 732.0, "GPU memory bandwidth (GB/s) for the selection "
                       "time estimate (P100: 732).")
    flags.DEFINE_float("gpu_select_s", None, "Use this selection time on the GPU instead of "
                       "the estimate.")
    flags.DEFINE_bool("sanity_check", True, "Add the dense ResNet-101 / VGG-16 check against "
                      "Horovod (builds ResNet-101 for its sizes).")
    flags.DEFINE_string("out", "benchmarks/results/scaling.json", "JSON output path.")


def _parse_gpu(entries: Sequence[str]) -> dict[str, float]:
    out = {}
    for e in entries:
        name, sep, val = e.partition("=")
        try:
            out[name.strip()] = float(val)
        except ValueError:
            sep = ""
        if not sep:
            raise app.UsageError(f"--gpu_compute_s entries must be MODEL=SECONDS, got {e!r}",
                                 exitcode=2)
    return out


def main(argv: Sequence[str]) -> None:
    """absl entry point: thin wrapper around :func:`launch.benches.scaling.run`."""
    del argv
    from launch.benches.scaling import run

    fl = FLAGS
    try:
        workers = [int(w) for w in fl.workers]
        bandwidths = [float(b) for b in fl.bandwidths_gbit]
    except ValueError as e:
        raise app.UsageError(f"--workers / --bandwidths_gbit must be numbers: {e}",
                             exitcode=2) from None
    try:
        result = run(fl.models, workers, bandwidths, fl.alpha_us * 1e-6, fl.overlap,
                     fl.image_size, fl.cpu_batch, fl.repeats, fl.k, fl.density,
                     _parse_gpu(fl.gpu_compute_s), fl.gpu_mem_gbps, fl.gpu_select_s,
                     fl.sanity_check, fl.out)
    except ValueError as e:
        raise app.UsageError(str(e), exitcode=2) from None
    print(markdown_table(result))
    if result["sanity_check"]:
        print(json.dumps(result["sanity_check"]["entries"], indent=1))
    print(json.dumps(result["summary"], indent=1))
    print(f"[project_scaling] wrote {fl.out}")


if __name__ == "__main__":
    script.run(main, define_flags)
