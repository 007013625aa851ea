"""tf.distribute adapters: the block-sparse CrossDeviceOps, the multi-worker fix and the
pipeline runtime."""

from tf_blocksparse.distribute.cross_device_ops import BlockSparseCrossDeviceOps
from tf_blocksparse.distribute.fused_ops import FusedCrossDeviceOps
from tf_blocksparse.distribute.pipeline_trainer import PipelineTrainer
from tf_blocksparse.distribute.strategy import MultiWorkerMirroredStrategy

__all__ = ["BlockSparseCrossDeviceOps", "FusedCrossDeviceOps", "MultiWorkerMirroredStrategy",
           "PipelineTrainer"]
