"""launch/local_steps_report.py: the summary rows of local_steps.json from given records."""

import json

import pytest

from launch import local_steps_report


def _run(method, seed, acc, sent, dense=1000):
    return {"model": "m", "method": method, "test_accuracy": acc, "test_correct": int(acc * 100),
            "test_examples": 100, "payload_bytes_per_step": sent, "dense_bytes_per_step": dense,
            "flags": {"seed": seed}, "provenance": {"commit": "c"}}


def test_rows_join_accuracy_bytes_and_wall_clock_per_rate():
    convergence = {"budget": {}, "runs": [
        _run("dense", 0, 0.9, 1000), _run("dense", 1, 0.92, 1000),
        _run("local_block", 1, 0.91, 2), _run("local_block", 0, 0.89, 2),
        _run("topk_1pct", 0, 0.5, 10), {**_run("dense", 0, 0.9, 1000), "model": "other"}]}
    speed = {"mean": 12.0, "std": 1.0, "min": 11.0, "max": 13.0, "n": 2}
    wall = {"summary": [
        {"model": "m", "bandwidth_mbit": 100.0, "method": "local_block",
         "wall_speedup_vs_dense": speed, "wall_s": None, "epochs_to_target": None,
         "reached": 2},
        {"model": "m", "bandwidth_mbit": 10.0, "method": "dense",
         "wall_speedup_vs_dense": None}]}
    rows = local_steps_report.summary_rows(convergence, [wall])
    assert [(r["bandwidth_mbit"], r["method"]) for r in rows] == [
        (100.0, "dense"), (100.0, "local_block"), (10.0, "dense"), (10.0, "local_block")]
    block = rows[1]
    assert block["seeds"] == [0, 1] and block["test_correct"] == [89, 91]
    assert block["final_accuracy"]["mean"] == 0.9 and block["final_accuracy"]["n"] == 2
    assert block["byte_reduction_vs_dense"] == 500.0
    assert block["wall_speedup_vs_dense"] == speed and rows[3]["wall_speedup_vs_dense"] is None
    untimed = local_steps_report.summary_rows(convergence)
    assert [r["bandwidth_mbit"] for r in untimed] == [None, None]
    # several timing files: their rates join, a later file's row of the same key wins
    later = {"summary": [{**wall["summary"][0], "wall_speedup_vs_dense": None},
                         {"model": "m", "bandwidth_mbit": 30.0, "method": "local_block",
                          "wall_speedup_vs_dense": speed}]}
    both = local_steps_report.summary_rows(convergence, [wall, later])
    assert [(r["bandwidth_mbit"], r["method"]) for r in both] == [
        (100.0, "dense"), (100.0, "local_block"), (10.0, "dense"), (10.0, "local_block"),
        (30.0, "dense"), (30.0, "local_block")]
    assert both[1]["wall_speedup_vs_dense"] is None and both[5]["wall_speedup_vs_dense"] == speed
    with pytest.raises(TypeError, match="walls"):
        local_steps_report.summary_rows(convergence, wall)


def _file(path, epochs, runs):
    budget = {"global_batch": 128, "dataset": "d", "epochs": epochs, "lr_by_model": {}}
    path.write_text(json.dumps({"budget": budget, "runs": runs}))
    return str(path)


def test_a_model_file_replaces_that_models_runs(tmp_path):
    """``MODEL=PATH`` takes that model's runs from PATH (a longer budget), the others'
    from the first file, as the wall-clock bench reads the same entries."""
    def run(model, method, acc):
        return {**_run(method, 0, acc, 10), "model": model, "history": {"val_accuracy": [acc]}}

    short = _file(tmp_path / "short.json", {"m": 10, "other": 10},
                  [run("m", "dense", 0.8), run("m", "local_block", 0.7),
                   run("other", "dense", 0.5)])
    long = _file(tmp_path / "long.json", {"m": 20}, [run("m", "dense", 0.9),
                                                     run("m", "local_block", 0.88)])
    runs, budgets, files = local_steps_report.model_runs([short, f"m={long}"])
    assert files == {"m": long, "other": short}
    assert budgets["m"]["epochs"] == {"m": 20}
    assert sorted((r["model"], r["test_accuracy"]) for r in runs) == [
        ("m", 0.88), ("m", 0.9), ("other", 0.5)]
    alone, _, files = local_steps_report.model_runs([short])
    assert files == {"m": short, "other": short} and len(alone) == 3
