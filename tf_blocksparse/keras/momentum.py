"""``MomentumCorrection``: where the momentum of a block-sparse step lives (a policy object).

With aggressive sparsification, an inner ``SGD(momentum=m)`` applied to the exchanged update
(*global momentum*) releases residuals late into a running velocity and can oscillate or
collapse.  DGC's momentum correction (Lin et al., ICLR 2018) keeps the momentum *per replica
before* the exchange instead: ``u = m u + grad`` goes through error feedback and selection in
place of ``grad``, and the blocks a replica sent are zeroed in its ``u`` too (factor masking).
With a dense exchange the two are the same math.

Maskings (which sent blocks are zeroed in the local momentum):

``"auto"`` (default)
    ``"none"`` with ``recurrent="whole"`` (a recurrent model whose recurrent layers are sent
    whole every step), ``"whole"`` otherwise: what converged best on each kind of model
    (docs/optimizer.md).
``"all"``
    DGC's factor masking: every sent block (the default before ``"whole"``, and what a
    saved optimizer without a masking in its config keeps).
``"none"``
    The momentum stays whole: every block receives momentum SGD's total update, only later
    (a block sent every step trains as plain momentum SGD, whereas ``"all"`` takes its
    momentum away).
``"waited"``
    Only blocks that had waited (a non-zero residual before this step), so blocks sent step
    after step keep their momentum and a block released after a wait does not carry its
    burst on.
``"compressed"``
    Only the compressed variables' sent blocks: a variable whose every block is sent every
    step (under ``dense_below``, or ``k`` at least its block count) keeps its momentum
    (momentum SGD on it), while the compressed variables are masked as with ``"all"``.
``"whole"``
    The other half of ``"all"``: only the variables whose every block is sent every step are
    masked (plain SGD on them), while the compressed variables keep their momentum whole
    as with ``"none"``.
``"whole_except_norm"``
    ``"whole"`` without the normalisation layers' scales and offsets (BatchNormalization,
    LayerNormalization, GroupNormalization): they keep their momentum (momentum SGD on
    them), while the other variables sent whole train with plain SGD.  On a model without
    normalisation layers it is ``"whole"``, bit for bit.
``"whole_vectors"``
    ``"whole"`` on the vectors only: the variables whose blocks are single elements (by the
    block-rule table: biases, normalisation scales and offsets, a recurrent layer's
    ``[2, 3 * units]`` bias).  The kernels sent whole (a small first convolution or
    projection, a classifier's kernel) keep their momentum (momentum SGD on them).

``whole_momentum``
    With a ``"whole"`` masking (or ``"auto"`` resolved to one), the variables sent whole
    keep part of their momentum instead of none: their velocity is scaled by
    ``whole_momentum / momentum`` after the exchange, so they train as momentum SGD with
    the factor ``whole_momentum`` (0: plain SGD, as without it; ``momentum``: as
    ``"none"`` on them), while the compressed variables are left as they are.

Without ``recurrent="whole"`` the default masks only the variables sent whole: at k=1,
trained to convergence (3 seeds each), it ended at most 0.14 points below dense on five
models (two CNNs, a batch-normalised CNN, ResNet-20, a GRU translation model), where
``"all"`` ended 0.36 points below dense on ResNet-20 and ``"none"`` 0.72 below on a small
CNN (docs/optimizer.md).

Variables sent whole count every block as sent, except recurrent layers' with
``recurrent="whole"``: no masking touches their momentum (momentum SGD on them), which is
what converged on recurrent models (docs/exchange.md).  With ``recurrent="whole"`` the
default masking leaves the compressed layers' momentum whole too: masking it slowed a GRU
translation model to 1.5-2.3x dense's epochs and stopped its LSTM twin in 2 seeds of 3,
while without masking both converged at dense's pace.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import keras
import tensorflow as tf

from tf_blocksparse import selection
from tf_blocksparse.blocks import BlockLayout
from tf_blocksparse.checks import check_choice
from tf_blocksparse.keras import inner_optimizer as inner_lib
from tf_blocksparse.options import AUTO, MASKINGS, SAVED_MASKING, WHOLE_MASKINGS

__all__ = ["MomentumCorrection", "mask_sent", "sends_every_block"]

#: What ``masking`` / ``momentum_masking`` accept: a masking, or ``"auto"`` (see
#: :meth:`MomentumCorrection.resolve`).
_MASKING_CHOICES = (AUTO, *MASKINGS)


def _check_momentum(value: Any, argument: str) -> float | str:
    if isinstance(value, str) and value == AUTO:
        return AUTO
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or math.isnan(value) or not 0.0 <= float(value) < 1.0:
        raise ValueError(f"`{argument}` must be 'auto', None or a float in [0, 1), "
                         f"got {value!r}")
    return float(value)


@dataclasses.dataclass(frozen=True)
class MomentumCorrection:
    """Momentum kept per replica before the exchange, with masking of what was sent.

    Args:
      momentum: The factor ``m`` in [0, 1), or ``"auto"``: the inner ``SGD``'s momentum,
        moved (see :meth:`resolve`).
      masking: ``"auto"`` (default), ``"all"``, ``"waited"``, ``"none"``,
        ``"compressed"``, ``"whole"``, ``"whole_except_norm"`` or ``"whole_vectors"``
        (module docstring); ``"auto"`` is decided by :meth:`resolve`.
      whole_momentum: ``None`` (default), or the momentum factor in [0, 1) the variables
        sent whole keep under a ``"whole"`` masking (module docstring); ``None`` is 0.

    Raises:
      ValueError: A bad value, naming the argument.
    """

    momentum: float | str = AUTO
    masking: str = AUTO
    whole_momentum: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "momentum", _check_momentum(self.momentum, "momentum"))
        check_choice(self.masking, _MASKING_CHOICES, "masking")
        if self.whole_momentum is not None:
            w = self.whole_momentum
            if isinstance(w, bool) or not isinstance(w, (int, float)) or math.isnan(w) \
                    or not 0.0 <= float(w) < 1.0:
                raise ValueError(f"`whole_momentum` must be None or a float in [0, 1), "
                                 f"got {w!r}")
            if self.masking not in (AUTO, *WHOLE_MASKINGS):
                raise ValueError(f"`whole_momentum` applies to the variables a 'whole' "
                                 f"masking masks ({', '.join(WHOLE_MASKINGS)} or 'auto'), "
                                 f"got masking={self.masking!r}")
            if self.momentum != AUTO and float(w) > self.momentum:
                raise ValueError(f"`whole_momentum` ({w}) must not exceed the momentum "
                                 f"({self.momentum})")
            object.__setattr__(self, "whole_momentum", float(w))

    @classmethod
    def from_arguments(cls, momentum_correction: Any, momentum_masking: Any = AUTO
                       ) -> MomentumCorrection | None:
        """The policy of the optimizer's ``momentum_correction`` / ``momentum_masking``
        keywords (``None``: no local momentum); errors name those keywords."""
        check_choice(momentum_masking, _MASKING_CHOICES, "momentum_masking")
        if momentum_correction is None:
            return None
        return cls(_check_momentum(momentum_correction, "momentum_correction"),
                   momentum_masking)

    @property
    def active(self) -> bool:
        """Whether a local momentum is kept (``momentum > 0``, once resolved)."""
        return self.momentum != AUTO and self.momentum > 0.0

    def resolve(self, inner: keras.optimizers.Optimizer, sparse: bool,
                recurrent_whole: bool = False) -> MomentumCorrection | None:
        """The policy for ``inner``; ``"auto"`` becomes a factor or ``None``, and an
        ``"auto"`` masking ``"none"`` where ``recurrent_whole`` (the compression options'
        ``recurrent="whole"``), else ``"whole"``.

        A momentum of ``"auto"``: with a sparse exchange and an inner ``SGD(momentum=m)``
        (not Nesterov), ``m`` is moved before the exchange and the inner SGD's momentum set
        to 0 (so call this last, once every other check passed); with any other inner
        optimizer, Nesterov, or the dense exchange (where both forms are the same math):
        ``None``.

        Raises:
          ValueError: A factor > 0 while the inner optimizer has a momentum of its own.
        """
        inner_m = float(getattr(inner, "momentum", 0.0) or 0.0)
        masking = self.masking
        if masking == AUTO:
            masking = "none" if recurrent_whole else "whole"
        whole = self.whole_momentum if masking in WHOLE_MASKINGS else None
        if self.momentum != AUTO:
            if self.momentum and inner_m:
                raise ValueError(f"`momentum_correction` keeps the momentum per replica "
                                 f"before the exchange, so the inner optimizer must have "
                                 f"none; got inner momentum={inner_m}")
            return dataclasses.replace(self, masking=masking, whole_momentum=whole)
        if not sparse or not isinstance(inner, keras.optimizers.SGD) or inner_m <= 0.0 \
                or getattr(inner, "nesterov", False) or not inner_m < 1.0:
            return None
        inner_lib.move_momentum(inner)  # no momentum slots: the wrapper keeps the momentum
        return dataclasses.replace(self, momentum=inner_m, masking=masking,
                                   whole_momentum=whole)

    def accumulate(self, velocities: Sequence[tf.Tensor], grads: Sequence[tf.Tensor]
                   ) -> list[tf.Tensor]:
        """``u = m u + grad`` per variable [*shape]: what goes into the exchange."""
        return [tf.cast(self.momentum, g.dtype) * u + g for u, g in zip(velocities, grads)]

    def mask(self, us: Sequence[tf.Tensor], layouts: Sequence[BlockLayout],
             sent_ids: Sequence[tf.Tensor] | None, residuals: Sequence[tf.Tensor] | None
             ) -> list[tf.Tensor]:
        """The new local momenta after the exchange (``residuals``: from before it)."""
        if self.masking == "none":
            return list(us)
        if self.masking in ("compressed", *WHOLE_MASKINGS) and sent_ids is not None:
            keep_whole = self.masking != "compressed"
            mask_norm = self.masking != "whole_except_norm"
            mask_kernels = self.masking != "whole_vectors"
            sent_ids = [ids if ids is not None and sends_every_block(ids, lay) == keep_whole
                        and (mask_norm or not lay.normalization)
                        and (mask_kernels or lay.block_size == 1)
                        else None for ids, lay in zip(sent_ids, layouts)]
            if keep_whole and self.whole_momentum:
                # every block of these variables was sent: scale, rather than zero, them
                keep = self.whole_momentum / self.momentum
                return [u if ids is None else u * tf.cast(keep, u.dtype)
                        for u, ids in zip(us, sent_ids)]
        return mask_sent(us, layouts, sent_ids,
                         residuals if self.masking == "waited" else None)

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = {"momentum": self.momentum, "masking": self.masking}
        if self.whole_momentum is not None:
            config["whole_momentum"] = self.whole_momentum
        return config

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> MomentumCorrection:
        """The policy of :meth:`get_config`'s dict; one without ``masking`` (written before
        maskings were selectable) keeps DGC's ``"all"``, the masking it was saved with."""
        return cls(**{"masking": SAVED_MASKING, **config})


