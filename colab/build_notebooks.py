"""Writes the Colab notebooks in ``colab/`` from the cell sources in this file.

The notebooks are generated so that a review reads plain Python and Markdown here, and the
committed ``.ipynb`` files carry no outputs (``tests/test_notebooks.py`` checks both, and
executes every notebook top to bottom).

    python colab/build_notebooks.py           # (re)write colab/*.ipynb
    python colab/build_notebooks.py --check   # exit 1 if a committed notebook is stale

Every notebook starts with the same install cell.  Where ``tf_blocksparse`` is already
importable (a checkout after ``make test``, which installs it in editable mode) it installs
nothing; otherwise it pip-installs ``TFBS_SOURCE`` (an environment variable: a pip requirement,
a git URL or a path), by default the repository checkout the notebook runs in, else the
project's git URL (``PROJECT_URL``).  A failed install stops the notebook with an error that
says what was tried and what to do.  Data: Fashion-MNIST
from Debian's ``dataset-fashion-mnist`` files when present, Keras' download on Colab, else
scikit-learn's bundled digits (offline).
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

import nbformat
from nbformat import v4

HERE = Path(__file__).resolve().parent

#: The project's repository; the install cell pip-installs it where no checkout is found
#: (on Colab).  The notebooks' "Open in Colab" badges in README.md point into it as well.
PROJECT_URL = "https://github.com/tf-blocksparse/tf_blocksparse"

Cell = tuple[str, str]  # ("md" | "code", source)


def md(text: str) -> Cell:
    return ("md", textwrap.dedent(text).strip("\n"))


def code(*parts: str) -> Cell:
    """A code cell; ``parts`` are dedented one by one and joined by a blank line."""
    return ("code", "\n\n".join(textwrap.dedent(p).strip("\n") for p in parts))


# --------------------------------------------------------------------------- shared cells

INSTALL = code(f'''
    # Install tf_blocksparse where it is not importable yet (on Colab: seconds; it keeps the
    # runtime's TensorFlow and Keras).
    # TFBS_SOURCE (environment variable) chooses what pip installs: a requirement, a git URL or
    # a path; by default the repository checkout this notebook runs in, else the project's
    # repository.  A failed install stops here with an error (Run all stops too).
    import importlib
    import importlib.metadata
    import importlib.util
    import os
    import subprocess
    import sys
    from pathlib import Path

    PROJECT_URL = "git+{PROJECT_URL}"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # quieter TensorFlow start-up


    def find_checkout(start):
        """The repository checkout holding the folder `start`, or None."""
        for folder in (start, *start.parents):
            if (folder / "pyproject.toml").is_file() and (folder / "tf_blocksparse").is_dir():
                return folder
        return None


    def loaded_distributions():
        """{{distribution: version}} of the packages this session has imported."""
        owners = importlib.metadata.packages_distributions()
        versions = {{}}
        for module in [m for m in sys.modules if "." not in m]:
            for dist in owners.get(module, ()):
                try:
                    versions[dist] = importlib.metadata.version(dist)
                except importlib.metadata.PackageNotFoundError:
                    pass
        return versions


    def present(dist):
        """The installed version of `dist`, or None."""
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None


    def install_tf_blocksparse(source):
        """pip-installs `source` into this kernel's interpreter; raises if that fails.

        Where TensorFlow and Keras are installed already (Colab), only tf_blocksparse is
        (`--no-deps`): the runtime keeps its own versions (tested: TensorFlow 2.19-2.21
        with Keras 3.10-3.15; others get a note)."""
        loaded = loaded_distributions()
        tf_version, keras_version = present("tensorflow"), present("keras")
        keep = tf_version is not None and keras_version is not None
        if keep and not (tf_version.split(".")[:2] in (["2", "19"], ["2", "20"], ["2", "21"])
                         and keras_version.split(".")[:2] in [["3", str(m)]
                                                               for m in range(10, 16)]):
            print(f"note: TensorFlow {{tf_version}} / Keras {{keras_version}} are outside the "
                  "tested versions (TensorFlow 2.19-2.21, Keras 3.10-3.15)")
        print(f"installing tf_blocksparse from {{source}} ...", flush=True)
        try:
            subprocess.check_call([sys.executable, "-m", "pip", "install", "-q",
                                   *(["--no-deps"] if keep else []), source])
        except subprocess.CalledProcessError as err:
            raise RuntimeError(
                f"pip could not install tf_blocksparse from {{source!r}} (exit code "
                f"{{err.returncode}}; pip's messages are above).  Point TFBS_SOURCE at a source "
                "pip can reach (a git URL, a wheel or a checkout's path; in a notebook: "
                "%env TFBS_SOURCE=...) and run this cell again.") from None
        importlib.invalidate_caches()
        now = loaded_distributions()
        changed = sorted(dist for dist, version in loaded.items() if now.get(dist) != version)
        if changed:
            raise RuntimeError(
                f"pip replaced {{', '.join(changed)}}, which this session had already loaded: "
                "restart the session (Colab: Runtime > Restart session) and run all cells "
                "again; the package is installed now, so this cell will not install it again.")


    if (importlib.util.find_spec("tf_blocksparse") is None
            or os.environ.get("TFBS_FORCE_INSTALL") == "1"):
        checkout = find_checkout(Path.cwd())
        install_tf_blocksparse(os.environ.get("TFBS_SOURCE") or str(checkout or PROJECT_URL))
    try:
        import tf_blocksparse
    except ImportError as err:
        raise RuntimeError(
            f"tf_blocksparse is installed but does not import ({{err}}); check that this "
            "runtime has Python >= 3.10, TensorFlow 2.19-2.21 and Keras 3.10-3.15.") from err
    print("tf_blocksparse from", Path(tf_blocksparse.__file__).parent)
''')

def logical_cpus(n: int = 2, why: str = "MirroredStrategy gets two replicas") -> str:
    """Source lines that split the CPU into ``n`` logical devices (before TF touches one)."""
    return f'''
    # {n} logical CPU devices on one CPU-only machine: {why}.
    # This must run before TensorFlow initialises its devices (restart the runtime otherwise).
    cpus = tf.config.list_physical_devices("CPU")
    try:
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration()] * {n})
    except RuntimeError:
        print("devices were already initialised: restart the runtime to get {n} logical CPUs")
    tf.get_logger().setLevel("WARNING")  # no INFO lines from tf.distribute
    print("TensorFlow", tf.__version__, "| logical CPUs:",
          [d.name for d in tf.config.list_logical_devices("CPU")])
'''

DATA = code('''
    FASHION_DIR = "/usr/share/datasets/fashion-mnist"  # Debian's dataset-fashion-mnist


    def load_images(num_train, num_test, seed=0):
        """A random subset of Fashion-MNIST: images float32 [N, H, W, 1] in [0, 1], labels int32.

        Sources, the first that works: Debian's IDX files (read by the repository's offline
        loader, `launch/data.py`), Keras' download (on Colab, which has internet access), or
        scikit-learn's bundled 8x8 digits (offline, a stand-in with the same interface).
        """
        checkout = find_checkout(Path.cwd())  # launch/ is a folder of the repository
        if checkout is not None and str(checkout) not in sys.path:
            sys.path.append(str(checkout))
        try:
            from launch import data
        except ImportError:  # not in a checkout (on Colab)
            data = None
        if data is not None and data.fashion_mnist_available(FASHION_DIR):
            (x, y), (xt, yt) = data.load_fashion_mnist(FASHION_DIR)
            source = f"Fashion-MNIST ({FASHION_DIR})"
        elif "google.colab" in sys.modules:
            (x, y), (xt, yt) = keras.datasets.fashion_mnist.load_data()
            x, xt = (a[..., None].astype("float32") / 255.0 for a in (x, xt))
            y, yt = y.astype("int32"), yt.astype("int32")
            source = "Fashion-MNIST (keras.datasets)"
        else:
            if data is not None:
                (x, y), (xt, yt) = data.load_digits()
            else:
                from sklearn.datasets import load_digits
                d = load_digits()
                x = (d.images[..., None] / 16.0).astype("float32")
                y = d.target.astype("int32")
                (x, y), (xt, yt) = (x[:1437], y[:1437]), (x[1437:], y[1437:])
            source = "scikit-learn digits, 8x8 (Fashion-MNIST is not available offline here)"
        rng = np.random.default_rng(seed)
        train = rng.permutation(len(x))[:num_train]
        test = rng.permutation(len(xt))[:num_test]
        print(f"{source}: {len(train)} training and {len(test)} test images of shape "
              f"{x.shape[1:]}")
        return (x[train], y[train]), (xt[test], yt[test])
''')

MODEL = code('''
    def make_model(input_shape, num_classes=10):
        """A small CNN (the repository's `cnn_small`): two conv blocks and a dense head."""
        pool = [keras.layers.MaxPooling2D(name="pool1")] if input_shape[0] >= 16 else []
        return keras.Sequential([
            keras.Input(input_shape),
            keras.layers.Conv2D(16, 3, padding="same", activation="relu", name="conv1"),
            *pool,
            keras.layers.Conv2D(32, 3, padding="same", activation="relu", name="conv2"),
            keras.layers.MaxPooling2D(name="pool2"),
            keras.layers.Flatten(name="flatten"),
            keras.layers.Dense(64, activation="relu", name="fc1"),
            keras.layers.Dense(num_classes, name="logits"),
        ], name="cnn")
''')


VGG = code('''
    def vgg_fc(input_shape, num_classes=10, fc_units=1024):
        """The repository's `vgg_fc`: two VGG conv blocks, then a large dense head."""
        layers = [keras.Input(input_shape)]
        for b, filters in enumerate((32, 64), start=1):
            layers += [keras.layers.Conv2D(filters, 3, padding="same", activation="relu",
                                           name=f"conv{b}_{c}") for c in (1, 2)]
            layers.append(keras.layers.MaxPooling2D(name=f"pool{b}"))
        layers += [keras.layers.Flatten(name="flatten"),
                   keras.layers.Dense(fc_units, activation="relu", name="fc1"),
                   keras.layers.Dense(fc_units, activation="relu", name="fc2"),
                   keras.layers.Dense(num_classes, name="logits")]
        return keras.Sequential(layers, name="vgg_fc")
''')


def colab_note(minutes: str) -> str:
    return (f"Runs top to bottom on a CPU-only runtime in {minutes} (*Runtime > Run all*); "
            "the first cell installs the package on Colab and does nothing where it is "
            "already installed.")


# --------------------------------------------------------------------------- 1. quickstart

#: Measured headless (``make test-notebooks``) on 2 CPU cores: the cells take ~1 minute.
QUICKSTART_MINUTES = "about 2 minutes (its cells take about one, the rest is the install)"

QUICKSTART = [
    md(f'''
        # Quick start: block-sparse gradient exchange in `model.fit`

        `tf_blocksparse` wraps any Keras optimizer.  On every replica and step it adds the
        gradient to a local *residual*, splits the sum into blocks that follow the layer's
        structure (one convolution filter, one dense neuron's incoming weights, one bias
        element), keeps the top-k blocks by L1 norm, and hands only those to the collectives.
        The rest stays in the residual and is added to the next step's gradient (error
        feedback): nothing is dropped, only delayed.

        This notebook trains a small CNN on Fashion-MNIST with `tf.distribute.MirroredStrategy`
        over two logical CPU devices (two replicas in one process; the same code runs on GPUs,
        or across machines with `tfbs.MultiWorkerMirroredStrategy`) five ways -- dense
        all-reduce, the one-line default (the automatic exchange), block k=1 always
        compressed, the literal block k=1 configuration, and element-wise top-k with 5% of
        the entries -- and plots test accuracy against the bytes each replica sends.

        {colab_note(QUICKSTART_MINUTES)}
    '''),
    INSTALL,
    code('''
        import time

        import keras
        import matplotlib.pyplot as plt
        import numpy as np
        import tensorflow as tf

        import tf_blocksparse as tfbs
    ''', logical_cpus()),
    md('''
        ## Data

        12,000 training and 2,000 test images keep the run short.  The global batch of 128 is
        split over the two replicas (64 each).
    '''),
    DATA,
    code('''
        (x_train, y_train), (x_test, y_test) = load_images(12_000, 2_000)
        BATCH = 128
        train_ds = (tf.data.Dataset.from_tensor_slices((x_train, y_train))
                    .shuffle(len(x_train), seed=0).batch(BATCH, drop_remainder=True).prefetch(2))
        STEPS_PER_EPOCH = len(x_train) // BATCH
    '''),
    md('''
        ## The model and its blocks

        `tfbs.block_table` shows how every trainable variable splits into blocks: a `Conv2D`
        kernel `(3, 3, in, filters)` has one block per output filter, a `Dense` kernel
        `(in, units)` one block per unit (that unit's incoming weights), a bias one block per
        element.  `k=1` keeps one block *per variable* and step; `density=0.05` keeps
        `ceil(0.05 * blocks)`.
    '''),
    MODEL,
    code('''
        print(tfbs.format_block_table(tfbs.block_table(make_model(x_train.shape[1:]))))
    '''),
    md('''
        ## Training under `MirroredStrategy`

        One strategy object for the whole notebook (TF gives every `MirroredStrategy` instance
        the same collective keys, so create one per process).  The optimizer is built inside
        `strategy.scope()`; `exchange="dense"` is the plain all-reduce Keras would make (the
        baseline), `granularity="element"` is element-wise top-k with error feedback (the
        DGC / GRACE baseline).  Every run wraps the same `SGD(0.05, momentum=0.9)`.  The
        default exchange is `"auto"`: it times the strategy's collectives and the compression
        when the optimizer is built and sends dense wherever compressing does not pay -- two
        devices of one process are such a place (in our runs it picked dense here).
        `exchange="allgather"` compresses whatever the link: one block per variable (`k=1`),
        the momentum moved *before* the exchange (kept per replica with DGC's correction,
        which keeps aggressive sparsification from oscillating) and variables of fewer than
        1,024 elements sent whole; `momentum_correction=None, dense_below=0` is the literal
        form (every variable compressed, global momentum after the exchange).
        `tfbs.BlockSparseMetrics` adds the bytes handed to the collectives per replica and step
        to the logs, and `tfbs.ExactValidation` the test accuracy over every test image once,
        so both land in `history`.
    '''),
    code('''
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        print("replicas in sync:", strategy.num_replicas_in_sync)

        EPOCHS = 3 if len(x_train) >= 10_000 else 12  # the digits fallback is ~8x smaller
        RUNS = {
            "dense all-reduce": dict(exchange="dense"),
            "block default": dict(),  # exchange="auto": dense on this fast "link"
            "block k=1": dict(exchange="allgather"),
            "block literal": dict(exchange="allgather", momentum_correction=None,
                                  dense_below=0),
            "element top-k, 5%": dict(exchange="allgather", density=0.05,
                                      granularity="element"),
        }


        def train(compression, epochs=EPOCHS, seed=0):
            keras.utils.set_random_seed(seed)  # same initial weights for every run
            with strategy.scope():
                model = make_model(x_train.shape[1:])
                opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.05, momentum=0.9),
                                                **compression)
                model.compile(
                    optimizer=opt, metrics=["accuracy"],
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            start = time.perf_counter()
            history = model.fit(train_ds, epochs=epochs, verbose=0,
                                shuffle=False,  # the tf.data pipeline shuffles
                                callbacks=tfbs.fit_callbacks(model, [  # + what opt needs
                                    tfbs.ExactValidation(x_test, y_test),
                                    tfbs.BlockSparseMetrics()]))
            return {"history": history.history, "metrics": opt.block_sparse_metrics(),
                    "seconds": time.perf_counter() - start}


        results = {}
        for label, compression in RUNS.items():
            results[label] = r = train(compression)
            print(f"{label:18s} test accuracy {r['history']['val_accuracy'][-1]:.3f}  "
                  f"{r['metrics']['payload_bytes']:>9,.0f} bytes/step  {r['seconds']:.0f} s")
    '''),
    md('''
        `opt.block_sparse_metrics()` holds the last step's figures, averaged over replicas:
        `payload_bytes` (what one replica hands to the collectives), `dense_bytes` (what a
        dense all-reduce would hand over), `blocks_kept`, `residual_norm` (L1 norm of the error
        feedback still waiting) and `skipped_steps` (steps skipped for a non-finite gradient).
    '''),
    code('''
        dense_bytes = results["dense all-reduce"]["metrics"]["dense_bytes"]
        print(f"{'method':18s} {'test acc':>8s} {'bytes/step':>11s} {'ratio':>7s} "
              f"{'residual L1':>11s} {'wall s':>7s}")
        for label, r in results.items():
            m = r["metrics"]
            print(f"{label:18s} {r['history']['val_accuracy'][-1]:8.3f} "
                  f"{m['payload_bytes']:11,.0f} {dense_bytes / m['payload_bytes']:6.1f}x "
                  f"{m['residual_norm']:11.2f} {r['seconds']:7.1f}")
        print("\\nkeys logged per epoch:", sorted(results["block k=1"]["history"]))
    '''),
    md('''
        ## Accuracy against bytes sent

        Left: test accuracy per epoch.  Middle: the same points against the bytes one replica
        has sent so far (log scale) -- the compressed runs reach a given accuracy with a
        fraction of the traffic.  Right: bytes per step and the compression ratio.
    '''),
    code('''
        fig, (ax_acc, ax_bytes, ax_bar) = plt.subplots(1, 3, figsize=(16, 4.2))
        for label, r in results.items():
            acc = r["history"]["val_accuracy"]
            epochs = np.arange(1, len(acc) + 1)
            sent = epochs * STEPS_PER_EPOCH * r["metrics"]["payload_bytes"]
            ax_acc.plot(epochs, acc, "o-", label=label)
            ax_bytes.plot(sent / 2**20, acc, "o-", label=label)
        ax_acc.set(xlabel="epoch", ylabel="test accuracy", title="accuracy per epoch")
        ax_acc.set_xticks(epochs)
        ax_bytes.set(xscale="log", xlabel="MiB sent per replica (cumulative)",
                     ylabel="test accuracy", title="accuracy against bytes sent")
        labels = list(results)
        payload = [results[k]["metrics"]["payload_bytes"] for k in labels]
        bars = ax_bar.bar(range(len(labels)), payload, color=[f"C{i}" for i in range(len(labels))])
        ax_bar.bar_label(bars, [f"{dense_bytes / p:.0f}x" for p in payload])
        ax_bar.set_xticks(range(len(labels)), labels, rotation=15)
        ax_bar.set(yscale="log", ylabel="bytes per step per replica", title="payload per step")
        ax_acc.legend()
        fig.tight_layout()
        plt.show()
    '''),
    md('''
        ## What to take away

        * The one-line default measures whether compressing pays; between two devices of
          one process it did not in our runs, so it sent dense (the table shows its bytes):
          the same bytes and accuracy as the dense all-reduce.  Compressing always
          (`exchange="allgather"`, k=1) sends ~40x fewer bytes per step than the dense
          all-reduce and keeps pace with it; the literal k=1 (every variable compressed,
          global momentum) sends ~59x fewer but trails at equal epochs: a 10-class head or a
          bias then moves one row or one element per step, and residuals released late into
          a running global velocity overshoot.
        * Element top-k at 5% density sends several times the bytes of block k=1 (every value
          carries its own int32 index).  Its selection is a `top_k` over every entry of every
          tensor (about 6x the block selection's time on ResNet-50's gradients, see the
          selection benchmark in the project's `docs/results.md`), and its payload has no
          structure; `compression_anatomy.ipynb` takes one gradient apart to show what each
          kind of selection keeps.
        * `exchange="allgather"` lets each replica pick its own blocks;
          `exchange="shared"` sums block scores first so every replica sends the same blocks
          (bytes stay flat as replicas are added).  Across processes use
          `tfbs.MultiWorkerMirroredStrategy()`; inside one process, `tfbs.BlockSparseCrossDeviceOps`
          puts the same exchange into the strategy instead of the optimizer.

        Next: `compression_anatomy.ipynb` (one gradient, up close), `pipeline_planner.ipynb`
        (pipeline partitioning on heterogeneous links) and `hybrid_placement.ipynb` (the conv/FC
        split and memory-aware placement).
    '''),
]


# --------------------------------------------------------------------------- 2. anatomy

ANATOMY = [
    md(f'''
        # Anatomy of a block-sparse gradient

        One real gradient of a trained CNN, taken apart: which filters and neurons the block
        top-k selection keeps, how the error-feedback residual grows and drains over steps, how
        many bytes block top-k needs against element top-k at the same density, and what the
        run-length codec makes of the same updates.  Everything here runs on one device with
        the compressor's explicit-state API (`tfbs.BlockTopK` / `tfbs.ElementTopK`), the same
        core `BlockSparseOptimizer` runs on every replica.

        {colab_note("about a minute")}
    '''),
    INSTALL,
    code('''

        import keras
        import matplotlib.pyplot as plt
        import numpy as np
        import tensorflow as tf
        from matplotlib.colors import LogNorm
        from matplotlib.patches import Rectangle

        import tf_blocksparse as tfbs
        from tf_blocksparse import blocks, codec, selection
        from tf_blocksparse.extras import run_length

        print("TensorFlow", tf.__version__)
    '''),
    DATA,
    MODEL,
    md('''
        ## A trained model and one real gradient

        One epoch on 6,000 images, so the gradient is that of a model that has learnt
        something (a gradient at initialisation is much more uniform).  Then the gradient of
        the loss on one batch of 256 images.
    '''),
    code('''
        (x_train, y_train), (x_test, y_test) = load_images(6_000, 1_000)
        keras.utils.set_random_seed(0)
        model = make_model(x_train.shape[1:])
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss=loss_fn,
                      metrics=["accuracy"])
        model.fit(x_train, y_train, batch_size=64, verbose=0,
                  epochs=1 if len(x_train) >= 6_000 else 4)  # the digits fallback is smaller
        accuracy = model.evaluate(x_test, y_test, verbose=0)[1]
        print(f"test accuracy after training: {accuracy:.3f}")

        x_batch, y_batch = x_train[:256], y_train[:256]
        with tf.GradientTape() as tape:
            loss = loss_fn(y_batch, model(x_batch, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        layouts = blocks.layouts_for(model.trainable_variables, model)
        names = [lay.path.split("/")[-2] + "/" + lay.path.split("/")[-1] for lay in layouts]
        for name, lay, g in zip(names, layouts, grads):
            print(f"{name:14s} shape {str(lay.shape):16s} rule {lay.rule.name:15s} "
                  f"{lay.num_blocks:4d} blocks of {lay.block_size:5d}  |g|_1 = "
                  f"{float(tf.reduce_sum(tf.abs(g))):.3f}")
    '''),
    md('''
        ## Which blocks are selected

        `BlockTopK(layouts, density=0.05)` scores every block by its L1 norm
        (`selection.block_scores`) and keeps the top `ceil(5% x blocks)` per variable.
        `compress` returns the payload (block ids and their values) and the new residual;
        `decompress(payload) + residual` is exactly the accumulated gradient.
    '''),
    code('''
        DENSITY = 0.05
        block_comp = tfbs.BlockTopK(layouts, density=DENSITY, metric="l1",
                                    dense_below=0)
        payload, residual = block_comp.compress(grads, block_comp.init())
        sent = block_comp.decompress(payload)
        exact = all(bool(tf.reduce_all(s + r == g)) for s, r, g in zip(sent, residual, grads))
        print("decompress(payload) + residual == gradient, bit for bit:", exact)
        selected = {name: sorted(ids.numpy().tolist()) for name, ids in zip(names, payload.ids)}
        for name, ids in selected.items():
            print(f"{name:14s} keeps blocks {ids}")
    '''),
    md('''
        **conv1**: its 16 filters (3x3, one input channel) as the gradient sees them; the
        selected filter is framed, titles give each filter's L1 score.  **conv2**: L1 norm of
        the gradient per (input channel, filter); a block is a whole column (one output filter
        across every input channel and tap), and the selected columns are framed.
    '''),
    code('''
        i = names.index("conv1/kernel")
        conv1 = grads[i].numpy()  # (3, 3, 1, 16)
        scores1 = selection.block_scores(grads[i], layouts[i], "l1").numpy()
        fig, axes = plt.subplots(2, 8, figsize=(14, 4))
        lim = np.abs(conv1).max()
        for f, ax in enumerate(axes.flat):
            ax.imshow(conv1[:, :, 0, f], cmap="RdBu_r", vmin=-lim, vmax=lim)
            ax.set_title(f"{f}: {scores1[f]:.3f}", fontsize=9)
            ax.set_xticks([])
            ax.set_yticks([])
            if f in selected["conv1/kernel"]:
                for side in ax.spines.values():
                    side.set(color="red", linewidth=3)
        fig.suptitle("conv1 filter gradients (red frame: selected block)")
        plt.show()

        conv2 = np.abs(grads[names.index("conv2/kernel")].numpy()).sum(axis=(0, 1))  # (16, 32)
        scores2 = conv2.sum(axis=0)
        fig, (ax_map, ax_bar) = plt.subplots(
            2, 1, figsize=(12, 5.5), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
        ax_map.imshow(conv2, aspect="auto", cmap="viridis")
        for f in selected["conv2/kernel"]:
            ax_map.add_patch(Rectangle((f - 0.5, -0.5), 1, conv2.shape[0], fill=False,
                                       edgecolor="red", linewidth=2.5))
        ax_map.set(ylabel="input channel", title="conv2: |gradient| summed over the 3x3 taps")
        colors = ["red" if f in selected["conv2/kernel"] else "C0" for f in range(len(scores2))]
        ax_bar.bar(range(len(scores2)), scores2, color=colors)
        ax_bar.set(xlabel="output filter (= block)", ylabel="block L1 score")
        plt.show()
    '''),
    md('''
        **fc1** (a `Dense` kernel `[inputs, units]`): left, the gradient's magnitude (the black
        columns are ReLU units that did not fire on this batch: their gradient is exactly
        zero); middle, the entries block top-k sends at 5% (whole columns: each selected unit's
        incoming weights); right, the entries element top-k sends at the same 5% (scattered
        entries, each with its own index).
    '''),
    code('''
        element_comp = tfbs.ElementTopK(layouts, density=DENSITY, dense_below=0)
        element_payload, _ = element_comp.compress(grads, element_comp.init())
        element_sent = element_comp.decompress(element_payload)

        i = names.index("fc1/kernel")
        fc1 = np.abs(grads[i].numpy())
        fig, axes = plt.subplots(1, 3, figsize=(15, 5), sharey=True)
        im = axes[0].imshow(fc1 + 1e-12, aspect="auto", cmap="magma",
                            norm=LogNorm(vmin=max(fc1.max() * 1e-4, 1e-12), vmax=fc1.max()))
        fig.colorbar(im, ax=axes[0])
        axes[0].set(title="|gradient| of fc1/kernel", xlabel="unit", ylabel="input")
        block_mask = np.zeros(fc1.shape)
        block_mask[:, payload.ids[i].numpy()] = 1
        element_mask = np.zeros(fc1.size)
        element_mask[element_payload.ids[i].numpy()] = 1  # element ids are flat indices
        for ax, mask, title in ((axes[1], block_mask, "block top-k 5%"),
                                (axes[2], element_mask.reshape(fc1.shape), "element top-k 5%")):
            ax.imshow(mask, aspect="auto", cmap="Greys", interpolation="nearest")
            ax.set(title=f"{title}: {int(mask.sum()):,} of {mask.size:,} sent", xlabel="unit")
        plt.show()
    '''),
    md('''
        ## Residual growth over steps

        Training on from the model above, one worker, for 60 steps: every step the compressor
        adds the gradient to the residual, sends the top blocks (here applied straight to the
        model) and keeps the rest.  At 5% the residual levels off after a few steps, at a few
        times one step's gradient: a block that loses the selection keeps growing until it
        wins, so every unit with a gradient gets its turn.  With k=1 (one block per variable
        and step) the residual is still growing after 60 steps -- it holds most of the
        gradient, which is why k=1 learns more slowly in the quick start.  The raster shows
        fc1's selected units step by step at 5% (four per step).
    '''),
    code('''
        train_batches = (tf.data.Dataset.from_tensor_slices((x_train, y_train))
                         .shuffle(len(x_train), seed=1).repeat().batch(64))


        def run_feedback(comp, steps=60):
            net = keras.models.clone_model(model)
            net.set_weights(model.get_weights())
            opt = keras.optimizers.SGD(0.05, momentum=0.9)
            opt.build(net.trainable_variables)

            @tf.function
            def step(x, y, state):
                with tf.GradientTape() as tape:
                    loss = loss_fn(y, net(x, training=True))
                g = tape.gradient(loss, net.trainable_variables)
                payload, state = comp.compress(g, state)
                opt.apply_gradients(zip(comp.decompress(payload), net.trainable_variables))
                return state, payload.ids, [tf.norm(t) for t in g], [tf.norm(r) for r in state]

            state, log = comp.init(), {"ids": [], "grad": [], "residual": []}
            for x, y in train_batches.take(steps):
                state, ids, g_norm, r_norm = step(x, y, state)
                log["ids"].append([t.numpy() for t in ids])
                log["grad"].append([float(t) for t in g_norm])
                log["residual"].append([float(t) for t in r_norm])
            log["state"] = state
            return log


        logs = {"k=1": run_feedback(tfbs.BlockTopK(layouts, k=1, dense_below=0)),
                "5%": run_feedback(tfbs.BlockTopK(layouts, density=DENSITY, dense_below=0))}

        kernels = [j for j, n in enumerate(names) if n.endswith("kernel")]
        fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
        for ax, (label, log) in zip(axes[:2], logs.items()):
            residual, grad = np.array(log["residual"]), np.array(log["grad"])
            for c, j in enumerate(kernels):
                ax.plot(residual[:, j], color=f"C{c}", label=f"{names[j]} residual")
                ax.plot(grad[:, j], color=f"C{c}", linestyle=":", alpha=0.6)
            ax.set(yscale="log", xlabel="step", ylabel="L2 norm",
                   title=f"block top-k {label}: residual (solid), gradient (dotted)")
        axes[0].legend(fontsize=8)
        i = names.index("fc1/kernel")
        raster = np.zeros((layouts[i].num_blocks, len(logs["5%"]["ids"])))
        for t, ids in enumerate(logs["5%"]["ids"]):
            raster[ids[i], t] = 1
        sent_once = raster.sum(axis=1) > 0
        waiting = np.abs(logs["5%"]["state"][i].numpy()).sum(axis=0) > 0
        axes[2].imshow(raster, aspect="auto", cmap="Greys", interpolation="nearest")
        axes[2].set(xlabel="step", ylabel="fc1 unit (block)", title="fc1 units sent (5%)")
        fig.tight_layout()
        plt.show()
        print(f"fc1 units sent at least once: {sent_once.sum()}; units with a gradient in these "
              f"60 steps: {(sent_once | waiting).sum()} of {layouts[i].num_blocks} (the others "
              "are dead ReLU units)")
    '''),
    md('''
        ## Bytes: block top-k against element top-k at the same density

        What one replica hands to the collectives for this gradient (`codec.buffer_nbytes` of
        the payload's id and value tensors): block top-k sends one int32 id per *block* and the
        block's values; element top-k one int32 index per *value*, so at equal density its
        payload is about twice as large (below 1% block top-k still sends one block per
        variable, a whole fc1 column).  The right panel is the other side of the trade: what
        each payload carries of the gradient's squared L2 norm.  Element top-k picks the
        largest entries wherever they are and carries more per byte sent; block top-k sends
        whole filters and units, scores only `num_blocks` values per variable instead of
        sorting every entry, and relies on error feedback for the rest.
    '''),
    code('''
        def payload_bytes(p):
            return sum(codec.buffer_nbytes(i) + codec.buffer_nbytes(v)
                       for i, v in zip(p.ids, p.values))


        def energy(p):
            return sum(float(tf.reduce_sum(tf.square(v))) for v in p.values)


        total_energy = sum(float(tf.reduce_sum(tf.square(g))) for g in grads)
        dense = sum(codec.dense_nbytes(g.shape, g.dtype) for g in grads)
        densities = [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5]
        sweep = {"block": [], "element": []}
        for d in densities:
            for kind, cls in (("block", tfbs.BlockTopK), ("element", tfbs.ElementTopK)):
                comp = cls(layouts, density=d)
                p, _ = comp.compress(grads, comp.init())
                sweep[kind].append((payload_bytes(p), energy(p) / total_energy))

        print(f"dense gradient: {dense:,} bytes")
        print(f"{'density':>8s} {'block bytes':>12s} {'element bytes':>14s} "
              f"{'block energy':>13s} {'element energy':>15s}")
        for d, (bb, be), (eb, ee) in zip(densities, sweep["block"], sweep["element"]):
            print(f"{d:8.3f} {bb:12,d} {eb:14,d} {be:13.3f} {ee:15.3f}")

        fig, (ax_b, ax_e) = plt.subplots(1, 2, figsize=(13, 4.2))
        for kind, marker in (("block", "o-"), ("element", "s-")):
            nbytes, captured = zip(*sweep[kind])
            ax_b.plot(densities, nbytes, marker, label=f"{kind} top-k")
            ax_e.plot(nbytes, captured, marker, label=f"{kind} top-k")
        ax_b.axhline(dense, color="gray", linestyle="--", label="dense")
        ax_b.set(xscale="log", yscale="log", xlabel="density", ylabel="payload bytes",
                 title="bytes per replica and step")
        ax_e.set(xscale="log", xlabel="payload bytes",
                 ylabel="share of the gradient's squared L2 norm sent",
                 title="what the bytes carry")
        ax_b.legend()
        ax_e.legend()
        plt.show()
    '''),
    md('''
        ## Run-length codec sizes

        `run_length.rle_encode` drops the zero runs of a tensor (4-byte header, int32 start and
        length per run, then the non-zero values).  Applied to the block update in the variable's
        own layout, a filter or unit block is strided (one entry per row of a Dense kernel), so it
        costs a run per row.  In the block-major view (`[blocks, outer * inner]`, one transpose)
        each selected block is contiguous, and RLE comes close to the block payload (ids plus
        values); what it still adds comes from zeros inside the blocks (an input that was zero for
        the whole batch, e.g. after a ReLU, gives a zero weight gradient), each of which splits a
        run.  Element updates are scattered: about one run per value.  `run_length.rle_decode`
        restores every tensor exactly, and `run_length.rle_encode_tf` (usable inside a
        `tf.function`) finds the same runs.
    '''),
    code('''
        def block_major(x, lay):
            """[num_blocks, outer * inner]: every block one contiguous row."""
            return np.transpose(x.reshape(lay.view_shape), (1, 0, 2)).reshape(lay.num_blocks, -1)


        def nbytes_of(p, j):
            return codec.buffer_nbytes(p.ids[j]) + codec.buffer_nbytes(p.values[j])


        rows = []
        for j, (name, lay) in enumerate(zip(names, layouts)):
            b, e = sent[j].numpy(), element_sent[j].numpy()
            rle_b, rle_e = run_length.rle_encode(b), run_length.rle_encode(e)
            rle_major = run_length.rle_encode(block_major(b, lay))
            assert np.array_equal(run_length.rle_decode(rle_b), b)
            assert np.array_equal(run_length.rle_decode(rle_e), e)
            starts, lengths, values = run_length.rle_encode_tf(tf.constant(b))
            assert np.array_equal(starts.numpy(), rle_b.starts)
            assert np.array_equal(values.numpy(), rle_b.values)
            rows.append((name, codec.dense_nbytes(b.shape, b.dtype), nbytes_of(payload, j),
                         run_length.rle_nbytes(rle_b), run_length.rle_nbytes(rle_major),
                         nbytes_of(element_payload, j), run_length.rle_nbytes(rle_e)))
        header = ("variable", "dense", "block", "block RLE", "block-major RLE", "element",
                  "element RLE")
        print("  ".join(f"{h:>15s}" for h in header))
        for row in rows:
            print(f"{row[0]:>15s}  " + "  ".join(f"{v:15,d}" for v in row[1:]))
        totals = np.array([row[1:] for row in rows]).sum(axis=0)
        print(f"{'total':>15s}  " + "  ".join(f"{v:15,d}" for v in totals))

        fig, ax = plt.subplots(figsize=(10, 3.8))
        bars = ax.bar(header[1:], totals, color=["gray", "C0", "C0", "C0", "C1", "C1"])
        ax.bar_label(bars, [f"{v / 1024:.1f} KiB" for v in totals])
        ax.set(ylabel="bytes", title=f"one gradient at {DENSITY:.0%} density")
        plt.show()
    '''),
    md('''
        ## Summary

        * A block is a structural unit (a filter, a neuron's incoming weights), so the selection
          scores `num_blocks` values per variable, not every entry, and the payload needs one
          id per block.
        * Error feedback keeps the residual bounded: blocks that lose the selection accumulate
          until they win it, so over a few dozen steps most of fc1's units are sent.
        * At equal density, element top-k pays an index per value (about 2x the bytes) and a
          full `top_k` per tensor; in exchange it carries more of the gradient per byte.  Block
          top-k trades that for structure: cheap selection, contiguous payloads, and error
          feedback that delivers the rest a few steps later.
        * Run-length coding of a block update only comes close to the block payload in the
          block-major layout; the exchange sends block ids and values directly.
    '''),
]


# --------------------------------------------------------------------------- 3. planner

PLANNER = [
    md(f'''
        # Pipeline planning on heterogeneous links

        The pipeline planner splits a chain model into consecutive stages and places
        each stage on a run of devices (data parallel inside the stage), minimising the slowest
        stage's time per micro-batch:
        `T_s = compute / replicas + activation bytes in / link bandwidth + ring all-reduce of
        the stage's parameters`.  This notebook profiles a real model layer by layer, draws a
        cluster with uneven links, plans it with the bandwidth-aware dynamic program and two
        baselines (PipeDream's planner, a bandwidth-oblivious equal-compute split), draws the
        stages over the devices, simulates GPipe / 1F1B schedules, and finally trains the model
        for a few steps with `tfbs.PipelineTrainer` on two logical CPUs.

        {colab_note("about a minute")}
    '''),
    INSTALL,
    code('''
        import time

        import keras
        import matplotlib.pyplot as plt
        import numpy as np
        import tensorflow as tf

        import tf_blocksparse as tfbs
        from tf_blocksparse import planning
    ''', logical_cpus(2, "two devices for the pipeline stages")),
    md('''
        ## Profile a model

        A VGG-style CNN with a large fully-connected head (`models/vgg.py`: conv blocks with
        big activations and few parameters, then dense layers with ~98% of the parameters and
        tiny activations).  `tfbs.profile_model` times every layer's forward and backward on
        its real input activations (median of 5 runs at a micro-batch of 16) and records the
        bytes of its output activation and of its parameters.  Timings on a shared CPU vary
        from run to run, and so can the plans below.
    '''),
    VGG,
    code('''
        MICRO_BATCH = 16
        keras.utils.set_random_seed(0)
        model = vgg_fc((28, 28, 1))
        start = time.perf_counter()
        profile = tfbs.profile_model(model, batch_size=MICRO_BATCH)
        print(f"profiled {profile.num_layers} layers in {time.perf_counter() - start:.1f} s\\n")
        print(f"{'layer':10s} {'fwd+bwd ms':>10s} {'activation KiB':>15s} {'params KiB':>11s}")
        for layer in profile.layers:
            print(f"{layer.name:10s} {layer.compute_s * 1e3:10.2f} "
                  f"{layer.activation_bytes / 1024:15.1f} {layer.param_bytes / 1024:11.1f}")
        layer_names = [layer.name for layer in profile.layers]
    '''),
    md('''
        ## A heterogeneous cluster

        `Topology.random_heterogeneous(8, base, spread=0.8)`: 8 devices whose pairwise links
        are uniform in `[0.2, 1] x base` bytes/s (links differ by up to 80%).  Here
        `base = 125 MB/s` (1 Gbit/s Ethernet).  The planner orders devices by their total
        bandwidth (highest first) and gives stages runs of that order.
    '''),
    code('''
        topology = planning.Topology.random_heterogeneous(8, 125e6, spread=0.8, seed=0)
        order = topology.bandwidth_order()
        bw = np.array(topology.bandwidth) / 1e6
        fig, ax = plt.subplots(figsize=(5.5, 4.5))
        im = ax.imshow(np.where(bw > 0, bw, np.nan), cmap="viridis")
        fig.colorbar(im, ax=ax, label="MB/s")
        ax.set(xlabel="device", ylabel="device", title="link bandwidth")
        plt.show()
        print("bandwidth order (highest total first):", order)
    '''),
    md('''
        ## Plan, and compare with the baselines

        All three plans are evaluated with the same cost model (`compare_pipeline_plans`):
        `bottleneck_s` is the slowest stage's time per micro-batch, `throughput` its inverse.
    '''),
    code('''
        plans = {
            "bandwidth DP": planning.plan_pipeline(profile, topology),
            "PipeDream": planning.plan_pipedream(profile, topology),
            "oblivious": planning.plan_oblivious(profile, topology),
        }
        summary = planning.compare_pipeline_plans(profile, topology, list(plans.values()))
        for label, row in zip(plans, summary):
            print(f"{label:13s} {row['stages']} stages on {row['devices_used']} devices "
                  f"{row['devices']}: bottleneck {row['bottleneck_s'] * 1e3:6.2f} ms, "
                  f"{row['throughput']:6.1f} micro-batches/s")
        print()
        for label, plan in plans.items():
            print(label)
            for s, st in enumerate(plan.stages):
                print(f"  stage {s}: {layer_names[st.first_layer]:>8s} .. "
                      f"{layer_names[st.last_layer]:8s} on devices {st.devices}: compute "
                      f"{st.compute_s * 1e3:5.2f} ms + in {st.comm_in_s * 1e3:5.2f} ms "
                      f"+ sync {st.sync_s * 1e3:6.2f} ms = {st.time_s * 1e3:6.2f} ms")
    '''),
    md('''
        ## Stages over devices

        Each grid is one plan: rows are the devices in bandwidth order, columns the layers; a
        coloured cell means the device holds that layer (one colour per stage, a stage with
        several rows runs data parallel).  The bars to the right split each stage's time into
        compute, incoming activations and parameter sync.
    '''),
    code('''
        def draw_plan(ax_grid, ax_time, plan, title):
            pos = {d: i for i, d in enumerate(order)}
            grid = np.full((topology.num_devices, profile.num_layers), np.nan)
            for s, st in enumerate(plan.stages):
                for d in st.devices:
                    grid[pos[d], st.first_layer:st.last_layer + 1] = s
            ax_grid.imshow(grid, cmap="tab10", vmin=0, vmax=10, aspect="auto")
            ax_grid.set_xticks(range(profile.num_layers), layer_names, rotation=60, fontsize=8)
            ax_grid.set_yticks(range(topology.num_devices), [f"dev {d}" for d in order],
                               fontsize=8)
            ax_grid.set_title(title)
            parts = np.array([[st.compute_s, st.comm_in_s, st.sync_s] for st in plan.stages])
            left = np.zeros(len(parts))
            for c, label in enumerate(("compute", "activations in", "sync")):
                ax_time.barh(range(len(parts)), parts[:, c] * 1e3, left=left * 1e3,
                             color=["0.3", "C1", "C2"][c], label=label)
                left += parts[:, c]
            ax_time.set_yticks(range(len(parts)), [f"stage {s}" for s in range(len(parts))])
            ax_time.invert_yaxis()
            ax_time.axvline(plan.bottleneck_s * 1e3, color="red", linestyle="--")
            ax_time.set_xlabel("ms per micro-batch")


        fig, axes = plt.subplots(len(plans), 2, figsize=(14, 3.3 * len(plans)),
                                 gridspec_kw={"width_ratios": [2, 1]})
        for (label, plan), (ax_grid, ax_time) in zip(plans.items(), axes):
            draw_plan(ax_grid, ax_time, plan,
                      f"{label}: bottleneck {plan.bottleneck_s * 1e3:.2f} ms")
        axes[0, 1].legend(fontsize=8)
        fig.tight_layout()
        plt.show()
    '''),
    md('''
        ## Simulated throughput

        `simulate_pipeline` pushes one mini-batch of `M` micro-batches through a plan, event by
        event: each stage runs one forward or backward at a time, activations and gradients
        queue on the links, and each stage all-reduces its parameters at the end (the flush).
        More micro-batches fill the pipeline; the steady state approaches the cost model's
        `1 / bottleneck`.  Below, samples/s against `M` for both schedules, then throughput
        against the cluster's base bandwidth (same profile, same random link spread).
    '''),
    code('''
        micro_batches = [1, 2, 4, 8, 16, 32]
        fig, (ax_m, ax_bw) = plt.subplots(1, 2, figsize=(14, 4.2))
        for c, (label, plan) in enumerate(plans.items()):
            for schedule, style in (("gpipe", "o-"), ("1f1b", "s--")):
                rate = [planning.simulate_pipeline(profile, topology, plan, m, schedule,
                                                   micro_batch_size=MICRO_BATCH)
                        ["throughput_samples_per_s"] for m in micro_batches]
                ax_m.plot(micro_batches, rate, style, color=f"C{c}", label=f"{label}, {schedule}")
        ax_m.set(xscale="log", xlabel="micro-batches per mini-batch", ylabel="samples/s",
                 title="simulated throughput (125 MB/s base)")
        ax_m.set_xticks(micro_batches, micro_batches)
        ax_m.legend(fontsize=8)

        bases = [25e6, 50e6, 125e6, 250e6, 500e6, 1.25e9, 2.5e9, 5e9]
        planners = {"bandwidth DP": planning.plan_pipeline, "PipeDream": planning.plan_pipedream,
                    "oblivious": planning.plan_oblivious}
        for c, (label, planner) in enumerate(planners.items()):
            rate = []
            for base in bases:
                topo = planning.Topology.random_heterogeneous(8, base, spread=0.8, seed=0)
                plan = planner(profile, topo)
                rate.append(planning.simulate_pipeline(
                    profile, topo, plan, 8, "1f1b",
                    micro_batch_size=MICRO_BATCH)["throughput_samples_per_s"])
            ax_bw.plot(np.array(bases) / 1e6, rate, "o-", color=f"C{c}", label=label)
        ax_bw.set(xscale="log", xlabel="base link bandwidth (MB/s)", ylabel="samples/s",
                  title="1F1B, 8 micro-batches, 8 devices")
        ax_bw.legend()
        plt.show()
    '''),
    md('''
        The schedule of the bandwidth-aware plan, 4 micro-batches, GPipe: one row per stage
        (forward in blue, backward in orange, the final all-reduce in green); the thin bars
        under a row are its outgoing transfers (activations down, gradients up).
    '''),
    code('''
        plan = plans["bandwidth DP"]
        sim = planning.simulate_pipeline(profile, topology, plan, 4, "gpipe",
                                         micro_batch_size=MICRO_BATCH, return_events=True)
        colors = {"forward": "C0", "backward": "C1", "allreduce": "C2",
                  "send_activation": "0.5", "send_gradient": "0.7"}
        fig, ax = plt.subplots(figsize=(14, 0.8 + 0.9 * plan.num_stages))
        for ev in sim["events"]:
            start, width = ev["start_s"] * 1e3, (ev["end_s"] - ev["start_s"]) * 1e3
            thin = ev["kind"].startswith("send")
            y = ev["stage"] + (0.35 if thin else 0.0)
            ax.barh(y, width, left=start, height=0.2 if thin else 0.6,
                    color=colors[ev["kind"]], edgecolor="white")
            if ev["micro_batch"] is not None and not thin:
                ax.text(start + width / 2, y, str(ev["micro_batch"]), ha="center",
                        va="center", fontsize=7, color="white")
        ax.set_yticks(range(plan.num_stages), [f"stage {s}" for s in range(plan.num_stages)])
        ax.invert_yaxis()
        ax.set(xlabel="ms", title=f"GPipe, 4 micro-batches: makespan {sim['makespan_s'] * 1e3:.1f} "
                                  f"ms, {sim['throughput_samples_per_s']:.0f} samples/s")
        plt.show()
    '''),
    md('''
        ## Larger plans

        The planner is pure Python and fast: a 48-layer CNN-shaped synthetic profile on 16
        devices with 80% bandwidth spread (the case of `launch/bench_pipeline.py`, which also
        profiles ResNet-50 and VGG-16).
    '''),
    code('''
        big = planning.synthetic_profile("cnn", 48, layer_compute_s=5e-3)
        cluster = planning.Topology.random_heterogeneous(16, 1.25e9, spread=0.8, seed=1)
        for planner in (planning.plan_pipeline, planning.plan_pipedream, planning.plan_oblivious):
            start = time.perf_counter()
            plan = planner(big, cluster)
            took = time.perf_counter() - start
            rate = planning.simulate_pipeline(big, cluster, plan, 16, "1f1b")
            print(f"{plan.method:13s} {plan.num_stages:2d} stages on {len(plan.devices_used):2d} "
                  f"devices, bottleneck {plan.bottleneck_s * 1e3:6.2f} ms, simulated "
                  f"{rate['throughput_samples_per_s']:6.1f} micro-batches/s  "
                  f"(planned in {took * 1e3:.0f} ms)")
    '''),
    md('''
        ## Run a plan: `tfbs.PipelineTrainer`

        The same model trained with a pipeline plan on this machine's two logical CPUs (a
        homogeneous 2-device topology; on a CPU the logical devices share the cores, so this
        shows the mechanics, not a speed-up).  The trainer builds the whole step -- GPipe
        micro-batches, gradient accumulation, replica sync, the update -- as one `tf.function`
        with explicit device scopes; `copy_to_model()` writes the trained weights back.
    '''),
    DATA,
    code('''
        (x_train, y_train), (x_test, y_test) = load_images(4_096, 1_000)
        keras.utils.set_random_seed(0)
        model = vgg_fc(x_train.shape[1:])
        local = planning.Topology.homogeneous(2, 5e9)  # two logical CPUs sharing memory
        local_profile = tfbs.profile_model(model, batch_size=16)
        local_plan = planning.plan_pipeline(local_profile, local)
        if local_plan.num_stages == 1:  # show a real pipeline even where one stage would do
            local_plan = planning.plan_oblivious(local_profile, local)
        print("plan:", local_plan.method)
        for s, st in enumerate(local_plan.stages):
            print(f"stage {s}: layers {st.first_layer}..{st.last_layer} on device(s) {st.devices}")

        trainer = tfbs.PipelineTrainer(
            model, local_plan.stages, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            keras.optimizers.SGD(0.02, momentum=0.9), micro_batches=4)
        BATCH, losses = 64, []
        EPOCHS = 2 if len(x_train) >= 4_096 else 6  # the digits fallback is ~3x smaller
        start = time.perf_counter()
        for epoch in range(EPOCHS):
            order = np.random.default_rng(epoch).permutation(len(x_train))
            for b in range(len(x_train) // BATCH):
                idx = order[b * BATCH:(b + 1) * BATCH]
                losses.append(float(trainer.train_step(x_train[idx], y_train[idx])))
        print(f"{len(losses)} pipelined steps in {time.perf_counter() - start:.1f} s")
        trainer.copy_to_model()
        logits = model.predict(x_test, verbose=0)
        print("test accuracy:", round(float(np.mean(logits.argmax(1) == y_test)), 3))

        fig, ax = plt.subplots(figsize=(8, 3.2))
        ax.plot(losses)
        ax.set(xlabel="step", ylabel="loss", title="PipelineTrainer on 2 logical CPUs")
        plt.show()
    '''),
    md('''
        ## Summary

        * The bandwidth-aware planner places stage boundaries where activations are small and
          keeps parameter-heavy layers off slow rings; the oblivious split ignores links and
          pays for every transfer, PipeDream's planner assumes one mean bandwidth.
        * It searches every split of the layers over every run of the bandwidth-ordered
          devices exactly (a dynamic program), so under the shared cost model it usually
          beats the baselines, which each fix part of the choice; the simulator shows how much
          of that survives real schedules (GPipe, 1F1B) and pipeline fill, and that the gap
          grows as links get slower.
        * `tfbs.PipelineTrainer(model, plan.stages, loss, optimizer, micro_batches)` runs a plan
          on real devices; its gradients equal full-batch training's.
    '''),
]


# --------------------------------------------------------------------------- 4. hybrid

HYBRID = [
    md(f'''
        # Hybrid conv/FC training and memory-aware placement

        Convolutional layers hold few parameters and do most of the compute; fully-connected
        layers hold most of the parameters and little compute.  The hybrid scheme
        splits a CNN at that boundary: group A trains the conv trunk data parallel on `I`
        replicas, group B trains the FC head on `J` replicas, and only the boundary activation
        (and its gradient) travels between them.  The head's large weights and optimizer state
        can live in *expanded memory* (CXL memory, emulated here by host memory) and be
        streamed to the device layer by layer; a planner decides which layers go there under a
        device memory budget.

        This notebook finds the boundary of a VGG-style CNN, splits it, plans the placement for
        several device budgets, and trains the model for a short while with
        `HybridTrainer` on four logical CPUs: two conv replicas, one FC replica, and one
        device standing in for the expanded memory.

        {colab_note("about a minute")}
    '''),
    INSTALL,
    code('''
        import math
        import time

        import keras
        import matplotlib.pyplot as plt
        import numpy as np
        import tensorflow as tf

        from tf_blocksparse import HybridTrainer, find_boundary, split_model
        from tf_blocksparse.hybrid.split import layer_memory
        from tf_blocksparse.pipeline.profiler import measure_layers
        from tf_blocksparse.planning import MemoryBudget, evaluate_placement, plan_placement
    ''', logical_cpus(4, "2 conv replicas, 1 FC replica, expanded memory")),
    md('''
        ## The conv/FC boundary

        `find_boundary(model)` returns the input of the first `Dense` after the last
        convolution (or of a layer you name); `split_model` cuts the model there into a trunk
        and a head that share the original layers, so `head(trunk(x)) == model(x)`.
    '''),
    VGG,
    code('''
        keras.utils.set_random_seed(0)
        model = vgg_fc((28, 28, 1))
        boundary = find_boundary(model)
        trunk, head = split_model(model, boundary)
        print(f"last convolution: {boundary.last_conv}; boundary tensor: output of "
              f"{boundary.producer!r}, shape {boundary.tensor.shape}; head starts at "
              f"{boundary.head_layer!r}")
        probe = np.random.default_rng(0).random((8, 28, 28, 1)).astype("float32")
        print("max |head(trunk(x)) - model(x)| =",
              float(np.abs(head(trunk(probe)) - model(probe)).max()))
        for part in (trunk, head):
            print(f"{part.name:12s} layers {[layer.name for layer in part.layers[1:]]}, "
                  f"{part.count_params():,} parameters")
    '''),
    md('''
        ## Per-layer memory

        `layer_memory` lists what each layer needs for a global mini-batch of 64 with SGD +
        momentum (one optimizer slot per weight): parameter bytes, optimizer-state bytes and
        output-activation bytes, plus the measured forward + backward time
        (`measure_layers`).  The trunk's memory is activations, the head's is weights.
    '''),
    code('''
        BATCH = 64
        sgd = keras.optimizers.SGD(0.02, momentum=0.9)
        timings = measure_layers(model, batch_size=BATCH, warmup=1, repeats=3)
        layers = layer_memory(model, boundary, BATCH, sgd, {m.name: m.compute_s for m in timings})
        MiB = 2**20
        print(f"{'layer':8s} {'group':5s} {'params MiB':>10s} {'slots MiB':>9s} "
              f"{'activations MiB':>15s} {'fwd+bwd ms':>10s}")
        for lay in layers:
            print(f"{lay.name:8s} {lay.group:5s} {lay.param_bytes / MiB:10.2f} "
                  f"{lay.optimizer_state_bytes / MiB:9.2f} {lay.activation_bytes / MiB:15.2f} "
                  f"{lay.compute_s * 1e3:10.2f}")

        fig, ax = plt.subplots(figsize=(11, 3.8))
        x = np.arange(len(layers))
        ax.bar(x - 0.2, [lay.param_bytes / MiB for lay in layers], 0.4, label="parameters")
        ax.bar(x + 0.2, [lay.activation_bytes / MiB for lay in layers], 0.4,
               label=f"activations (batch {BATCH})")
        ax.axvline(sum(not lay.is_fc for lay in layers) - 0.5, color="red", linestyle="--",
                   label="conv/FC boundary")
        ax.set_xticks(x, [lay.name for lay in layers])
        ax.set(yscale="log", ylabel="MiB")
        ax.legend()
        plt.show()
    '''),
    md('''
        ## Memory-aware placement

        `plan_placement(layers, device_budget, expanded_budget, host_bandwidth,
        link_bandwidth, conv_replicas, fc_replicas)` starts with every layer on its group's
        device; while the FC group is over the device budget it moves the FC layer with the
        largest resident bytes (weights, gradient, optimizer slots) to expanded memory, then
        the same for the conv group.  A layer in expanded memory still needs a *staging*
        buffer on the device (its weights and gradient in flight), so some budgets cannot be
        met at all -- the planner then raises a `ValueError` that says why.  Each plan comes
        with a predicted step time: compute, boundary transfers, all-reduces, and the cost of
        streaming and updating the expanded layers over the host link.  Below: 2 conv
        replicas, 1 FC replica, 25 GB/s host link, 12.5 GB/s network, expanded memory
        unlimited.
    '''),
    code('''
        HOST_BW, LINK_BW, I_REPLICAS, J_REPLICAS = 25e9, 12.5e9, 2, 1
        plans, refused = {}, {}
        for budget_mib in (64, 48, 32, 24, 16):
            try:
                plans[budget_mib] = plan_placement(layers, budget_mib * MiB, math.inf, HOST_BW,
                                                   LINK_BW, I_REPLICAS, J_REPLICAS)
            except ValueError as err:
                refused[budget_mib] = str(err)
        for budget_mib, plan in plans.items():
            fc = plan.group_bytes["fc"]
            print(f"{budget_mib:3d} MiB: expanded {list(plan.expanded_layers) or '-'}; FC "
                  f"device {fc['device'] / MiB:5.1f} MiB (staging {fc['staging'] / MiB:4.1f}), "
                  f"expanded {fc['expanded'] / MiB:5.1f} MiB; conv device "
                  f"{plan.group_bytes['conv']['device'] / MiB:4.1f} MiB; predicted step "
                  f"{plan.step_time_s * 1e3:.1f} ms")
        for budget_mib, why in refused.items():
            print(f"{budget_mib:3d} MiB: refused -- {why}")
    '''),
    code('''
        fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(15, 4.2))
        labels = [f"{b} MiB" for b in plans]
        x = np.arange(len(plans))
        bottom = np.zeros(len(plans))
        for key, color in (("resident", "C0"), ("activations", "C1"), ("staging", "C2")):
            values = []
            for plan in plans.values():
                g = plan.group_bytes["fc"]
                values.append((g["device"] - g["activations"] - g["staging"]
                               if key == "resident" else g[key]) / MiB)
            ax_mem.bar(x - 0.2, values, 0.4, bottom=bottom, color=color, label=f"device: {key}")
            bottom += values
        expanded_mib = [p.group_bytes["fc"]["expanded"] / MiB for p in plans.values()]
        ax_mem.bar(x + 0.2, expanded_mib, 0.4, color="0.6", label="expanded memory")
        ax_mem.hlines(list(plans), x - 0.45, x + 0.05, color="red", label="device budget")
        ax_mem.set_xticks(x, labels)
        ax_mem.set_ylim(0, 1.4 * max(*plans, bottom.max(), *expanded_mib))
        ax_mem.set(xlabel="device budget", ylabel="MiB per FC replica", title="FC group memory")
        ax_mem.legend(fontsize=8, ncol=3, loc="upper center")

        terms = list(next(iter(plans.values())).breakdown)
        left = np.zeros(len(plans))
        for c, term in enumerate(terms):
            values = np.array([p.breakdown[term] * 1e3 for p in plans.values()])
            if values.any():
                ax_time.barh(x, values, left=left, color=plt.cm.tab20(c), label=term)
                left += values
        ax_time.set_yticks(x, labels)
        ax_time.invert_yaxis()
        ax_time.set(xlabel="predicted ms per step", title="step time breakdown")
        ax_time.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
        fig.tight_layout()
        plt.show()
    '''),
    md('''
        `evaluate_placement` prices any placement you choose, e.g. the simplest
        placement -- the whole FC group in expanded memory (`offload_fc_group=True` in
        `plan_placement`) -- against keeping everything on the device.
    '''),
    code('''
        budget = MemoryBudget(math.inf, math.inf, HOST_BW, LINK_BW)
        head_layers = [lay.name for lay in layers if lay.is_fc and lay.param_bytes]
        for label, expanded in (("all on the device", []), ("FC group in expanded", head_layers)):
            plan = evaluate_placement(layers, expanded, budget, I_REPLICAS, J_REPLICAS)
            print(f"{label:22s} FC device {plan.group_bytes['fc']['device'] / MiB:5.1f} MiB, "
                  f"predicted step {plan.step_time_s * 1e3:.1f} ms")
    '''),
    md('''
        ## A short hybrid run

        `HybridTrainer` builds the whole step as one `tf.function`: the two conv replicas run
        the trunk on their halves of the batch, the activations travel to the FC replica, the
        head runs forward and backward, the head's gradients are summed over the FC group and
        the activation gradients travel back, then the trunk's backward, and each conv
        variable's gradient is all-reduced as soon as it is ready.  `offload=plan` keeps the
        layers the 32 MiB plan put in expanded memory on `host_device` (their variables and
        optimizer slots).  First a check: the trainer's gradients equal the full-batch
        gradient of the unsplit model.
    '''),
    DATA,
    code('''
        (x_train, y_train), (x_test, y_test) = load_images(4_096, 1_000)
        CONV, FC, HOST = ["/cpu:0", "/cpu:1"], ["/cpu:2"], "/cpu:3"
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        EPOCHS = 2 if len(x_train) >= 4_096 else 6  # the digits fallback is ~3x smaller


        def make_trainer(compression=None):
            keras.utils.set_random_seed(0)
            net = vgg_fc(x_train.shape[1:])
            net_layers = layer_memory(net, None, BATCH, sgd)
            plan = plan_placement(net_layers, 32 * MiB, math.inf, HOST_BW, LINK_BW, 2, 1)
            trainer = HybridTrainer(net, CONV, FC, sgd, loss, host_device=HOST,
                                    compression=compression, offload=plan)
            return net, trainer


        net, trainer = make_trainer()
        xb, yb = x_train[:BATCH], y_train[:BATCH]
        with tf.GradientTape() as tape:
            full = loss(yb, net(xb, training=True))
        want = tape.gradient(full, net.trainable_variables)
        got = trainer.compute_gradients(xb, yb)
        print("max |hybrid gradient - full-batch gradient| =",
              max(float(tf.reduce_max(tf.abs(a - b))) for a, b in zip(got, want)))
        where = trainer.placement()
        print("expanded layers on", where["host_device"], ":", where["expanded_layers"])
        for device, nbytes in sorted(trainer.variable_bytes_by_device().items()):
            print(f"  {device.split('device:')[-1]}: {nbytes / MiB:6.2f} MiB of variables")
    '''),
    md('''
        Two runs of 128 steps (two epochs) on the same batches: dense exchange in both groups, and
        block-sparse exchange (10% of the blocks, with error feedback) in the conv group.  The
        FC group has a single replica here, so it has nothing to exchange.  `syncs[g].nbytes()`
        gives what one replica hands to its group's exchange per step.
    '''),
    code('''
        runs = {}
        for label, compression in (("dense", None), ("conv block 10%", {"conv": {"density": 0.1}})):
            net, trainer = make_trainer(compression)
            losses, start = [], time.perf_counter()
            for epoch in range(EPOCHS):
                order = np.random.default_rng(epoch).permutation(len(x_train))
                for b in range(len(x_train) // BATCH):
                    idx = order[b * BATCH:(b + 1) * BATCH]
                    losses.append(float(trainer.train_step(x_train[idx], y_train[idx])))
            seconds = time.perf_counter() - start
            trainer.copy_to_model()
            accuracy = float(np.mean(net.predict(x_test, verbose=0).argmax(1) == y_test))
            runs[label] = losses
            sent = {g: trainer.syncs[g].nbytes() for g in ("conv", "fc")}
            print(f"{label:15s} {len(losses)} steps in {seconds:5.1f} s, test accuracy "
                  f"{accuracy:.3f}; conv exchange {sent['conv']['payload']:,} of "
                  f"{sent['conv']['dense']:,} bytes per replica and step")

        fig, ax = plt.subplots(figsize=(9, 3.5))
        for label, losses in runs.items():
            ax.plot(losses, label=label)
        ax.set(xlabel="step", ylabel="loss", title="HybridTrainer: 2 conv replicas + 1 FC replica")
        ax.legend()
        plt.show()
    '''),
    md('''
        ## Summary

        * The boundary is where the activation is small and the parameters start: here the
          head holds ~98% of the weights, the trunk almost all of the activation memory.
        * The placement planner moves the heaviest FC layers to expanded memory only as far as
          the device budget demands, and says when no placement can fit (the staging buffer of
          the largest offloaded layer sets a floor); the cost model prices each choice.
        * `HybridTrainer` runs the plan: gradients equal full-batch training's, offloaded
          layers keep their state on the host device, and each group can use dense or
          block-sparse exchange.  `python -m launch.train_hybrid --help` has the command-line
          version, with a data-parallel reference run.
    '''),
]


# --------------------------------------------------------------------------- assembly

NOTEBOOKS: dict[str, list[Cell]] = {
    "quickstart": QUICKSTART,
    "compression_anatomy": ANATOMY,
    "pipeline_planner": PLANNER,
    "hybrid_placement": HYBRID,
}

METADATA = {
    "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
    "language_info": {"name": "python"},
    "colab": {"provenance": [], "toc_visible": True},
    "accelerator": "None",
}


def build(name: str) -> nbformat.NotebookNode:
    """The notebook ``name`` (outputs empty, deterministic cell ids)."""
    nb = v4.new_notebook(metadata=METADATA)
    for i, (kind, source) in enumerate(NOTEBOOKS[name]):
        make = v4.new_markdown_cell if kind == "md" else v4.new_code_cell
        nb.cells.append(make(source, id=f"{name[:40]}-{i:02d}"))
    nbformat.validate(nb)
    return nb


def render(name: str) -> str:
    """The file text of notebook ``name``."""
    return nbformat.writes(build(name)) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if a notebook differs from its generated text")
    parser.add_argument("names", nargs="*", help="notebooks to write (default: all)")
    args = parser.parse_args(argv)
    stale = []
    for name in args.names or NOTEBOOKS:
        path = HERE / f"{name}.ipynb"
        text = render(name)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(path.name)
        else:
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print(f"stale notebooks (run python colab/build_notebooks.py): {stale}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
