"""Tests of the alpha-beta scaling model (``tf_blocksparse.planning.scaling``), the projected
efficiency (``tf_blocksparse.planning.projection``) and of the JSON that
``launch/project_scaling.py`` writes (its body: ``launch/benches/scaling.py``)."""

from __future__ import annotations

import json
import math

import pytest

from tf_blocksparse.planning import scaling
from tf_blocksparse.planning.projection import NetworkModel, exchange_cost, scaling_efficiency
from tf_blocksparse.planning.scaling import (
    allgather_mode_time,
    allgather_time,
    dense_mode_time,
    ring_allreduce_time,
    shared_mode_time,
)

A, B = 1e-5, 1e9  # 10 us per message, 1 GB/s


def test_ring_allreduce_hand_computed():
    # p=4, 1 MB: 2*3*10us + 2*3/4 * 1e6/1e9 = 60 us + 1.5 ms
    assert ring_allreduce_time(1e6, 4, A, B) == pytest.approx(60e-6 + 1.5e-3)
    # p=2, 8 bytes, no latency: 2*1/2 * 8 / 4 = 2 s
    assert ring_allreduce_time(8, 2, 0.0, 4.0) == pytest.approx(2.0)
    assert ring_allreduce_time(1e9, 1, A, B) == 0.0  # one worker: nothing to exchange
    # The bandwidth term approaches 2 n / B from below.
    assert ring_allreduce_time(1e6, 10**6, 0.0, B) < 2e-3


def test_allgather_hand_computed_and_linear_in_workers():
    # p=4, 1 MB each: 3*10us + 3 * 1 ms
    assert allgather_time(1e6, 4, A, B) == pytest.approx(30e-6 + 3e-3)
    assert allgather_time(1e6, 1, A, B) == 0.0
    t = [allgather_time(1e6, p, A, B) for p in (2, 3, 5)]
    assert t[1] - t[0] == pytest.approx(t[0]) and t[2] == pytest.approx(4 * t[0])


def test_shared_mode_is_two_allreduces():
    # scores 400 KB, values 1 MB, p=8: 2 * (2*7*10us) + 2*7/8 * 1.4e6 / 1e9
    expect = 2 * 14 * A + 2 * 7 / 8 * 1.4e6 / B
    assert shared_mode_time(4e5, 1e6, 8, A, B) == pytest.approx(expect)
    assert shared_mode_time(4e5, 1e6, 8, A, B) == pytest.approx(
        ring_allreduce_time(4e5, 8, A, B) + ring_allreduce_time(1e6, 8, A, B))


def test_fused_and_per_tensor_count_latency_per_collective():
    sizes = [1e5, 2e5, 3e5]
    p = 4
    fused = dense_mode_time(sizes, p, A, B)
    per_tensor = dense_mode_time(sizes, p, A, B, fused=False)
    assert fused == pytest.approx(2 * 3 * A + 2 * 3 / 4 * 6e5 / B)
    assert per_tensor - fused == pytest.approx(2 * (2 * 3 * A))  # two more collectives
    assert dense_mode_time(6e5, p, A, B) == pytest.approx(fused)  # a total is one buffer
    # Shared per tensor: 2 collectives per variable; allgather likewise.
    assert shared_mode_time([1, 1], [2, 2], p, A, B, fused=False) == pytest.approx(
        4 * 2 * 3 * A + 2 * 3 / 4 * 6 / B)
    assert allgather_mode_time([4, 4], [8, 8], p, A, B, fused=False) == pytest.approx(
        4 * 3 * A + 3 * 24 / B)
    assert allgather_mode_time([4, 4], [8, 8], p, A, B) == pytest.approx(2 * 3 * A + 3 * 24 / B)
    assert dense_mode_time([], p, A, B) == 0.0


def test_scaling_efficiency_hand_computed():
    assert scaling_efficiency(1.0, 0.5) == pytest.approx(1 / 1.5)
    assert scaling_efficiency(1.0, 0.5, overlap=0.4) == pytest.approx(1 / 1.1)
    assert scaling_efficiency(1.0, 0.5, overlap=0.6) == 1.0  # fully hidden
    assert scaling_efficiency(1.0, 0.5, overlap=0.6, extra_s=0.25) == pytest.approx(0.8)
    assert scaling_efficiency(2.0, 0.0) == 1.0


def test_exchange_cost_and_network():
    net = NetworkModel(8.0, alpha_s=A)  # 8 Gbit/s = 1 GB/s
    assert net.bandwidth_bytes_per_s == pytest.approx(1e9)
    c = exchange_cost("shared", 8, net, 0.1, score_bytes=4e5, value_bytes=1e6,
                      select_s=0.01, overlap=0.5)
    comm = shared_mode_time(4e5, 1e6, 8, A, 1e9)
    assert c.comm_s == pytest.approx(comm) and c.extra_s == 0.01
    assert c.efficiency == pytest.approx(0.1 / (0.1 + 0.01 + comm))
    assert c.efficiency_overlap == pytest.approx(0.1 / (0.1 + 0.01 + max(0, comm - 0.05)))
    d = exchange_cost("dense", 8, net, 0.1, dense_bytes=[1e6, 1e6], select_s=5.0)
    assert d.extra_s == 0.0 and d.comm_s == pytest.approx(ring_allreduce_time(2e6, 8, A, 1e9))
    g = exchange_cost("allgather", 8, net, 0.1, id_bytes=8, value_bytes=[1e3, 1e3])
    assert g.comm_s == pytest.approx(allgather_mode_time(8, 2e3, 8, A, 1e9))


