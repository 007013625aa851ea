"""Argument checks and the Keras config of ``BlockSparseOptimizer``.

:func:`resolve_arguments` turns the constructor's arguments into :class:`WrapperArguments`
(every check done before the inner optimizer changes); :func:`wrapper_config` and
:func:`config_arguments` are the two directions of its Keras config.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any

import keras
import tensorflow as tf

from tf_blocksparse import _compat
from tf_blocksparse import clipping as clipping_lib
from tf_blocksparse.checks import check_choice, unknown_keywords_message
from tf_blocksparse.keras import inner_optimizer, local_steps
from tf_blocksparse.keras.momentum import MomentumCorrection
from tf_blocksparse.options import (
    AUTO,
    DEFAULT_DENSE_BELOW,
    NONFINITE,
    OPTION_NAMES,
    SAVED_EMBEDDINGS,
    SAVED_MASKING,
    CompressionOptions,
    option_view,
    options_from,
)

#: Default of ``dense_below`` (see :data:`tf_blocksparse.options.DEFAULT_DENSE_BELOW`).
DENSE_BELOW = DEFAULT_DENSE_BELOW
#: Every keyword argument ``BlockSparseOptimizer`` takes (its own and the options').
KEYWORDS = ("compression", "momentum_correction", "momentum_masking", "clipping", "nonfinite",
            "fusion_buffer_bytes", "gradient_accumulation_steps", "sync_every", "outer",
            "model", "name",
            *OPTION_NAMES)
_UNSET = object()


def inner_arguments(inner: keras.optimizers.Optimizer) -> frozenset[str]:
    """The keyword arguments of ``inner``'s constructor (``momentum``, ``clipnorm``...)."""
    names: set[str] = set()
    for cls in (type(inner), keras.optimizers.Optimizer):
        try:
            params = inspect.signature(cls.__init__).parameters.values()
        except (TypeError, ValueError):  # no introspectable signature
            continue
        names.update(p.name for p in params if p.name != "self" and p.kind in (
            p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    return frozenset(names)


def check_keywords(inner: keras.optimizers.Optimizer, kwargs: Mapping[str, Any]) -> None:
    """Checks that the wrapper's extra keyword arguments are options.

    Raises:
      ValueError: Naming each other keyword: one of the inner optimizer's arguments is to be
        set there; any other gets the closest keyword of the wrapper ("did you mean").
    """
    other = set(kwargs) - set(KEYWORDS)
    if not other:
        return
    theirs = sorted(other & inner_arguments(inner))
    messages = []
    if other - set(theirs):
        messages.append(unknown_keywords_message("BlockSparseOptimizer", other - set(theirs),
                                                 KEYWORDS))
    if theirs:
        names = ", ".join(f"`{n}`" for n in theirs)
        verb, pronoun = ("is an argument", "it") if len(theirs) == 1 else ("are arguments",
                                                                          "them")
        messages.append(f"{names} {verb} of the inner optimizer, not of BlockSparseOptimizer: "
                        f"set {pronoun} there, e.g. BlockSparseOptimizer("
                        f"{type(inner).__name__}(..., {theirs[0]}=...))")
    raise ValueError("; ".join(messages))


def check_inner(inner: Any) -> keras.optimizers.Optimizer:
    """Checks the wrapped optimizer.

    Raises:
      TypeError: Not a Keras optimizer, or a ``LossScaleOptimizer`` (naming ``inner``).
      ValueError: It accumulates gradients (``gradient_accumulation_steps``): the wrapper
        accumulates before its exchange, so the number is given to the wrapper.
    """
    if not isinstance(inner, keras.optimizers.Optimizer):
        raise TypeError(f"`inner` must be a keras.optimizers.Optimizer, got {inner!r}")
    if isinstance(inner, keras.optimizers.LossScaleOptimizer):
        raise TypeError("`inner` must not be a LossScaleOptimizer: use "
                        "LossScaleOptimizer(BlockSparseOptimizer(...)) instead")
    created = _compat.optimizer_strategy(inner)
    if created is not None and created is not tf.distribute.get_strategy():
        raise ValueError(
            "`inner` was created under another tf.distribute strategy than the one this "
            "BlockSparseOptimizer is created under (e.g. outside strategy.scope()): create "
            "both inside the same strategy.scope()")
    steps = getattr(inner, "gradient_accumulation_steps", None)
    if steps:
        raise ValueError(f"the inner optimizer has gradient_accumulation_steps={steps}: give "
                         f"it to the wrapper instead, BlockSparseOptimizer("
                         f"{type(inner).__name__}(...), gradient_accumulation_steps={steps}), "
                         "which accumulates locally and exchanges once per window")
    return inner


def check_step_arguments(nonfinite: Any, fusion_buffer_bytes: Any,
                         gradient_accumulation_steps: Any = None) -> int:
    """Checks ``nonfinite``, ``fusion_buffer_bytes`` and ``gradient_accumulation_steps``.

    Returns:
      The micro-steps per exchange (1 for ``gradient_accumulation_steps=None``).

    Raises:
      ValueError: Naming the argument.
    """
    check_choice(nonfinite, NONFINITE, "nonfinite")
    steps = gradient_accumulation_steps
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int)
                              or steps < 1):
        raise ValueError(f"`gradient_accumulation_steps` must be None or an int >= 1, got "
                         f"{steps!r}")
    if fusion_buffer_bytes is not None and (
            isinstance(fusion_buffer_bytes, bool) or not isinstance(fusion_buffer_bytes, int)
            or fusion_buffer_bytes < 1):
        raise ValueError(f"`fusion_buffer_bytes` must be an int >= 1, got "
                         f"{fusion_buffer_bytes!r}")
    return steps or 1


