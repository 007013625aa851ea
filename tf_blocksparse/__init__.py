"""tf_blocksparse: block-wise top-k gradient exchange with error feedback for tf.distribute.

Core (no adapters imported by it): :mod:`~tf_blocksparse.blocks` (block-rule table),
:mod:`~tf_blocksparse.options` (the one options object),
:mod:`~tf_blocksparse.selection`, :mod:`~tf_blocksparse.feedback`,
:mod:`~tf_blocksparse.codec`, :mod:`~tf_blocksparse.collectives`,
:mod:`~tf_blocksparse.exchange` (the one exchange),
:mod:`~tf_blocksparse.clipping`, and the TF-free planners in
:mod:`tf_blocksparse.planning` (those modules import no TensorFlow themselves).  Adapters:
:mod:`tf_blocksparse.keras` and :mod:`tf_blocksparse.distribute`.  The adapters are imported
here so that ``import tf_blocksparse`` registers the optimizer with Keras (``.keras`` files
that use it load after that import).
"""

from tf_blocksparse import clipping, planning
from tf_blocksparse.blocks import BlockLayout, BlockRule, block_table, format_block_table
from tf_blocksparse.distribute.cross_device_ops import BlockSparseCrossDeviceOps
from tf_blocksparse.distribute.fused_ops import FusedCrossDeviceOps
from tf_blocksparse.distribute.hybrid import HybridTrainer
from tf_blocksparse.distribute.pipeline import PipelineTrainer
from tf_blocksparse.distribute.strategy import MultiWorkerMirroredStrategy
from tf_blocksparse.feedback import BlockTopK, ElementTopK, Payload
from tf_blocksparse.keras.backup import BackupAndRestore, save_model
from tf_blocksparse.keras.callbacks import BlockSparseMetrics
from tf_blocksparse.keras.evaluation import EvalResult, ExactValidation, evaluate_exactly
from tf_blocksparse.keras.hybrid_split import find_boundary, split_model
from tf_blocksparse.keras.momentum import MomentumCorrection
from tf_blocksparse.keras.optimizer import BlockSparseOptimizer
from tf_blocksparse.keras.profiler import profile_model
from tf_blocksparse.keras.warmup import DensityWarmup
from tf_blocksparse.options import CompressionOptions

__all__ = [
    "BackupAndRestore", "BlockLayout", "BlockRule", "BlockSparseCrossDeviceOps",
    "BlockSparseMetrics", "BlockSparseOptimizer", "BlockTopK", "CompressionOptions",
    "DensityWarmup", "ElementTopK", "EvalResult", "ExactValidation", "FusedCrossDeviceOps",
    "HybridTrainer", "MomentumCorrection", "MultiWorkerMirroredStrategy", "Payload",
    "PipelineTrainer",
    "block_table", "clipping", "evaluate_exactly", "find_boundary", "format_block_table",
    "planning", "profile_model", "save_model", "split_model",
]
__version__ = "0.1.0"
