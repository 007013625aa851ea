"""The exchange methods the benchmarks and the demo compare, by name: one table of
:class:`~launch.method.Method` configs built from the library's options, and the method
lists each script may run.  No TensorFlow here.
"""

from __future__ import annotations

from collections.abc import Callable

from launch.method import DENSE, Method
from tf_blocksparse.options import CompressionOptions

#: A method of the table: one :class:`~launch.method.Method`, or one per density (the
#: benchmarks' ``--density``).
MethodSpec = Method | Callable[[float], Method]

_K1 = CompressionOptions(k=1, exchange="allgather")
_LOCAL_INT8 = CompressionOptions(density=0.05, exchange="allgather", quantize="int8")
#: DGC's masking of the local momentum, stated on the methods whose committed results were
#: made while it was the library's default (the default is ``"whole"`` since, measured as
#: ``block_default_maskwhole`` / ``block_auto_maskwhole``): the documented commands then
#: regenerate those results whatever the default is.
_DGC = "all"
#: Small embedding tables sent whole by ``dense_below`` like any other variable, stated on
#: the methods whose committed results on models with embeddings (``gru_nmt``,
#: ``lstm_nmt``) were made while it was the library's behaviour (embedding tables are
#: compressed whatever their size since, measured as ``block_default_embed``).
_BY_SIZE = "by_size"
#: The one table of the exchange methods the scripts compare: name -> method, each built
#: from the library's options (:func:`method_config`; :func:`method_flags` renders its
#: ``launch.train`` flags).  Every sparse method takes the library's defaults for what it
#: does not set; ``stated`` flags are written although at their default, as the results
#: record them.
METHODS: dict[str, MethodSpec] = {
    "dense": Method(DENSE),
    # The one-line default BlockSparseOptimizer(SGD(lr, momentum=0.9)) with DGC's masking:
    # the automatic exchange over one fusion group (dense where compression does not pay),
    # k=1 when sparse.
    "block_auto_default": Method(CompressionOptions(embeddings=_BY_SIZE),
                                 momentum_masking=_DGC, stated=frozenset({"exchange"})),
    # The same with today's default masking: the one-line default as it is now.
    "block_auto_maskwhole": Method(CompressionOptions(embeddings=_BY_SIZE),
                                   momentum_masking="whole",
                                   stated=frozenset({"exchange"})),
    # The one-line default as it is now: the same with embedding tables compressed whatever
    # their size (block_auto_maskwhole bit for bit on a model without embeddings).
    "block_auto_embed": Method(CompressionOptions(), momentum_masking="whole",
                               stated=frozenset({"exchange"})),
    # The one-line default with the local momentum never masked: ResNet-20 ends level with
    # dense and reaches its converged target sooner; cnn_small and cnn_bn end below dense.
    "block_auto_nomask": Method(CompressionOptions(), momentum_masking="none",
                                stated=frozenset({"exchange"})),
    # The one-line default with the normalisation layers' momentum kept (momentum_masking
    # "whole_except_norm").
    "block_auto_masknorm": Method(CompressionOptions(), momentum_masking="whole_except_norm",
                                  stated=frozenset({"exchange"})),
    # The one-line default with only the vectors sent whole masked (momentum_masking
    # "whole_vectors": the kernels sent whole keep their momentum).
    "block_auto_maskvec": Method(CompressionOptions(), momentum_masking="whole_vectors",
                                 stated=frozenset({"exchange"})),
    # The default compression, always applied, with DGC's masking:
    # BlockSparseOptimizer(SGD(lr, momentum=0.9), exchange="allgather"): k=1, momentum before
    # the exchange (DGC correction), variables under 1,024 elements sent whole (the one-line
    # default before the automatic exchange).
    "block_default": Method(CompressionOptions(exchange="allgather", embeddings=_BY_SIZE),
                            momentum_masking=_DGC),
    # The default with variables of 512 to 1,023 elements compressed too (gru_nmt's
    # embeddings, 83% of its default payload when sent whole).
    "block_dense_below_512": Method(CompressionOptions(exchange="allgather", dense_below=512),
                                    momentum_masking=_DGC),
    # The same with today's default masking.
    "block_dense_below_512_maskwhole": Method(
        CompressionOptions(exchange="allgather", dense_below=512), momentum_masking="whole"),
    # The default with recurrent layers' variables sent whole every step (k=1 on the rest):
    # what compressing a GRU / LSTM model can save without error feedback's delay on them.
    # DGC's masking stated: it was the default masking when the results were made, and
    # "none" is the default with recurrent="whole" since.
    "block_recurrent_whole": Method(CompressionOptions(exchange="allgather", recurrent="whole",
                                                       embeddings=_BY_SIZE),
                                    momentum_masking=_DGC),
    # The same without momentum masking anywhere (what the tuning runs on gru_nmt / lstm_nmt
    # used; the default masking with recurrent="whole").
    "block_recurrent_whole_nomask": Method(
        CompressionOptions(exchange="allgather", recurrent="whole", embeddings=_BY_SIZE),
        momentum_masking="none"),
    # The same with the embedding tables compressed (the library's embeddings rule).
    "block_recurrent_whole_embed": Method(
        CompressionOptions(exchange="allgather", recurrent="whole"), momentum_masking="none"),
    # The default with the other maskings of the local momentum (tuning runs on gru_nmt).
    "block_default_waited": Method(CompressionOptions(exchange="allgather"),
                                   momentum_masking="waited"),
    "block_default_nomask": Method(CompressionOptions(exchange="allgather"),
                                   momentum_masking="none"),
    # The default with only the compressed variables' sent blocks masked: the variables
    # sent whole every step keep their momentum (momentum SGD on them).
    "block_default_maskcomp": Method(CompressionOptions(exchange="allgather"),
                                     momentum_masking="compressed"),
    # The default with only the variables sent whole masked: the compressed variables keep
    # their momentum (as without masking), the ones sent whole train with plain SGD (the
    # default masking since; stated, as the results record it).
    "block_default_maskwhole": Method(CompressionOptions(exchange="allgather",
                                                         embeddings=_BY_SIZE),
                                      momentum_masking="whole"),
    # The default as it is now: the same with embedding tables compressed whatever their
    # size (on a model without embeddings, block_default_maskwhole bit for bit).
    "block_default_embed": Method(CompressionOptions(exchange="allgather"),
                                  momentum_masking="whole"),
    # The same with the normalisation layers' scales and offsets keeping their momentum
    # (the other variables sent whole masked): "whole" on a model without normalisation.
    "block_default_masknorm": Method(CompressionOptions(exchange="allgather"),
                                     momentum_masking="whole_except_norm"),
    # The same with only the vectors sent whole masked (biases, normalisation scales and
    # offsets): the kernels sent whole (first convolution, projection, logits) keep momentum.
    "block_default_maskvec": Method(CompressionOptions(exchange="allgather"),
                                    momentum_masking="whole_vectors"),
    # The same with the variables sent whole keeping a momentum of 0.7 (a step of 3.3x plain
    # SGD's, between "whole"'s plain SGD and "none"'s momentum SGD of 0.9 on them).
    "block_default_wholem07": Method(CompressionOptions(exchange="allgather"),
                                     momentum_masking="whole", whole_momentum=0.7),
    # The same with 0.8 and 0.85 (a step of 5x and 6.7x plain SGD's): where between 0.7 and
    # "none"'s 0.9 the small CNNs' accuracy drops.
    "block_default_wholem08": Method(CompressionOptions(exchange="allgather"),
                                     momentum_masking="whole", whole_momentum=0.8),
    "block_default_wholem085": Method(CompressionOptions(exchange="allgather"),
                                      momentum_masking="whole", whole_momentum=0.85),
    # The same with the shared exchange (replicas sum their block scores and all send the
    # top blocks of the sum), the other sparse mode the automatic exchange may choose
    # (small embedding tables sent whole, as in block_auto_maskwhole whose curves these are).
    "block_shared_maskwhole": Method(CompressionOptions(exchange="shared", embeddings=_BY_SIZE),
                                     momentum_masking="whole"),
    # The default with DGC's density warm-up: 25%, 6.25%, 1.56% and 0.4% of the blocks in
    # the first four epochs, then k=1.
    "block_default_dgc_warmup": Method(CompressionOptions(exchange="allgather"),
                                       density_warmup=(0.25, 0.0625, 0.015625, 0.004),
                                       momentum_masking=_DGC),
    "block_allgather": lambda density: Method(
        CompressionOptions(density=density, exchange="allgather"), momentum_masking=_DGC),
    "block_shared": lambda density: Method(
        CompressionOptions(density=density, exchange="shared"), momentum_masking=_DGC),
    # Per fusion group (256 KiB buffers) dense or block-sparse, from measured link and
    # compression times (BlockSparseOptimizer(exchange="auto")).
    "block_auto": lambda density: Method(CompressionOptions(density=density),
                                         fusion_buffer_bytes=262144, momentum_masking=_DGC,
                                         stated=frozenset({"exchange"})),
    "block_k1": Method(_K1, momentum_masking=_DGC, stated=frozenset({"k"})),
    # The literal configuration: k=1 on every variable, global momentum after the exchange.
    "block_source": Method(_K1.replace(dense_below=0), global_momentum=True,
                           stated=frozenset({"k"})),
    # k=1 on every variable with DGC's local momentum (the default without dense_below).
    "block_k1_dgc": Method(_K1.replace(dense_below=0), momentum_masking=_DGC,
                           stated=frozenset({"k"})),
    "block_k1_waited": Method(CompressionOptions(), momentum_masking="waited"),
    "topk": lambda density: Method(
        CompressionOptions(density=density, exchange="allgather", granularity="element"),
        momentum_masking=_DGC, stated=frozenset({"density"})),
    "topk_1pct": Method(
        CompressionOptions(density=0.01, exchange="allgather", granularity="element"),
        momentum_masking=_DGC, stated=frozenset({"density"})),
    # Local steps (docs/local_steps.md), 32 steps per exchange, the library's default outer
    # optimizers: DiLoCo (a dense exchange of the progress, Nesterov SGD(0.7, momentum 0.9)),
    # or 5% of the blocks in int8 with error feedback and SGD(1.0).
    "local_dense": Method(DENSE, sync_every=32),
    "local_block": Method(_LOCAL_INT8, sync_every=32, outer_lr=1.0, outer_momentum=0.0),
    # 20% of the blocks in int8 (a quarter of the bytes of 500x fewer than dense on vgg_fc).
    "local_block_20pct": Method(_LOCAL_INT8.replace(density=0.2), sync_every=32,
                                outer_lr=1.0, outer_momentum=0.0),
    # 20% of the blocks in int8 under DiLoCo's Nesterov outer step (the closest block-sparse
    # form of DiLoCo's dense exchange of the progress).
    "local_block_20pct_nesterov": Method(_LOCAL_INT8.replace(density=0.2), sync_every=32,
                                         outer_lr=0.7, outer_momentum=0.9),
    # 40% of the blocks in int4 under the same Nesterov outer step: twice the blocks of
    # local_block_20pct_nesterov in about the same bytes.
    "local_block_40pct_int4_nesterov": Method(
        _LOCAL_INT8.replace(density=0.4, quantize="int4"), sync_every=32, outer_lr=0.7,
        outer_momentum=0.9),
    # Model averaging: a dense exchange of the progress under a plain SGD(1.0) outer step
    # (what local_auto does where it sends dense).
    "local_average": Method(DENSE, sync_every=32, outer_lr=1.0, outer_momentum=0.0),
    # local_block's compression under the automatic exchange, decided per window of 32
    # steps: a dense exchange of the progress (model averaging, the same plain SGD(1.0)
    # outer step) where compressing does not pay on the link, local_block where it does.
    "local_auto": Method(_LOCAL_INT8.replace(exchange="auto"), sync_every=32,
                         stated=frozenset({"exchange"})),
    # The block exchange with DiLoCo's Nesterov outer step (tried, 9.7 points below dense).
    "local_block_nesterov": Method(_LOCAL_INT8, sync_every=32, outer_lr=0.7,
                                   outer_momentum=0.9),
}
#: The methods of ``launch.demo`` under the names its table prints.
DEMO_METHODS = {"dense": "dense", "block default": "block_auto_embed",
                "block k=1": "block_default_embed", "block literal": "block_source"}
