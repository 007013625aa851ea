"""The optimizers ``launch.bench_clipping`` compares: layer-wise local clipping before a
per-group exchange, Keras' global-norm clipping, none, and clipping after the all-reduce.

Every variant wraps ``SGD(LEARNING_RATE, momentum=MOMENTUM)``; :data:`DESCRIPTIONS` says what
each is, in the words the benchmark's record uses.
"""

from __future__ import annotations

from typing import Any

import keras

from tf_blocksparse import BlockSparseOptimizer
from tf_blocksparse.clipping import LocalNormClip
from tf_blocksparse.clipping_baseline import clip_after_all_reduce

LEARNING_RATE = 0.05
MOMENTUM = 0.9

OVERLAP_VARIANTS = ("fused", "single_group")
STEP_VARIANTS = ("local_clip_dense", "local_clip_allgather", "global_clipnorm", "no_clip",
                 "reduce_then_global_clip")
BASELINE = "global_clipnorm"
DESCRIPTIONS = {
    "fused": "BlockSparseOptimizer(SGD, k=1, exchange='allgather', clipping=[LocalNormClip(t)],"
             " fusion_buffer_bytes=B)",
    "single_group": "BlockSparseOptimizer(SGD, k=1, exchange='allgather', "
                    "clipping=[LocalNormClip(t)], fusion_buffer_bytes=None)",
    "local_clip_dense": "BlockSparseOptimizer(SGD, exchange='dense', "
                        "clipping=[LocalNormClip(t)], fusion_buffer_bytes=B)",
    "local_clip_allgather": "BlockSparseOptimizer(SGD, k=1, exchange='allgather', "
                            "clipping=[LocalNormClip(t)], fusion_buffer_bytes=B)",
    "global_clipnorm": "SGD(global_clipnorm=t): Keras clips each replica's local gradients' "
                       "global norm, then all-reduces",
    "no_clip": "SGD, no clipping (Keras all-reduce)",
    "reduce_then_global_clip": "SGD whose all-reduced gradients are clipped to global norm t",
}


class ReduceThenClipSGD(keras.optimizers.SGD):
    """SGD that clips the global norm of the *all-reduced* gradients.

    Keras clips (``clipnorm`` / ``global_clipnorm``) before its all-reduce; this clips its
    result (:func:`tf_blocksparse.clipping_baseline.clip_after_all_reduce`), so every replica clips
    the same aggregated gradient.

    Args:
        clip_norm: Global-norm threshold of the aggregated gradients.
        **kwargs: ``keras.optimizers.SGD`` arguments.
    """

    def __init__(self, clip_norm: float, **kwargs: Any):
        super().__init__(**kwargs)
        self.clip_norm = float(clip_norm)
        clip_after_all_reduce(self, self.clip_norm)


def make_optimizer(variant: str, threshold: float, buffer_bytes: int
                   ) -> keras.optimizers.Optimizer:
    """The optimizer of one of :data:`OVERLAP_VARIANTS` or :data:`STEP_VARIANTS`."""
    sgd = {"learning_rate": LEARNING_RATE, "momentum": MOMENTUM}
    clip = [LocalNormClip(threshold)]
    if variant in ("fused", "local_clip_allgather"):
        return BlockSparseOptimizer(keras.optimizers.SGD(**sgd), k=1, exchange="allgather",
                                    clipping=clip, fusion_buffer_bytes=buffer_bytes)
    if variant == "single_group":
        return BlockSparseOptimizer(keras.optimizers.SGD(**sgd), k=1, exchange="allgather",
                                    clipping=clip, fusion_buffer_bytes=None)
    if variant == "local_clip_dense":
        return BlockSparseOptimizer(keras.optimizers.SGD(**sgd), exchange="dense",
                                    clipping=clip, fusion_buffer_bytes=buffer_bytes)
    if variant == "global_clipnorm":
        return keras.optimizers.SGD(global_clipnorm=threshold, **sgd)
    if variant == "no_clip":
        return keras.optimizers.SGD(**sgd)
    if variant == "reduce_then_global_clip":
        return ReduceThenClipSGD(threshold, **sgd)
    raise ValueError(f"unknown variant {variant!r}")