def config_arguments(config: Mapping[str, Any]) -> dict[str, Any]:
    """The constructor arguments of a ``BlockSparseOptimizer`` config (``inner`` still
    serialized), from the composed layout or the flat one of files written before it."""
    config = dict(config)
    if "compression" not in config:
        # The flat layout holds the options as keys, and the behaviour the file was saved
        # with: no key means global momentum, every variable compressed, DGC's masking.
        config.setdefault("momentum_correction", None)
        config.setdefault("dense_below", 0)
        config.setdefault("momentum_masking", SAVED_MASKING)
        if isinstance(config["momentum_masking"], bool):
            # Files from when the masking was on or off: on was DGC's masking.
            config["momentum_masking"] = SAVED_MASKING if config["momentum_masking"] else "none"
    elif isinstance(config["compression"], Mapping):
        # Options saved before the embeddings rule existed sent small tables whole.
        config["compression"] = CompressionOptions.from_config(
            {"embeddings": SAVED_EMBEDDINGS} | dict(config["compression"]))
    if isinstance(config.get("momentum_correction"), Mapping):
        config["momentum_correction"] = MomentumCorrection.from_config(
            config["momentum_correction"])
    return config


def split_arguments(inner: keras.optimizers.Optimizer, compression: Any,
                    momentum_correction: Any, kwargs: dict[str, Any]
                    ) -> tuple[CompressionOptions, MomentumCorrection | None]:
    """The compression options and the momentum policy of the wrapper's arguments.

    ``kwargs`` may hold the arguments of :class:`CompressionOptions` (instead of
    ``compression``) and ``momentum_masking`` (with a non-policy ``momentum_correction``);
    either form defaults to ``exchange="auto"``.
    ``"auto"`` is resolved last (it changes the inner optimizer), once every check passed.

    Raises:
      ValueError: Naming the argument: a bad option, ``learning_rate`` or another argument
        of the inner optimizer (to be set there), or any other keyword (with the closest
        keyword the wrapper takes, see :func:`check_keywords`).
    """
    if "learning_rate" in kwargs:
        raise ValueError("`learning_rate` is the inner optimizer's: set it there, e.g. "
                         "BlockSparseOptimizer(keras.optimizers.SGD(learning_rate=0.1))")
    check_keywords(inner, kwargs)
    masking = kwargs.pop("momentum_masking", _UNSET)
    options = options_from(compression, kwargs, "BlockSparseOptimizer")
    if isinstance(momentum_correction, MomentumCorrection):
        if masking is not _UNSET:
            raise ValueError("give `momentum_masking` as MomentumCorrection(masking=...)")
        policy = momentum_correction
    else:
        policy = MomentumCorrection.from_arguments(
            momentum_correction, AUTO if masking is _UNSET else masking)
    sparse = options.sparse and not options.keeps_every_block  # density=1.0 sends dense
    return options, None if policy is None else policy.resolve(
        inner, sparse, recurrent_whole=options.recurrent == "whole")


@dataclasses.dataclass(frozen=True)
class WrapperArguments:
    """The resolved arguments of ``BlockSparseOptimizer`` (see :func:`resolve_arguments`).

    Attributes:
      compression: The compression options.
      momentum: The resolved momentum policy (``None``: no local momentum).
      clipping: The clipping rules.
      accumulation_steps: Micro-steps per exchange (1: every step exchanges).
      sync_every: Local steps per exchange (``None``: every step exchanges).
      outer: The outer optimizer with ``sync_every`` (its default filled in), else ``None``.
    """

    compression: CompressionOptions
    momentum: MomentumCorrection | None
    clipping: tuple[Any, ...]
    accumulation_steps: int
    sync_every: int | None
    outer: keras.optimizers.Optimizer | None


