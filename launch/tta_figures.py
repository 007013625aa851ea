"""The figures of ``launch.bench_time_to_accuracy``'s run records: a step's parts, the
one-time costs, time to the target per seed and their spreads over seeds; and which groups
and runs a ``--resume``d results file keeps.

Pure functions of ``launch.train`` records (dicts); nothing is run here.
"""

from __future__ import annotations

from collections.abc import Callable

from launch import experiments

__all__ = ["SPREAD_FIELDS", "aggregate", "group_key", "group_records", "kept_groups",
           "one_time_s", "runs_to_do", "steady_step_s", "step_breakdown", "summarise"]


def steady_step_s(record: dict) -> float | None:
    """Median training seconds per step over epochs 2.. (epoch 1 also traces the graphs)."""
    times = [0.0, *record["train_s_per_epoch"]]
    per_epoch = [b - a for a, b in zip(times[1:-1], times[2:])]
    if not per_epoch:
        return None
    per_epoch.sort()
    mid = len(per_epoch) // 2
    median = (per_epoch[mid] if len(per_epoch) % 2
              else 0.5 * (per_epoch[mid - 1] + per_epoch[mid]))
    return round(median / record["steps_per_epoch"], 4)


def step_breakdown(record: dict) -> dict:
    """Where one step's time goes (seconds): ``compute_s`` (forward, backward, input and
    everything outside the optimizer wrapper), ``compression_s`` (one replica's compression,
    timed alone) and ``communication_s`` (the rest of the wrapper's time: collectives,
    waiting for the slowest worker, the inner update).  Empty for records without the
    wrapper's timings."""
    step = steady_step_s(record)
    exchange = record.get("exchange_s_per_step")
    if step is None or exchange is None:
        return {}
    compress = min(record.get("compress_s_per_step") or 0.0, exchange)
    return {"compute_s": round(max(0.0, step - exchange), 4),
            "compression_s": round(compress, 4),
            "communication_s": round(exchange - compress, 4),
            "auto_modes": record.get("auto_modes")}


def one_time_s(record: dict) -> dict:
    """What a run spent once rather than per step (seconds): ``startup_s``, its first
    epoch's training time beyond a steady epoch (the train step's trace and first runs,
    and the automatic exchange's build-time measurement, counted in that epoch), and of it
    ``measure_s``, the automatic exchange's measuring and deciding (``None`` for the
    other methods)."""
    step = steady_step_s(record)
    first = record["train_s_per_epoch"][0] if record["train_s_per_epoch"] else None
    startup = None if step is None or first is None else \
        round(max(0.0, first - step * record["steps_per_epoch"]), 3)
    return {"startup_s": startup, "measure_s": record.get("auto_measure_s")}


def summarise(records: list[dict], target_drop: float) -> list[dict]:
    """Adds the time-to-accuracy figures to the runs of one model x bandwidth group and one
    seed (dense among them: its final accuracy sets the target)."""
    if len({r.get("seed", 0) for r in records}) > 1:
        raise ValueError("`records` must hold the runs of one seed")
    dense = next((r for r in records if r["method"] == "dense"), None)
    if dense is None:
        raise ValueError("`methods` must include dense (the target comes from it)")
    target = dense["test_accuracy"] - target_drop
    dense_t = experiments.time_to_target(dense, target)
    out = []
    for r in records:
        t = experiments.time_to_target(r, target)
        out.append({
            "model": r["model"], "bandwidth_mbit": r["bandwidth_mbit"], "method": r["method"],
            "seed": r.get("seed", 0),
            "target_accuracy": round(target, 4), "lr": r.get("flags", {}).get("lr"),
            "evaluation": "exact", "test_correct": r.get("test_correct"),
            "test_examples": r.get("test_examples"),
            "momentum_masking": (None if r["method"] == "dense"
                                 else r.get("flags", {}).get("momentum_masking")),
            "time_to_target_s": t, "final_accuracy": round(r["test_accuracy"], 4),
            "bytes_per_step": r["payload_bytes_per_step"],
            "dense_bytes_per_step": r["dense_bytes_per_step"],
            "wall_s": r["launcher_wall_s"], "train_s": r["train_s_per_epoch"][-1],
            "speedup_vs_dense": (round(dense_t / t, 3) if t and dense_t else None),
            "within_target_of_dense": r["test_accuracy"] >= target,
            "epochs_trained": len(r["train_s_per_epoch"]),
            "steps_per_epoch": r["steps_per_epoch"],
            "s_per_step": steady_step_s(r),
            **step_breakdown(r), **one_time_s(r),
            "accuracy_per_epoch": [round(a, 4) for a in r["history"].get("val_accuracy", [])],
            "train_s_per_epoch": r["train_s_per_epoch"],
        })
    return out


