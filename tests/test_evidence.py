"""Evidence benchmarks: time-to-accuracy derivation and the results files' JSON schema."""

import json
import os
import subprocess
import sys

import pytest

from launch import bench_convergence, experiments, tta_figures

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _record(method, accs, times, final=None, payload=1000, dense=8000):
    return {"method": method, "model": "vgg_fc", "bandwidth_mbit": 100.0,
            "history": {"val_accuracy": accs}, "train_s_per_epoch": times,
            "test_accuracy": accs[-1] if final is None else final,
            "payload_bytes_per_step": payload, "dense_bytes_per_step": dense,
            "launcher_wall_s": times[-1] + 5, "steps_per_epoch": 10, "steps": 10 * len(accs),
            "test_correct": round(1000 * (accs[-1] if final is None else final)),
            "test_examples": 1000, "flags": {"seed": 0}}


def test_time_to_target_and_speedup():
    dense = _record("dense", [0.5, 0.7, 0.8], [10.0, 20.0, 30.0], payload=8000)
    block = _record("block_allgather", [0.6, 0.798, 0.81], [2.0, 4.0, 6.0])
    slow = _record("topk", [0.4, 0.5, 0.6], [3.0, 6.0, 9.0])
    assert experiments.time_to_target(dense, 0.797) == 30.0
    assert experiments.time_to_target(block, 0.797) == 4.0
    assert experiments.time_to_target(slow, 0.797) is None
    rows = tta_figures.summarise([dense, block, slow], 0.003)
    by = {r["method"]: r for r in rows}
    assert by["dense"]["speedup_vs_dense"] == 1.0
    assert by["block_allgather"]["speedup_vs_dense"] == 7.5
    assert by["topk"]["speedup_vs_dense"] is None and not by["topk"]["within_target_of_dense"]
    for r in rows:
        assert {"model", "bandwidth_mbit", "method", "time_to_target_s", "final_accuracy",
                "bytes_per_step", "speedup_vs_dense"} <= set(r)
    with pytest.raises(ValueError, match="dense"):
        tta_figures.summarise([block], 0.003)


def test_time_to_accuracy_over_seeds():
    rows = []
    for seed, (dense_t, block_t) in enumerate([(30.0, 4.0), (30.0, 6.0), (24.0, None)]):
        dense = {**_record("dense", [0.5, 0.7, 0.8], [10.0, 20.0, dense_t], payload=8000),
                 "seed": seed}
        block_accs = [0.6, 0.798, 0.81] if block_t else [0.6, 0.7, 0.75]
        block = {**_record("block_allgather", block_accs, [2.0, block_t or 5.0, 7.0]),
                 "seed": seed}
        rows += tta_figures.summarise([dense, block], 0.003)
    assert [r["seed"] for r in rows] == [0, 0, 1, 1, 2, 2]
    by = {r["method"]: r for r in tta_figures.aggregate(rows)}
    assert by["dense"]["seeds"] == [0, 1, 2] and by["dense"]["reached"] == 3
    assert by["dense"]["speedup_vs_dense"] == {"mean": 1.0, "std": 0.0, "min": 1.0,
                                               "max": 1.0, "n": 3}
    speed = by["block_allgather"]["speedup_vs_dense"]  # 7.5 and 5.0; seed 2 never reached
    assert by["block_allgather"]["reached"] == 2 and speed["n"] == 2
    assert speed["mean"] == 6.25 and speed["min"] == 5.0 and speed["max"] == 7.5
    assert speed["std"] == pytest.approx(1.7678, abs=1e-4)
    assert by["block_allgather"]["final_accuracy"]["n"] == 3
    with pytest.raises(ValueError, match="one seed"):
        tta_figures.summarise([{**dense, "seed": 0}, {**block, "seed": 1}], 0.003)


