"""What the two step-based trainers (:class:`~tf_blocksparse.PipelineTrainer`,
:class:`~tf_blocksparse.HybridTrainer`) share, on TensorFlow.

- :mod:`~tf_blocksparse.runtime.replica`: one device's copy of a piece of a model, the
  agreement on non-trainable state and each replica's optimizer.
- :mod:`~tf_blocksparse.runtime.slicing`: row slices of a mini-batch and moving them between
  pieces.
- :mod:`~tf_blocksparse.runtime.losses`: per-example losses and each slice's share of the mean.
- :mod:`~tf_blocksparse.runtime.devices`: the default device list and device identity.
- :mod:`~tf_blocksparse.runtime.fit`: a Keras-like ``fit`` around the trainers' ``train_step``.
- :mod:`~tf_blocksparse.runtime.remote`: worker servers and the client connection, so the
  trainers span processes (``python -m tf_blocksparse.runtime.remote`` starts a worker).

Nothing is imported here: ``from tf_blocksparse.runtime import remote`` loads what it needs.
"""