def resolve_arguments(inner: keras.optimizers.Optimizer, compression: Any, *,
                      momentum_correction: Any, clipping: Any, nonfinite: Any,
                      fusion_buffer_bytes: Any, gradient_accumulation_steps: Any,
                      sync_every: Any, outer: Any, options: dict[str, Any]
                      ) -> WrapperArguments:
    """Checks and resolves the arguments of ``BlockSparseOptimizer`` (named as there).

    With ``sync_every`` the inner optimizer's momentum stays local (``momentum_correction``
    defaults to ``None``) and the exchange defaults to ``"allgather"``.  The only change to
    ``inner`` (an ``"auto"`` momentum moved) is made once every check passed.

    Raises:
      TypeError: ``inner`` or ``outer`` is not a Keras optimizer, or is a
        ``LossScaleOptimizer``.
      ValueError: Naming the bad argument or combination.
    """
    check_inner(inner)
    every = check_step_arguments(nonfinite, fusion_buffer_bytes, gradient_accumulation_steps)
    rules = clipping_lib.as_rules(clipping)
    if sync_every is not None and momentum_correction == AUTO:
        momentum_correction = None  # the inner optimizer's momentum stays local
    if sync_every is not None and compression is None and "exchange" not in options:
        options["exchange"] = "allgather"  # the automatic exchange times per-step syncs
    compression, momentum = split_arguments(inner, compression, momentum_correction, options)
    local_steps.check_local_steps(sync_every, outer, clipping=rules, accumulation_steps=every)
    if sync_every is not None and momentum is not None:
        raise ValueError("`momentum_correction` does not combine with `sync_every`: the "
                         "inner optimizer's momentum stays local")
    if sync_every is not None and outer is None:
        outer = local_steps.default_outer(compression.sparse)
    if outer is not None:
        check_inner(outer)
    return WrapperArguments(compression, momentum, rules, every, sync_every, outer)


def wrapper_config(opt: Any, inner_momentum: bool) -> dict[str, Any]:
    """The Keras config of the ``BlockSparseOptimizer`` ``opt`` (``inner_momentum``: the
    inner SGD applies the local momentum to dense groups, see
    :func:`~tf_blocksparse.keras.inner_optimizer.inner_config`)."""
    policy = opt.momentum_policy
    return {
        "name": opt.name,
        "inner": inner_optimizer.inner_config(opt.inner_optimizer, inner_momentum),
        "compression": opt.compression.get_config(),
        "momentum_correction": None if policy is None else policy.get_config(),
        "clipping": [clipping_lib.rule_config(r) for r in opt.clipping],
        "nonfinite": opt.nonfinite, "fusion_buffer_bytes": opt.fusion_buffer_bytes,
    } | ({"gradient_accumulation_steps": opt.accumulation_steps}
         if opt.accumulation_steps > 1 else {}) | (
        {"sync_every": opt.sync_every,
         "outer": keras.saving.serialize_keras_object(opt.outer_optimizer)}
        if opt.sync_every is not None else {})


def from_wrapper_config(config: Mapping[str, Any], custom_objects: Any = None
                        ) -> tuple[keras.optimizers.Optimizer, dict[str, Any]]:
    """The inner optimizer and the other constructor arguments of a
    ``BlockSparseOptimizer`` config (see :func:`config_arguments`)."""
    config = config_arguments(config)
    inner = keras.saving.deserialize_keras_object(config.pop("inner"),
                                                  custom_objects=custom_objects)
    if config.get("outer") is not None:
        config["outer"] = keras.saving.deserialize_keras_object(
            config["outer"], custom_objects=custom_objects)
    return inner, config


class OptionsView:
    """Flat read access to ``BlockSparseOptimizer``'s parts (``compression``,
    ``momentum_policy``) under the names of its keyword arguments."""

    compression: CompressionOptions
    momentum_policy: MomentumCorrection | None
    metric = option_view("metric")
    exchange = option_view("exchange")
    granularity = option_view("granularity")
    dense_below = option_view("dense_below")

    @property
    def k(self) -> int | None:
        """Blocks kept per variable (``None`` when ``density`` is set); assigning replaces
        ``compression`` (the train function must be retraced, see ``DensityWarmup``)."""
        return self.compression.k

    @k.setter
    def k(self, value: int | None) -> None:
        self.compression = self.compression.replace(k=value)

    @property
    def density(self) -> float | None:
        """Fraction of blocks kept (``None`` when ``k`` is set); assignable like ``k``."""
        return self.compression.density

    @density.setter
    def density(self, value: float | None) -> None:
        self.compression = self.compression.replace(density=value)

    @property
    def block_rules(self) -> dict[str, Any]:
        return self.compression.rules

    @property
    def momentum_correction(self) -> float | None:
        """The local momentum factor (``None``: no momentum correction)."""
        return None if self.momentum_policy is None else self.momentum_policy.momentum

    @property
    def momentum_masking(self) -> str:
        return "all" if self.momentum_policy is None else self.momentum_policy.masking
