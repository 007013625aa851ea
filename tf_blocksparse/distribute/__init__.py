"""tf.distribute adapters: the multi-worker strategy fix."""

from tf_blocksparse.distribute.strategy import MultiWorkerMirroredStrategy

__all__ = ["MultiWorkerMirroredStrategy"]
