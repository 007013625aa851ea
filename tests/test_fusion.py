"""Balanced tensor fusion: offline planners, online scheduler, cycle simulator."""

import ast
import itertools
import pathlib
import random
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tf_blocksparse.planning import (
    FusionGroup,
    FusionPlan,
    FusionScheduler,
    TensorSpec,
    compare_plans,
    execution_order,
    plan_balanced,
    plan_ddp,
    plan_horovod_greedy,
    plan_tf_group_by_size,
    simulate,
    simulate_greedy_cycles,
)

FUSION = pathlib.Path(__file__).resolve().parents[1] / "tf_blocksparse" / "fusion"
#: The fusion runtime (TensorFlow): not part of the planner.
RUNTIME = ("forward_order",)
FAST = settings(max_examples=50, deadline=None)


def specs(sizes, dtypes=None):
    dtypes = dtypes or ["float32"] * len(sizes)
    return [TensorSpec(f"t{i}", s, d) for i, (s, d) in enumerate(zip(sizes, dtypes))]


@st.composite
def problems(draw, max_n=12, mixed=False, min_size=0):
    n = draw(st.integers(0, max_n))
    sizes = draw(st.lists(st.integers(min_size, 30), min_size=n, max_size=n))
    dts = st.sampled_from(["float32", "float16"]) if mixed else st.just("float32")
    dtypes = draw(st.lists(dts, min_size=n, max_size=n))
    return specs(sizes, dtypes), draw(st.integers(1, max(1, sum(sizes))))


