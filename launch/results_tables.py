"""Markdown tables of the evidence results (what the README's Results section shows).

    python launch/results_tables.py [--results=benchmarks/results]

Reads ``time_to_accuracy.json`` and ``convergence.json`` (written by
``launch/bench_time_to_accuracy.py`` and ``launch/bench_convergence.py``) and prints one table
each, plus the budget lines; a missing file is reported and skipped.
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The script's flags."""
    flags.DEFINE_string("results", "benchmarks/results", "Directory of the results files.")


def _fmt(value: float | None, spec: str, missing: str = "not reached") -> str:
    return missing if value is None else format(value, spec)


def time_to_accuracy_table(doc: dict) -> str:
    """One row per model x bandwidth x method (``time_to_accuracy.json``)."""
    lines = ["| model | link | method | lr | masking | final acc | target | time to target s | "
             "s/step | bytes/step | vs dense bytes | speedup vs dense |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["records"]:
        ratio = r["dense_bytes_per_step"] / r["bytes_per_step"]
        speed = _fmt(r["speedup_vs_dense"], ".2f")
        lines.append(
            f"| {r['model']} | {r['bandwidth_mbit']:g} Mbit/s | {r['method']} | "
            f"{_fmt(r.get('lr'), 'g', '-')} | {r.get('momentum_masking') or '-'} | "
            f"{r['final_accuracy']:.3f} | "
            f"{r['target_accuracy']:.3f} | "
            f"{_fmt(r['time_to_target_s'], '.0f')} | {_fmt(r.get('s_per_step'), '.3f', '-')} | "
            f"{r['bytes_per_step']:,} | {ratio:.0f}x | "
            f"{speed if speed == 'not reached' else speed + 'x'} |")
    return "\n".join(lines)


def convergence_table(doc: dict) -> str:
    """One row per model x method (``convergence.json``): mean +- std over seeds."""
    lines = ["| model | method | seeds | test acc mean | std | gap to dense (points) | "
             "within 0.3 points | bytes/step |",
             "|---|---|---|---|---|---|---|---|"]
    for r in doc["records"]:
        lines.append(
            f"| {r['model']} | {r['method']} | {len(r['seeds'])} | {r['mean']:.4f} | "
            f"{r['std']:.4f} | {r.get('gap_to_dense_points', 0.0):+.2f} | "
            f"{'yes' if r.get('within_0_3_points') else 'no'} | {r['bytes_per_step']:,} |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    for name, table in (("time_to_accuracy.json", time_to_accuracy_table),
                        ("convergence.json", convergence_table)):
        path = os.path.join(FLAGS.results, name)
        if not os.path.exists(path):
            print(f"{path}: missing (run `make bench-full`)\n", file=sys.stderr)
            continue
        with open(path) as fh:
            doc = json.load(fh)
        print(f"### {name}\n\nbudget: {json.dumps(doc['budget'])}\n")
        print(table(doc) + "\n")


if __name__ == "__main__":
    define_flags()
    app.run(main)
