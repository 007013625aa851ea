"""Keras adapters: the optimizer wrapper, callbacks and the layer profiler."""

from tf_blocksparse.keras.profiler import (
    LayerMeasurement,
    chain_layers,
    measure_layers,
    profile_model,
)

__all__ = ["LayerMeasurement", "chain_layers", "measure_layers", "profile_model"]
