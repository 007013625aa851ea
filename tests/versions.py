"""Markers for the few tests that need the newest tested Keras (3.15): the suite also runs
on TensorFlow 2.19 / Keras 3.10 (``make test-compat``)."""

import keras
import pytest

KERAS = tuple(int(p) for p in keras.__version__.split(".")[:2])

#: Files saved by Keras 3.15 (committed fixtures) hold initializer arguments older Keras
#: versions do not take.
reads_keras_315_files = pytest.mark.skipif(
    KERAS < (3, 15), reason="reads a .keras file saved by Keras 3.15, which older Keras "
    "cannot deserialize (initializer arguments added since)")
#: ``keras.layers.Attention`` with a key mask fails in its gradient before Keras 3.15
#: (a [b, Tq, Tv] vs [b, Tv] broadcast), so the repository's gru_nmt model needs 3.15.
needs_keras_315_attention = pytest.mark.skipif(
    KERAS < (3, 15), reason="keras.layers.Attention's masked gradient needs Keras >= 3.15")
