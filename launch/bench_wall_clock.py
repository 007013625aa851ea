"""Wall-clock time to a converged accuracy on a shaped cluster, composed from measured parts.

A user waits from launch until the test accuracy reaches the target: start-up, tracing, the
automatic exchange's measuring, training, and every epoch's evaluation and backup.  Training
to convergence on a shaped 4-worker cluster for every method and seed does not fit a 2-core
machine, so the time is composed from measured parts and the composition is checked against
one direct run:

1. **Epochs to target** come from the converged accuracy curves of
   ``launch.bench_convergence`` (``--convergence``): per model the target is dense's
   converged mean accuracy minus ``--target_drop``; per method and seed, the first epoch whose
   test accuracy reaches it.
2. **Seconds per epoch and one-time seconds** come from short runs of every method on the
   shaped ``--num_workers``-process cluster (``--timing_steps`` steps per epoch,
   ``--timing_epochs`` epochs, the full test set evaluated and a backup written after every
   epoch, as in a real run): a full epoch's wall seconds are the measured per-step training
   seconds times the full epoch's steps plus the measured rest of a steady epoch (evaluation,
   backup, waits); the one-time seconds are what the first epoch took beyond a steady one plus
   everything before it (process start, TensorFlow import, tracing, measuring).  With
   ``--timing_repeats=R`` every method is timed R times, in rounds (dense, block; block,
   dense; dense, block; ...: every second round reversed, ``--timing_order``), so a slow
   spell of the machine and the position in a round hit every method alike; the composition
   takes the median of each part over the repeats, and each repeat's parts are kept.
3. ``wall_s = one_time_s + epochs_to_target x epoch_wall_s``; ``train_s`` (the training-only
   clock) ``= epochs_to_target x epoch_train_s``.

``--check=MODEL:RATE:METHOD:SEED`` also trains that run directly on the shaped cluster for
the budget's epochs (stopping at the target) and reports its measured wall time to target
against the composition (with the direct run's own epochs to target, and with the curves').

Writes ``OUT/time_to_accuracy.json``: ``budget`` (``target_rule``, the timing set-up),
``timings`` (per model x rate x method, with the run records' flags and provenance),
``records`` (per model x rate x method x seed) and ``summary`` rows with ``wall_s``,
``train_s``, ``wall_speedup_vs_dense`` and ``speedup_vs_dense`` as {mean, std, min, max, n}.

    python -m launch.bench_wall_clock --models=cnn_small --bandwidths_mbit=100,1000 \\
        --methods=dense,block_default --convergence=benchmarks/results/convergence.json
"""

from __future__ import annotations

import json
import os
from typing import Any

from absl import app, flags

from launch import experiments, runtime, script
from launch import flags as train_flags
from launch.config import TrainConfig
from launch.convergence_curves import PER_MODEL_BUDGET, epochs_to_target, load_convergence
from launch.wall_clock_compose import (
    TIMING_ORDERS,
    compose,
    curves_of_runs,
    epoch_parts,
    kept_checks,
    median_parts,
    timing_order,
)

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The script's flags."""
    flags.DEFINE_list("models", ["cnn_small"], "Models (each must be in --convergence).")
    flags.DEFINE_list("bandwidths_mbit", ["100", "1000"], "Link rates to shape to.")
    flags.DEFINE_list("methods", ["dense", "block_default"], "Methods (dense first).")
    flags.register_validator(
        "methods", lambda m: experiments.known_methods(m, list(experiments.METHODS)),
        f"--methods must be a non-empty list of {sorted(experiments.METHODS)}")
    flags.register_validator("models", lambda m: experiments.known_methods(
        m, train_flags.MODELS), f"--models must be a non-empty list of {train_flags.MODELS}")
    flags.DEFINE_list("convergence", ["benchmarks/results/convergence.json"],
                      "launch.bench_convergence's results (curves, budget): PATH for every "
                      "model, MODEL=PATH for one model's (e.g. a longer budget's file).")
    flags.DEFINE_float("target_drop", 0.003, "Target = dense's converged mean minus this.")
    flags.DEFINE_integer("num_workers", 4, "Worker processes of the shaped cluster.")
    flags.DEFINE_integer("timing_steps", 40, "Steps per epoch of the timing runs.",
                         lower_bound=2)
    flags.DEFINE_integer("timing_epochs", 3, "Epochs of the timing runs.", lower_bound=2)
    flags.DEFINE_integer("timing_repeats", 1, "Timing runs per model x rate x method, taken "
                         "in rounds (every method once, then again); their median parts are "
                         "composed.", lower_bound=1)
    flags.DEFINE_enum("timing_order", "balanced", list(TIMING_ORDERS),
                      "Order of the rounds: 'balanced' reverses every second round (A B, "
                      "B A, ...) so a run's position cancels; 'turns' keeps one order (A B, "
                      "A B, ...).")
    flags.DEFINE_float("density", 0.05, "Density of methods that take one.")
    flags.DEFINE_list("check", [], "MODEL:RATE:METHOD:SEED runs to train directly.")
    flags.DEFINE_boolean("resume", True, "Keep the timings and checks of OUT's file with "
                         "the same set-up, those of other models, rates and methods too.")
    flags.DEFINE_string("out", "benchmarks/results", "Output directory.")


