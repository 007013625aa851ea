"""Keras adapters: the optimizer wrapper and its momentum policy, callbacks, evaluation and
backup."""

from tf_blocksparse.keras.momentum import MomentumCorrection

__all__ = ["MomentumCorrection"]
