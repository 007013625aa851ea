"""Helpers outside the exchange, for the Colab notebooks: nothing else in the package imports
them.

- :mod:`~tf_blocksparse.extras.run_length`: run-length encoding of sparse tensors (NumPy and
  TensorFlow), whose sizes the ``compression_anatomy`` notebook compares with the exchange's
  blocks.

Nothing is imported here: ``from tf_blocksparse.extras import run_length`` loads TensorFlow.
"""
