"""The committed evidence files in ``benchmarks/results`` keep the schema the README cites."""

import json
import math
import os

import pytest

from launch import results_tables
from launch.bench_time_to_accuracy import aggregate
from models import registry

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "benchmarks", "results")
TTA_FIELDS = {"model", "bandwidth_mbit", "method", "time_to_target_s", "final_accuracy",
              "bytes_per_step", "speedup_vs_dense"}


def _load(name: str) -> dict:
    path = os.path.join(RESULTS, name)
    assert os.path.exists(path), f"{path} is missing: run `make bench`"
    with open(path) as fh:
        return json.load(fh)


def _png(name: str) -> None:
    path = os.path.join(RESULTS, name)
    with open(path, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"


def test_time_to_accuracy_file():
    doc = _load("time_to_accuracy_early.json")
    records = doc["records"]
    groups = {(r["model"], r["bandwidth_mbit"]) for r in records}
    assert {m for m, _ in groups} >= {"vgg_fc", "resnet20"}
    assert {b for _, b in groups} >= {100.0, 1000.0}
    for r in records:
        assert TTA_FIELDS <= set(r)
        assert 0.0 <= r["final_accuracy"] <= 1.0 and r["bytes_per_step"] > 0
        if r["method"] == "dense":
            assert r["speedup_vs_dense"] == 1.0 and r["bytes_per_step"] == \
                r["dense_bytes_per_step"]
        elif r["method"] == "block_auto":  # it may choose dense for every group
            dense_everywhere = all(m == "dense" for m in r["auto_modes"])
            assert (r["bytes_per_step"] == r["dense_bytes_per_step"]) == dense_everywhere
            assert r["bytes_per_step"] <= r["dense_bytes_per_step"]
        else:
            assert r["bytes_per_step"] < r["dense_bytes_per_step"]
        t = r["time_to_target_s"]
        assert t is None or (math.isfinite(t) and t > 0)
        assert (r["speedup_vs_dense"] is None) == (t is None)
    for model, bw in groups:
        methods = {r["method"] for r in records
                   if (r["model"], r["bandwidth_mbit"]) == (model, bw)}
        assert {"dense", "block_allgather", "block_shared", "topk", "block_auto"} <= methods
    assert doc["budget"]["num_workers"] == 4
    summary = doc.get("summary") or aggregate(records)  # files from before --seeds
    for row in summary:  # one row per model x link x method, over its seeds
        runs = [r for r in records if (r["model"], r["bandwidth_mbit"], r["method"]) ==
                (row["model"], row["bandwidth_mbit"], row["method"])]
        assert row["seeds"] == sorted(r.get("seed", 0) for r in runs)
        assert row["reached"] == sum(r["speedup_vs_dense"] is not None for r in runs)
        speed = row["speedup_vs_dense"]
        assert speed is None or speed["min"] <= speed["mean"] <= speed["max"]
    assert sum(len(row["seeds"]) for row in summary) == len(records)
    table = results_tables.time_to_accuracy_table(doc).splitlines()
    assert len(table) == len(summary) + 2
    _png("time_to_accuracy_early.png")


def _check_convergence_rows(rows: list[dict]) -> None:
    for r in rows:
        assert 0.0 <= r["mean"] <= 1.0 and r["std"] >= 0.0
        assert len(r["final_accuracy"]) == len(r["seeds"]) == len(r["test_correct"]) \
            == len(r["test_examples"]) >= 1
        for acc, correct, n in zip(r["final_accuracy"], r["test_correct"], r["test_examples"]):
            assert acc == round(correct / n, 4)  # every test example counted once
            if not registry.is_sequence_model(r["model"]):  # these count target tokens
                assert n == 10_000
        assert {"mean", "std", "bytes_per_step", "dense_bytes_per_step"} <= set(r)
        if any((d["model"], d["method"]) == (r["model"], "dense") for d in rows):
            assert isinstance(r["within_0_3_points"], bool) and "gap_to_dense_points" in r


def test_convergence_file():
    """Converged accuracies: the rule stated in the budget, dense converged by it for every
    model, every run's flags and commit recorded."""
    doc = _load("convergence.json")
    rows = doc["records"]
    _check_convergence_rows(rows)
    assert doc["budget"]["rule"] and doc["budget"]["lr_schedule"] == "cosine"
    models = {r["model"] for r in rows}
    assert set(doc["budget"]["converged"]) == models
    # every verdict is the rule applied to dense's curve; ResNet-20's 12-epoch budget is
    # recorded as not converged (it still gained 0.29 points over its last quarter)
    from launch.bench_convergence import converged
    for model, verdict in doc["budget"]["converged"].items():
        dense = next(r for r in rows if (r["model"], r["method"]) == (model, "dense"))
        assert verdict == converged(dense["curve_mean"]), model
    assert all(doc["budget"]["converged"][m]["converged"]
               for m in ("cnn_small", "gru_nmt", "vgg_fc"))
    assert {"dense", "block_default"} <= {r["method"] for r in rows}
    for run in doc["runs"]:
        assert run["flags"]["lr_schedule"] == "cosine" and run["flags"]["deterministic"]
        assert len(run["provenance"]["commit"]) == 40
    assert "cnn_small" in models
    assert all(len(r["seeds"]) >= 3 for r in rows if r["model"] == "cnn_small"
               and r["method"] in ("dense", "block_default", "local_dense", "local_block"))
    table = results_tables.converged_table(doc).splitlines()
    assert len(table) == len(rows) + 2 + 1 + 2 + len(models)
    _png("convergence.png")


@pytest.mark.parametrize("name,model", [("convergence_vgg_fc_20_epochs.json", "vgg_fc"),
                                        ("convergence_vgg_fc_lr_warmup.json", "vgg_fc"),
                                        ("convergence_vgg_fc_local_tuning.json", "vgg_fc"),
                                        ("convergence_resnet20_20_epochs.json", "resnet20"),
                                        ("convergence_resnet20_30_epochs.json", "resnet20"),
                                        ("convergence_resnet20_30_epochs_lr_warmup.json",
                                         "resnet20"),
                                        ("convergence_resnet20_local_tuning.json", "resnet20")])
def test_other_budget_convergence_files(name, model):
    """One model at another budget (more epochs, a learning-rate warm-up): the same
    schema, every verdict the rule applied to dense's curve where dense ran."""
    doc = _load(name)
    rows = doc["records"]
    _check_convergence_rows(rows)
    assert [*doc["budget"]["epochs"]] == [model] and doc["budget"]["rule"]
    from launch.bench_convergence import converged
    for model, verdict in doc["budget"]["converged"].items():
        dense = next(r for r in rows if (r["model"], r["method"]) == (model, "dense"))
        assert verdict == converged(dense["curve_mean"]), model
    for run in doc["runs"]:
        assert run["flags"]["lr_schedule"] == "cosine" and run["flags"]["deterministic"]
        assert run["flags"]["warmup_epochs"] == doc["budget"]["warmup_epochs"]
        assert len(run["provenance"]["commit"]) == 40
    # A file without a dense run compares nothing with dense in its table.
    table = results_tables.convergence_table(doc).splitlines()[2:]
    has_dense = {r["model"] for r in rows if r["method"] == "dense"}
    for r, line in zip(rows, table, strict=True):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert (cells[7:9] == ["-", "-"]) == (r["model"] not in has_dense), line


def test_early_convergence_file():
    doc = _load("convergence_early.json")
    rows = doc["records"]
    _check_convergence_rows(rows)
    assert {"dense", "block_default", "block_source"} <= {r["method"] for r in rows}
    assert len(results_tables.convergence_table(doc).splitlines()) == len(rows) + 2
    _png("convergence_early.png")


def test_wall_clock_file():
    """Wall-clock time to the converged target: every run counted from launch, the
    composition checked against a direct run, speedups per seed against that seed's dense."""
    doc = _load("time_to_accuracy.json")
    assert "converged" in doc["budget"]["target_rule"]
    for t in doc["timings"]:
        parts = t["parts"]
        assert parts["epoch_wall_s"] >= parts["epoch_train_s"] > 0 and parts["one_time_s"] > 0
        assert len(t["record"]["provenance"]["commit"]) == 40
    for row in doc["summary"]:
        runs = [r for r in doc["records"] if (r["model"], r["bandwidth_mbit"], r["method"]) ==
                (row["model"], row["bandwidth_mbit"], row["method"])]
        assert row["reached"] == sum(r["wall_s"] is not None for r in runs)
        for r in runs:
            assert r["wall_s"] is None or r["wall_s"] > r["train_s"] > 0
    assert doc["checks"] and all(0.9 <= c["composed_over_measured"] <= 1.1
                                 for c in doc["checks"])
    assert len(results_tables.wall_clock_table(doc).splitlines()) == len(doc["summary"]) + 2


@pytest.mark.parametrize("name", ["time_to_accuracy_repeats.json",
                                  "time_to_accuracy_resnet20_repeats.json",
                                  "time_to_accuracy_resnet20_30_epochs.json",
                                  "time_to_accuracy_maskwhole_resnet20_repeats.json",
                                  "time_to_accuracy_nomask_resnet20_repeats.json",
                                  "time_to_accuracy_maskwhole_gru_nmt_repeats.json",
                                  "time_to_accuracy_maskwhole_gru_nmt_balanced.json",
                                  "time_to_accuracy_embed_gru_nmt_repeats.json",
                                  "time_to_accuracy_embed_gru_nmt_1gbit_repeats.json",
                                  "time_to_accuracy_embed_gru_nmt_1gbit_balanced.json",
                                  "time_to_accuracy_embed_resnet20_1gbit_balanced.json",
                                  "time_to_accuracy_maskwhole_resnet20_balanced.json",
                                  "local_steps_wall_clock_resnet20_repeats.json",
                                  "time_to_accuracy_recurrent.json"])
def test_repeated_wall_clock_file(name):
    """Timing runs repeated in turns: every composed part is the median of the repeats, and
    each repeat is kept."""
    import statistics

    doc = _load(name)
    repeats = doc["budget"]["setup"]["timing_repeats"]
    assert repeats >= 3
    for t in doc["timings"]:
        parts = t["parts"]
        assert len(t["repeats"]) == len(t["repeat_records"]) == repeats
        for key in ("step_s", "epoch_other_s", "one_time_s"):
            assert parts[key] == pytest.approx(statistics.median(r[key] for r in t["repeats"]),
                                               abs=1e-3), key
        assert parts["repeat_epoch_wall_s"] == [r["epoch_wall_s"] for r in t["repeats"]]
    reached = {(r["model"], r["bandwidth_mbit"], r["method"], r["seed"])
               for r in doc["records"] if r["epochs_to_target"] is not None}
    for row in doc["summary"]:
        if row["method"] != "dense":
            assert row["epoch_wall_ratio_vs_dense_per_round"]["n"] == repeats
        at = (row["model"], row["bandwidth_mbit"])
        both = any((*at, "dense", s) in reached and (*at, row["method"], s) in reached
                   for s in row["seeds"])
        # the wall speedup composed per round of turns, over the seeds both reach
        assert ("wall_speedup_vs_dense_per_round" in row) == both
        if both:
            assert row["wall_speedup_vs_dense_per_round"]["n"] == repeats
    assert len(results_tables.wall_clock_table(doc).splitlines()) == len(doc["summary"]) + 2


def test_backup_file():
    """A block-sparse backup puts (nearly) no bytes on the links: far below its state."""
    doc = _load("backup.json")
    rows = {r["method"]: r for r in doc["rows"]}
    assert {"dense", "block_shared"} <= set(rows)
    for r in rows.values():
        assert len(r["backup_s_per_epoch"]) == doc["budget"]["repeats"]
        assert all(len(run) == doc["budget"]["epochs"] for run in r["backup_s_per_epoch"])
        assert r["backup_s_steady_spread"]["n"] == doc["budget"]["repeats"] * (
            doc["budget"]["epochs"] - 1)
        assert r["link_bytes_per_backup"] < 1_000_000  # vgg_fc's state is ~50 MB
    assert len(results_tables.backup_table(doc).splitlines()) == len(rows) + 2


def test_backup_rows_pool_the_steady_epochs_of_every_repeat():
    """``bench_backup.summarise``: every run's first backup (it builds the writer) is left
    out, the rest pooled; link bytes per backup = (with - without) / epochs per worker."""
    from launch.bench_backup import summarise

    runs = [{"backup_s_per_epoch": [9.0, 1.0, 3.0], "payload_bytes_per_step": 5,
             "flags": {"seed": 0}},
            {"backup_s_per_epoch": [7.0, 2.0, 2.0], "payload_bytes_per_step": 5,
             "flags": {"seed": 0}}]
    row = summarise("dense", runs, [1300, 1600], [1000, 1000], 3)
    assert row["backup_s_steady"] == 2.0
    assert row["backup_s_steady_spread"] == {"mean": 2.0, "std": 0.816, "min": 1.0,
                                             "max": 3.0, "n": 4}
    assert row["link_bytes_per_backup"] == 150
    assert row["backup_s_per_epoch"] == [[9.0, 1.0, 3.0], [7.0, 2.0, 2.0]]


@pytest.mark.parametrize("key", ["projections", "sanity_check", "summary"])
def test_scaling_file(key):
    doc = _load("scaling.json")
    assert doc["schema"].startswith("tf_blocksparse.scaling/")
    assert doc[key]
    for p in doc["projections"]:
        assert 0.0 < p["efficiency_no_overlap"] <= p["efficiency_overlap"] <= 1.0
        assert p["workers"] in doc["workers"] and p["bandwidth_gbit"] in doc["bandwidths_gbit"]


def _readme_tables() -> dict[str, list[str]]:
    """docs/results.md blocks between ``<!-- table: FILE -->`` and ``<!-- /table -->``."""
    readme = os.path.join(os.path.dirname(RESULTS), "..", "docs", "results.md")
    with open(readme) as fh:
        text = fh.read()
    blocks: dict[str, list[str]] = {}
    for part in text.split("<!-- table: ")[1:]:
        name, _, rest = part.partition(" -->")
        assert "<!-- /table -->" in rest, f"docs/results.md: table {name} is not closed"
        blocks.setdefault(name, []).append(rest.split("<!-- /table -->")[0].strip())
    return blocks


def test_readme_tables_equal_the_committed_results():
    blocks = _readme_tables()
    assert set(blocks) == set(results_tables.TABLES), sorted(blocks)
    for name, found in blocks.items():
        expected = results_tables.TABLES[name](_load(results_tables.source_file(name))).strip()
        for block in found:
            assert block == expected, f"docs/results.md table of {name} differs from " \
                f"`python launch/results_tables.py`:\n{block}\n--- expected ---\n{expected}"


def test_demo_file():
    doc = _load("demo.json")
    rows = {(r["link"], r["method"]): r for r in doc["results"]}
    assert {m for link, m in rows if link == "loopback"} == {
        "dense", "block default", "block k=1", "block literal"}
    shaped = [link for link in doc["links"] if link != "loopback"]
    assert shaped, "the committed main job shows a shaped link"
    for link in shaped:  # both trained to the same target; the default got there sooner
        dense, auto = rows[(link, "dense")], rows[(link, "block default")]
        assert min(dense["test_accuracy"], auto["test_accuracy"]) >= doc["target"]
        assert auto["compression_ratio"] > 1 and auto["wall_s"] < dense["wall_s"]
    assert rows[("loopback", "block default")]["compression_ratio"] == 1.0  # dense there
    for r in rows.values():
        assert r["test_examples"] == 10_000 and r["num_workers"] == 2
        assert r["test_accuracy"] == r["test_correct"] / r["test_examples"]
        assert len(r["epoch_wall_s"]) == r["epochs"] and r["flags"]["deterministic"]
    assert doc["deterministic"] and doc["test_samples"] == 0


def test_pipeline_cluster_file():
    doc = _load("pipeline_cluster.json")
    assert len(doc["runs"]) >= 3
    for run in doc["runs"].values():
        assert set(run["plans"]) == {"bandwidth_aware", "pipedream", "oblivious"}
        assert run["workers"] == 4 and len(run["pair_mbit"]) == 4
        for plan in run["plans"].values():
            for key in ("measured_step_s", "predicted_step_s", "throughput_samples_s"):
                assert plan[key] > 0
            assert plan["stages"][0]["layers"][0] == 0
            assert all(0 <= t < 4 for s in plan["stages"] for t in s["worker_tasks"])
            assert len(plan["step_s"]) == run["steps"]


def test_hybrid_cluster_file():
    doc = _load("hybrid_cluster.json")
    assert doc["workers"] == "2+1" and doc["conv_tasks"] == [0, 1]
    assert doc["fc_state_task"] == 2
    assert doc["max_abs_weight_diff"] < 1e-4
    cap = doc["conv_worker_memory_mib"] * 2**20
    # the cap leaves less room beside a conv worker's idle footprint than the FC state needs
    assert all(cap - idle < doc["fc_state_bytes"] for idle in doc["conv_worker_idle_bytes"])


def test_local_steps_file():
    """Local steps against dense and the per-step exchange: every row's figures come from
    its run records (exact evaluation), and the bytes per step are what the runs counted."""
    doc = _load("local_steps.json")
    methods = {r["method"] for r in doc["summary"]}
    assert {"dense", "block_default", "local_dense", "local_block"} <= methods
    runs = doc["runs"]
    for row in doc["summary"]:
        recs = [r for r in runs if (r["model"], r["method"]) == (row["model"], row["method"])]
        assert sorted(r["flags"]["seed"] for r in recs) == sorted(row["seeds"])
        assert row["final_accuracy"]["n"] == len(recs)
        for r in recs:
            assert r["test_accuracy"] == r["test_correct"] / r["test_examples"]
            assert r["provenance"]["commit"]
        assert row["bytes_per_step"]["mean"] == pytest.approx(sum(
            r["payload_bytes_per_step"] for r in recs) / len(recs), abs=0.1)
        if row["method"].startswith("local"):
            assert all(r["flags"]["sync_every"] == 32 for r in recs)
        speed = row["wall_speedup_vs_dense"]
        assert speed is None or speed["n"] >= 1
