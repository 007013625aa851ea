"""Writes ``datasets/digits.npz`` from scikit-learn's copy of the 8x8 digits.

The file holds the 1,797 images as ``uint8`` pixel values 0..16 [1797, 8, 8], their labels
[1797] and the one train/test split every run of this project uses (a stratified 80/20
split, scikit-learn's ``train_test_split(..., test_size=0.2, random_state=0,
stratify=labels)``) as two index arrays.  The repository ships the file so that no
TensorFlow process needs scikit-learn (Keras imports it, with SciPy, whenever it is
installed: about 0.9 s of every start).  Rebuild it, in an environment with scikit-learn:

    python datasets/make_digits.py
"""

from __future__ import annotations

import os

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    bunch = load_digits()
    images = bunch.images.astype(np.uint8)
    assert np.array_equal(images, bunch.images)  # whole pixel values 0..16
    labels = bunch.target.astype(np.uint8)
    train_idx, test_idx = train_test_split(np.arange(len(labels)), test_size=0.2,
                                           random_state=0, stratify=labels)
    np.savez_compressed(os.path.join(HERE, "digits.npz"), images=images, labels=labels,
                        train_index=train_idx.astype(np.int16),
                        test_index=test_idx.astype(np.int16))


if __name__ == "__main__":
    main()
