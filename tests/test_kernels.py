"""The fused CPU kernels (tf_blocksparse.kernels) against NumPy and the pure-TF path.

The library is built first when it is missing (skipped only without a C++ compiler), so a
broken kernel or a broken integration fails here instead of silently falling back.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

from tf_blocksparse import blocks, kernels, selection
from tf_blocksparse.feedback import BlockTopK, ElementTopK
from tf_blocksparse.kernels import build

ROOT = Path(__file__).resolve().parents[1]
NO_COMPILER = shutil.which(os.environ.get("CXX", "g++")) is None
CASES = [  # (shape, rule): filter, unit, row, element, transpose, depthwise, single, odd sizes
    ((3, 3, 5, 7), "output_channel"), ((1, 1, 64, 40), "output_channel"),
    ((33, 1000), "output_channel"), ((3, 3, 7, 5), "transpose_filter"),
    ((3, 3, 4, 3), "depthwise_channel"), ((17, 9), "row"), ((300, 70000), "row"),
    ((13,), "element"), ((5, 7), "element"), ((3, 5), "single"), ((2, 3, 5, 4), "output_unit_2d"),
    ((3, 40000, 3), "transpose_filter"), ((2, 70000), "output_channel"), ((1,), "element"),
]
SETTINGS = settings(max_examples=25, deadline=None)


@pytest.fixture(scope="module", autouse=True)
def library():
    """Builds the library if needed and loads it (a load failure fails the tests)."""
    if kernels.load() is None:
        if NO_COMPILER:
            if os.environ.get("TFBS_REQUIRE_KERNELS") == "1":  # CI: no silent skip
                pytest.fail("TFBS_REQUIRE_KERNELS=1 but there is no C++ compiler (g++)")
            pytest.skip("no C++ compiler (g++) to build the fused kernels")
        build.build()
        kernels.reset()
        assert kernels.load() is not None, "the built library does not load"
    return kernels.load()


def _layout(shape, rule) -> blocks.BlockLayout:
    return blocks.BlockLayout("v", tuple(shape), blocks.RULES[rule])


def _ref_scores(x: np.ndarray, lay: blocks.BlockLayout, metric: str) -> np.ndarray:
    v = x.astype(np.float64).reshape(lay.view_shape)
    if metric == "l1" or lay.block_size == 1:
        return np.abs(v).sum(axis=(0, 2))
    return np.sqrt((v * v).sum(axis=(0, 2)))


def _ref_take(acc: np.ndarray, lay: blocks.BlockLayout, ids: np.ndarray):
    v = acc.reshape(lay.view_shape)
    values = v[:, ids, :].transpose(1, 0, 2).reshape(len(ids), lay.block_size)
    residual = v.copy()
    residual[:, ids, :] = 0
    return values, residual.reshape(lay.shape)


@pytest.mark.parametrize("metric", ["l1", "l2"])
@pytest.mark.parametrize("shape,rule", CASES)
def test_accumulate_score_matches_numpy(shape, rule, metric):
    lay = _layout(shape, rule)
    rng = np.random.default_rng(len(shape) + lay.size)
    g, r = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    acc, scores = kernels.accumulate_score(tf.constant(g), tf.constant(r), lay, metric)
    np.testing.assert_array_equal(acc.numpy(), g + r)  # bit-exact
    assert scores.shape == (lay.num_blocks,) and scores.dtype == tf.float32
    np.testing.assert_allclose(scores.numpy(), _ref_scores(g + r, lay, metric), rtol=2e-5)
    # Scoring alone gives the same bits; the TF path agrees up to summation order.
    np.testing.assert_array_equal(kernels.block_scores(acc, lay, metric).numpy(),
                                  scores.numpy())
    with kernels.tf_path():
        tf_scores = selection.block_scores(tf.constant(g + r), lay, metric).numpy()
    np.testing.assert_allclose(scores.numpy(), tf_scores, rtol=2e-5)


def test_scores_are_deterministic_and_float64_works():
    lay = _layout((3, 3, 256, 300), "output_channel")
    g = tf.constant(np.random.default_rng(1).standard_normal(lay.shape).astype(np.float32))
    first = [kernels.block_scores(g, lay, m).numpy() for m in ("l1", "l2")]
    for _ in range(3):
        for m, want in zip(("l1", "l2"), first):
            np.testing.assert_array_equal(kernels.block_scores(g, lay, m).numpy(), want)
    g64 = tf.cast(g, tf.float64)
    acc, s = kernels.accumulate_score(g64, g64, lay, "l2")
    assert acc.dtype == s.dtype == tf.float64
    np.testing.assert_allclose(s.numpy(), _ref_scores(2 * g.numpy(), lay, "l2"), rtol=1e-9)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("offset", [0, 1, 3])
def test_accumulate_into_a_forwarded_buffer_at_any_alignment(dtype, offset):
    """``acc`` written over a fresh ``grad`` (the buffer forwarded) and into slices that start
    off a 16-byte boundary: the same bits as NumPy either way, scores as the reference."""
    lay = _layout((3, 3, 64, 129), "output_channel")  # > one tile, rows not a lane multiple
    rng = np.random.default_rng(offset)
    base = rng.standard_normal(lay.size + offset).astype(dtype)
    r = rng.standard_normal(lay.shape).astype(dtype)

    @tf.function
    def run(base, r):
        g = tf.reshape(base[offset:] * 2, lay.shape)  # fresh, uniquely owned: forwardable
        return kernels.accumulate_score(g, r, lay, "l1")

    acc, scores = run(tf.constant(base), tf.constant(r))
    want = (base[offset:] * 2).reshape(lay.shape) + r
    np.testing.assert_array_equal(acc.numpy(), want)
    np.testing.assert_allclose(scores.numpy(), _ref_scores(want, lay, "l1"), rtol=2e-5)


def test_one_element_blocks_score_abs_even_where_the_square_overflows():
    lay = _layout((4,), "element")
    x = tf.constant([3e20, -2.0, 0.0, -1e30], tf.float32)
    np.testing.assert_array_equal(kernels.block_scores(x, lay, "l2").numpy(), np.abs(x))


@pytest.mark.parametrize("shape,rule", CASES)
@pytest.mark.parametrize("ids_dtype", [tf.int32, tf.int64])
def test_take_blocks_matches_numpy(shape, rule, ids_dtype):
    lay = _layout(shape, rule)
    acc = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    for ids in ([lay.num_blocks - 1], [0, lay.num_blocks - 1, lay.num_blocks // 2]):
        ids = np.array(ids[: lay.num_blocks] if len(set(ids)) == len(ids) else ids[:1])
        values, residual = kernels.take_blocks(tf.constant(acc), lay, tf.constant(ids, ids_dtype))
        want_values, want_residual = _ref_take(acc, lay, ids)
        np.testing.assert_array_equal(values.numpy(), want_values)
        np.testing.assert_array_equal(residual.numpy(), want_residual)


def test_take_blocks_repeated_ids_and_bad_ids():
    lay = _layout((4, 6), "output_channel")
    acc = tf.constant(np.arange(24, dtype=np.float32).reshape(4, 6))
    values, residual = kernels.take_blocks(acc, lay, tf.constant([2, 2]))
    np.testing.assert_array_equal(values.numpy(), np.tile(acc.numpy()[:, 2], (2, 1)))
    assert not residual.numpy()[:, 2].any() and residual.numpy().sum() == acc.numpy().sum() - 44
    with pytest.raises(tf.errors.InvalidArgumentError, match="not in"):
        kernels.take_blocks(acc, lay, tf.constant([6]))
    with pytest.raises(tf.errors.InvalidArgumentError, match="elements"):
        kernels.accumulate_score(acc, acc, _layout((5, 6), "output_channel"), "l1")


@st.composite
def _problems(draw):
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=0, max_size=4)))
    lay = _layout(shape, draw(st.sampled_from(sorted(blocks.RULES))))
    k = draw(st.integers(1, lay.num_blocks))
    return lay, k, draw(st.integers(0, 2**31 - 1)), draw(st.sampled_from(["l1", "l2"]))


@SETTINGS
@given(_problems())
def test_conservation_is_exact(problem):
    lay, k, seed, metric = problem
    rng = np.random.default_rng(seed)
    g, r = (tf.constant(rng.standard_normal(lay.shape).astype(np.float32)) for _ in range(2))
    acc, scores = kernels.accumulate_score(g, r, lay, metric)
    ids = selection.top_blocks(scores, k)
    values, residual = kernels.take_blocks(acc, lay, ids)
    back = selection.scatter_blocks(values, ids, lay) + residual
    np.testing.assert_array_equal(back.numpy(), (g + r).numpy())
    assert not selection.gather_blocks(residual, lay, ids).numpy().any()


def _compress_fn(comp: BlockTopK):
    """``comp.compress`` as a ``tf.function`` returning ``(ids, values, new_state)``."""
    def run(grads, state):
        payload, new_state = comp.compress(grads, state)
        return payload.ids, payload.values, new_state
    return tf.function(run)


def _model_layouts(max_size: int | None = None) -> list[blocks.BlockLayout]:
    layouts = [_layout(s, r) for s, r in CASES[:11]]
    return [lay for lay in layouts if max_size is None or lay.size <= max_size]


@pytest.mark.parametrize("cls", [BlockTopK, ElementTopK])
@pytest.mark.parametrize("metric", ["l1", "l2"])
@pytest.mark.parametrize("k,density", [(1, None), (3, None), (None, 0.3)])
def test_fused_and_tf_paths_give_the_same_exchange(cls, metric, k, density):
    # element top-k's TF path sorts every element: its comparison leaves out the 21M-element
    # layout (the fused accumulation of that shape is compared by the block-wise cases)
    layouts = _model_layouts(None if cls is BlockTopK else 1 << 20)
    comp = cls(layouts, k=k, density=density, metric=metric)
    rng = np.random.default_rng(3)
    grads = [tf.constant(rng.standard_normal(lay.shape).astype(np.float32)) for lay in layouts]
    state = [tf.constant(rng.standard_normal(lay.shape).astype(np.float32)) for lay in layouts]
    fused = _compress_fn(comp)
    graph = fused.get_concrete_function(grads, state).graph
    assert {"BlockAccumulateScore", "TakeBlocks"} <= {op.type for op in graph.get_operations()}
    ids, values, new_state = fused(grads, state)
    with kernels.tf_path():
        tf_compress = _compress_fn(comp)
        tf_graph = tf_compress.get_concrete_function(grads, state).graph
    assert "TakeBlocks" not in {op.type for op in tf_graph.get_operations()}
    tf_ids, tf_values, tf_state = tf_compress(grads, state)
    for i, ti, v, tv in zip(ids, tf_ids, values, tf_values):  # random data: no near-ties
        order, tf_order = np.argsort(i.numpy()), np.argsort(ti.numpy())
        np.testing.assert_array_equal(i.numpy()[order], ti.numpy()[tf_order])
        np.testing.assert_array_equal(v.numpy()[order], tv.numpy()[tf_order])
    for a, b in zip(new_state, tf_state):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def _both_paths(comp, grads, state):
    """``(ids, values, new_state)`` of the fused and of the pure-TF path."""
    fused = _compress_fn(comp)(grads, state)
    with kernels.tf_path():
        plain = _compress_fn(comp)(grads, state)
    return fused, plain


def _same_exchange(fused, plain):
    for i, ti, v, tv in zip(fused[0], plain[0], fused[1], plain[1]):
        order, tf_order = np.argsort(i.numpy(), kind="stable"), np.argsort(ti.numpy(),
                                                                          kind="stable")
        np.testing.assert_array_equal(i.numpy()[order], ti.numpy()[tf_order])
        np.testing.assert_array_equal(v.numpy()[order], tv.numpy()[tf_order])
    for a, b in zip(fused[2], plain[2]):
        np.testing.assert_array_equal(a.numpy(), b.numpy())  # NaN == NaN here


@pytest.mark.parametrize("metric", ["l1", "l2"])
def test_nan_and_inf_take_the_same_blocks_on_both_paths(metric):
    """A block holding an inf or a NaN scores inf / NaN on both paths; both select the same
    blocks (an inf block first) and keep the same residuals, NaN included."""
    layouts = [_layout((3, 3, 4, 6), "output_channel"), _layout((17, 9), "row"),
               _layout((5, 7), "element")]
    rng = np.random.default_rng(5)
    grads = [rng.standard_normal(lay.shape).astype(np.float32) for lay in layouts]
    grads[0][1, 1, 2, 4] = np.inf
    grads[1][3, 2] = np.nan
    grads[2][4, 6] = -np.inf
    state = [tf.constant(rng.standard_normal(lay.shape).astype(np.float32)) for lay in layouts]
    grads = [tf.constant(g) for g in grads]
    fused, plain = _both_paths(BlockTopK(layouts, k=2, metric=metric, dense_below=0), grads, state)
    _same_exchange(fused, plain)
    assert 4 in fused[0][0].numpy()
    assert np.isnan(fused[2][1].numpy()).any() or 3 in fused[0][1].numpy()


def test_zero_size_variables_and_k_beyond_the_blocks_match_the_tf_path():
    """An empty variable sends nothing; k larger than a variable's blocks sends all of them
    (both paths), leaving a zero residual."""
    layouts = [_layout((0, 4), "row"), _layout((3, 3, 2, 3), "output_channel"),
               _layout((4,), "element")]
    rng = np.random.default_rng(6)
    grads = [tf.constant(rng.standard_normal(lay.shape).astype(np.float32)) for lay in layouts]
    state = [tf.zeros(lay.shape) for lay in layouts]
    fused, plain = _both_paths(BlockTopK(layouts, k=50, dense_below=0), grads, state)
    _same_exchange(fused, plain)
    assert [int(tf.size(i)) for i in fused[0]] == [0, 3, 4]
    for residual in fused[2]:
        np.testing.assert_array_equal(residual.numpy(), 0.0)


@pytest.mark.parametrize("metric", ["l1", "l2"])
def test_a_wide_layer_scores_in_bounded_row_ranges(metric):
    """More than 2**15 one-element-wide blocks per row (an LM head's kernel, one block per
    output unit): the rows are summed in at most 16 ranges, still matching NumPy."""
    lay = _layout((40, 40000), "output_channel")
    rng = np.random.default_rng(7)
    g = rng.standard_normal(lay.shape).astype(np.float32)
    r = rng.standard_normal(lay.shape).astype(np.float32)
    acc, scores = kernels.accumulate_score(tf.constant(g), tf.constant(r), lay, metric)
    np.testing.assert_array_equal(acc.numpy(), g + r)
    np.testing.assert_allclose(scores.numpy(), _ref_scores(g + r, lay, metric), rtol=2e-5)
    again = kernels.block_scores(acc, lay, metric).numpy()
    np.testing.assert_array_equal(kernels.block_scores(acc, lay, metric).numpy(), again)


def test_ties_go_to_the_lower_block_id():
    lay = _layout((3, 3, 4, 10), "output_channel")
    comp = BlockTopK([lay], k=3, dense_below=0)
    ones = tf.ones(lay.shape)
    payload, _ = comp.compress([ones], [tf.zeros(lay.shape)])
    np.testing.assert_array_equal(np.sort(payload.ids[0].numpy()), [0, 1, 2])
    one = BlockTopK([lay], k=1, dense_below=0).compress([ones], [tf.zeros(lay.shape)])[0]
    np.testing.assert_array_equal(one.ids[0].numpy(), [0])


def test_not_fused_on_gpu_devices_or_other_dtypes():
    @tf.function(input_signature=[tf.TensorSpec([4, 3])])
    def probe(x):
        with tf.device("/device:GPU:0"):
            on_gpu = tf.identity(x)
        with tf.device("/device:CPU:0"):
            on_cpu = tf.identity(x)
        flags.extend([kernels.fusable(on_gpu), kernels.fusable(on_cpu),
                      kernels.fusable(tf.cast(x, tf.float16))])
        return x

    flags: list[bool] = []
    probe.get_concrete_function()
    assert flags == [False, True, False]


def _run(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)],
                          env={**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "3",
                               **env}, capture_output=True, text=True, timeout=300)


PRELUDE = """
    import os, warnings, numpy as np, tensorflow as tf
    from pathlib import Path
    from tf_blocksparse import blocks, kernels
    from tf_blocksparse.feedback import BlockTopK
    lay = blocks.BlockLayout("v", (3, 3, 4, 8), blocks.RULES["output_channel"])
    g = tf.constant(np.arange(288, dtype=np.float32).reshape(lay.shape))
