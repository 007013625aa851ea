"""Reading what a training run saved, for the tests that compare runs."""

import zipfile

import h5py
import numpy as np


def final_weights(model_dir) -> dict[str, np.ndarray]:
    """Every array of the run's final ``model.keras`` (weights and optimizer state)."""
    out = {}
    with zipfile.ZipFile(model_dir / "model.keras") as z, z.open("model.weights.h5") as fh:
        with h5py.File(fh, "r") as h5:
            h5.visititems(lambda name, obj: out.__setitem__(name, np.asarray(obj))
                          if isinstance(obj, h5py.Dataset) else None)
    return out