def sends_every_block(ids: tf.Tensor, layout: BlockLayout) -> bool:
    """Whether sent block ids [k_v] (a static count) cover all of ``layout``'s blocks every
    step: a variable sent whole, or one whose ``k`` reaches its block count."""
    count = ids.shape[0] if ids.shape.rank == 1 else None
    return count is not None and count >= layout.num_blocks


def mask_sent(us: Sequence[tf.Tensor], layouts: Sequence[BlockLayout],
              sent_ids: Sequence[tf.Tensor] | None,
              residuals: Sequence[tf.Tensor] | None = None) -> list[tf.Tensor]:
    """DGC factor masking of the local momenta.

    Args:
      us: Per variable the replica's momentum ``u`` [*shape].
      layouts: Their block layouts.
      sent_ids: Per variable the block ids [k_v] this replica sent (``None``, or ``None``
        for a variable: exchanged densely; the momentum then carries on whole, which is
        momentum SGD).
      residuals: Optional per-variable residuals [*shape] from *before* this step: only
        sent blocks whose residual block was non-zero (they had waited) are zeroed.

    Returns:
      Per variable ``u`` with the masked blocks zeroed (the others bit-exact).
    """
    if sent_ids is None:
        return list(us)
    if residuals is None:
        return [u if ids is None else
                selection.zero_blocks(u, lay, ids, selection.block_flat_indices(ids, lay))
                for u, lay, ids in zip(us, layouts, sent_ids)]
    return [u if ids is None else selection.zero_blocks_where(
                u, lay, selection.blocks_hit(ids, lay) &
                (selection.block_scores(r, lay, "l1") > 0))
            for u, lay, ids, r in zip(us, layouts, sent_ids, residuals)]
