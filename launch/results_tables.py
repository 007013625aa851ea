"""Markdown tables of the evidence results (what the README's Results section shows).

    python -m launch.results_tables [--results=benchmarks/results]

Reads the results files of :data:`TABLES` (written by ``launch/bench_time_to_accuracy.py``,
``launch/bench_convergence.py``, ``launch/bench_wall_clock.py``, ``launch/bench_backup.py``,
``launch/demo.py`` and the cluster scripts) and prints one table each, plus the budget lines;
a missing file is reported and skipped.
The result tables of ``docs/results.md`` sit between ``<!-- table: FILE -->`` and
``<!-- /table -->`` markers and must equal these tables (``tests/test_results_files.py``
checks it; ``--update_readme=docs/results.md`` rewrites them).
"""

from __future__ import annotations

import itertools
import json
import os
import sys

from absl import app, flags

from launch import script

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The script's flags."""
    flags.DEFINE_string("results", "benchmarks/results", "Directory of the results files.")
    flags.DEFINE_string("update_readme", None, "Also rewrite the marked tables of this "
                        "document (e.g. docs/results.md; between <!-- table: FILE --> and "
                        "<!-- /table -->) in place.")


def _fmt(value: float | None, spec: str, missing: str = "not reached") -> str:
    return missing if value is None else format(value, spec)


def _spread(value: dict | None, spec: str, missing: str = "not reached",
            suffix: str = "", count: bool = False) -> str:
    """A :func:`launch.experiments.spread`: the value alone for one seed, else ``mean ±
    std (min-max)``, with ``count`` ``(min-max, n)``."""
    if value is None:
        return missing
    if value["n"] == 1:
        return format(value["mean"], spec) + suffix
    n = f", {value['n']}" if count else ""
    return (f"{value['mean']:{spec}}{suffix} ± {value['std']:{spec}} "
            f"({value['min']:{spec}}-{value['max']:{spec}}{n})")


def _tta_summary(doc: dict) -> list[dict]:
    """The per-method summary over seeds (recomputed for files written before it)."""
    from launch.bench_time_to_accuracy import aggregate

    return doc.get("summary") or aggregate(doc["records"])