def _reused_parts(method: str, run: dict) -> dict:
    """A kept timing's parts (updated in ``run``), whose curves are looked up again from
    its runs' recorded modes: which curves stand for a mode may have been added since."""
    records = run.get("repeat_records") or [run["record"]]
    run["parts"]["curves_of"] = curves_of_runs(method, records)
    return run["parts"]


def _train_config(method: str, model: str, budget: dict, epochs: int, steps: int,
                  seed: int, density: float | None, **fields: Any) -> TrainConfig:
    """The ``launch.train`` config of one run of ``method`` on the convergence ``budget``."""
    return experiments.train_config(
        method, density, model=model, dataset=budget["dataset"], epochs=epochs,
        steps_per_epoch=steps, batch_size=budget["global_batch"],
        lr=float(budget.get("lr_by_model", {}).get(model, budget["lr"])), momentum=0.9,
        seed=seed, lr_schedule=budget.get("lr_schedule", "constant"),
        warmup_epochs=float(budget.get("warmup_epochs", 0.0)), **fields)


def main(argv: list[str]) -> None:
    script.require_root(argv)
    f = FLAGS
    curves, budgets, files = load_convergence(f.convergence)
    missing = [m for m in f.models if m not in budgets]
    if missing:
        raise app.UsageError(f"--models {missing} have no curves in --convergence "
                             f"{f.convergence}")
    budget = next(iter(budgets.values()))
    rates = [float(r) for r in f.bandwidths_mbit]
    path = os.path.join(f.out, "time_to_accuracy.json")
    setup = {"num_workers": f.num_workers, "timing_steps": f.timing_steps,
             "timing_epochs": f.timing_epochs, "density": f.density,
             "convergence_budget": {k: v for k, v in budget.items() if k not in PER_MODEL_BUDGET}}
    if f.timing_repeats > 1:  # files of single timing runs keep their set-up
        setup["timing_repeats"] = f.timing_repeats
        if f.timing_order != "turns":  # files timed in turns keep theirs
            setup["timing_order"] = f.timing_order
    old, old_checks, prev_sources = {}, {}, {}
    if f.resume and os.path.exists(path):
        with open(path) as fh:
            prev = json.load(fh)
        if prev.get("budget", {}).get("setup") == setup:
            prev_sources = prev["budget"].get("convergence", {})
            old = {(t["model"], t["bandwidth_mbit"], t["method"]): t for t in prev["timings"]}
            old_checks = {c["run"]: c for c in prev.get("checks", [])}
    timings, runs = {}, []
    todo = [(model, rate, method) for model in f.models for rate in rates
            for method in f.methods]
    for key in todo:
        if key in old:
            timings[key] = _reused_parts(key[2], old[key])
            runs.append(old[key])
    measured: dict[tuple, list[tuple[dict, dict]]] = {}
    full: dict[str, int] = {}
    for key in timing_order([k for k in todo if k not in old], f.timing_repeats,
                            f.timing_order):
        model, rate, method = key
        rec = experiments.run_training(
            method, _train_config(method, model, budgets[model], f.timing_epochs,
                                  f.timing_steps, 0, f.density),
            f.num_workers, bandwidth_mbit=rate, timeout_s=3600)
        if model not in full:
            full[model] = _full_steps(model, budgets[model], f.num_workers)
        parts = epoch_parts(rec, full[model])
        measured.setdefault(key, []).append((parts, rec))
        print(json.dumps({"model": model, "rate": rate, "method": method,
                          "repeat": len(measured[key]), **parts}), flush=True)
    for key, done in measured.items():
        model, rate, method = key
        modes = [rec.get("auto_modes") for _, rec in done]
        parts = (dict(done[0][0]) if len(done) == 1
                 else median_parts([p for p, _ in done], full[model]))
        # the automatic exchange's curves are those of its mode, if every repeat chose it
        parts["curves_of"] = curves_of_runs(method, [rec for _, rec in done])
        parts["auto_modes"] = modes[0] if all(m == modes[0] for m in modes) else modes
        if len(done) > 1:  # each repeat's, in the order taken
            parts["repeat_epoch_wall_s"] = [p["epoch_wall_s"] for p, _ in done]
            parts["repeat_one_time_s"] = [p["one_time_s"] for p, _ in done]
        timings[key] = parts
        rec = done[0][1]
        run = {"model": model, "bandwidth_mbit": rate, "method": method, "parts": parts,
               "full_steps": full[model],
               "record": experiments.slim(rec) | {
                   k: rec.get(k) for k in ("epoch_wall_s", "eval_s_per_epoch",
                                           "backup_s_per_epoch", "start_s", "flags",
                                           "provenance")}}
        if len(done) > 1:
            run["repeats"] = [p for p, _ in done]
            run["repeat_records"] = [{k: r.get(k) for k in (
                "epoch_wall_s", "train_s_per_epoch", "start_s", "auto_modes",
                "auto_measure_s", "test_correct")} for _, r in done]
        runs.append(run)
    for key, run in old.items():  # timings of other models, rates and methods stay
        if key not in timings:
            timings[key] = _reused_parts(key[2], run)
            runs.append(run)
    models = list(dict.fromkeys([*f.models, *(k[0] for k in timings)]))
    methods = list(dict.fromkeys([*f.methods, *(k[2] for k in timings)]))
    records, summary, targets = compose(curves, timings, models,
                                        sorted({k[1] for k in timings}), methods,
                                        f.target_drop)
    checks = kept_checks(f.check, old_checks, targets,
                         lambda entry: _check(entry, curves, timings, targets, budgets, f))
    known = {m: {"file": p, "epochs": budgets[m]["epochs"][m]} for m, p in files.items()
             if m in targets}
    for model, entry in prev_sources.items():  # models composed by earlier runs of the bench
        known.setdefault(model, entry)
    doc = {"budget": {"setup": setup, "targets": targets, "convergence": known,
                      "target_rule": f"dense's converged mean test accuracy (rule: "
                                     f"{budget.get('rule')}) minus {f.target_drop * 100:.1f} "
                                     f"points"},
           "timings": runs, "records": records, "summary": summary, "checks": checks,
           "machine": runtime.machine_info()}
    os.makedirs(f.out, exist_ok=True)
    with open(path, "w") as fh:
        json.dump(doc, fh, indent=1)
    for row in summary:
        print(json.dumps({k: row[k] for k in ("model", "bandwidth_mbit", "method",
                                              "wall_speedup_vs_dense", "speedup_vs_dense")}))
    for c in checks:
        print(json.dumps(c))


