"""The one exchange over a device list (the CrossDeviceOps' and the hybrid sync's path)
against the NumPy reference, on two logical CPUs: updates, residuals, non-finite fallback."""

import numpy as np
import pytest
import tensorflow as tf

from tests import reference as ref
from tf_blocksparse import blocks, exchange
from tf_blocksparse.collectives import DeviceCollectives
from tf_blocksparse.distribute.device_exchange import run_on_devices
from tf_blocksparse.feedback import BlockTopK

DEVICES = ["/cpu:0", "/cpu:1"]
LAYOUTS = [blocks.BlockLayout("m/k", (3, 3, 2, 4), blocks.OUTPUT_CHANNEL),
           blocks.BlockLayout("m/t", (2, 2, 5, 3), blocks.TRANSPOSE_FILTER),
           blocks.BlockLayout("m/b", (6,), blocks.ELEMENT)]


def _data(seed: int, shape, low: int = -24, high: int = 25) -> np.ndarray:
    """Integers / 8: every sum of a few of them (and their squares) is exact in float32."""
    rng = np.random.default_rng(seed)
    return (rng.integers(low, high, size=shape) / 8).astype(np.float32)


def _inputs():
    grads = [[_data(10 * r + i, lay.shape) for i, lay in enumerate(LAYOUTS)] for r in range(2)]
    state = [[_data(100 + 10 * r + i, lay.shape, -8, 9) for i, lay in enumerate(LAYOUTS)]
             for r in range(2)]
    return grads, state


@pytest.mark.parametrize("mode", ["allgather", "shared", "dense"])
@pytest.mark.parametrize("dense_below", [0, 65])
def test_run_over_devices_matches_reference(mode, dense_below):
    comp = BlockTopK(LAYOUTS, density=0.5, metric="l2", dense_below=dense_below)
    grads, state = _inputs()
    out = exchange.run(DeviceCollectives(DEVICES), mode, comp,
                       [[tf.constant(g) for g in rep] for rep in grads],
                       [[tf.constant(s) for s in rep] for rep in state])
    updates, residuals, finite = ref.np_step(mode, grads, state, LAYOUTS, density=0.5,
                                             metric="l2", dense_below=dense_below)
    assert len(out) == 2 and all(bool(o.finite.numpy()) == finite for o in out)
    for got, want in zip(out[0].updates, updates):
        np.testing.assert_array_equal(got.numpy(), want)
    if mode != "dense":
        for r in range(2):
            for got, want in zip(out[r].residuals, residuals[r]):
                np.testing.assert_array_equal(got.numpy(), want)
            # every update and residual was made on the device its replica names
            assert all(t.device.endswith(f"CPU:{r}") for t in out[r].residuals)
    # the same figures as the replica-context exchange (one more replica's buffers)
    single = exchange.run_exchange(mode, tf.distribute.get_replica_context(), comp,
                                   [tf.constant(g) for g in grads[0]],
                                   [tf.constant(s) for s in state[0]])
    assert out[0].payload_bytes == single.payload_bytes
    assert out[0].payload_bytes == ref.np_payload_bytes(mode, LAYOUTS, density=0.5,
                                                        dense_below=dense_below)


@pytest.mark.parametrize("mode", ["allgather", "shared"])
def test_run_on_devices_commits_residuals_and_falls_back_when_not_finite(mode):
    comp = BlockTopK(LAYOUTS, k=1, dense_below=0)
    grads, state = _inputs()
    residuals = []
    for r, dev in enumerate(DEVICES):
        with tf.device(dev):
            residuals.append([tf.Variable(s) for s in state[r]])
    sums = run_on_devices(DEVICES, mode, comp,
                          [[tf.constant(g) for g in rep] for rep in grads], residuals)
    updates, new_res, _ = ref.np_step(mode, grads, state, LAYOUTS, k=1)
    for got, want in zip(sums, updates):
        np.testing.assert_array_equal(got.numpy(), want)
    for r in range(2):
        for var, want in zip(residuals[r], new_res[r]):
            np.testing.assert_array_equal(var.numpy(), want)
    before = [[v.numpy() for v in rep] for rep in residuals]
    bad = [[g.copy() for g in rep] for rep in grads]
    bad[1][2][0] = np.inf
    sums = run_on_devices(DEVICES, mode, comp,
                          [[tf.constant(g) for g in rep] for rep in bad], residuals)
    for got, a, b in zip(sums, bad[0], bad[1]):  # the dense sum of the gradients
        np.testing.assert_array_equal(got.numpy(), a + b)
    for rep, saved in zip(residuals, before):
        for var, want in zip(rep, saved):
            np.testing.assert_array_equal(var.numpy(), want)