@pytest.mark.parametrize(("call", "name"), [
    (lambda: ring_allreduce_time(-1, 2, A, B), "nbytes"),
    (lambda: ring_allreduce_time(1, 0, A, B), "workers"),
    (lambda: ring_allreduce_time(1, 2.5, A, B), "workers"),
    (lambda: ring_allreduce_time(1, 2, -A, B), "alpha_s"),
    (lambda: ring_allreduce_time(1, 2, A, 0), "bandwidth_bytes_per_s"),
    (lambda: allgather_time(math.nan, 2, A, B), "nbytes_per_worker"),
    (lambda: shared_mode_time([1, -1], 1, 2, A, B), r"score_bytes\[1\]"),
    (lambda: allgather_mode_time("x", 1, 2, A, B), "id_bytes"),
    (lambda: scaling_efficiency(0.0, 1.0), "compute_s"),
    (lambda: scaling_efficiency(1.0, -1.0), "comm_s"),
    (lambda: scaling_efficiency(1.0, 1.0, overlap=1.5), "overlap"),
    (lambda: scaling_efficiency(1.0, 1.0, extra_s=-1), "extra_s"),
    (lambda: NetworkModel(0.0), "bandwidth_gbit"),
    (lambda: exchange_cost("ring", 2, NetworkModel(1.0), 1.0), "mode"),
])
def test_bad_input_names_the_argument(call, name):
    with pytest.raises(ValueError, match=name):
        call()


def test_module_is_pure_python():
    import ast
    import inspect
    tree = ast.parse(inspect.getsource(scaling))
    imported = {n.name.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, ast.Import) for n in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert not imported & {"tensorflow", "keras", "numpy"}, imported


_NUM = (int, float)


def _check_schema(r: dict, workers: list[int], bandwidths: list[float],
                  sanity: bool = True) -> None:
    assert r["schema"] == "tf_blocksparse.scaling/1"
    assert isinstance(r["created"], str) and isinstance(r["seconds"], _NUM)
    assert {"platform", "cpus", "tensorflow", "device"} <= set(r["machine"])
    a = r["assumptions"]
    assert {"cost_model", "alpha_s", "overlap", "gpu_compute_s", "gpu_compute_source",
            "gpu_select", "gradient_dtype"} <= set(a)
    assert r["workers"] == workers and r["bandwidths_gbit"] == bandwidths
    for m in r["models"].values():
        assert {"parameters", "variables", "image_size", "dense_bytes", "tensor_bytes",
                "cpu_batch", "cpu_compute_s", "selections", "measure_seconds"} <= set(m)
        assert len(m["tensor_bytes"]) == m["variables"]
        assert sum(m["tensor_bytes"]) == m["dense_bytes"] == 4 * m["parameters"]
        assert m["cpu_compute_s"] > 0
        assert set(m["selections"]) == {"k=1", "density=0.01"}
        for s in m["selections"].values():
            for key in ("id_bytes", "value_bytes", "score_bytes"):
                assert len(s[key]) == m["variables"] and all(isinstance(x, int) for x in s[key])
            assert s["allgather_bytes_per_worker"] == sum(s["id_bytes"]) + 4 + sum(
                s["value_bytes"])
            assert s["shared_bytes_per_worker"] == sum(s["score_bytes"]) + sum(s["value_bytes"])
            assert sum(s["score_bytes"]) == 4 * s["blocks_total"]
            assert sum(s["id_bytes"]) == 4 * s["blocks_kept"]
            assert s["compression_ratio_allgather"] > 1 and s["compression_ratio_shared"] > 1
            for key in ("select_s_cpu", "accumulate_pass_s_cpu", "select_s_gpu"):
                assert s[key] > 0
    modes = {"dense", "dense_per_tensor", "allgather", "shared"}
    rows = r["projections"]
    n_models = len(r["models"])
    computes = {"cpu_measured", "gpu_assumed"}
    assert len(rows) == n_models * len(computes) * len(workers) * len(bandwidths) * 6
    for row in rows:
        assert set(row) == {"model", "compute", "mode", "selection", "workers",
                            "bandwidth_gbit", "compute_s", "comm_s", "select_s",
                            "efficiency_no_overlap", "efficiency_overlap"}
        assert row["mode"] in modes and row["compute"] in computes
        assert (row["selection"] is None) == row["mode"].startswith("dense")
        assert 0 < row["efficiency_no_overlap"] <= row["efficiency_overlap"] <= 1
    if not sanity:
        assert r["sanity_check"] is None
    else:
        _check_sanity(r["sanity_check"])
    assert set(r["summary"]) == set(r["models"])