"""
#: Loads as ``{load}`` says, compresses twice, prints the library's warnings.
COMPRESS = """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        {load}
        for _ in range(2):
            payload, state = BlockTopK([lay], k=2, dense_below=0).compress([g], [tf.zeros_like(g)])
    assert sorted(payload.ids[0].numpy()) == [6, 7], payload.ids
    assert kernels.path_name() == "tf"
    print("WARNINGS", len([w for w in caught if "tf_blocksparse" in str(w.message)]))
    print("\\n".join(str(w.message) for w in caught))
"""


def test_environment_variable_forces_the_tf_path_and_a_missing_library_warns_once():
    """One fresh process, two phases: with ``TF_BLOCKSPARSE_KERNELS=0`` nothing is loaded and
    nothing warns; with the variable gone, a library that is not there warns once (however
    often the path is taken) with the build command, and the TF path is used."""
    proc = _run(PRELUDE + COMPRESS.format(load="kernels.load()")
                + '\n    os.environ.pop("TF_BLOCKSPARSE_KERNELS")\n'
                + COMPRESS.format(load='kernels.load(Path("/nonexistent/lib.so"))'),
                TF_BLOCKSPARSE_KERNELS="0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = [line for line in proc.stdout.splitlines() if line.startswith("WARNINGS")]
    assert counts == ["WARNINGS 0", "WARNINGS 1"], proc.stdout
    assert "python -m tf_blocksparse.kernels.build" in proc.stdout


@pytest.mark.slow  # `make test` builds the same source first (`make kernels`), and CI
# fails when that build does not load (TFBS_REQUIRE_KERNELS=1)
@pytest.mark.skipif(NO_COMPILER, reason="no C++ compiler (g++) to build the fused kernels")
def test_build_module_builds_from_source(tmp_path):
    out = build.build(tmp_path / "ops.so", force=True)
    assert out.exists() and out.stat().st_size > 0
    proc = _run(f"""
        import tensorflow as tf
        m = tf.load_op_library({str(out)!r})
        acc, s = m.block_accumulate_score([[1.0, -2.0]], [[0.5, 0.5]], outer=1, num_blocks=2,
                                          inner=1)
        print(acc.numpy().tolist(), s.numpy().tolist())
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[[1.5, -1.5]] [1.5, 1.5]" in proc.stdout


