"""The memory-aware placement planner of hybrid conv/FC training, on hand-made budgets."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from tf_blocksparse.hybrid import (
    LayerMemory,
    MemoryBudget,
    PlacementPlan,
    evaluate_placement,
    plan_placement,
)

ROOT = Path(__file__).resolve().parents[1]


def _layers() -> list[LayerMemory]:
    # resident bytes (2 * param + state): c1 300, c2 600, fc1 30000, fc2 3000
    return [LayerMemory("c1", 100, 100, 1000, compute_s=0.3),
            LayerMemory("c2", 200, 200, 500, compute_s=0.6),
            LayerMemory("fc1", 10_000, 10_000, 50, compute_s=0.2, is_fc=True),
            LayerMemory("fc2", 1_000, 1_000, 10, compute_s=0.1, is_fc=True)]


def _plan(device: float, expanded: float = math.inf, **kwargs) -> PlacementPlan:
    return plan_placement(_layers(), device, expanded, host_bandwidth=10.0,
                          link_bandwidth=100.0, **kwargs)


def test_everything_fits_on_the_device() -> None:
    plan = _plan(math.inf)
    assert plan.expanded_layers == ()
    # conv: resident 900 + activations 1500; fc: resident 33000 + its 60 + received 500
    assert plan.group_bytes["conv"]["device"] == 2400
    assert plan.group_bytes["fc"] == {"device": 33560, "expanded": 0, "activations": 560,
                                      "staging": 0}
    assert plan.fits


@pytest.mark.parametrize("device,expected,fc_device", [
    (40_000, (), 33560),
    (25_000, ("fc1",), 3000 + 560 + 20_000),      # largest FC layer first
    (21_000, ("fc1", "fc2"), 560 + 20_000),       # then the next one
])
def test_fc_group_goes_first_largest_first(device: int, expected: tuple, fc_device: int) -> None:
    plan = _plan(device)
    assert plan.expanded_layers == expected
    assert plan.group_bytes["fc"]["device"] == fc_device
    assert plan.group_bytes["fc"]["expanded"] == sum(
        x.resident_bytes for x in _layers() if x.name in expected)
    assert plan.placement_of("c1") == "device" and plan.fits


def test_nothing_fits_names_the_device_budget() -> None:
    # even with both FC layers offloaded the FC device holds 560 activations + 20000 staging
    with pytest.raises(ValueError, match="device_budget_bytes=20000"):
        _plan(20_000)


def test_expanded_budget_too_small_is_named() -> None:
    with pytest.raises(ValueError, match="expanded_budget_bytes=20000") as err:
        _plan(25_000, 20_000)  # fc1's 30000 resident bytes do not fit in expanded memory
    assert "fc1" in str(err.value) and "device_budget_bytes=25000" in str(err.value)


def test_conv_group_offload_after_fc() -> None:
    layers = [LayerMemory("c1", 1000, 1000, 100), LayerMemory("c2", 100, 100, 100),
              LayerMemory("fc1", 50, 50, 10, is_fc=True)]
    # conv on device: 3000 + 300 + 200 = 3500 > 3000; c1 offloaded: 300 + 200 + 2000 = 2500
    plan = plan_placement(layers, 3000, math.inf, 10.0, 100.0)
    assert plan.expanded_layers == ("c1",)
    assert plan.group_bytes["conv"]["device"] == 2500
    with pytest.raises(ValueError, match="allow_conv_offload"):
        plan_placement(layers, 3000, math.inf, 10.0, 100.0, allow_conv_offload=False)


def test_offload_fc_group_flag() -> None:
    plan = _plan(math.inf, offload_fc_group=True)
    assert plan.expanded_layers == ("fc1", "fc2")
    with pytest.raises(ValueError, match="expanded_budget_bytes"):
        _plan(math.inf, 1000, offload_fc_group=True)


def test_cost_model_terms() -> None:
    budget = MemoryBudget(math.inf, math.inf, 10.0, 100.0)
    plan = evaluate_placement(_layers(), ["fc1"], budget, conv_replicas=2, fc_replicas=1,
                              forward_fraction=0.25)
    b = plan.breakdown
    conv_compute = (0.3 + 0.6) / 2
    assert b["conv_forward"] == pytest.approx(0.25 * conv_compute)
    assert b["conv_backward"] == pytest.approx(0.75 * conv_compute)
    assert b["activations_to_fc"] == pytest.approx(500 / 1 / 100.0)
    assert b["gradients_to_conv"] == b["activations_to_fc"]
    assert b["fc_compute"] == pytest.approx(0.3)
    assert b["fc_host_stream"] == pytest.approx(2 * 10_000 / 10.0)
    assert b["fc_host_update"] == pytest.approx((3 * 10_000 + 2 * 10_000) / 10.0)
    assert b["fc_allreduce"] == 0.0  # one FC replica
    ring_first = 2 * (2 - 1) / 2 * 100 / 100.0
    ring_rest = 2 * (2 - 1) / 2 * 200 / 100.0
    assert b["conv_allreduce_exposed"] == pytest.approx(
        ring_first + max(0.0, ring_rest - 0.75 * conv_compute))
    assert plan.step_time_s == pytest.approx(sum(b.values()))
    on_device = evaluate_placement(_layers(), [], budget, 2, 1, 0.25)
    assert on_device.step_time_s < plan.step_time_s  # host streaming costs time


def test_json_round_trip() -> None:
    plan = _plan(25_000, 1e6, conv_replicas=2, fc_replicas=1)
    again = PlacementPlan.from_json(plan.to_json())
    assert again == plan
    assert again.to_dict() == plan.to_dict()
    unlimited = _plan(math.inf)
    assert PlacementPlan.from_json(unlimited.to_json()).budget.device_bytes == math.inf
    assert '"device_bytes": null' in unlimited.to_json()


@pytest.mark.parametrize("kwargs,match", [
    ({"layers": []}, "layers"),
    ({"layers": [LayerMemory("a", 1, 1, 1), LayerMemory("a", 1, 1, 1)]}, "repeat"),
    ({"layers": [LayerMemory("a", 1, 1, 1, is_fc=True), LayerMemory("b", 1, 1, 1)]}, "suffix"),
    ({"device_budget_bytes": -1}, "device_budget_bytes"),
    ({"expanded_budget_bytes": float("nan")}, "expanded_budget_bytes"),
    ({"host_bandwidth": 0}, "host_bandwidth"),
    ({"link_bandwidth": "fast"}, "link_bandwidth"),
    ({"conv_replicas": 0}, "conv_replicas"),
    ({"fc_replicas": 1.5}, "fc_replicas"),
    ({"forward_fraction": 2.0}, "forward_fraction"),
])
def test_bad_arguments(kwargs: dict, match: str) -> None:
    args = {"layers": _layers(), "device_budget_bytes": 1e9, "expanded_budget_bytes": 1e9,
            "host_bandwidth": 1.0, "link_bandwidth": 1.0, **kwargs}
    with pytest.raises(ValueError, match=match):
        plan_placement(**args)


def test_bad_layer_memory() -> None:
    with pytest.raises(ValueError, match="param_bytes"):
        LayerMemory("x", -1, 0, 0)
    with pytest.raises(ValueError, match="is_fc"):
        LayerMemory("x", 1, 0, 0, is_fc=1)
    with pytest.raises(ValueError, match="expanded"):
        evaluate_placement(_layers(), ["nope"], MemoryBudget(1, 1, 1, 1))


def test_planner_imports_no_tensorflow() -> None:
    # load the hybrid package's planner alone: stub the parent package (its __init__ imports
    # every planner, with NumPy); the placement modules use the standard library only
    code = ("import sys, types\n"
            "pkg = types.ModuleType('tf_blocksparse'); pkg.__path__ = ['tf_blocksparse']\n"
            "sys.modules['tf_blocksparse'] = pkg\n"
            "import tf_blocksparse.hybrid as P\n"
            "assert P.plan_placement and P.evaluate_placement and P.PlacementPlan\n"
            "print(any(k.split('.')[0] in ('tensorflow', 'keras', 'numpy') for k in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
