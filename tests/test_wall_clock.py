"""The wall-clock composition (launch.wall_clock_compose) of launch.bench_wall_clock, on
hand-made records."""

import json
import statistics
from pathlib import Path

import pytest

from launch import bench_wall_clock as bw
from launch import convergence_curves as cc
from launch import experiments
from launch import wall_clock_compose as wc

ROOT = Path(__file__).resolve().parents[1]


def test_epochs_to_target_is_the_first_epoch_reaching_it():
    assert cc.epochs_to_target([0.5, 0.7, 0.69, 0.8], 0.7) == 2
    assert cc.epochs_to_target([0.5, 0.6], 0.7) is None


def test_epoch_parts_scale_the_training_and_keep_the_rest():
    record = {"steps_per_epoch": 10, "train_s_per_epoch": [5.0, 7.0, 9.0],
              "epoch_wall_s": [20.0, 25.0, 30.0], "eval_s_per_epoch": [2.0, 1.0, 1.0],
              "backup_s_per_epoch": [0.5, 0.2, 0.2]}
    parts = wc.epoch_parts(record, full_steps=100)
    assert parts["step_s"] == pytest.approx(0.2)  # 2 s per 10-step steady epoch
    assert parts["epoch_train_s"] == pytest.approx(20.0)
    assert parts["epoch_other_s"] == pytest.approx(3.0)  # 5 s wall - 2 s training
    assert parts["epoch_wall_s"] == pytest.approx(23.0)
    assert parts["one_time_s"] == pytest.approx(15.0)  # 20 s to epoch 1's end - 5 s steady
    assert parts["eval_s"] == 1.0 and parts["backup_s"] == 0.2


def test_compose_gives_per_seed_speedups_against_that_seeds_dense():
    curves = {("m", "dense"): {0: [0.5, 0.8, 0.9], 1: [0.6, 0.85, 0.9]},
              ("m", "block"): {0: [0.7, 0.9, 0.91], 1: [0.5, 0.6, 0.7]}}
    slow = {"epoch_wall_s": 10.0, "epoch_train_s": 8.0, "one_time_s": 5.0, "eval_s": 1.0,
            "backup_s": 0.5}
    fast = dict(slow, epoch_wall_s=4.0, epoch_train_s=2.0)
    records, summary, targets = wc.compose(
        curves, {("m", 100.0, "dense"): slow, ("m", 100.0, "block"): fast}, ["m"], [100.0],
        ["dense", "block"], 0.003)
    assert targets == {"m": pytest.approx(0.897)}
    by = {(r["method"], r["seed"]): r for r in records}
    assert by[("dense", 0)]["wall_s"] == 35.0  # 5 + 3 x 10
    assert by[("block", 0)]["wall_s"] == 13.0  # 5 + 2 x 4
    assert by[("block", 0)]["wall_speedup_vs_dense"] == pytest.approx(35 / 13, abs=1e-3)
    assert by[("block", 0)]["speedup_vs_dense"] == pytest.approx(24 / 4, abs=1e-3)
    assert by[("block", 1)]["wall_s"] is None and by[("block", 1)]["wall_speedup_vs_dense"] is None
    row = next(r for r in summary if r["method"] == "block")
    assert row["reached"] == 1 and row["wall_speedup_vs_dense"]["n"] == 1


def test_each_automatic_method_takes_the_curves_of_itself_pinned():
    """``AUTO_CURVES`` is written by hand: for the automatic exchange without local steps,
    its ``allgather`` curves are those of the same method with the exchange pinned, and its
    dense curves dense's, so a new entry cannot borrow another masking's curves."""
    import dataclasses

    from launch.methods import METHODS

    checked = 0
    for auto, curves in wc.AUTO_CURVES.items():
        method = METHODS[auto]
        if method.sync_every:
            continue  # local steps: dense mode is model averaging (the test below)
        assert curves["dense"] == "dense" and "allgather" in curves
        for mode, source in curves.items():
            if mode == "dense":
                continue
            pinned = dataclasses.replace(method, options=method.options.replace(
                exchange=mode), stated=frozenset())
            assert pinned == dataclasses.replace(METHODS[source], stated=frozenset()), mode
        checked += 1
    assert checked >= 3


def test_the_automatic_exchange_takes_the_curves_of_the_mode_it_chose():
    assert wc.curves_of("block_default", {}) == "block_default"
    assert wc.curves_of("block_auto_default", {"auto_modes": ["dense"]}) == "dense"
    assert wc.curves_of("block_auto_default", {"auto_modes": ["allgather"] * 2}) == \
        "block_default"
    assert wc.curves_of("block_auto_default", {"auto_modes": ["dense", "allgather"]}) is None
    # with local steps: local_block's compression under the automatic exchange, whose dense
    # mode is model averaging
    assert wc.curves_of("local_auto", {"auto_modes": ["allgather"]}) == "local_block"
    assert wc.curves_of("local_auto", {"auto_modes": ["dense"]}) == "local_average"
    # repeated runs stand for one source only where they agree
    assert wc.curves_of_runs("local_auto", [{"auto_modes": ["dense"]}] * 2) == "local_average"
    assert wc.curves_of_runs("local_auto", [{"auto_modes": ["dense"]},
                                            {"auto_modes": ["allgather"]}]) is None