def all_plans(tensors, buf):
    return [plan_balanced(tensors, buf), plan_tf_group_by_size(tensors, buf),
            plan_ddp(tensors, buf, max(1, buf // 4)), plan_horovod_greedy(tensors, buf)]


@FAST
@given(problems(mixed=True))
def test_plan_invariants_every_method(problem):
    tensors, buf = problem
    rev = execution_order(len(tensors))
    single_dtype = len({t.dtype for t in tensors}) <= 1
    for plan in all_plans(tensors, buf):
        bounded = plan.method in ("balanced", "horovod_greedy")
        plan.validate(check_size_bound=bounded)  # each tensor once, contiguous, one dtype
        pos = {i: p for p, i in enumerate(rev)}
        for g in plan.groups:  # ready order kept inside every group
            assert [pos[i] for i in g.members] == sorted(pos[i] for i in g.members)
        if plan.method != "ddp" or single_dtype:
            assert plan.order == rev
        if plan.method == "horovod_greedy":
            for g in plan.groups:  # oversized tensors alone, others within the buffer
                assert g.nbytes <= buf or len(g.members) == 1
        if plan.method == "balanced":
            for g in plan.groups:  # above the buffer: one oversized tensor last, extras <= buffer
                big = [i for i in g.members if tensors[i].nbytes >= buf]
                assert g.nbytes <= buf or big == [g.members[-1]]
                assert g.nbytes - sum(tensors[i].nbytes for i in big) <= buf
    # the fewest-groups objective uses as few groups as greedy filling
    fewest = plan_balanced(tensors, buf, balance=None)
    fewest.validate()
    assert len(fewest.groups) == len(plan_horovod_greedy(tensors, buf).groups)


@FAST
@given(problems())
def test_tf_and_ddp_follow_their_closing_rules(problem):
    tensors, buf = problem
    tf_plan = plan_tf_group_by_size(tensors, buf)
    for g in tf_plan.groups[:-1]:  # a pack closes right after it exceeds bytes_per_pack
        assert g.nbytes > buf >= g.nbytes - tensors[g.members[-1]].nbytes
    cap = max(1, buf // 4)
    ddp = plan_ddp(tensors, buf, cap)
    for k, g in enumerate(ddp.groups[:-1]):  # a bucket closes once it reaches its cap
        limit = cap if k == 0 else buf
        assert g.nbytes >= limit > g.nbytes - tensors[g.members[-1]].nbytes


def brute_force(sizes, dtypes, buf):
    """(groups, largest, -smallest) minimised over every valid contiguous partition."""
    n, best = len(sizes), None
    for cuts in itertools.product([False, True], repeat=max(n - 1, 0)):
        runs, start = [], 0
        for k, cut in enumerate(cuts, 1):
            if cut:
                runs.append(range(start, k))
                start = k
        runs.append(range(start, n))
        sums = [sum(sizes[j] for j in r) for r in runs]
        if all((s <= buf or len(r) == 1) and len({dtypes[j] for j in r}) == 1
               for r, s in zip(runs, sums)):
            key = (len(runs), max(sums), -min(sums))
            best = key if best is None else min(best, key)
    return best


@settings(max_examples=100, deadline=None)
@given(problems(max_n=10, mixed=True), st.randoms(use_true_random=False))
def test_balanced_is_exact_optimum(problem, rnd):
    tensors, buf = problem
    order = list(range(len(tensors)))
    rnd.shuffle(order)
    plan = plan_balanced(tensors, buf, order, balance=None)
    assert plan.order == tuple(order)
    if not tensors:
        assert plan.groups == ()
        return
    sizes = [tensors[i].nbytes for i in order]
    dtypes = [tensors[i].dtype for i in order]
    assert (len(plan.groups), plan.largest, -plan.smallest) == brute_force(sizes, dtypes, buf)


def test_balanced_matches_brute_force_on_random_sweep():
    rnd = random.Random(1234)
    for trial in range(1500):
        n = rnd.randint(1, 9)
        sizes = [rnd.randint(0, 30) for _ in range(n)]
        dtypes = [rnd.choice("ab") if trial % 3 == 0 else "a" for _ in range(n)]
        buf = rnd.randint(1, max(1, sum(sizes)))
        plan = plan_balanced(specs(sizes, dtypes), buf, balance=None)
        got = (len(plan.groups), plan.largest, -plan.smallest)
        assert got == brute_force(sizes[::-1], dtypes[::-1], buf), (sizes, dtypes, buf)


def test_fewest_groups_hand_example():
    plan = plan_balanced(specs([5, 3, 8, 2, 9, 1, 4, 4]), 10, balance=None)
    assert (len(plan.groups), plan.largest, plan.smallest) == (4, 10, 8)
    tensors = specs([2, 3, 3, 3, 3])  # ready order: 3, 3, 3, 3, 2
    assert [g.nbytes for g in plan_horovod_greedy(tensors, 9).groups] == [9, 5]
    plan = plan_balanced(tensors, 9, balance=None)
    assert [g.members for g in plan.groups] == [(4, 3), (2, 1, 0)]
    assert [g.nbytes for g in plan.groups] == [6, 8]
    assert plan_balanced(specs([50, 1, 2]), 10, balance=None).groups[-1] == FusionGroup((0,), 50)


def test_balanced_hand_example():
    # ready order: 4, 4, 1, 9, 2, 8, 3, 5 (buffer 10): four groups within 1.25 (8..10)
    plan = plan_balanced(specs([5, 3, 8, 2, 9, 1, 4, 4]), 10)
    assert len(plan.groups) == 4 and plan.imbalance <= 1.25
    # a small tensor ready just before an oversized one rides along with it
    plan = plan_balanced(specs([6, 50, 1, 6, 6]), 10)  # ready: 6, 6, 1, 50, 6: 6 | 6 1 50 | 6
    assert [g.members for g in plan.groups] == [(4,), (3, 2, 1), (0,)]
    assert plan.imbalance_excluding_oversized == 1.0
    fewest = plan_balanced(specs([6, 50, 1, 50, 6]), 10, balance=None)  # 6 | 50 | 1 | 50 | 6
    assert fewest.imbalance_excluding_oversized == 6.0
    assert plan_balanced(specs([6, 50, 1, 50, 6]), 10).imbalance_excluding_oversized == 1.0
    # more groups when the fewest would be uneven: 12 | 4 (3.0) -> 8 | 8 (1.0)
    plan = plan_balanced(specs([4, 4, 4, 4]), 12)
    assert [g.nbytes for g in plan.groups] == [8, 8]


def balanced_brute_force(sizes, dtypes, buf, balance):
    """(max(imbalance, balance), groups) minimised over every valid partition (ride-along)."""
    n, best = len(sizes), None
    for cuts in itertools.product([False, True], repeat=max(n - 1, 0)):
        runs, start = [], 0
        for k, cut in enumerate(cuts, 1):
            if cut:
                runs.append(list(range(start, k)))
                start = k
        runs.append(list(range(start, n)))
        ok, normal = True, []
        for r in runs:
            big = [j for j in r if sizes[j] >= buf]
            extra = sum(sizes[j] for j in r) - sum(sizes[j] for j in big)
            total = sum(sizes[j] for j in r)
            ok &= len({dtypes[j] for j in r}) == 1 and (
                total <= buf or (big == [r[-1]] and extra <= buf))
            if not big:
                normal.append(sum(sizes[j] for j in r))
        if not ok:
            continue
        if not normal or max(normal) == 0:
            ratio = 1.0
        else:
            ratio = max(normal) / min(normal) if min(normal) else float("inf")
        key = (max(ratio, balance), len(runs))
        best = key if best is None else min(best, key)
    return best


@settings(max_examples=150, deadline=None)
@given(problems(max_n=9, mixed=True, min_size=1), st.sampled_from([1.0, 1.25, 2.0]))
def test_balanced_objective_is_exact_optimum(problem, balance):
    # (0-byte gradients, which no real variable has, are covered by the invariants test only)
    tensors, buf = problem
    plan = plan_balanced(tensors, buf, balance=balance)
    plan.validate()
    if not tensors:
        return
    order = execution_order(len(tensors))
    want = balanced_brute_force([tensors[i].nbytes for i in order],
                                [tensors[i].dtype for i in order], buf, balance)
    got = (max(plan.imbalance_excluding_oversized, balance), len(plan.groups))
    if want[0] == float("inf"):
        assert got[0] == float("inf")
    else:
        assert got[0] == pytest.approx(want[0], rel=1e-9) and got[1] == want[1], (tensors, buf)


MiB = 2**20
# ResNet-50 float32 gradient sizes (bytes) in forward order: stem, one block per stage plus its
# projection shortcut, BN scale/offset vectors, and the classifier.
RESNET50 = [4 * n for n in (
    9408, 64, 64,                                    # conv1 7x7x3x64, bn1
    4096, 64, 36864, 64, 16384, 256, 16384, 256,     # stage 1 (64 -> 256), shortcut
    4096, 36864, 16384,                              # stage 1, 2nd block
    32768, 128, 147456, 128, 65536, 512, 131072,     # stage 2 (128 -> 512), shortcut
    65536, 147456, 65536,                            # stage 2, 2nd block
    131072, 256, 589824, 256, 262144, 1024, 524288,  # stage 3 (256 -> 1024), shortcut
    262144, 589824, 262144,                          # stage 3, 2nd block
    524288, 2359296, 1048576, 2048, 2097152,         # stage 4 (512 -> 2048), shortcut
    2048000, 1000,                                   # fc
)]


@pytest.mark.parametrize("buf", [4 * MiB, 8 * MiB, 16 * MiB, 25 * MiB])
def test_balanced_beats_greedy_on_resnet50(buf):
    tensors = specs(RESNET50)
    rows = {r["method"]: r for r in compare_plans(tensors, buf)}
    bal, greedy = rows["balanced"], rows["horovod_greedy"]
    assert bal["imbalance_excluding_oversized"] <= greedy["imbalance_excluding_oversized"]
    fewest = plan_balanced(tensors, buf, balance=None)
    assert len(fewest.groups) == greedy["groups"]
    assert fewest.largest <= greedy["largest_bytes"] and fewest.imbalance <= greedy["imbalance"]
    assert set(rows) == {"balanced", "tf_group_by_size", "ddp", "horovod_greedy"}


def test_balanced_strictly_more_even_on_resnet50():
    tensors = specs(RESNET50)
    bal, greedy = plan_balanced(tensors, 8 * MiB), plan_horovod_greedy(tensors, 8 * MiB)
    assert bal.imbalance < greedy.imbalance


@FAST
@given(problems(mixed=True), st.text(max_size=5))
def test_json_round_trip(problem, name):
    tensors, buf = problem
    tensors = [TensorSpec(name + t.name, t.nbytes, t.dtype) for t in tensors]
    for plan in all_plans(tensors, buf):
        assert FusionPlan.from_json(plan.to_json()) == plan


def test_execution_order():
    assert execution_order(4) == (3, 2, 1, 0)
    assert execution_order(3, [2, 0, 1]) == (1, 0, 2)
    with pytest.raises(ValueError):
        execution_order(3, [0, 0, 1])
    with pytest.raises(ValueError):
        plan_balanced(specs([1, 2]), 0)


def seed_plan():
    tensors = specs([4, 4, 8, 2, 3, 3])
    groups = tuple(FusionGroup(m, sum(tensors[i].nbytes for i in m))
                   for m in [(0, 1), (2,), (3, 4, 5)])
    plan = FusionPlan("hand", 8, tuple(range(6)), groups, tuple(tensors))
    plan.validate()
    return plan


def test_scheduler_seed_cycles():
    plan = seed_plan()
    sched = FusionScheduler(plan)
    for _ in range(2):  # second pass after reset()
        assert sched.step([1]) == ([], (1,))
        fused, pending = sched.step([0, 2])
        assert [g.members for g in fused] == [(0, 1), (2,)] and pending == ()
        assert sched.step([3, 5]) == ([], (3, 5))
        fused, pending = sched.step([4])
        assert [g.members for g in fused] == [(3, 4, 5)] and pending == () and sched.done
        sched.reset()


def test_scheduler_rejects_unknown_and_duplicate_ids():
    sched = FusionScheduler(seed_plan())
    with pytest.raises(ValueError, match="response_list"):
        sched.step([9])
    with pytest.raises(ValueError, match="response_list"):
        sched.step([1, 1])
    sched.step([1])
    with pytest.raises(ValueError, match="response_list"):
        sched.step([1])
    sched.reset()
    assert sched.step([1]) == ([], (1,))


@FAST
@given(problems(), st.randoms(use_true_random=False))
def test_scheduler_emits_each_group_when_complete(problem, rnd):
    tensors, buf = problem
    plan = plan_balanced(tensors, buf)
    ids = list(range(len(tensors)))
    rnd.shuffle(ids)
    cuts = sorted(rnd.sample(range(len(ids) + 1), min(3, len(ids) + 1)))
    cycles = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)])]
    sched, seen, emitted = FusionScheduler(plan), set(), []
    for cyc in cycles:
        seen.update(cyc)
        fused, pending = sched.step(cyc)
        assert all(set(g.members) <= seen for g in fused)
        emitted += fused
        done = {i for g in emitted for i in g.members}
        assert set(pending) == seen - done
    assert sorted(emitted, key=plan.groups.index) == list(plan.groups) and sched.done


