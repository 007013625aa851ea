"""What the automatic exchange decided, and the figures it decided from.

Pure Python.  :class:`ExchangeDecision` is the result of
:meth:`~tf_blocksparse.planning.exchange_cost.AutoExchange.decide`: the mode of every fusion
group with the measured link and groups and the predicted step times of that choice and of
all dense.  The optimizer keeps the current one; logs and TensorBoard read
:meth:`ExchangeDecision.summary`.
"""

from __future__ import annotations

import dataclasses
import math

from tf_blocksparse.planning.link_cost import GroupCost, LinkCost

__all__ = ["ExchangeDecision"]


@dataclasses.dataclass(frozen=True)
class ExchangeDecision:
    """What :meth:`AutoExchange.decide` chose and from what.

    Attributes:
      modes: Per fusion group, ``"dense"``, ``"allgather"`` or ``"shared"``.
      link: The measured collective costs.
      groups: The groups' sizes and compression times.
      compute_s: Measured time per step outside the exchange (0 when not yet known); per
        exchange (a window of steps) with accumulated micro-steps or local steps.
      step_s: Predicted step time with ``modes`` (compute + exchanges; per exchange as
        ``compute_s``).
      dense_step_s: Predicted step time with every group dense.
      objective_s: Predicted time-to-accuracy proxy of ``modes`` (module docstring).
      dense_objective_s: The same for all dense.
    """

    modes: tuple[str, ...]
    link: LinkCost
    groups: tuple[GroupCost, ...]
    compute_s: float
    step_s: float
    dense_step_s: float
    objective_s: float
    dense_objective_s: float

    @property
    def compress_s(self) -> float:
        """Measured compression seconds per step of the sparse groups."""
        return math.fsum(g.compress_s for g, m in zip(self.groups, self.modes) if m != "dense")

    def summary(self) -> dict[str, float]:
        """Flat figures for logs and TensorBoard."""
        return {
            "auto_sparse_groups": float(sum(m != "dense" for m in self.modes)),
            "auto_dense_groups": float(sum(m == "dense" for m in self.modes)),
            "auto_sum_latency_ms": 1e3 * self.link.sum_latency_s,
            "auto_sum_mbit_s": min(self.link.sum_mbit_s, 1e9),
            "auto_gather_latency_ms": 1e3 * self.link.gather_latency_s,
            "auto_compute_ms": 1e3 * self.compute_s,
            "auto_compress_ms": 1e3 * self.compress_s,
            "auto_predicted_step_ms": 1e3 * self.step_s,
            "auto_predicted_dense_step_ms": 1e3 * self.dense_step_s,
        }
