"""tf.distribute adapters: the block-sparse CrossDeviceOps, the multi-worker fix, the
pipeline runtime and the worker servers / client connection for training across processes
(:mod:`~tf_blocksparse.distribute.remote`)."""

from tf_blocksparse.distribute import remote
from tf_blocksparse.distribute.cross_device_ops import BlockSparseCrossDeviceOps
from tf_blocksparse.distribute.fused_ops import FusedCrossDeviceOps
from tf_blocksparse.distribute.pipeline_trainer import PipelineTrainer
from tf_blocksparse.distribute.strategy import MultiWorkerMirroredStrategy

__all__ = ["BlockSparseCrossDeviceOps", "FusedCrossDeviceOps", "MultiWorkerMirroredStrategy",
           "PipelineTrainer", "remote"]
