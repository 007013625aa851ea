"""Keras adapters: the optimizer wrapper and its momentum policy, callbacks and the layer
profiler."""

from tf_blocksparse.keras.momentum import MomentumCorrection
from tf_blocksparse.keras.profiler import (
    LayerMeasurement,
    chain_layers,
    measure_layers,
    profile_model,
)

__all__ = ["LayerMeasurement", "MomentumCorrection", "chain_layers", "measure_layers",
           "profile_model"]
