"""tf.distribute adapters: the block-sparse CrossDeviceOps and the multi-worker fix."""

from tf_blocksparse.distribute.cross_device_ops import BlockSparseCrossDeviceOps
from tf_blocksparse.distribute.fused_ops import FusedCrossDeviceOps
from tf_blocksparse.distribute.strategy import MultiWorkerMirroredStrategy

__all__ = ["BlockSparseCrossDeviceOps", "FusedCrossDeviceOps", "MultiWorkerMirroredStrategy"]