def _check_sanity(s: dict) -> None:
    assert s["workers"] == 512 and s["bandwidth_gbit"] == 25.0
    assert {e["model"] for e in s["entries"]} == {"resnet101", "vgg16"}
    for e in s["entries"]:
        assert {"dense_bytes", "compute_s", "comm_s", "horovod_efficiency",
                "projected_no_overlap", "projected_overlap", "within_band"} <= set(e)


def _project(tmp_path, with_sanity_check: bool) -> dict:
    scaling_body = pytest.importorskip("launch.benches.scaling")
    out = tmp_path / "results" / "scaling.json"
    result = scaling_body.run(models=["resnet50"], workers=[8, 1024],
                              bandwidths_gbit=[1.0, 25.0], image_size=32, cpu_batch=1,
                              repeats=1, with_sanity_check=with_sanity_check, out=str(out))
    on_disk = json.loads(out.read_text())
    assert on_disk == json.loads(json.dumps(result))
    return on_disk


@pytest.mark.slow
def test_project_scaling_sanity_check_builds_the_reference_models(tmp_path):
    """The whole script as ``make bench-full`` runs it: ResNet-101 and VGG-16 built at 224
    (a few minutes on 2 cores) for the dense check against Horovod's figures."""
    _check_schema(_project(tmp_path, True), [8, 1024], [1.0, 25.0])


def test_sanity_check_projects_horovods_models_from_their_sizes():
    report = pytest.importorskip("launch.scaling_report")
    sizes = {"resnet101": 4 * 44_707_176, "vgg16": 4 * 138_357_544}  # their parameters
    s = report.sanity_check(sizes, 50e-6, 0.5, report.GPU_COMPUTE_S)
    _check_sanity(s)
    vgg = next(e for e in s["entries"] if e["model"] == "vgg16")
    resnet = next(e for e in s["entries"] if e["model"] == "resnet101")
    assert vgg["comm_s"] > 2 * resnet["comm_s"]  # 3.1x the bytes on the same ring
    assert report.sanity_check({}, 50e-6, 0.5, report.GPU_COMPUTE_S)["entries"] == []


@pytest.mark.slow
def test_project_scaling_writes_the_schema(tmp_path):
    """The script's file on ResNet-50 at 32x32 (about 30 s: building and timing the model).
    Slow: the projection's arithmetic is checked by the tests above and below on the same
    functions, without building a model."""
    on_disk = _project(tmp_path, False)
    _check_schema(on_disk, [8, 1024], [1.0, 25.0], sanity=False)
    # The dense ring all-reduce is flat in p while allgather's payload grows with it.
    rows = {(x["compute"], x["mode"], x["selection"], x["workers"], x["bandwidth_gbit"]): x
            for x in on_disk["projections"]}
    ag8 = rows[("gpu_assumed", "allgather", "density=0.01", 8, 1.0)]["comm_s"]
    ag1024 = rows[("gpu_assumed", "allgather", "density=0.01", 1024, 1.0)]["comm_s"]
    assert ag1024 > 100 * ag8
    table = (tmp_path / "results" / "scaling.md").read_text()
    assert "| shared k=1 |" in table and "resnet50, 25 Gbit/s" in table


def test_project_scaling_rejects_bad_input():
    scaling_body = pytest.importorskip("launch.benches.scaling")
    with pytest.raises(ValueError, match="models"):
        scaling_body.run(models=["alexnet"], out=None)
    with pytest.raises(ValueError, match="workers"):
        scaling_body.run(models=["resnet50"], workers=[0], out=None)
    with pytest.raises(ValueError, match="bandwidths_gbit"):
        scaling_body.run(models=["resnet50"], bandwidths_gbit=[0.0], out=None)


def test_the_projection_prices_the_modes_with_the_one_cost_model():
    """The scaling projection and the automatic exchange share one cost model: a
    network's ring collectives are a ``LinkCost``, each mode's collectives ``mode_seconds``."""
    from tf_blocksparse.planning.exchange_cost import CANDIDATES
    from tf_blocksparse.planning.link_cost import EXCHANGES, GroupCost, LinkCost, mode_seconds

    net = NetworkModel(8.0, alpha_s=A)
    link = net.link(4)
    assert link == LinkCost.ring(4, A, 1e9)
    assert link.sum_seconds(1e6) == pytest.approx(ring_allreduce_time(1e6, 4, A, 1e9))
    assert link.gather_seconds(1e6) == pytest.approx(allgather_time(1e6, 4, A, 1e9))
    group = GroupCost(dense_bytes=4e6, id_bytes=4004, value_bytes=4e4, score_bytes=4e4)
    for mode, sizes in (("dense", {"dense_bytes": 4e6}),
                        ("allgather", {"id_bytes": 4004, "value_bytes": 4e4}),
                        ("shared", {"score_bytes": 4e4, "value_bytes": 4e4})):
        assert exchange_cost(mode, 4, net, 0.1, **sizes).comm_s == pytest.approx(
            mode_seconds(link, group, mode))
    assert scaling.MODES is CANDIDATES and sorted(CANDIDATES) == sorted(EXCHANGES)
    with pytest.raises(ValueError, match="workers"):
        net.link(0)
