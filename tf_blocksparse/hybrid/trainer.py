"""Hybrid conv/FC training with the FC group's state in (emulated) expanded memory.

The model is split at its conv/FC boundary (:func:`~tf_blocksparse.hybrid.split.
find_boundary`).  Group A: ``I`` replicas train the conv trunk data-parallel on
``conv_devices``.  Group B: ``J`` replicas train the FC head data-parallel on ``fc_devices``.
The layers in *expanded memory* (by default every head layer; or the layers a
:class:`~tf_blocksparse.hybrid.PlacementPlan` puts there) keep their variables,
optimizer slots and block-sparse residuals on ``host_device`` -- host memory standing in for a
CXL memory expander -- while their compute runs on the group's device (on a GPU the weights
are read from host memory every step and the optimizer update runs on the host; pass the host
as an FC device to compute there too).  Here the devices are logical CPUs, or a GPU when there
is one.

Row mapping: the global mini-batch [B, ...] is cut into ``I`` consecutive slices (sizes differ
by at most one).  When ``I >= J``, A replica ``i`` sends its rows to B replica
``n(i) = floor(i * J / I)`` (several consecutive A replicas per B replica); when ``I < J`` the
batch is cut into ``J`` slices and an A replica's rows go to the B replicas whose slices
overlap them.

One step, built as **one** ``tf.function`` with explicit ``tf.device`` scopes (TF's executor
runs every op as soon as its inputs are ready):

1. A forward: each A replica runs the trunk on its slice (last-conv activations [b_i, ...]).
2. The activations travel to the B replicas (only the rows each needs).
3. B forward / backward of the head; per-example losses are summed and divided by ``B``, so
   the replicas' gradients add up to the gradient of the mini-batch mean loss.
4. All-reduce of the head gradients among B (per variable, dense or block-sparse with error
   feedback, :class:`~tf_blocksparse.hybrid.sync.GroupSync`), then the update: one
   optimizer copy per replica and layer (built where the layer's variables live), all applying
   the same summed gradient, so the replicas stay identical.
5. The activation gradients [b_j, ...] travel back to the A replicas.
6. A backward; each conv variable's gradient is all-reduced among A as soon as it is ready: its
   sum depends only on that variable's per-replica gradients (no barrier over the layer list),
   so the reduce of the last conv layer runs while the first layers are still in backward
   (:meth:`HybridTrainer.sync_dependencies` checks this on the traced graph); each layer's
   update depends only on its own sum.

Variables: every replica owns copies; the original model is not trained (call
:meth:`HybridTrainer.copy_to_model`).  Non-trainable state (BatchNorm statistics) is averaged
over a group's replicas after each step; BatchNorm normalises with per-replica statistics.
Optimizer features that look at several variables at once (``global_clipnorm``) act per layer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import keras
import tensorflow as tf

from tf_blocksparse.hybrid.inspection import GROUPS, HybridInspection
from tf_blocksparse.hybrid.split import Boundary, find_boundary, split_model
from tf_blocksparse.hybrid.sync import GroupSync, check_compression, check_devices, row_sizes
from tf_blocksparse.options import CompressionOptions
from tf_blocksparse.runtime.fit import FitLoop
from tf_blocksparse.runtime.losses import loss_part, per_example_loss
from tf_blocksparse.runtime.replica import Replica, average_state, clone_optimizer
from tf_blocksparse.runtime.slicing import reslice

__all__ = ["HybridTrainer"]


class HybridTrainer(HybridInspection, FitLoop):
    """Trains a CNN as two data-parallel groups, conv trunk and FC head (module docstring).

    Attributes:
        model: The model (its layer objects run both groups; its variables are not trained).
        boundary: The :class:`~tf_blocksparse.hybrid.split.Boundary` used.
        trunk: The conv part (a functional model over the original layers).
        head: The FC part.
        expanded_layers: Names of the layers whose state lives on ``host_device``.
        replicas: ``{"conv": [Replica] * I, "fc": [Replica] * J}``
            (:class:`~tf_blocksparse.runtime.replica.Replica`).
        syncs: ``{"conv": GroupSync, "fc": GroupSync}``.
        optimizers: ``optimizers[group][r]``: ``(optimizer, variable indices)`` per layer and
            variable device of replica ``r``.
    """

    def __init__(self, model: keras.Model, conv_devices: Sequence[str],
                 fc_devices: Sequence[str], optimizer: Any, loss: Any,
                 boundary: Boundary | str | None = None, host_device: str = "/cpu:0",
                 compression: CompressionOptions | Mapping[str, Any] | None = None,
                 offload: str | Iterable[str] | Any = "fc") -> None:
        """Splits the model and builds the replicas, syncs and optimizers.

        Args:
            model: A built Sequential or functional CNN with one input and one output.
            conv_devices: Devices of the ``I`` conv replicas (a device may repeat: replicas
                then share its compute).
            fc_devices: Devices of the ``J`` FC replicas (may repeat, may be conv devices).
            optimizer: A Keras optimizer (cloned from its config per replica and layer; the
                instance passed is not used) or a zero-argument function making one.
            loss: A ``keras.losses.Loss``, a loss name, or a function returning per-example
                losses [b] or [b, ...]; the step minimises the mean over the mini-batch.
            boundary: Where to split: a ``Boundary``, the name of the first head layer, or
                ``None`` for the input of the first Dense after the last convolution.
            host_device: Where the expanded-memory layers keep their state.
            compression: ``None`` (dense all-reduce), a
                :class:`~tf_blocksparse.options.CompressionOptions` for both groups, or
                ``{"conv": options | None, "fc": options | None}`` per group.  The
                launchers' dict form ``{"k" | "density", "metric"}`` is accepted in place of
                options and converted once by :func:`check_compression` (every variable
                compressed, ``"allgather"``).
            offload: ``"fc"`` (every head layer in expanded memory), ``"none"``, layer names,
                or a plan with ``expanded_layers`` (e.g. a ``PlacementPlan``).

        Raises:
            ValueError: Bad ``model``, ``boundary``, devices, ``optimizer``, ``loss``,
                ``compression`` or ``offload``.
        """
        self.model = model
        self.boundary = boundary if isinstance(boundary, Boundary) else \
            find_boundary(model, boundary)
        self.trunk, self.head = split_model(model, self.boundary)
        devices = {"conv": check_devices(conv_devices, "conv_devices"),
                   "fc": check_devices(fc_devices, "fc_devices")}
        self.host_device = check_devices([host_device], "host_device")[0]
        self.expanded_layers = self._resolve_offload(offload)
        specs = self._resolve_compression(compression)
        self._loss_fn = per_example_loss(loss)
        self.replicas: dict[str, list[Replica]] = {}
        for group, part in (("conv", self.trunk), ("fc", self.head)):
            self.replicas[group] = [
                Replica(part, dev, lambda name, d=dev: (
                    self.host_device if name in self.expanded_layers else d))
                for dev in devices[group]]
        self.syncs = {g: GroupSync(self.replicas[g], model, specs[g], g) for g in GROUPS}
        self.optimizers: dict[str, list[list[tuple[keras.optimizers.Optimizer, list[int]]]]] = {}
        for group in GROUPS:
            self.optimizers[group] = [self._build_optimizers(rep, optimizer)
                                      for rep in self.replicas[group]]
        where = {id(v): (g, i) for g in GROUPS
                 for i, v in enumerate(self.replicas[g][0].trainable_refs)}
        self._model_order = [where[id(v)] for v in model.trainable_variables]
        self._train_fn = tf.function(lambda x, y: self._step(x, y, None, True), autograph=False)
        self._grad_fn = tf.function(lambda x, y: self._step(x, y, None, False)[1],
                                    autograph=False)

    # ------------------------------------------------------------------------ set-up

    def _resolve_offload(self, offload: Any) -> frozenset[str]:
        names = {layer.name for part in (self.trunk, self.head) for layer in part.layers
                 if not isinstance(layer, keras.layers.InputLayer)}
        if isinstance(offload, str):
            if offload == "fc":
                return frozenset(layer.name for layer in self.head.layers
                                 if layer.name in names)
            if offload == "none":
                return frozenset()
            raise ValueError(f"offload must be 'fc', 'none', layer names or a plan, got "
                             f"{offload!r}")
        chosen = getattr(offload, "expanded_layers", offload)
        if not isinstance(chosen, Iterable):
            raise ValueError(f"offload must be 'fc', 'none', layer names or a plan, got "
                             f"{offload!r}")
        chosen = set(chosen)
        unknown = chosen - names
        if unknown:
            raise ValueError(f"offload: unknown layers {sorted(unknown)} (model layers: "
                             f"{sorted(names)})")
        return frozenset(chosen)

    @staticmethod
    def _resolve_compression(compression: Any) -> dict[str, CompressionOptions | None]:
        if isinstance(compression, Mapping) and compression and set(compression) <= set(GROUPS):
            return {g: check_compression(compression.get(g), f"compression[{g!r}]")
                    for g in GROUPS}
        spec = check_compression(compression, "compression")
        return {g: spec for g in GROUPS}

    @staticmethod
    def _build_optimizers(rep: Replica, optimizer: Any) -> list:
        groups: dict[tuple[str, str], list[int]] = {}
        for i, key in enumerate(zip(rep.owners, rep.var_devices)):
            groups.setdefault(key, []).append(i)
        entries = []
        for (_, dev), idxs in groups.items():
            with tf.device(dev):
                opt = clone_optimizer(optimizer)
                opt.build([rep.trainable[i] for i in idxs])
            entries.append((opt, idxs))
        return entries

    # ------------------------------------------------------------------------ public API

    def row_sizes(self, batch: int) -> dict[str, list[int]]:
        """Rows of a ``batch``-row mini-batch per replica: ``{"conv": [...], "fc": [...]}``."""
        return row_sizes(batch, len(self.replicas["conv"]), len(self.replicas["fc"]))

    def mapping(self, batch: int) -> list[list[int]]:
        """``mapping(batch)[i]``: the B replicas that receive rows of A replica ``i``."""
        sizes = self.row_sizes(batch)
        starts = {g: [sum(s[:k]) for k in range(len(s))] for g, s in sizes.items()}
        out = []
        for a0, na in zip(starts["conv"], sizes["conv"]):
            out.append([j for j, (b0, nb) in enumerate(zip(starts["fc"], sizes["fc"]))
                        if max(a0, b0) < min(a0 + na, b0 + nb)])
        return out

    def train_step(self, x: Any, y: Any) -> tf.Tensor:
        """One hybrid step on a mini-batch (module docstring, steps 1-6).

        Args:
            x: Inputs [B, ...] (static ``B``).
            y: Targets [B, ...].

        Returns:
            The mini-batch mean loss (a scalar tensor), computed before the update.
        """
        return self._train_fn(x, y)

    def compute_gradients(self, x: Any, y: Any) -> list[tf.Tensor]:
        """The groups' summed gradients of the mean loss, without updating anything.

        With compression this runs the exchange (residuals change) and returns the sums of
        the selected blocks.

        Returns:
            One tensor per variable, in ``model.trainable_variables`` order.
        """
        totals = self._grad_fn(x, y)
        return [totals[g][i] for g, i in self._model_order]

    @property
    def primary_optimizer(self) -> keras.optimizers.Optimizer:
        """The first conv replica's first optimizer (callbacks read its learning rate and
        iterations)."""
        return self.optimizers["conv"][0][0][0]

    def copy_to_model(self) -> None:
        """Writes replica 0's variables of both groups into the original model's variables."""
        for group in GROUPS:
            self.replicas[group][0].copy_to_refs()

    # ------------------------------------------------------------------------ the step

    def _step(self, x: Any, y: Any, record: dict | None, update: bool) -> Any:
        x, y = tf.convert_to_tensor(x), tf.convert_to_tensor(y)
        if x.shape.rank is None or x.shape[0] is None or y.shape[0] != x.shape[0]:
            raise ValueError(f"x, y: need static, equal batch sizes, got {x.shape}, {y.shape}")
        batch = int(x.shape[0])
        sizes = self.row_sizes(batch)
        conv, fc = self.replicas["conv"], self.replicas["fc"]
        tapes, outs, states = [], [], {"conv": [], "fc": []}
        start = 0
        for rep, rows in zip(conv, sizes["conv"]):  # 1. A forward
            with tf.device(rep.device), tf.GradientTape() as tape:
                out, state = rep.forward(x[start:start + rows])
            start += rows
            tapes.append(tape)
            outs.append(out)
            states["conv"].append(state)
        acts = reslice(outs, sizes["conv"], sizes["fc"], [r.device for r in fc])  # 2.
        losses, grads, dacts = [], {"conv": [], "fc": []}, []
        start = 0
        for rep, h, rows in zip(fc, acts, sizes["fc"]):  # 3. B forward / backward
            with tf.device(rep.device):
                with tf.GradientTape() as tape:
                    tape.watch(h)
                    logits, state = rep.forward(h)
                    part = loss_part(self._loss_fn, y[start:start + rows], logits, batch)
                g = tape.gradient(part, [h, *rep.trainable])
            start += rows
            losses.append(part)
            states["fc"].append(state)
            dacts.append(tf.zeros_like(h) if g[0] is None else g[0])
            grads["fc"].append(self._fill(g[1:], rep))
        totals, per_rep = {}, {}
        totals["fc"], per_rep["fc"] = self.syncs["fc"].reduce(grads["fc"])  # 4.
        dh = reslice(dacts, sizes["fc"], sizes["conv"], [r.device for r in conv])  # 5.
        for rep, tape, out, d in zip(conv, tapes, outs, dh):  # 6. A backward + sync
            with tf.device(rep.device):
                g = tape.gradient(out, rep.trainable, output_gradients=d)
            grads["conv"].append(self._fill(g, rep))
        totals["conv"], per_rep["conv"] = self.syncs["conv"].reduce(grads["conv"])
        with tf.device(fc[0].device):
            loss = tf.add_n(losses)
        if record is not None:
            record.update(grads=grads, totals=totals)
        if not update:
            return loss, totals
        for group in ("fc", "conv"):
            self._apply(group, per_rep[group])
            average_state(self.replicas[group], states[group])
        return loss

    @staticmethod
    def _fill(grads: Sequence[Any], rep: Replica) -> list[tf.Tensor]:
        return [tf.zeros_like(v) if g is None else g for g, v in zip(grads, rep.trainable)]

    def _apply(self, group: str, per_rep: list[list[tf.Tensor]]) -> None:
        for rep, entries, grads in zip(self.replicas[group], self.optimizers[group], per_rep):
            for opt, idxs in entries:
                with tf.device(rep.var_devices[idxs[0]]):
                    opt.apply_gradients([(grads[i], rep.trainable[i]) for i in idxs])