def test_build_module_reports_a_missing_compiler():
    """Run by path (as ``make kernels`` does), so no TensorFlow import is needed to say so."""
    proc = subprocess.run([sys.executable, str(Path(build.__file__)), "--force"],
                          env={**os.environ, "CXX": "no-such-compiler-xyz"},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "not built" in proc.stderr and "no-such-compiler-xyz" in proc.stderr


def test_library_name_and_freshness_follow_the_installed_tensorflow(tmp_path):
    from tf_blocksparse.kernels import library

    assert kernels.LIBRARY == library.library_path()  # metadata and tf.__version__ agree
    assert library.library_path("2.19.1").name == "_blocksparse_ops-tf2.19.so"
    lib = tmp_path / "ops.so"
    assert not library.up_to_date(lib)
    lib.write_bytes(b"")
    source = library.SOURCE.stat().st_mtime
    os.utime(lib, (source - 10, source - 10))
    assert not library.up_to_date(lib)
    os.utime(lib, (source, source))
    assert library.up_to_date(lib)


@pytest.mark.skipif(not kernels.LIBRARY.exists() or not kernels.library.up_to_date(
    kernels.LIBRARY), reason="the kernels' library is not built or out of date")
def test_build_by_path_knows_an_up_to_date_library_without_importing_tensorflow():
    script = Path(build.__file__)
    proc = subprocess.run([sys.executable, "-X", "importtime", str(script)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "up to date" in proc.stdout
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines()
                if line.startswith("import time:")}
    assert "library" in imported and "tensorflow" not in imported, sorted(imported)