#: Per-seed figures of :func:`summarise` that :func:`aggregate` gives as spreads.
SPREAD_FIELDS = ("speedup_vs_dense", "time_to_target_s", "final_accuracy", "target_accuracy",
                 "s_per_step", "compute_s", "compression_s", "communication_s", "startup_s",
                 "measure_s")


def aggregate(rows: list[dict]) -> list[dict]:
    """One row per model x bandwidth x method of :func:`summarise`'s per-seed ``rows``
    (sorted by model and bandwidth): the seeds, and per figure of :data:`SPREAD_FIELDS` its
    :func:`experiments.spread` over the seeds where it exists (``speedup_vs_dense``:
    ``None`` where no seed reached the target; ``reached`` counts the seeds that did)."""
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        key = (r["model"], r["bandwidth_mbit"], r["method"])
        out.setdefault(key, []).append(r)
    summary = []
    # by model and link; methods in the order of their first record (dense first)
    for (model, bw, method), runs in sorted(out.items(), key=lambda kv: kv[0][:2]):
        runs = sorted(runs, key=lambda r: r.get("seed", 0))
        first = runs[0]
        summary.append({
            "model": model, "bandwidth_mbit": bw, "method": method,
            "seeds": [r.get("seed", 0) for r in runs],
            "reached": sum(r["speedup_vs_dense"] is not None for r in runs),
            **{k: experiments.spread([r.get(k) for r in runs]) for k in SPREAD_FIELDS},
            "bytes_per_step": first["bytes_per_step"],
            "dense_bytes_per_step": first["dense_bytes_per_step"],
            "evaluation": first.get("evaluation"), "lr": first.get("lr"),
            "momentum_masking": first.get("momentum_masking"),
            "auto_modes": [r.get("auto_modes") for r in runs]
            if any(r.get("auto_modes") for r in runs) else None,
        })
    return summary


def _same_budget(old: dict, new: dict) -> bool:
    """Whether a kept group was run with the budget asked for now (its ``rule`` is prose
    that describes the budget, not part of it)."""
    return {k: v for k, v in old.items() if k != "rule"} == \
        {k: v for k, v in new.items() if k != "rule"}


def group_records(runs: list[dict], budget: dict) -> list[dict]:
    """The per-seed figures (:func:`launch.tta_figures.summarise`) of one group's ``runs``,
    seed by seed.  Runs stored without flags take the group's ``budget`` learning rate and,
    when sparse, momentum masking (DGC's ``"all"`` in budgets from before it was recorded)."""
    records = [row for seed in sorted({r["seed"] for r in runs})
               for row in summarise([r for r in runs if r["seed"] == seed],
                                    budget["target_drop"])]
    for r in records:
        if r["lr"] is None:
            r["lr"] = budget["lr"]
        if r["momentum_masking"] is None and r["method"] != "dense":
            r["momentum_masking"] = budget.get("momentum_masking", "all")
    return records


def group_key(model: str, bandwidth_mbit: float) -> str:
    """The name of a model x link rate group in the results file, e.g.
    ``"vgg_fc @ 100 Mbit/s"``."""
    return f"{model} @ {float(bandwidth_mbit):g} Mbit/s"


def kept_groups(old: dict, running: set[str], budget_of: Callable[[str], dict]) -> list[str]:
    """Keys (``"model @ rate Mbit/s"``) of the groups of a ``--resume``d file to keep: every
    group this invocation does not run (with its own budget), and a group it runs only if
    its budget is the one asked for now (``budget_of(model)``; else it is run again)."""
    return [key for key, budget in old.get("group_budgets", {}).items()
            if key not in running or _same_budget(budget, budget_of(key.split(" @ ")[0]))]


def runs_to_do(kept: list[dict], methods: list[str], seeds: list[int], rerun: list[str]
               ) -> list[tuple[int, str]]:
    """``(seed, method)`` of every run to make, seed by seed: each method a seed lacks in
    ``kept`` or that is in ``rerun``; dense first in each seed (its final accuracy sets the
    seed's target, so a re-run dense sets it for the runs after it)."""
    return [(seed, m) for seed in seeds
            for m in sorted(methods, key=lambda m: m != "dense")
            if m in rerun or not any(r["method"] == m and r.get("seed", 0) == seed
                                     for r in kept)]