def test_one_time_costs_and_records_derived_from_runs():
    """startup_s: the first epoch beyond a steady one; measure_s: the automatic exchange's
    measuring; a kept group's figures are derived from its stored runs, seed by seed."""
    dense = _record("dense", [0.5, 0.7, 0.8], [16.0, 20.0, 24.0], payload=8000)
    auto = {**_record("block_auto", [0.5, 0.7, 0.8], [16.5, 20.5, 24.5], payload=8000),
            "auto_measure_s": 0.5}
    once = tta_figures.one_time_s(auto)
    assert once == {"startup_s": 12.5, "measure_s": 0.5}  # 16.5 s - 10 steps x 0.4 s
    assert tta_figures.one_time_s(dense) == {"startup_s": 12.0, "measure_s": None}
    runs = [{**r, "seed": seed} for seed in (1, 0) for r in (dense, auto)]
    for r in runs:
        del r["flags"]  # stored runs keep no flags
    budget = {"target_drop": 0.003, "lr": 0.05, "momentum_masking": "waited"}
    records = tta_figures.group_records(runs, budget)
    assert [(r["seed"], r["method"]) for r in records] == [
        (0, "dense"), (0, "block_auto"), (1, "dense"), (1, "block_auto")]
    assert all(r["lr"] == 0.05 for r in records)
    assert [r["momentum_masking"] for r in records[:2]] == [None, "waited"]
    assert records[1]["startup_s"] == 12.5 and records[1]["speedup_vs_dense"] == 0.98
    summary = {r["method"]: r for r in tta_figures.aggregate(records)}
    assert summary["block_auto"]["measure_s"]["mean"] == 0.5
    assert summary["dense"]["measure_s"] is None


def test_runs_to_do_fills_gaps_reruns_and_puts_dense_first():
    kept = [{"method": m, "seed": s} for s in (0, 1) for m in ("dense", "block_shared")]
    kept.append({"method": "block_auto"})  # a file from before seeds: seed 0
    todo = tta_figures.runs_to_do(kept, ["block_shared", "block_auto", "dense"],
                                             [0, 1, 2], ["block_auto", "dense"])
    # seed by seed, dense first (it sets the seed's target), kept shared runs not repeated
    assert todo == [(0, "dense"), (0, "block_auto"), (1, "dense"), (1, "block_auto"),
                    (2, "dense"), (2, "block_shared"), (2, "block_auto")]
    assert tta_figures.runs_to_do(kept, ["dense", "block_shared"], [0, 1], []) == []


def test_spread_and_seed_list():
    assert experiments.spread([None, None]) is None
    assert experiments.spread([2.0]) == {"mean": 2.0, "std": 0.0, "min": 2.0, "max": 2.0,
                                         "n": 1}
    assert experiments.spread([1.0, None, 3.0])["std"] == pytest.approx(1.4142, abs=1e-4)
    assert experiments.seed_list(["0", "1", "2"])
    for bad in ([], ["0", "0"], ["-1"], ["x"], ["1.5"]):
        assert not experiments.seed_list(bad), bad


def test_convergence_summary():
    recs = [_record("dense", [0.5, 0.8], [1.0, 2.0]), _record("dense", [0.6, 0.82], [1.0, 2.0])]
    row = bench_convergence.summarise("cnn_small", "dense", recs)
    assert row["mean"] == pytest.approx(0.81) and row["std"] == pytest.approx(0.0141, abs=1e-4)
    assert row["curve_mean"] == [0.55, 0.81]
    assert row["test_correct"] == [800, 820] and row["test_examples"] == [1000, 1000]
    block = bench_convergence.summarise("cnn_small", "block_default", [
        _record("block_default", [0.5, 0.8], [1.0, 2.0], payload=100)] * 2)
    rows = [row, block]
    bench_convergence.add_gaps(rows)
    assert block["gap_to_dense_points"] == pytest.approx(1.0)
    assert block["compression_ratio"] == 80.0 and not block["within_0_3_points"]
    assert row["within_0_3_points"] and row["gap_to_dense_points"] == 0.0


def test_a_written_budget_is_the_same_budget():
    """The rule and verdicts a run writes into the budget do not make --resume drop it."""
    common = {"lr": 0.05, "lr_schedule": "cosine"}
    written = {**common, "epochs": {"cnn_small": 20}, "rule": bench_convergence.RULE,
               "converged": {"cnn_small": {"converged": True}}}
    assert bench_convergence.same_budget(written, common)
    assert not bench_convergence.same_budget({**written, "lr": 0.1}, common)


def test_converged_rule():
    assert bench_convergence.converged([0.5, 0.8, 0.9, 0.9005])["converged"]
    late = bench_convergence.converged([0.5, 0.8, 0.85, 0.9])
    assert not late["converged"] and late["tail_gain_points"] == 5.0 and late["from_epoch"] == 3


def test_method_flags_reject_unknown():
    assert "--density=0.01" in experiments.method_flags("topk", 0.01)
    with pytest.raises(ValueError, match="`method`"):
        experiments.method_flags("nope", 0.01)