def test_compose_takes_the_groups_that_were_timed():
    """A results file gathers models timed at different rates (and methods) over several
    runs of the bench; each model x rate with dense timed is composed, with its methods."""
    curves = {("m", "dense"): {0: [0.5, 0.9]}, ("m", "block"): {0: [0.9, 0.9]}}
    parts = {"epoch_wall_s": 10.0, "epoch_train_s": 8.0, "one_time_s": 5.0, "eval_s": 1.0,
             "backup_s": 0.5}
    timings = {("m", 30.0, "dense"): parts, ("m", 30.0, "block"): parts,
               ("m", 300.0, "dense"): parts, ("m", 1000.0, "block"): parts}
    _, summary, _ = wc.compose(curves, timings, ["m"], [30.0, 300.0, 1000.0],
                               ["dense", "block"], 0.003)
    assert [(r["bandwidth_mbit"], r["method"]) for r in summary] == [
        (30.0, "dense"), (30.0, "block"), (300.0, "dense")]


def _convergence_file(tmp_path, name: str, epochs: int, curve: list[float], **budget) -> str:
    import json

    doc = {"budget": {"dataset": "fashion_mnist", "global_batch": 128, "lr": 0.05,
                      "epochs": {"m": epochs, "n": epochs}, "lr_by_model": {}, **budget},
           "runs": [{"model": model, "method": "dense", "flags": {"seed": 0},
                     "history": {"val_accuracy": curve}} for model in ("m", "n")]}
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return str(path)


def test_a_model_may_take_its_curves_from_a_longer_budget_file(tmp_path):
    short = _convergence_file(tmp_path, "short.json", 2, [0.5, 0.8])
    long = _convergence_file(tmp_path, "long.json", 3, [0.5, 0.8, 0.9])
    curves, budgets, files = cc.load_convergence([short, f"m={long}"])
    assert curves[("m", "dense")] == {0: [0.5, 0.8, 0.9]}  # m from the longer budget
    assert curves[("n", "dense")] == {0: [0.5, 0.8]}
    assert budgets["m"]["epochs"]["m"] == 3 and budgets["n"]["epochs"]["n"] == 2
    assert files == {"m": long, "n": short}


def test_files_with_another_shared_budget_are_refused(tmp_path):
    short = _convergence_file(tmp_path, "short.json", 2, [0.5, 0.8])
    other = _convergence_file(tmp_path, "other.json", 3, [0.5, 0.8, 0.9], global_batch=64)
    with pytest.raises(ValueError, match="--convergence"):
        cc.load_convergence([short, f"m={other}"])


def test_run_configs_render_the_committed_runs_flags():
    """The configs the bench builds for its timing runs and direct checks are the command
    lines of the committed runs (flags added since then aside)."""
    doc = json.loads((ROOT / "benchmarks" / "results" / "time_to_accuracy.json").read_text())
    base = "benchmarks/results/convergence.json"
    _, budgets, _ = cc.load_convergence(
        [str(ROOT / base)] + [f"{model}={ROOT / entry['file']}"
                              for model, entry in doc["budget"]["convergence"].items()
                              if entry["file"] != base])
    runs = [(t["method"], t["model"], t["bandwidth_mbit"], t["record"]["flags"], {})
            for t in doc["timings"]]
    for check in doc["checks"]:
        model, rate, method, _ = check["run"].split(":")
        runs.append((method, model, float(rate), check["flags"],
                     {"stop_at_accuracy": check["target"], "test_samples": 0}))
    assert len(runs) > 10
    for method, model, rate, recorded, extra in runs:
        config = experiments.for_link(bw._train_config(
            method, model, budgets[model], recorded["epochs"], recorded["steps_per_epoch"],
            recorded["seed"], doc["budget"]["setup"]["density"], **extra).replace(
            strategy="multiworker", model_dir=recorded["model_dir"], deterministic=True), rate)
        got = config.flag_values()
        if recorded["compression"] != "dense" and "momentum_masking" in recorded \
                and recorded["momentum_masking"] is None:
            # recorded before the methods stated their masking: DGC's, the default then
            recorded = {**recorded, "momentum_masking": "all"}
        assert {k: got[k] for k in recorded} == recorded, (model, method)


def test_repeated_timing_runs_take_turns_in_balanced_rounds():
    keys = [("m", 100.0, "dense"), ("m", 100.0, "block"), ("m", 1000.0, "dense")]
    assert wc.timing_order(keys, 1) == keys
    # dense, block, ...; ..., block, dense; dense, block, ...
    assert wc.timing_order(keys, 3) == keys + keys[::-1] + keys
    assert wc.timing_order(keys, 3, "turns") == keys * 3
    order = wc.timing_order(keys, 4)
    for a in keys:  # over an even number of rounds each key precedes each other as often
        for b in keys:
            if a != b:
                before = sum(order.index(a, 3 * r) < order.index(b, 3 * r) for r in range(4))
                assert before == 2
    with pytest.raises(ValueError, match="`order`"):
        wc.timing_order(keys, 2, "random")


