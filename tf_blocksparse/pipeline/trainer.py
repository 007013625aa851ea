"""Pipeline-parallel training of a chain Keras model on the logical devices of one host.

A plan (e.g. from :func:`tf_blocksparse.planning.plan_pipeline`) splits the chain's layers into
consecutive stages, each run data-parallel on its own devices.  :class:`PipelineTrainer` builds
the whole training step as **one** ``tf.function`` with explicit ``tf.device`` scopes; TF's
executor runs every op as soon as its inputs are ready, so different stages work on different
micro-batches at once:

1. The mini-batch [B, ...] is cut into ``micro_batches`` micro-batches of ``B / M`` rows; a stage
   with ``k`` replicas gives each replica a consecutive slice of every micro-batch (sizes differ
   by at most one row).
2. Forward: each stage replica runs its layers on its slice; the outputs are re-sliced for the
   next stage's replicas and sent to their devices (only the overlapping rows travel).  The last
   stage computes the loss contribution ``sum(per-example losses) / (B * elements per
   example)``, so the contributions add up to the full-batch mean loss.
3. Backward: activation gradients flow upstream the same way (``tape.gradient`` with
   ``output_gradients``); each replica sums its micro-batches' variable gradients (gradient
   accumulation, GPipe-style: all micro-batches' activations stay alive until their backward).
4. Replica sync: per stage, the replicas' accumulated gradients are summed with ``tf.add_n``
   on the stage's first device and the sum is copied back to every replica (reduce + broadcast,
   ``2 (k - 1)`` transfers).
5. Update: one Keras optimizer per replica (a fresh copy of ``optimizer``, built and applied
   under the replica's ``tf.device``) applies the summed gradient to the replica's variables;
   same gradient, same optimizer state, so the replicas stay identical.

Variables: every replica owns **copies** of its stage's variables (see
:class:`~tf_blocksparse.runtime.replica.Replica`); the original model's layer objects are
reused but its variables are not trained: call :meth:`PipelineTrainer.copy_to_model` to write
the trained values back.  Non-trainable state (e.g. BatchNorm moving statistics) is
updated micro-batch after micro-batch on each replica and averaged over the stage's replicas at
the end of :meth:`~PipelineTrainer.train_step`.  Note that BatchNorm in training mode normalises
with *micro-batch* statistics, so its gradients differ from full-batch training.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from tf_blocksparse.pipeline.profiler import chain_layers
from tf_blocksparse.pipeline.stages import StageSpec, normalize_stages
from tf_blocksparse.runtime.devices import default_devices
from tf_blocksparse.runtime.fit import FitLoop
from tf_blocksparse.runtime.losses import loss_part, per_example_loss
from tf_blocksparse.runtime.replica import Replica, average_state, clone_optimizer
from tf_blocksparse.runtime.slicing import reslice, split_sizes

__all__ = ["PipelineTrainer"]


class PipelineTrainer(FitLoop):
    """Trains a chain model with a pipeline plan (see the module docstring).

    Attributes:
        model: The model (its layer objects run the stages; its variables are not trained).
        stages: The validated :class:`StageSpec`\\ s.
        replicas: ``replicas[s][r]``: the :class:`~tf_blocksparse.runtime.replica.Replica`
            of stage ``s`` on its ``r``-th device.
        optimizers: ``optimizers[s][r]``: the optimizer of replica ``r`` of stage ``s``.
        micro_batches: Micro-batches per mini-batch.
    """

    def __init__(self, model: keras.Model, stages: Sequence[Any], loss: Any, optimizer: Any,
                 micro_batches: int, devices: Sequence[str] | None = None, *,
                 allow_device_reuse: bool = False) -> None:
        """Builds the replicas and optimizers.

        Args:
            model: A built chain model (Sequential or chain functional model).
            stages: Stages in order, each ``(first_layer, last_layer, devices)`` or an object
                with those attributes (e.g. ``PipelinePlan.stages``); layer indices count the
                model's layers without the ``InputLayer``; devices are ints (indices into
                ``devices``) or device names.
            loss: A ``keras.losses.Loss`` (its unreduced ``call`` is used), a loss name, or a
                function returning per-example losses [b] or [b, ...]; the step minimises the
                mean over all elements of the mini-batch.
            optimizer: A Keras optimizer (copied via its config, one copy per replica; the
                instance passed is not used) or a zero-argument function making one.
            micro_batches: Micro-batches per mini-batch; must divide the batch size.
            devices: Device names the integer ids refer to; default: the host's logical GPUs,
                else its logical CPUs.
            allow_device_reuse: Accept a device in several stages / replicas (for tests on
                hosts with few devices; such replicas then share that device's compute).

        Raises:
            ValueError: Bad ``model``, ``stages``, ``loss``, ``optimizer`` or ``micro_batches``.
        """
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) \
                or micro_batches < 1:
            raise ValueError(f"micro_batches must be a positive int, got {micro_batches!r}")
        self.model = model
        self._layers = chain_layers(model)
        device_list = list(devices) if devices is not None else default_devices()
        self.stages: list[StageSpec] = normalize_stages(stages, len(self._layers), device_list,
                                                        allow_device_reuse)
        self.micro_batches = micro_batches
        self._loss_fn = per_example_loss(loss)
        self.replicas = [[Replica(self._layers[st.first_layer:st.last_layer + 1], dev)
                          for dev in st.devices] for st in self.stages]
        self.optimizers: list[list[keras.optimizers.Optimizer]] = []
        for reps in self.replicas:
            self.optimizers.append([])
            for rep in reps:
                with tf.device(rep.device):
                    opt = clone_optimizer(optimizer)
                    opt.build(rep.trainable)
                self.optimizers[-1].append(opt)
        where = {id(v): (s, i) for s, reps in enumerate(self.replicas)
                 for i, v in enumerate(reps[0].trainable_refs)}
        missing = [v.path for v in model.trainable_variables if id(v) not in where]
        if missing:
            raise ValueError(f"model {model.name!r} has trainable variables outside its chain "
                             f"layers: {missing}")
        self._model_order = [where[id(v)] for v in model.trainable_variables]
        self._train_fn = tf.function(self._train_step, autograph=False)
        self._grad_fn = tf.function(lambda x, y: self._forward_backward(x, y)[:2],
                                    autograph=False)

    # ----------------------------------------------------------------------- public API

    def train_step(self, x: Any, y: Any) -> tf.Tensor:
        """One pipelined step on a mini-batch: forward, backward, replica sync, update.

        Args:
            x: Inputs [B, ...]; ``B`` must be divisible by ``micro_batches``.
            y: Targets [B, ...].

        Returns:
            The mini-batch mean loss (a scalar tensor), computed before the update.
        """
        return self._train_fn(x, y)

    def compute_gradients(self, x: Any, y: Any) -> list[tf.Tensor]:
        """The pipeline's summed gradients of the mean loss, without updating anything.

        Returns:
            One gradient per variable, in ``model.trainable_variables`` order (stage replica 0's
            copy of the replica-summed gradient).
        """
        _, totals = self._grad_fn(x, y)
        return [totals[s][0][i] for s, i in self._model_order]

    @property
    def primary_optimizer(self) -> keras.optimizers.Optimizer:
        """The optimizer of the first replica that has variables (callbacks read its learning
        rate and iterations)."""
        return next((o for opts, reps in zip(self.optimizers, self.replicas)
                     for o, r in zip(opts, reps) if r.trainable), self.optimizers[0][0])

    def copy_to_model(self) -> None:
        """Writes replica 0's variables of every stage into the original model's variables."""
        for reps in self.replicas:
            reps[0].copy_to_refs()

    # --------------------------------------------------------------------- step builders

    def _check_batch(self, x: tf.Tensor) -> int:
        batch = x.shape[0]
        if batch is None:
            raise ValueError("x: the batch size must be static")
        if batch % self.micro_batches:
            raise ValueError(f"micro_batches={self.micro_batches} does not divide the batch "
                             f"size {batch}")
        size = batch // self.micro_batches
        widest = max(len(st.devices) for st in self.stages)
        if size < widest:
            raise ValueError(f"micro_batches={self.micro_batches} leaves {size} rows per "
                             f"micro-batch, fewer than a stage's {widest} replicas")
        return batch

    def _forward_backward(self, x: Any, y: Any) -> tuple[tf.Tensor, list, list]:
        """Builds forward, backward and the replica reduction of one mini-batch.

        Returns:
            ``(loss, totals, states)``: the mean loss; ``totals[s][r]`` the summed gradients of
            stage ``s`` on its ``r``-th device; ``states[s][r]`` the replica's non-trainable
            state after the last micro-batch.
        """
        x, y = tf.convert_to_tensor(x), tf.convert_to_tensor(y)
        batch = self._check_batch(x)
        micro = batch // self.micro_batches
        sizes = [split_sizes(micro, len(st.devices)) for st in self.stages]
        states = [[list(rep.non_trainable) for rep in reps] for reps in self.replicas]
        records, losses = {}, []
        last = len(self.stages) - 1
        for m in range(self.micro_batches):
            start = m * micro
            offsets = [start + sum(sizes[0][:r]) for r in range(len(sizes[0]))]
            pieces = [x[o:o + n] for o, n in zip(offsets, sizes[0])]
            for s, reps in enumerate(self.replicas):
                pieces = reslice(pieces, sizes[max(s - 1, 0)], sizes[s], self.stages[s].devices)
                outs = []
                for r, rep in enumerate(reps):
                    with tf.device(rep.device), tf.GradientTape() as tape:
                        if s > 0:
                            tape.watch(pieces[r])
                        out, states[s][r] = rep.forward(pieces[r], states[s][r])
                        if s == last:
                            o = start + sum(sizes[s][:r])
                            out = loss_part(self._loss_fn, y[o:o + sizes[s][r]], out, batch)
                            losses.append(out)
                    records[m, s, r] = (tape, pieces[r], out)
                    outs.append(out)
                pieces = outs
        grads = [[[] for _ in reps] for reps in self.replicas]
        for m in reversed(range(self.micro_batches)):
            upstream = None
            for s in reversed(range(len(self.replicas))):
                dxs = []
                for r, rep in enumerate(self.replicas[s]):
                    tape, inp, out = records[m, s, r]
                    with tf.device(rep.device):
                        sources = ([inp] if s > 0 else []) + rep.trainable
                        g = tape.gradient(out, sources, output_gradients=(
                            None if upstream is None else upstream[r]))
                        if s > 0:
                            dxs.append(tf.zeros_like(inp) if g[0] is None else g[0])
                            g = g[1:]
                        grads[s][r].append([tf.zeros_like(v) if gv is None else gv
                                            for gv, v in zip(g, rep.trainable)])
                if s > 0:
                    upstream = reslice(dxs, sizes[s], sizes[s - 1], self.stages[s - 1].devices)
        totals = [self._reduce(reps, per_rep) for reps, per_rep in zip(self.replicas, grads)]
        with tf.device(self.stages[-1].devices[0]):
            loss = tf.add_n(losses)
        return loss, totals, states

    @staticmethod
    def _reduce(reps: list[Replica], per_rep: list[list[list[tf.Tensor]]]) -> list:
        """Accumulates micro-batches per replica, then all-reduces over the replicas."""
        acc = []
        for rep, per_micro in zip(reps, per_rep):
            with tf.device(rep.device):
                acc.append([tf.add_n(list(gs)) for gs in zip(*per_micro)])
        if len(reps) == 1:
            return acc
        with tf.device(reps[0].device):
            total = [tf.add_n(list(gs)) for gs in zip(*acc)]
        out = []
        for rep in reps:
            with tf.device(rep.device):
                out.append([tf.identity(t) for t in total])
        return out

    def _train_step(self, x: Any, y: Any) -> tf.Tensor:
        loss, totals, states = self._forward_backward(x, y)
        for opts, reps, per_rep in zip(self.optimizers, self.replicas, totals):
            for opt, rep, grads in zip(opts, reps, per_rep):
                if rep.trainable:  # a stage of pooling / reshaping layers has nothing to update
                    with tf.device(rep.device):
                        opt.apply_gradients(list(zip(grads, rep.trainable)))
        for reps, rep_states in zip(self.replicas, states):
            average_state(reps, rep_states)
        return loss