#: The methods ``launch.bench_convergence`` may run, in its table's order.
CONVERGENCE_METHODS = ("dense", "block_default", "block_dense_below_512",
                       "block_dense_below_512_maskwhole",
                       "block_recurrent_whole", "block_recurrent_whole_nomask",
                       "block_recurrent_whole_embed",
                       "block_default_waited", "block_default_nomask", "block_default_maskcomp",
                       "block_default_maskwhole", "block_default_embed",
                       "block_default_masknorm", "block_default_maskvec",
                       "block_default_wholem07", "block_default_wholem08",
                       "block_default_wholem085",
                       "block_shared_maskwhole",
                       "block_default_dgc_warmup", "block_allgather",
                       "block_source", "block_k1_dgc", "block_k1_waited", "topk_1pct",
                       "local_dense", "local_average", "local_block", "local_block_20pct",
                       "local_block_20pct_nesterov", "local_block_40pct_int4_nesterov",
                       "local_block_nesterov")
#: The methods ``launch.bench_time_to_accuracy`` may run (dense sets the target).
TIME_TO_ACCURACY_METHODS = ("dense", "block_allgather", "block_shared", "topk", "block_auto")


def method_config(method: str, density: float | None = None) -> Method:
    """The :class:`~launch.method.Method` named ``method`` (at ``density``, for the methods
    that take one).

    Raises:
      ValueError: ``method`` unknown, or one that takes a density without one.
    """
    if method not in METHODS:
        raise ValueError(f"`method` must be one of {sorted(METHODS)}, got {method!r}")
    spec = METHODS[method]
    if isinstance(spec, Method):
        return spec
    if density is None:
        raise ValueError(f"method {method!r} needs a `density`")
    return spec(density)


def method_flags(method: str, density: float | None = None) -> list[str]:
    """``launch.train`` flags of ``method`` (at ``density``, for the methods that take one):
    :meth:`Method.to_flags <launch.method.Method.to_flags>` of :func:`method_config`."""
    return method_config(method, density).to_flags()
