"""``benchmarks/results/local_steps.json``: local steps against dense and the per-step exchange.

Reads the converged accuracy runs of ``launch.bench_convergence`` (``--convergence``: every
method's curve on the same budget, exact evaluation) and the composed wall-clock times of
``launch.bench_wall_clock`` (``--wall_clock``, made with ``--target_drop=0.005``: dense's
converged accuracy minus 0.5 points), and writes one summary row per model x link rate x
method with ``bytes_per_step``, ``dense_bytes_per_step``, ``final_accuracy`` and
``wall_speedup_vs_dense`` as {mean, std, min, max, n}, and the run records behind them
(flags, commit, ``test_correct`` / ``test_examples``).  Nothing is trained here.

    python -m launch.bench_convergence ... --methods=dense,block_default,local_dense,local_block
    python -m launch.bench_wall_clock --target_drop=0.005 --out=runs/local_wall \\
        --methods=dense,block_default,local_dense,local_block --timing_steps=64 ...
    cp runs/local_wall/time_to_accuracy.json benchmarks/results/local_steps_wall_clock.json
    python -m launch.local_steps_report [--convergence=PATH,MODEL=PATH]
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from absl import flags

from launch import convergence_curves, experiments, script

FLAGS = flags.FLAGS
#: The methods the report compares, in its order.
REPORT_METHODS = ("dense", "block_default", "local_dense", "local_block",
                  "local_block_20pct_nesterov", "local_block_40pct_int4_nesterov")


def define_flags() -> None:
    """The script's flags."""
    flags.DEFINE_list("convergence", ["benchmarks/results/convergence.json"],
                      "launch.bench_convergence's results: PATH for every model, MODEL=PATH "
                      "for one model's (e.g. a longer budget's file), as "
                      "launch.bench_wall_clock --convergence.")
    flags.DEFINE_list("wall_clock", ["benchmarks/results/local_steps_wall_clock.json"],
                      "launch.bench_wall_clock's results (--target_drop=0.005); of several "
                      "files, a later file's row of a model, rate and method wins.")
    flags.DEFINE_string("out", "benchmarks/results/local_steps.json", "Output file.")


def summary_rows(convergence: dict, walls: Sequence[dict] = ()) -> list[dict]:
    """One row per model x rate x method of :data:`REPORT_METHODS`, for the models with a
    local-step run (rate ``None``: no wall-clock timing of that model).  ``walls``: the
    ``launch.bench_wall_clock`` documents, in order (a later one's row of a model, rate and
    method wins); none for no timing."""
    if isinstance(walls, dict):
        raise TypeError("`walls` must be a sequence of bench_wall_clock documents, "
                        "not one document")
    runs = [r for r in convergence["runs"] if r["method"] in REPORT_METHODS]
    wall_rows = {(w["model"], w["bandwidth_mbit"], w["method"]): w
                 for doc in walls for w in doc.get("summary", [])}
    rates_of: dict[str, list] = {}
    for model, rate, _ in wall_rows:
        rates_of.setdefault(model, [])
        if rate not in rates_of[model]:
            rates_of[model].append(rate)
    rows = []
    local = {r["model"] for r in runs if r["method"].startswith("local")}
    for model in dict.fromkeys(r["model"] for r in runs if r["model"] in local):
        for rate in rates_of.get(model) or [None]:
            for method in REPORT_METHODS:
                recs = sorted((r for r in runs if (r["model"], r["method"]) == (model, method)),
                              key=lambda r: r["flags"]["seed"])
                if not recs:
                    continue
                timed = wall_rows.get((model, rate, method), {})
                rows.append({
                    "model": model, "bandwidth_mbit": rate, "method": method,
                    "seeds": [r["flags"]["seed"] for r in recs],
                    "bytes_per_step": experiments.spread(
                        [r["payload_bytes_per_step"] for r in recs], 1),
                    "dense_bytes_per_step": experiments.spread(
                        [r["dense_bytes_per_step"] for r in recs], 1),
                    "byte_reduction_vs_dense": round(
                        recs[0]["dense_bytes_per_step"] / recs[0]["payload_bytes_per_step"], 1),
                    "final_accuracy": experiments.spread([r["test_accuracy"] for r in recs]),
                    "test_correct": [r["test_correct"] for r in recs],
                    "test_examples": [r["test_examples"] for r in recs],
                    "wall_speedup_vs_dense": timed.get("wall_speedup_vs_dense"),
                    "wall_s": timed.get("wall_s"),
                    "epochs_to_target": timed.get("epochs_to_target"),
                    "reached": timed.get("reached"),
                })
    return rows


def model_runs(entries: list[str]) -> tuple[list[dict], dict[str, dict], dict[str, str]]:
    """The runs of ``--convergence``, each model's from the last file that has it (the
    choice ``launch.bench_wall_clock`` makes from the same entries).

    Returns:
      ``(runs, budgets, files)``: the runs, and per model its file's budget and path.

    Raises:
      ValueError: The files' shared budgets differ (naming ``--convergence``).
    """
    _, budgets, files = convergence_curves.load_convergence(entries)
    docs: dict[str, dict] = {}
    runs = []
    for model, path in files.items():
        if path not in docs:
            with open(path) as fh:
                docs[path] = json.load(fh)
        runs += [r for r in docs[path]["runs"] if r["model"] == model]
    return runs, budgets, files


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise ValueError(f"unexpected arguments: {argv[1:]}")
    runs, budgets, files = model_runs(FLAGS.convergence)
    first = budgets[next(iter(files))] if files else {}
    convergence = {"budget": first, "runs": runs}
    walls = {}
    for path in FLAGS.wall_clock:
        if os.path.exists(path):
            with open(path) as fh:
                walls[path] = json.load(fh)
    rows = summary_rows(convergence, list(walls.values()))
    reported = {row["model"] for row in rows}
    doc = {
        "budget": {"convergence": convergence["budget"],
                   "convergence_files": files,
                   "epochs_by_model": {m: b["epochs"][m] for m, b in budgets.items()},
                   "wall_clock": {p: w["budget"] for p, w in walls.items()} or None,
                   "methods": {m: experiments.method_flags(m) for m in REPORT_METHODS}},
        "summary": rows,
        "runs": [r for r in convergence["runs"]  # the records behind the rows
                 if r["method"] in REPORT_METHODS and r["model"] in reported],
    }
    os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
    with open(FLAGS.out, "w") as fh:
        json.dump(doc, fh, indent=1)
    print(json.dumps(doc["summary"]))


if __name__ == "__main__":
    script.run(main, define_flags)