def test_simulate_fewer_more_even_buffers_than_greedy_cycles():
    # backward order 5..0; sizes 4,4,2 | 4,4,2 with a 10-byte buffer; one tensor per cycle
    tensors = specs([2, 4, 4, 2, 4, 4])
    ready = [5.0, 4.0, 3.0, 2.0, 1.0, 0.0]
    plan = plan_balanced(tensors, 10)
    assert [g.nbytes for g in plan.groups] == [10, 10]
    bal = simulate(plan, ready, cycle_s=1.0)
    greedy = simulate_greedy_cycles(tensors, ready, cycle_s=1.0, fusion_bytes=10)
    assert bal["fused_bytes_per_cycle"] == [[], [], [10], [], [], [10]]
    assert greedy["fused_bytes_per_cycle"] == [[4], [4], [2], [4], [4], [2]]
    assert bal["collectives"] == 2 < greedy["collectives"] == 6
    assert bal["imbalance"] == 1.0 < greedy["imbalance"] == 2.0
    assert bal["last_start_s"] == greedy["last_start_s"] == 5.0
    # tensors ready within one cycle: greedy fuses them together, bounded by the threshold
    together = simulate_greedy_cycles(tensors, [0.1] * 6, cycle_s=1.0, fusion_bytes=10)
    assert together["fused_bytes_per_cycle"] == [[], [10, 10]]


