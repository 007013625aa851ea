"""The wall-clock composition of ``launch.bench_wall_clock``: timing runs' per-epoch parts
and converged accuracy curves combined into a wall time to target per model, link rate,
method and seed (no TensorFlow; the runs themselves are made by the bench).

``wall_s = one_time_s + epochs_to_target x epoch_wall_s`` and ``train_s = epochs_to_target x
epoch_train_s``, with the epochs to target read from the curves and the parts from short
timing runs on the shaped cluster (the bench's docstring says how they are measured).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from launch import experiments
from launch.convergence_curves import epochs_to_target

#: The automatic exchange's curve at a rate is that of the mode it chose there: all groups
#: dense -> dense's, all sparse -> the same compression always applied in that mode (where a
#: mode has no converged curves of its own, a timing that chose it is not composed).
AUTO_CURVES = {"block_auto_default": {"dense": "dense", "allgather": "block_default"},
               "block_auto_maskwhole": {"dense": "dense",
                                        "allgather": "block_default_maskwhole",
                                        "shared": "block_shared_maskwhole"},
               "block_auto_embed": {"dense": "dense", "allgather": "block_default_embed"},
               "block_auto_nomask": {"dense": "dense", "allgather": "block_default_nomask"},
               "block_auto_masknorm": {"dense": "dense",
                                       "allgather": "block_default_masknorm"},
               "block_auto_maskvec": {"dense": "dense", "allgather": "block_default_maskvec"},
               "local_auto": {"dense": "local_average", "allgather": "local_block"}}


def curves_of(method: str, record: dict) -> str | None:
    """Whose converged curves stand for ``method`` on the timing run ``record``: its own, or
    for the automatic exchange those of the one mode it chose (``None``: modes mixed)."""
    if method not in AUTO_CURVES:
        return method
    modes = set(record.get("auto_modes") or [])
    if len(modes) != 1:
        return None
    return AUTO_CURVES[method].get(modes.pop())


def curves_of_runs(method: str, records: list[dict]) -> str | None:
    """:func:`curves_of` over a timing's repeated runs: the one source they agree on
    (``None`` where the automatic exchange chose differently between them)."""
    sources = {curves_of(method, rec) for rec in records}
    return sources.pop() if len(sources) == 1 else None


def epoch_parts(record: dict, full_steps: int) -> dict:
    """A timing run's per-epoch costs, scaled to an epoch of ``full_steps`` steps.

    Args:
      record: ``launch.train``'s metrics record of a run with >= 2 epochs.
      full_steps: Steps of a full epoch.

    Returns:
      ``{"step_s", "epoch_train_s", "epoch_other_s", "epoch_wall_s", "one_time_s",
      "eval_s", "backup_s"}``: steady per-step training seconds; a full epoch's training,
      other (evaluation, backup, waits) and total wall seconds; the one-time seconds.
    """
    train = record["train_s_per_epoch"]
    wall = record["epoch_wall_s"]
    steps = record["steps_per_epoch"]
    steady_train = [b - a for a, b in zip(train, train[1:])]
    steady_wall = [b - a for a, b in zip(wall, wall[1:])]
    return _parts(step_s=statistics.fmean(steady_train) / steps,
                  epoch_other_s=statistics.fmean(w - t for w, t in
                                                 zip(steady_wall, steady_train)),
                  one_time_s=wall[0] - statistics.fmean(steady_wall),
                  eval_s=statistics.fmean(record["eval_s_per_epoch"][1:]),
                  backup_s=statistics.fmean(record["backup_s_per_epoch"][1:]),
                  full_steps=full_steps)


def _parts(step_s: float, epoch_other_s: float, one_time_s: float, eval_s: float,
           backup_s: float, full_steps: int) -> dict:
    """The parts of :func:`epoch_parts` from the measured ones (a full epoch's training and
    wall seconds derived), rounded as the results files keep them."""
    train = step_s * full_steps
    return {"step_s": round(step_s, 5), "epoch_train_s": round(train, 3),
            "epoch_other_s": round(epoch_other_s, 3),
            "epoch_wall_s": round(train + epoch_other_s, 3),
            "one_time_s": round(one_time_s, 3), "eval_s": round(eval_s, 3),
            "backup_s": round(backup_s, 3)}


#: The measured parts of :func:`epoch_parts` (the arguments of :func:`_parts`).
_MEASURED = ("step_s", "epoch_other_s", "one_time_s", "eval_s", "backup_s")


#: The orders :func:`timing_order` knows.
TIMING_ORDERS = ("balanced", "turns")


def timing_order(keys: list[tuple], repeats: int, order: str = "balanced") -> list[tuple]:
    """The timing runs of ``keys`` (model, rate, method) repeated ``repeats`` times, in
    rounds: every key once per round, so that a slow spell of the machine falls on every
    method alike rather than on one method's repeats.

    ``"balanced"`` reverses every second round (A B, B A, A B, ...): over an even number of
    rounds every key runs as often right after the others as right before them, so an effect
    of a run's position (the previous cluster still shutting down, a drift of the machine's
    speed within a round) cancels in the per-round ratios.  ``"turns"`` keeps one order in
    every round (A B, A B, ...).

    Raises:
      ValueError: ``order`` is not one of :data:`TIMING_ORDERS`.
    """
    if order not in TIMING_ORDERS:
        raise ValueError(f"`order` must be one of {TIMING_ORDERS}, got {order!r}")
    rounds = [list(keys) if order == "turns" or r % 2 == 0 else list(reversed(keys))
              for r in range(repeats)]
    return [key for keys_of_round in rounds for key in keys_of_round]


def median_parts(repeats: list[dict], full_steps: int) -> dict:
    """The parts of several timing runs of one model x rate x method combined: the median
    of each measured part (per-step training, the rest of an epoch, one-time, evaluation and
    backup seconds), a full epoch's training and wall seconds derived from them.

    Args:
      repeats: :func:`epoch_parts` of each run (at least one).
      full_steps: Steps of a full epoch.
    """
    if not repeats:
        raise ValueError("`repeats`: no timing run to combine")
    return _parts(**{k: statistics.median(p[k] for p in repeats) for k in _MEASURED},
                  full_steps=full_steps)


def compose(curves: dict, timings: dict, models: list[str], rates: list[float],
            methods: list[str], target_drop: float) -> tuple[list[dict], list[dict], dict]:
    """Records per model x rate x method x seed and their summary rows.

    Args:
      curves: ``{(model, method): {seed: accuracy curve}}``.
      timings: ``{(model, rate, method): epoch_parts(...)}``.
      models, rates, methods: What to compose: every model x rate with dense timed, and
        its methods that are timed.
      target_drop: Target below dense's converged mean.

    Returns:
      ``(records, summary, targets)``.
    """
    records, summary, targets = [], [], {}
    for model in models:
        if (model, "dense") not in curves:
            print(f"{model}: no converged curves of every method yet; not composed")
            continue
        dense = curves[(model, "dense")]
        target = statistics.fmean(c[-1] for c in dense.values()) - target_drop
        targets[model] = round(target, 4)
        for rate in [r for r in rates if (model, r, "dense") in timings]:
            base: dict[int, dict] = {}
            for method in [m for m in methods if (model, rate, m) in timings]:
                parts = timings[(model, rate, method)]
                rows = []
                source = parts.get("curves_of", method)
                if (model, source) not in curves:
                    print(f"{model} {method} @ {rate:g}: no curves of {source}; not composed")
                    continue
                for seed, curve in sorted(curves[(model, source)].items()):
                    n = epochs_to_target(curve, target)
                    rec = {"model": model, "bandwidth_mbit": rate, "method": method,
                           "seed": seed, "target": round(target, 4), "epochs_to_target": n,
                           "final_accuracy": curve[-1],
                           "wall_s": None if n is None else
                           round(parts["one_time_s"] + n * parts["epoch_wall_s"], 2),
                           "train_s": None if n is None else round(n * parts["epoch_train_s"],
                                                                   2),
                           "backup_s_per_epoch": parts["backup_s"],
                           "eval_s_per_epoch": parts["eval_s"]}
                    if method == "dense":
                        base[seed] = rec
                    rows.append(rec)
                for rec in rows:
                    ref = base.get(rec["seed"])
                    for key, out in (("wall_s", "wall_speedup_vs_dense"),
                                     ("train_s", "speedup_vs_dense")):
                        ok = ref is not None and ref[key] and rec[key]
                        rec[out] = round(ref[key] / rec[key], 3) if ok else None
                records += rows
                summary.append({
                    "model": model, "bandwidth_mbit": rate, "method": method,
                    "curves_of": source, "seeds": [r["seed"] for r in rows],
                    **{key: experiments.spread([r[key] for r in rows], 3) for key in
                       ("wall_s", "train_s", "wall_speedup_vs_dense", "speedup_vs_dense",
                        "epochs_to_target")},
                    "reached": sum(r["epochs_to_target"] is not None for r in rows),
                    **{k: parts[k] for k in ("epoch_wall_s", "epoch_train_s", "one_time_s",
                                             "eval_s", "backup_s")},
                    **_round_ratios(timings[(model, rate, "dense")], parts,
                                    [(base[r["seed"]]["epochs_to_target"],
                                      r["epochs_to_target"]) for r in rows
                                     if r["seed"] in base])})
    return records, summary, targets


def _round_ratios(dense: dict, parts: dict, epochs: list[tuple[int | None, int | None]]
                  ) -> dict:
    """With repeated timing runs, ratios to dense per round of turns (each from runs taken
    one after the other), as {mean, std, min, max, n} over the rounds.

    ``epoch_wall_ratio_vs_dense_per_round``: dense's epoch wall seconds over the method's.
    ``wall_speedup_vs_dense_per_round``: the wall time to target composed from each round's
    own one-time and epoch seconds, dense's over the method's, averaged over the seeds
    where both reach the target (``epochs``: per seed, dense's and the method's epochs to
    target).  Its spread is the timing's: the headline speedup composes the medians of the
    parts, so its own spread is the seeds' alone.
    """
    a, b = dense.get("repeat_epoch_wall_s"), parts.get("repeat_epoch_wall_s")
    if not a or not b or len(a) != len(b):
        return {}
    out = {"epoch_wall_ratio_vs_dense_per_round":
           experiments.spread([x / y for x, y in zip(a, b)], 3)}
    ta, tb = dense.get("repeat_one_time_s"), parts.get("repeat_one_time_s")
    both = [(nd, nm) for nd, nm in epochs if nd is not None and nm is not None]
    if ta and tb and len(ta) == len(a) and len(tb) == len(b) and both:
        out["wall_speedup_vs_dense_per_round"] = experiments.spread(
            [statistics.fmean((td + nd * wd) / (tm + nm * wm) for nd, nm in both)
             for wd, wm, td, tm in zip(a, b, ta, tb)], 3)
    return out


def kept_checks(requested: list[str], old: dict[str, dict], targets: dict[str, float],
                run: Callable[[str], dict]) -> list[dict]:
    """The direct-run checks of a wall-clock file: ``requested`` ones, then earlier ones.

    A requested check (``MODEL:RATE:METHOD:SEED``) is kept from ``old`` when it was made at
    its model's current target, else ``run`` makes it again.  An earlier check not
    requested again stays whatever the target is now: it compares the composition with a
    direct run at the target it records, which a later change of the curves does not
    alter.

    Args:
      requested: The check entries asked for now.
      old: The earlier file's checks by entry.
      targets: The current target per model.
      run: Makes one check from its entry.

    Returns:
      The checks, requested ones first.
    """
    checks = [old[entry] if entry in old and
              old[entry]["target"] == targets.get(entry.split(":")[0]) else run(entry)
              for entry in requested]
    return checks + [c for entry, c in old.items() if entry not in requested]