def test_repeated_timing_runs_compose_their_median_parts():
    def parts(step_s, other_s, one_time_s):
        return {"step_s": step_s, "epoch_other_s": other_s, "one_time_s": one_time_s,
                "eval_s": other_s / 2, "backup_s": 0.1, "epoch_train_s": 0.0,
                "epoch_wall_s": 0.0}

    runs = [parts(0.2, 3.0, 10.0), parts(0.5, 2.0, 30.0), parts(0.3, 4.0, 12.0)]
    med = wc.median_parts(runs, full_steps=100)
    assert med["step_s"] == 0.3 and med["epoch_other_s"] == 3.0 and med["one_time_s"] == 12.0
    assert med["epoch_train_s"] == pytest.approx(30.0)  # 0.3 s x 100 steps
    assert med["epoch_wall_s"] == pytest.approx(33.0)  # derived, not a median of its own
    assert med["eval_s"] == 1.5 and med["backup_s"] == 0.1
    assert wc.median_parts(runs[:1], 100)["epoch_wall_s"] == pytest.approx(23.0)
    with pytest.raises(ValueError, match="repeats"):
        wc.median_parts([], 100)


def test_repeated_timings_report_the_per_round_ratio_to_dense():
    curves = {("m", "dense"): {0: [0.5, 0.9]}, ("m", "block"): {0: [0.5, 0.9]}}
    base = {"epoch_wall_s": 10.0, "epoch_train_s": 8.0, "one_time_s": 5.0, "eval_s": 1.0,
            "backup_s": 0.5}
    dense = dict(base, repeat_epoch_wall_s=[10.0, 12.0])
    block = dict(base, epoch_wall_s=5.0, repeat_epoch_wall_s=[5.0, 4.0])
    _, summary, _ = wc.compose(curves, {("m", 100.0, "dense"): dense,
                                        ("m", 100.0, "block"): block}, ["m"], [100.0],
                               ["dense", "block"], 0.003)
    row = next(r for r in summary if r["method"] == "block")
    ratio = row["epoch_wall_ratio_vs_dense_per_round"]
    assert ratio["n"] == 2 and ratio["min"] == 2.0 and ratio["max"] == 3.0
    assert "wall_speedup_vs_dense_per_round" not in row  # no one-time seconds per round
    # each round's wall to target from its own parts: one-time + epochs x epoch wall
    curves[("m", "block")] = {0: [0.5, 0.8, 0.9], 1: [0.9, 0.9, 0.9]}
    curves[("m", "dense")] = {0: [0.5, 0.9, 0.9], 1: [0.5, 0.9, 0.9]}
    dense["repeat_one_time_s"], block["repeat_one_time_s"] = [5.0, 8.0], [10.0, 2.0]
    _, summary, _ = wc.compose(curves, {("m", 100.0, "dense"): dense,
                                        ("m", 100.0, "block"): block}, ["m"], [100.0],
                               ["dense", "block"], 0.003)
    row = next(r for r in summary if r["method"] == "block")
    # target 0.897: dense needs 2 epochs in both seeds, block 3 (seed 0) and 1 (seed 1)
    rounds = [statistics.fmean([(5 + 2 * 10) / (10 + 3 * 5), (5 + 2 * 10) / (10 + 1 * 5)]),
              statistics.fmean([(8 + 2 * 12) / (2 + 3 * 4), (8 + 2 * 12) / (2 + 1 * 4)])]
    per_round = row["wall_speedup_vs_dense_per_round"]
    assert per_round["n"] == 2
    assert per_round["mean"] == pytest.approx(statistics.fmean(rounds), abs=1e-3)
    assert per_round["min"] == pytest.approx(min(rounds), abs=1e-3)
    dense_row = next(r for r in summary if r["method"] == "dense")
    assert dense_row["wall_speedup_vs_dense_per_round"]["min"] == 1.0
    single = wc.compose(curves, {("m", 100.0, "dense"): base, ("m", 100.0, "block"): base},
                        ["m"], [100.0], ["dense", "block"], 0.003)[1]
    assert all("epoch_wall_ratio_vs_dense_per_round" not in r and
               "wall_speedup_vs_dense_per_round" not in r for r in single)


def test_checks_are_remade_at_a_new_target_and_earlier_ones_stay():
    made = []

    def run(entry):
        made.append(entry)
        return {"run": entry, "target": 0.9}

    old = {"m:100:block:0": {"run": "m:100:block:0", "target": 0.8},
           "n:100:block:0": {"run": "n:100:block:0", "target": 0.7}}
    same = wc.kept_checks(["m:100:block:0"], old, {"m": 0.8, "n": 0.75}, run)
    assert same == [old["m:100:block:0"], old["n:100:block:0"]] and made == []
    moved = wc.kept_checks(["m:100:block:0"], old, {"m": 0.9, "n": 0.75}, run)
    # the requested one is made again at its new target; the other keeps its own
    assert moved == [{"run": "m:100:block:0", "target": 0.9}, old["n:100:block:0"]]
    assert made == ["m:100:block:0"]
    assert wc.kept_checks([], {}, {}, run) == []
