"""The ``plans`` section of ``launch.bench_fusion``: every bucketing method's fusion plan of a
model's variables, in the backward order derived from its forward pass, and how balanced the
groups are (see that script's documentation).  No training runs here."""

from __future__ import annotations

import gc
import math
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np

from models.registry import build_image_model
from tf_blocksparse.fusion.forward_order import derive_execution_order
from tf_blocksparse.planning import (
    FusionPlan,
    TensorSpec,
    compare_plans,
    execution_order,
    min_imbalance,
    plan_balanced,
    plan_ddp,
    plan_horovod_greedy,
    plan_summary,
    plan_tf_group_by_size,
)

MIB = 2**20
#: The balanced plan's goal: largest / smallest group bytes at most this.
BALANCE_TARGET = 1.25


def tensor_specs(variables: Sequence[Any]) -> list[TensorSpec]:
    """One float32 :class:`TensorSpec` per variable, in the variables' order."""
    return [TensorSpec(getattr(v, "path", v.name), int(np.prod(v.shape, dtype=np.int64)) * 4)
            for v in variables]


def finite_round(x: float, digits: int = 4) -> float | None:
    """Rounds a float for JSON; ``None`` when it is not finite."""
    return round(float(x), digits) if math.isfinite(x) else None


def _plans(specs: Sequence[TensorSpec], buffer_bytes: int,
           order: Sequence[int] | None) -> dict[str, FusionPlan]:
    """The plans :func:`compare_plans` summarises, with the same arguments."""
    return {
        "balanced": plan_balanced(specs, buffer_bytes, order),
        "tf_group_by_size": plan_tf_group_by_size(specs, buffer_bytes, order),
        "ddp": plan_ddp(specs, buffer_bytes, min(MIB, buffer_bytes), order),
        "horovod_greedy": plan_horovod_greedy(specs, buffer_bytes, order),
    }


def _method_row(row: dict, plan: FusionPlan) -> dict:
    """One method's JSON row from its :func:`plan_summary` and its plan."""
    if len(plan.groups) != row["groups"]:
        raise AssertionError(f"{row['method']}: plan differs from compare_plans")
    return {
        "buffer_bytes": row["buffer_bytes"], "groups": row["groups"],
        "largest_bytes": row["largest_bytes"], "smallest_bytes": row["smallest_bytes"],
        "imbalance": finite_round(row["imbalance"]),
        "imbalance_excluding_oversized": finite_round(row["imbalance_excluding_oversized"]),
        "imbalance_excluding_single_oversized":
            finite_round(row["imbalance_excluding_single_oversized"]),
        "oversized_groups": sum(plan.is_oversized(g) for g in plan.groups),
    }


def _meets(ratio: float | None) -> bool:
    return ratio is not None and ratio <= BALANCE_TARGET


def plan_buffer_report(specs: Sequence[TensorSpec], buffer_bytes: int,
                       order: Sequence[int] | None = None) -> dict:
    """Every method's plan summary at one buffer size, and the balanced plan's checks."""
    plans = _plans(specs, buffer_bytes, order)
    methods = {row["method"]: _method_row(row, plans[row["method"]])
               for row in compare_plans(specs, buffer_bytes, order)}
    bal = methods["balanced"]
    best = min_imbalance(specs, buffer_bytes, order)
    return {
        "buffer_mib": buffer_bytes / MIB, "buffer_bytes": buffer_bytes,
        "methods": methods,
        "greedy_min_groups": methods["horovod_greedy"]["groups"],
        "optimal_imbalance_excluding_oversized": finite_round(best),
        "target_feasible": best <= BALANCE_TARGET,
        "balanced_meets_1_25": _meets(bal["imbalance_excluding_oversized"]),
        "balanced_meets_1_25_strict": _meets(bal["imbalance_excluding_single_oversized"]),
    }


def defaults_report(specs: Sequence[TensorSpec], order: Sequence[int] | None = None) -> dict:
    """The baselines at their own defaults (:data:`DEFAULT_METHODS`), whatever the buffer:
    DDP with 25 MiB buckets and a 1 MiB first bucket, Horovod greedy at 128 MiB."""
    plans = {"ddp_default": plan_ddp(specs, order=order),
             "horovod_greedy_128mib": plan_horovod_greedy(specs, order=order)}
    return {m: _method_row(plan_summary(p), p) for m, p in plans.items()}


def model_execution_order(model: keras.Model) -> tuple[int, ...]:
    """The derived backward order of ``model.trainable_variables`` (see the module doc)."""
    order = derive_execution_order(model, model.trainable_variables)
    if order is None:
        raise ValueError(f"cannot derive the execution order of {model.name!r}")
    return order


def plans_section(models: Sequence[str], buffer_mib: Sequence[float]) -> dict:
    """``plans``: per model, its variable set and derived order, the baselines at their
    defaults and one report per buffer size."""
    out = {}
    for name in models:
        model = build_image_model(name)
        specs = tensor_specs(model.trainable_variables)
        order = model_execution_order(model)
        del model
        gc.collect()
        out[name] = {
            "tensors": len(specs), "total_bytes": sum(s.nbytes for s in specs),
            "largest_tensor_bytes": max(s.nbytes for s in specs),
            "execution_order": "derived: reverse of the forward pass's first variable reads",
            "order_positions_differing_from_reversed_list":
                sum(a != b for a, b in zip(order, execution_order(len(specs)))),
            "defaults": defaults_report(specs, order),
            "buffers": [plan_buffer_report(specs, int(round(m * MIB)), order)
                        for m in buffer_mib],
        }
    return out
