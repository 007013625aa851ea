"""tf_blocksparse: block-wise top-k gradient exchange with error feedback for tf.distribute.

Core (no adapters imported by it): :mod:`~tf_blocksparse.blocks` (block-rule table),
:mod:`~tf_blocksparse.selection`, :mod:`~tf_blocksparse.feedback`,
:mod:`~tf_blocksparse.codec`, :mod:`~tf_blocksparse.exchange`.  Adapters:
:mod:`tf_blocksparse.keras` and :mod:`tf_blocksparse.distribute`.
"""

from tf_blocksparse.blocks import BlockLayout, BlockRule, block_table, format_block_table
from tf_blocksparse.distribute.strategy import MultiWorkerMirroredStrategy
from tf_blocksparse.feedback import BlockTopK, ElementTopK, Payload
from tf_blocksparse.keras.backup import BackupAndRestore
from tf_blocksparse.keras.callbacks import BlockSparseMetrics
from tf_blocksparse.keras.optimizer import BlockSparseOptimizer

__all__ = [
    "BackupAndRestore", "BlockLayout", "BlockRule", "BlockSparseMetrics",
    "BlockSparseOptimizer", "BlockTopK", "ElementTopK", "MultiWorkerMirroredStrategy",
    "Payload", "block_table", "format_block_table",
]
__version__ = "0.1.0"