@pytest.mark.slow
def test_convergence_end_to_end_schema(tmp_path):
    cmd = [sys.executable, "-m", "launch.bench_convergence",
           "--num_workers=2", "--dataset=digits", "--epochs=1", "--seeds=0",
           "--models=cnn_small", "--model_epochs=", "--methods=dense,block_default",
           f"--out={tmp_path}"]
    subprocess.run(cmd, check=True, timeout=600, cwd=ROOT, capture_output=True)
    doc = json.loads((tmp_path / "convergence.json").read_text())
    assert {r["method"] for r in doc["records"]} == {"dense", "block_default"}
    for r in doc["records"]:
        assert 0.0 <= r["mean"] <= 1.0 and r["bytes_per_step"] > 0
        assert r["test_examples"] == [360]  # digits' test set, every image once
        assert r["final_accuracy"] == [round(r["test_correct"][0] / 360, 4)]
        assert isinstance(r["within_0_3_points"], bool)
    assert (tmp_path / "convergence.png").stat().st_size > 0
    # --resume adds a method and keeps the rows of the same budget
    subprocess.run([*cmd[:-2], "--methods=block_source", "--resume", f"--out={tmp_path}"],
                   check=True, timeout=600, cwd=ROOT, capture_output=True)
    again = json.loads((tmp_path / "convergence.json").read_text())
    assert [r["method"] for r in again["records"]] == ["dense", "block_default", "block_source"]
    assert again["records"][:2] == doc["records"]
    assert "gap_to_dense_points" in again["records"][2]


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="shaped links need root (netns + tc)")
def test_time_to_accuracy_end_to_end_schema(tmp_path):
    cmd = [sys.executable, "-m", "launch.bench_time_to_accuracy",
           "--num_workers=2", "--dataset=digits", "--models=cnn_small", "--bandwidths_mbit=100",
           "--methods=dense,block_allgather", "--epochs=2", "--steps_per_epoch=5",
           "--density=0.05", "--momentum_masking=waited", "--seeds=0,1", f"--out={tmp_path}"]
    subprocess.run(cmd, check=True, timeout=900, cwd=ROOT, capture_output=True)
    doc = json.loads((tmp_path / "time_to_accuracy_early.json").read_text())
    assert len(doc["records"]) == 4 and doc["budget"]["num_workers"] == 2
    assert [(r["seed"], r["method"]) for r in doc["records"]] == [
        (0, "dense"), (0, "block_allgather"), (1, "dense"), (1, "block_allgather")]
    assert [(s["method"], s["seeds"]) for s in doc["summary"]] == [
        ("dense", [0, 1]), ("block_allgather", [0, 1])]
    for r in doc["records"]:
        assert r["bandwidth_mbit"] == 100.0 and r["bytes_per_step"] > 0
        assert r["lr"] == 0.05
        assert r["momentum_masking"] == (None if r["method"] == "dense" else "waited")
        assert r["startup_s"] >= 0 and r["measure_s"] == 0.0  # fixed modes measure nothing
    assert (tmp_path / "time_to_accuracy_early.png").stat().st_size > 0
    # --resume with nothing to run derives the same figures from the stored runs
    subprocess.run([*cmd, "--resume"], check=True, timeout=300, cwd=ROOT, capture_output=True)
    again = json.loads((tmp_path / "time_to_accuracy_early.json").read_text())
    assert again["records"] == doc["records"] and again["summary"] == doc["summary"]


def test_resume_keeps_every_group_it_does_not_run():
    """A group of a model being run at another link rate keeps its own budget (it was
    dropped before when its budget differed); a group run now is kept only with the same
    budget."""
    old_budget, new_budget = {"lr": 0.01, "rule": "a"}, {"lr": 0.01, "clock": "x", "rule": "b"}
    old = {"group_budgets": {"vgg_fc @ 100 Mbit/s": old_budget,
                             "vgg_fc @ 1000 Mbit/s": old_budget,
                             "resnet20 @ 100 Mbit/s": {**new_budget, "rule": "c"}}}
    running = {"vgg_fc @ 1000 Mbit/s", "resnet20 @ 100 Mbit/s"}
    assert tta_figures.kept_groups(old, running, lambda model: new_budget) == [
        "vgg_fc @ 100 Mbit/s", "resnet20 @ 100 Mbit/s"]
    assert tta_figures.kept_groups({}, running, lambda model: new_budget) == []
