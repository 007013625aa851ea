"""Per-layer model profiles: the planners' view of a chain model.

A profile lists the layers of a chain model in forward order with, per layer, the measured
compute time (forward + backward of one micro-batch), the bytes of its output activation (what
crosses a stage cut placed after it) and the bytes of its parameters.  Pure Python: the TF
profiler that measures real models is :func:`tf_blocksparse.pipeline.profiler.profile_model`;
here are the containers, their JSON form and synthetic builders for benchmarks and tests.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

__all__ = ["LayerProfile", "ModelProfile", "random_profile", "synthetic_profile"]


def _number(owner: str, arg: str, value: Any, allow_none: bool = False) -> int | float | None:
    """Checks a finite number >= 0 and turns numpy scalars into Python ones."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{owner}: {arg} must be a number, got {value!r}")
    value = int(value) if isinstance(value, (int, np.integer)) else float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{owner}: {arg} must be finite and >= 0, got {value!r}")
    return value


@dataclass(frozen=True)
class LayerProfile:
    """One layer of a chain model.

    Attributes:
        name: The layer's name.
        compute_s: Forward + backward seconds of one micro-batch on one device.
        activation_bytes: Bytes of the layer's output for one micro-batch (what crosses a stage
            cut after this layer, downstream in forward and as a gradient upstream in backward).
        param_bytes: Bytes of the layer's parameters (what a data-parallel stage all-reduces).
        forward_s: Optional measured forward part of ``compute_s`` (``<= compute_s``); ``None``
            lets the simulator split ``compute_s`` itself (see :func:`simulate_pipeline`).
    """

    name: str
    compute_s: float
    activation_bytes: int | float
    param_bytes: int | float
    forward_s: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise ValueError(f"LayerProfile: name must be a str, got {self.name!r}")
        owner = f"LayerProfile {self.name!r}"
        for arg in ("compute_s", "activation_bytes", "param_bytes", "forward_s"):
            value = _number(owner, arg, getattr(self, arg), allow_none=arg == "forward_s")
            object.__setattr__(self, arg, value)
        if self.forward_s is not None and self.forward_s > self.compute_s:
            raise ValueError(f"{owner}: forward_s must be <= compute_s")

    def to_dict(self) -> dict[str, Any]:
        """The layer as a JSON-ready dict (``forward_s`` only when set)."""
        d = {"name": self.name, "compute_s": self.compute_s,
             "activation_bytes": self.activation_bytes, "param_bytes": self.param_bytes}
        if self.forward_s is not None:
            d["forward_s"] = self.forward_s
        return d


@dataclass(frozen=True)
class ModelProfile:
    """A chain model's per-layer profile, in forward order, with cumulative tables.

    Attributes:
        layers: The layers (any sequence is accepted and stored as a tuple); at least one.
        name: The model's name.
        metadata: Free JSON-serialisable facts (batch size, device, dtype, ...); not hashed.
    """

    layers: tuple[LayerProfile, ...]
    name: str = "model"
    metadata: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        layers = tuple(self.layers)
        if not layers:
            raise ValueError("ModelProfile: layers must not be empty")
        if not all(isinstance(x, LayerProfile) for x in layers):
            raise ValueError("ModelProfile: layers must all be LayerProfile")
        if not isinstance(self.name, str):
            raise ValueError("ModelProfile: name must be a str")
        metadata = dict(self.metadata)
        try:
            json.dumps(metadata, allow_nan=False)
        except (TypeError, ValueError) as err:
            raise ValueError(f"ModelProfile: metadata must be JSON-serialisable ({err})") from err
        object.__setattr__(self, "layers", layers)
        object.__setattr__(self, "metadata", metadata)

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def num_layers(self) -> int:
        """Number of layers L."""
        return len(self.layers)

    @cached_property
    def compute(self) -> tuple[float, ...]:
        """Per-layer ``compute_s``."""
        return tuple(x.compute_s for x in self.layers)

    @cached_property
    def activation_bytes(self) -> tuple[int | float, ...]:
        """Per-layer output activation bytes."""
        return tuple(x.activation_bytes for x in self.layers)

    @cached_property
    def param_bytes(self) -> tuple[int | float, ...]:
        """Per-layer parameter bytes."""
        return tuple(x.param_bytes for x in self.layers)

    @cached_property
    def cumulative_compute(self) -> tuple[float, ...]:
        """Prefix sums of ``compute_s``, length L+1: layers ``i..j`` take ``c[j+1] - c[i]``."""
        return tuple(float(v) for v in np.concatenate([[0.0], np.cumsum(self.compute)]))

    @cached_property
    def cumulative_param_bytes(self) -> tuple[float, ...]:
        """Prefix sums of ``param_bytes``, length L+1."""
        return tuple(float(v) for v in np.concatenate([[0.0], np.cumsum(self.param_bytes)]))

    @cached_property
    def cumulative_activation_bytes(self) -> tuple[float, ...]:
        """Prefix sums of ``activation_bytes``, length L+1."""
        return tuple(float(v)
                     for v in np.concatenate([[0.0], np.cumsum(self.activation_bytes)]))

    @property
    def total_compute_s(self) -> float:
        """Forward + backward seconds of the whole model on one device."""
        return float(sum(self.compute))

    @property
    def total_param_bytes(self) -> float:
        """Bytes of all parameters."""
        return float(sum(self.param_bytes))

    def to_json(self) -> str:
        """Serialises the profile; ``ModelProfile.from_json(p.to_json()) == p``."""
        return json.dumps({"name": self.name, "metadata": self.metadata,
                           "layers": [x.to_dict() for x in self.layers]})

    @classmethod
    def from_json(cls, text: str) -> ModelProfile:
        """Inverse of :meth:`to_json`."""
        d = json.loads(text)
        return cls(layers=tuple(LayerProfile(**x) for x in d["layers"]),
                   name=d.get("name", "model"), metadata=d.get("metadata", {}))