def test_simulate_all_ready_at_once_gives_plan_groups():
    tensors = specs(RESNET50)
    plan = plan_balanced(tensors, 8 * MiB)
    sim = simulate(plan, [0.0] * len(tensors), cycle_s=0.001)
    assert sim["buffers"] == [g.nbytes for g in plan.groups]
    assert sim["collectives"] == len(plan.groups) and sim["last_start_s"] == 0.0


def test_fusion_planner_does_not_import_tensorflow():
    # The parent package's __init__ imports the planners of every product; stub it so only
    # fusion/ itself is loaded, then check that importing it loads every planner module of
    # fusion/ (all but its runtime, forward_order) and no TensorFlow or Keras.
    code = (
        "import sys, types\n"
        f"pkg = types.ModuleType('tf_blocksparse'); pkg.__path__ = [{str(FUSION.parent)!r}]\n"
        "sys.modules['tf_blocksparse'] = pkg\n"
        "import tf_blocksparse.fusion\n"
        "names = sorted(m for m in sys.modules if m.startswith('tf_blocksparse.'))\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras')]\n"
        "assert not bad, bad\n"
        "print(' '.join(names))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, timeout=60,
                         capture_output=True, text=True)
    paths = sorted(p for p in FUSION.glob("*.py") if p.stem not in RUNTIME)
    assert out.stdout.split() == sorted(
        "tf_blocksparse.fusion" + ("" if p.stem == "__init__" else f".{p.stem}") for p in paths)
    for path in paths:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                roots = [(node.module or "").split(".")[0]]
                parts = (node.module or "").split(".") if node.level == 0 else \
                    ["tf_blocksparse", "fusion", *(node.module or "").split(".")[:1]]
                if parts[0] == "tf_blocksparse":
                    # within the package, the planner may only import the planner
                    assert parts[1:2] == ["fusion"] and parts[2:3] not in (
                        [r] for r in RUNTIME), (path, node.module)
            else:
                continue
            assert not {"tensorflow", "keras"} & set(roots), (path, roots)


