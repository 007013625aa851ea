"""What a :class:`~tf_blocksparse.hybrid.HybridTrainer` can say about itself without training.

Where every variable copy, optimizer variable and residual lives, their bytes per device, and
which gradients each group all-reduce waits for (from a traced, never run, step).  A mixin of
the trainer, which provides ``boundary``, ``host_device``, ``expanded_layers``, ``replicas``,
``optimizers``, ``syncs`` and ``_step``.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tf_blocksparse.hybrid.sync import gradient_dependencies, replica_report, variable_bytes
from tf_blocksparse.runtime.replica import Replica

__all__ = ["GROUPS", "HybridInspection"]

#: The two groups of a hybrid trainer, in step order.
GROUPS = ("conv", "fc")


class HybridInspection:
    """Placement, memory and dependency reports of a hybrid trainer (a mixin)."""

    boundary: Any
    host_device: str
    expanded_layers: frozenset[str]
    replicas: dict[str, list[Replica]]
    optimizers: dict[str, list]
    syncs: dict[str, Any]

    def placement(self) -> dict[str, Any]:
        """Where everything lives: the boundary, the expanded layers, and per group and
        replica the compute device and the device of every variable copy, optimizer variable
        and residual (full TF device names)."""
        out: dict[str, Any] = {"boundary": {"head_layer": self.boundary.head_layer,
                                            "producer": self.boundary.producer,
                                            "last_conv": self.boundary.last_conv},
                               "host_device": self.host_device,
                               "expanded_layers": sorted(self.expanded_layers)}
        for group in GROUPS:
            out[group] = [replica_report(rep, [o for o, _ in opts], res)
                          for rep, opts, res in self._owned(group)]
        return out

    def variable_bytes_by_device(self) -> dict[str, int]:
        """Bytes of every variable the trainer owns (copies, optimizer variables, residuals),
        summed per TF device name."""
        out: dict[str, int] = {}
        for group in GROUPS:
            for rep, opts, res in self._owned(group):
                for device, n in variable_bytes(rep, [o for o, _ in opts], res):
                    out[device] = out.get(device, 0) + n
        return out

    def _owned(self, group: str) -> list[tuple[Replica, list, list]]:
        sync = self.syncs[group]
        return [(rep, self.optimizers[group][r], sync.residuals[r] if sync.residuals else [])
                for r, rep in enumerate(self.replicas[group])]

    def trace_step(self, x: Any, y: Any) -> dict[str, Any]:
        """Traces a training step on ``x``, ``y`` into a fresh graph (nothing runs).

        Returns:
            ``{"graph": the FuncGraph, "grads": {group: [replica][variable] gradient
            tensors}, "totals": {group: [variable] summed gradient tensors}}`` (symbolic
            tensors of that graph, for dependency analysis).
        """
        record: dict[str, Any] = {}
        concrete = tf.function(lambda a, b: self._step(a, b, record, True),
                               autograph=False).get_concrete_function(x, y)
        record["graph"] = concrete.graph
        return record

    def sync_dependencies(self, x: Any, y: Any, group: str = "conv") -> dict[str, list[str]]:
        """Which other variables' gradients each all-reduce of ``group`` waits for.

        Traces the step on ``x``, ``y`` (nothing runs) and walks the graph back from every
        variable's reduced gradient (data and control edges).

        Returns:
            ``{variable path: [paths of the other variables of the group whose per-replica
            gradient ops are ancestors of its sum]}``; all lists empty means every variable is
            reduced as soon as its own gradient is ready.
        """
        if group not in GROUPS:
            raise ValueError(f"group must be one of {GROUPS}, got {group!r}")
        record = self.trace_step(x, y)
        paths = [v.path for v in self.replicas[group][0].trainable_refs]
        return gradient_dependencies(record["grads"][group], record["totals"][group], paths)