def time_to_accuracy_table(doc: dict) -> str:
    """One row per model x bandwidth x method (``time_to_accuracy_early.json``), over its seeds."""
    lines = ["| model | link | method | seeds | evaluation | lr | masking | final acc | "
             "target | time to target s | s/step | bytes/step | vs dense bytes | "
             "speedup vs dense |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in _tta_summary(doc):
        ratio = r["dense_bytes_per_step"] / r["bytes_per_step"]
        reached = "" if r["reached"] == len(r["seeds"]) else \
            f" ({r['reached']} of {len(r['seeds'])} seeds reached)"
        lines.append(
            f"| {r['model']} | {r['bandwidth_mbit']:g} Mbit/s | {r['method']} | "
            f"{','.join(str(s) for s in r['seeds'])} | "
            f"{r.get('evaluation') or 'miscounted'} | "
            f"{_fmt(r.get('lr'), 'g', '-')} | {r.get('momentum_masking') or '-'} | "
            f"{_spread(r['final_accuracy'], '.3f')} | {_spread(r['target_accuracy'], '.3f')} | "
            f"{_spread(r['time_to_target_s'], '.0f')} | {_spread(r['s_per_step'], '.3f', '-')} | "
            f"{r['bytes_per_step']:,} | {ratio:.0f}x | "
            f"{_spread(r['speedup_vs_dense'], '.2f', suffix='x')}{reached} |")
    return "\n".join(lines)


def _runs_of(modes: list[str]) -> str:
    """``["dense", "allgather", "allgather"]`` -> ``"dense, allgather x2"``."""
    parts = []
    for mode, run in itertools.groupby(modes):
        n = sum(1 for _ in run)
        parts.append(mode if n == 1 else f"{mode} x{n}")
    return ", ".join(parts)


def step_breakdown_table(doc: dict) -> str:
    """Where a step's time goes, per model x bandwidth x method (``time_to_accuracy_early.json``
    runs that carry the optimizer wrapper's timings), mean over the seeds."""
    lines = ["| model | link | method | seeds | s/step | compute s | compression s | "
             "communication s | once s (of it measuring) | modes per fusion group |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in _tta_summary(doc):
        if r.get("compute_s") is None:
            continue
        modes = sorted({_runs_of(m) for m in r.get("auto_modes") or [] if m})
        lines.append(
            f"| {r['model']} | {r['bandwidth_mbit']:g} Mbit/s | {r['method']} | "
            f"{len(r['seeds'])} | {r['s_per_step']['mean']:.3f} | "
            f"{r['compute_s']['mean']:.3f} | {r['compression_s']['mean']:.3f} | "
            f"{r['communication_s']['mean']:.3f} | {_once(r)} | {'; '.join(modes) or '-'} |")
    return "\n".join(lines)


def _once(row: dict) -> str:
    """A summary row's one-time seconds, e.g. ``6.21 (0.52)`` (``-`` where not recorded)."""
    startup, measure = row.get("startup_s"), row.get("measure_s")
    if startup is None:
        return "-"
    measured = measure is not None and measure["mean"] > 0  # other methods record 0
    return f"{startup['mean']:.2f}" + (f" ({measure['mean']:.2f})" if measured else "")


def convergence_table(doc: dict) -> str:
    """One row per model x method (``convergence.json``): mean +- std over seeds."""
    lines = ["| model | method | seeds | epochs | test acc per seed | mean | std | "
             "points below dense | within 0.3 points | bytes/step | vs dense bytes |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["records"]:
        per_seed = " / ".join(f"{a:.4f}" for a in r["final_accuracy"])
        ratio = r["dense_bytes_per_step"] / r["bytes_per_step"]
        gap = r.get("gap_to_dense_points")  # None: no dense run in this file
        vs_dense = ("- | -" if gap is None else
                    f"{gap:+.2f} | {'yes' if r.get('within_0_3_points') else 'no'}")
        lines.append(
            f"| {r['model']} | {r['method']} | {len(r['seeds'])} | {r.get('epochs', '-')} | "
            f"{per_seed} | {r['mean']:.4f} | "
            f"{r['std']:.4f} | {vs_dense} | {r['bytes_per_step']:,} | "
            f"{ratio:.1f}x |")
    return "\n".join(lines)


def demo_table(doc: dict) -> str:
    """One row per link x method of the main job (``demo.json``, from ``launch/demo.py``)."""
    lines = ["| link | method | epochs | test acc | correct / test images | bytes/step/worker | "
             "ratio | wall s |", "|---|---|---|---|---|---|---|---|"]
    for r in doc["results"]:
        link = r.get("link", "loopback")
        lines.append(
            f"| {link if link == 'loopback' else link + ' Mbit/s'} | {r['method']} | "
            f"{r.get('epochs', doc['epochs'])} | {r['test_accuracy']:.4f} | "
            f"{r['test_correct']:,} / {r['test_examples']:,} | "
            f"{r['payload_bytes_per_step']:,} | {r['compression_ratio']:.1f}x | "
            f"{r['wall_s']:.1f} |")
    return "\n".join(lines)


def converged_table(doc: dict) -> str:
    """Per model whether dense converged by the file's rule, then one row per model x method
    (``convergence.json`` of converged runs)."""
    lines = [convergence_table(doc), "", "| model | dense converged | gain over the last "
             "quarter (points) | target (dense mean - 0.3 points) |", "|---|---|---|---|"]
    for model, c in doc["budget"].get("converged", {}).items():
        dense = next(r["mean"] for r in doc["records"]
                     if r["model"] == model and r["method"] == "dense")
        lines.append(f"| {model} | {'yes' if c['converged'] else 'no'} | "
                     f"{c['tail_gain_points']:+.2f} (epoch {c['from_epoch']} to the last) | "
                     f"{dense - 0.003:.4f} |")
    return "\n".join(lines)


def wall_clock_table(doc: dict) -> str:
    """One row per model x link x method (``time_to_accuracy.json``)."""
    lines = ["| model | link | method | seeds reaching target | epochs to target | "
             "s/epoch (of it eval, backup) | one-time s | wall s to target | wall speedup | "
             "wall speedup per timing round | training-clock speedup |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["summary"]:
        per_round = r.get("wall_speedup_vs_dense_per_round")
        lines.append(
            f"| {r['model']} | {r['bandwidth_mbit']:g} Mbit/s | {r['method']} | "
            f"{r['reached']}/{len(r['seeds'])} | {_spread(r['epochs_to_target'], '.1f')} | "
            f"{r['epoch_wall_s']:.1f} ({r['eval_s']:.1f}, {r['backup_s']:.2f}) | "
            f"{r['one_time_s']:.1f} | {_spread(r['wall_s'], '.0f')} | "
            f"{_spread(r['wall_speedup_vs_dense'], '.2f', suffix='x')} | "
            f"{_spread(per_round, '.2f', suffix='x', count=True) if per_round else '-'} | "
            f"{_spread(r['speedup_vs_dense'], '.2f', suffix='x')} |")
    return "\n".join(lines)


def backup_table(doc: dict) -> str:
    """One row per method of ``launch/bench_backup.py`` (``backup.json``); the spread over the
    steady epochs of every run where the record has it."""
    lines = ["| method | backup s per epoch (steady) | std, min-max (n) | vs dense | link bytes "
             "per backup per worker | bytes/step |", "|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        s = r.get("backup_s_steady_spread")
        spread = f"{s['std']:.3f}, {s['min']:.3f}-{s['max']:.3f} ({s['n']})" if s else "-"
        lines.append(f"| {r['method']} | {r['backup_s_steady']:.3f} | {spread} | "
                     f"{r.get('backup_s_ratio_vs_dense', 1.0):.2f}x | "
                     f"{r['link_bytes_per_backup']:,} | {r['payload_bytes_per_step']:,} |")
    return "\n".join(lines)


def pipeline_cluster_table(doc: dict) -> str:
    """One row per topology x plan of ``launch/train_pipeline.py --results_file``."""
    lines = ["| topology | plan | stages (layers @ worker tasks) | measured step s | "
             "predicted step s | measured / predicted | samples/s | bandwidth-aware speedup |",
             "|---|---|---|---|---|---|---|---|"]
    for key, run in doc["runs"].items():
        best = run["plans"].get("bandwidth_aware", {}).get("throughput_samples_s")
        for name, p in run["plans"].items():
            stages = ", ".join(f"{s['layers'][0]}-{s['layers'][1]} @ "
                               f"{'+'.join(map(str, s['worker_tasks']))}" for s in p["stages"])
            speed = "-" if name == "bandwidth_aware" or not best else \
                f"{best / p['throughput_samples_s']:.2f}x"
            lines.append(f"| {key} | {name} | {stages} | {p['measured_step_s']:.3f} | "
                         f"{p['predicted_step_s']:.3f} | {p['measured_over_predicted']:.2f} | "
                         f"{p['throughput_samples_s']:.0f} | {speed} |")
    return "\n".join(lines)


def hybrid_cluster_table(doc: dict) -> str:
    """The ``launch/train_hybrid.py --workers`` record as one row."""
    mib = 2**20
    idle = ", ".join(f"{b / mib:.0f}" for b in doc["conv_worker_idle_bytes"])
    return "\n".join([
        "| workers | FC state on task | FC state MiB | conv tasks | conv cap MiB | conv idle "
        "MiB | steps | max abs weight diff vs data parallel | step s |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {doc['workers']} | {doc['fc_state_task']} | {doc['fc_state_bytes'] / mib:.0f} | "
        f"{', '.join(map(str, doc['conv_tasks']))} | {doc['conv_worker_memory_mib']} | {idle} "
        f"| {doc['steps']} | {doc['max_abs_weight_diff']:.1e} | "
        f"{doc['step_time_s_median']:.3f} |"])


def local_steps_table(doc: dict) -> str:
    """One row per model x link x method of ``launch/local_steps_report.py``
    (``local_steps.json``)."""
    lines = ["| model | link | method | seeds | final accuracy | bytes/step | fewer bytes than "
             "dense | seeds reaching dense - 0.5 points | wall speedup to it |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in doc["summary"]:
        link = "-" if r["bandwidth_mbit"] is None else f"{r['bandwidth_mbit']:g} Mbit/s"
        lines.append(
            f"| {r['model']} | {link} | {r['method']} | {len(r['seeds'])} | "
            f"{_spread(r['final_accuracy'], '.4f')} | {r['bytes_per_step']['mean']:,.0f} | "
            f"{r['byte_reduction_vs_dense']:,.1f}x | "
            f"{'-' if r['reached'] is None else str(r['reached']) + '/' + str(len(r['seeds']))}"
            f" | {_spread(r['wall_speedup_vs_dense'], '.2f', suffix='x', missing='-')} |")
    return "\n".join(lines)


#: Results file -> its table.
#: ``FILE`` or ``FILE#VIEW`` (a second table from the same file) -> table builder.
TABLES = {"time_to_accuracy_early.json": time_to_accuracy_table,
          "time_to_accuracy_early.json#breakdown": step_breakdown_table,
          "convergence.json": converged_table,
          "convergence_vgg_fc_20_epochs.json": converged_table,
          "convergence_resnet20_20_epochs.json": converged_table,
          "convergence_resnet20_30_epochs.json": converged_table,
          "convergence_resnet20_30_epochs_lr_warmup.json": convergence_table,
          "convergence_early.json": convergence_table, "demo.json": demo_table,
          "time_to_accuracy.json": wall_clock_table,
          "time_to_accuracy_repeats.json": wall_clock_table,
          "time_to_accuracy_resnet20_repeats.json": wall_clock_table,
          "time_to_accuracy_resnet20_30_epochs.json": wall_clock_table,
          "time_to_accuracy_maskwhole.json": wall_clock_table,
          "time_to_accuracy_maskwhole_resnet20_repeats.json": wall_clock_table,
          "time_to_accuracy_maskwhole_cnn_small.json": wall_clock_table,
          "time_to_accuracy_nomask_resnet20_repeats.json": wall_clock_table,
          "time_to_accuracy_maskwhole_gru_nmt_repeats.json": wall_clock_table,
          "time_to_accuracy_maskwhole_gru_nmt_balanced.json": wall_clock_table,
          "time_to_accuracy_embed_gru_nmt_repeats.json": wall_clock_table,
          "time_to_accuracy_embed_gru_nmt_1gbit_repeats.json": wall_clock_table,
          "time_to_accuracy_embed_gru_nmt_1gbit_balanced.json": wall_clock_table,
          "time_to_accuracy_embed_resnet20_1gbit_balanced.json": wall_clock_table,
          "time_to_accuracy_maskwhole_resnet20_balanced.json": wall_clock_table,
          "time_to_accuracy_recurrent.json": wall_clock_table, "backup.json": backup_table,
          "pipeline_cluster.json": pipeline_cluster_table,
          "hybrid_cluster.json": hybrid_cluster_table,
          "local_steps.json": local_steps_table,
          "local_steps_auto_wall_clock.json": wall_clock_table}


def source_file(name: str) -> str:
    """The results file a :data:`TABLES` key reads (``FILE#VIEW`` -> ``FILE``)."""
    return name.split("#", 1)[0]


def update_readme(text: str, results: str) -> str:
    """``text`` with every ``<!-- table: FILE -->`` block replaced by FILE's table."""
    parts = text.split("<!-- table: ")
    out = [parts[0]]
    for part in parts[1:]:
        name, _, rest = part.partition(" -->")
        if name not in TABLES or "<!-- /table -->" not in rest:
            raise ValueError(f"README: unknown or unclosed table marker {name!r}")
        with open(os.path.join(results, source_file(name))) as fh:
            table = TABLES[name](json.load(fh))
        tail = rest.split("<!-- /table -->", 1)[1]
        out.append(f"{name} -->\n{table}\n<!-- /table -->{tail}")
    return "<!-- table: ".join(out)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    for name, table in TABLES.items():
        path = os.path.join(FLAGS.results, source_file(name))
        if not os.path.exists(path):
            print(f"{path}: missing (run `make bench-full`)\n", file=sys.stderr)
            continue
        with open(path) as fh:
            doc = json.load(fh)
        budget = doc.get("budget", {k: v for k, v in doc.items() if k != "results"})
        print(f"### {name}\n\nbudget: {json.dumps(budget)}\n")
        print(table(doc) + "\n")
    if FLAGS.update_readme:
        with open(FLAGS.update_readme) as fh:
            text = fh.read()
        with open(FLAGS.update_readme, "w") as fh:
            fh.write(update_readme(text, FLAGS.results))


if __name__ == "__main__":
    script.run(main, define_flags)