def test_balanced_full_tensor_cases():
    # ready order: 1 B (fills the 1 B buffer), 0 B: one group is valid and fewest
    plan = plan_balanced(specs([0, 1]), 1)
    plan.validate()
    assert len(plan.groups) == 1
    # a tensor exactly the buffer's size carries the small ones ready before it
    plan = plan_balanced(specs([8, 1, 8, 1, 4, 4]), 8)  # ready: 4, 4, 1, 8, 1, 8
    plan.validate()
    assert plan.imbalance_excluding_oversized == 1.0 and len(plan.groups) == 3
    assert all(g.members[-1] in (0, 2) for g in plan.groups if plan.is_oversized(g))


def test_strict_imbalance_leaves_out_only_single_tensors_above_the_buffer():
    # backward order 9, 12, 100, 10, 10 with a 30-byte buffer: the balanced plan lets small
    # tensors ride along with the 100-byte one; the strict measure counts that group.
    plan = plan_balanced(specs([10, 10, 100, 12, 9]), 30)
    ride = [g for g in plan.groups if plan.is_oversized(g)]
    assert len(ride) == 1 and len(ride[0].members) > 1
    normal = [g.nbytes for g in plan.groups if not plan.is_oversized(g)]
    assert plan.imbalance_excluding_oversized == max(normal) / min(normal)
    every = [g.nbytes for g in plan.groups]
    assert plan.imbalance_excluding_single_oversized == max(every) / min(every)
    # a lone tensor above the buffer is left out; one exactly the buffer's size is not
    alone = FusionPlan("x", 30, (0, 1, 2), (FusionGroup((0,), 40), FusionGroup((1,), 30),
                                            FusionGroup((2,), 20)),
                       tuple(specs([40, 30, 20])))
    assert alone.imbalance_excluding_single_oversized == 30 / 20
    assert alone.imbalance_excluding_oversized == 1.0


def test_compare_plans_defaults_and_order():
    tensors = specs(RESNET50)
    order = tuple(random.Random(0).sample(range(len(tensors)), len(tensors)))
    rows = {r["method"]: r for r in compare_plans(tensors, 4 * MiB, order, defaults=True)}
    assert set(rows) == {"balanced", "tf_group_by_size", "ddp", "horovod_greedy",
                         "ddp_default", "horovod_greedy_128mib"}
    assert rows["ddp_default"]["buffer_bytes"] == 25 * MiB
    assert rows["horovod_greedy_128mib"]["buffer_bytes"] == 128 * MiB
    assert rows["ddp_default"]["groups"] == len(plan_ddp(tensors, order=order).groups)
    assert rows["balanced"]["groups"] == len(plan_balanced(tensors, 4 * MiB, order).groups)
    for plan in (plan_ddp(tensors, order=order), plan_horovod_greedy(tensors, order=order),
                 plan_tf_group_by_size(tensors, 4 * MiB, order)):
        assert plan.order == order  # one dtype: groups are contiguous runs of the given order
    assert set(compare_plans(tensors, 4 * MiB)[0]) >= {
        "imbalance_excluding_oversized", "imbalance_excluding_single_oversized"}


def test_plan_backward_takes_a_derived_order():
    from tf_blocksparse.planning import plan_backward

    nbytes, dtypes = [60, 12, 80, 20], ["float32"] * 4
    assert plan_backward(nbytes, dtypes, 100).order == (3, 2, 1, 0)
    assert plan_backward(nbytes, dtypes, 100, order=(1, 0, 3, 2)).order == (1, 0, 3, 2)
    with pytest.raises(ValueError, match="order"):
        plan_backward(nbytes, dtypes, 100, order=(0, 0, 1, 2))
