"""Keras models used by the launch scripts."""
