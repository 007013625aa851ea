"""Keras adapters: the optimizer wrapper and the metrics callback."""