def random_profile(num_layers: int, seed: int = 0, compute_s: tuple[float, float] = (1e-3, 1e-2),
                   activation_bytes: tuple[float, float] = (1e5, 1e7),
                   param_bytes: tuple[float, float] = (1e4, 1e7)) -> ModelProfile:
    """A profile with log-uniform random per-layer values (deterministic per ``seed``).

    Args:
        num_layers: Number of layers (>= 1).
        seed: Seed of the generator.
        compute_s: ``(low, high)`` seconds per layer.
        activation_bytes: ``(low, high)`` output bytes per layer (rounded to ints).
        param_bytes: ``(low, high)`` parameter bytes per layer (rounded to ints).

    Returns:
        The profile, named ``random_<seed>``.
    """
    if int(num_layers) != num_layers or num_layers < 1:
        raise ValueError("num_layers must be an int >= 1")
    for arg, (lo, hi) in (("compute_s", compute_s), ("activation_bytes", activation_bytes),
                          ("param_bytes", param_bytes)):
        if not 0 < lo <= hi:
            raise ValueError(f"{arg} must be (low, high) with 0 < low <= high")
    rng = np.random.default_rng(seed)

    def draw(lo: float, hi: float) -> np.ndarray:
        return np.exp(rng.uniform(np.log(lo), np.log(hi), num_layers))

    c, a, p = draw(*compute_s), draw(*activation_bytes), draw(*param_bytes)
    layers = [LayerProfile(f"layer_{i}", float(c[i]), int(a[i]), int(p[i]))
              for i in range(num_layers)]
    return ModelProfile(layers, name=f"random_{seed}", metadata={"kind": "random", "seed": seed})


def synthetic_profile(kind: str, num_layers: int, layer_compute_s: float = 5e-3,
                      activation_bytes: float = 8 * 2**20, param_bytes: float = 2 * 2**20,
                      seed: int = 0, jitter: float = 0.1) -> ModelProfile:
    """A stylised profile of a model family (shapes only, no real model's numbers).

    * ``"uniform"``: identical layers.
    * ``"cnn"``: activations shrink and parameters grow geometrically with depth (each quarter
      of the layers halves the activation and doubles the parameters), ending in a classifier
      layer with 8x the parameters and a tiny output.
    * ``"transformer"``: an embedding (4x parameters, no extra compute), identical blocks, and
      an output head (4x parameters).

    Args:
        kind: ``"uniform"``, ``"cnn"`` or ``"transformer"``.
        num_layers: Number of layers (>= 2 for ``cnn`` and ``transformer``).
        layer_compute_s: Typical seconds per layer.
        activation_bytes: Typical (first-layer) activation bytes.
        param_bytes: Typical (first-layer) parameter bytes.
        seed: Seed of the multiplicative jitter.
        jitter: Relative jitter (uniform in ``[1 - jitter, 1 + jitter]``) applied to every value.

    Returns:
        The profile, named ``<kind>_<num_layers>``.
    """
    if kind not in ("uniform", "cnn", "transformer"):
        raise ValueError(f"kind must be 'uniform', 'cnn' or 'transformer', got {kind!r}")
    if int(num_layers) != num_layers or num_layers < (1 if kind == "uniform" else 2):
        raise ValueError("num_layers must be an int >= 1 (>= 2 for cnn and transformer)")
    if not 0 <= jitter < 1:
        raise ValueError("jitter must be in [0, 1)")
    n = int(num_layers)
    c = np.full(n, float(layer_compute_s))
    a = np.full(n, float(activation_bytes))
    p = np.full(n, float(param_bytes))
    if kind == "cnn":
        level = np.minimum(np.arange(n) * 4 // n, 3)
        a, p = a / 2.0 ** level, p * 2.0 ** level
        a[-1], p[-1], c[-1] = 4e3, 8 * p[-2], c[-1] / 4
    elif kind == "transformer":
        c[0] = c[0] / 10
        p[0] = p[-1] = 4 * param_bytes
    rng = np.random.default_rng(seed)
    c, a, p = (x * rng.uniform(1 - jitter, 1 + jitter, n) for x in (c, a, p))
    layers = [LayerProfile(f"{kind}_{i}", float(c[i]), int(a[i]), int(p[i])) for i in range(n)]
    return ModelProfile(layers, name=f"{kind}_{n}", metadata={"kind": kind, "seed": seed})