def _full_steps(model: str, budget: dict, num_workers: int) -> int:
    from launch import inputs

    arrays = inputs.load_arrays(budget["dataset"], model, "/usr/share/datasets/fashion-mnist",
                                None, ["32", "32", "3"], 0, 0, 0)
    return inputs.steps_per_epoch(arrays, budget["global_batch"], num_workers)


def _check(entry: str, curves: dict, timings: dict, targets: dict, budgets: dict,
           f) -> dict:
    """Trains ``MODEL:RATE:METHOD:SEED`` directly to the target; composed vs measured."""
    model, rate, method, seed = entry.split(":")
    budget = budgets[model]
    rate_f, seed_i = float(rate), int(seed)
    target = targets[model]
    epochs = budget["epochs"][model]
    config = _train_config(method, model, budget, epochs, 0, seed_i, f.density,
                           stop_at_accuracy=target, test_samples=0)
    rec = experiments.run_training(method, config, f.num_workers, bandwidth_mbit=rate_f,
                                   timeout_s=7200)
    own = epochs_to_target(rec["history"].get("val_accuracy")
                           or rec["history"].get("val_token_accuracy", []), target)
    parts = timings[(model, rate_f, method)]
    measured = None if own is None else rec["epoch_wall_s"][own - 1]
    from_curve = epochs_to_target(curves[(model, parts.get("curves_of", method))][seed_i],
                                  target)
    out = {"run": entry, "target": target, "measured_wall_s": measured,
           "epochs_to_target": own, "curve_epochs_to_target": from_curve,
           "composed_wall_s_own_epochs": None if own is None else
           round(parts["one_time_s"] + own * parts["epoch_wall_s"], 2),
           "composed_wall_s_curve_epochs": None if from_curve is None else
           round(parts["one_time_s"] + from_curve * parts["epoch_wall_s"], 2),
           "flags": rec["flags"], "provenance": rec.get("provenance"),
           "history": rec["history"].get("val_accuracy"), "epoch_wall_s": rec["epoch_wall_s"]}
    trained = len(rec["epoch_wall_s"])  # also when the target was not reached
    out["epochs_trained"] = trained
    out["measured_wall_s_at_end"] = rec["epoch_wall_s"][-1]
    out["composed_wall_s_at_end"] = round(parts["one_time_s"] + trained * parts["epoch_wall_s"],
                                          2)
    out["composed_over_measured"] = round(out["composed_wall_s_at_end"] /
                                          out["measured_wall_s_at_end"], 3)
    return out


if __name__ == "__main__":
    script.run(main, define_flags)
