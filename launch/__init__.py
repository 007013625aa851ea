"""Launch scripts (training, benchmarks, cluster tooling) over the ``tf_blocksparse`` library.

Run a script from the repository root as a module, e.g. ``python -m launch.train --help``.
Importing the package keeps TensorFlow's C++ start-up chatter off (``TF_CPP_MIN_LOG_LEVEL=2``
unless the environment sets it): every script imports it before TensorFlow.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
