"""One ``launch.train`` run as a frozen config: :class:`TrainConfig`.

``launch.train`` parses its flags (:mod:`launch.flags`, the one place of their names,
defaults and rules) into a :class:`TrainConfig` and trains it (``launch.train.run``).  A
config holds every training setting under its flag's name, the exchange method as a
:class:`~launch.method.Method` (the library's ``CompressionOptions`` and the optimizer
wrapper's settings), and renders back to the command line that makes it
(:meth:`TrainConfig.to_flags`); the metrics record stores its flag values
(:meth:`TrainConfig.flag_values`).  A config is checked on construction by parsing the
flags it renders, so it always is a command line ``launch.train`` accepts.  No TensorFlow
here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from absl import flags

from launch import flags as train_flags
from launch.method import METHOD_FLAGS, Method


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The settings of one ``launch.train`` run; validated, immutable.

    Every field is the flag of the same name (see ``python -m launch.train --helpfull``);
    the defaults are the flags' own, so build a config with :meth:`default`,
    :meth:`from_args` or :meth:`from_flags`, and change it with :meth:`replace`.

    Raises:
      ValueError: A value or combination ``launch.train`` refuses (absl's message, naming
        the flag).
    """

    # what is trained, on which data
    model: str
    dataset: str
    data_dir: str
    tfds_data_dir: str | None
    synthetic_shape: tuple[int, ...]
    train_samples: int
    test_samples: int
    seed: int
    # where it runs and how gradients travel
    strategy: str
    num_devices: int
    heartbeat_timeout_s: float | None
    method: Method
    # how long, and the optimizer
    epochs: int
    steps_per_epoch: int
    batch_size: int
    lr: float
    lr_schedule: str
    warmup_epochs: float
    momentum: float
    deterministic: bool
    # evaluation and early stopping
    validate: bool
    eval_batch_size: int
    stop_at_accuracy: float
    min_epochs: int
    # what it writes
    model_dir: str | None
    backup: bool
    save_freq: int
    block_metrics: bool
    # fault injection, for the tests
    fail_at_step: int
    fail_worker: int
    dump_restored: str | None
    slow_state_write_s: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.method, Method):
            raise ValueError(f"`method` must be a launch.method.Method, got {self.method!r}")
        object.__setattr__(self, "synthetic_shape",
                           tuple(int(v) for v in self.synthetic_shape))
        try:
            train_flags.parse(self.to_flags())
        except flags.Error as err:
            raise ValueError(str(err)) from err

    @classmethod
    def run_flags(cls) -> tuple[str, ...]:
        """The flags that are fields of the config itself (not of its :class:`Method`)."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.name != "method")

    @classmethod
    def from_flags(cls, values: flags.FlagValues) -> TrainConfig:
        """The config of parsed ``launch.train`` flags (absl's ``FLAGS`` in ``main``)."""
        fields = {name: values[name].value for name in cls.run_flags()}
        return cls(**fields, method=Method.from_flags(values))

    @classmethod
    def from_args(cls, args: Iterable[str]) -> TrainConfig:
        """The config of a ``launch.train`` command line's flags.

        Raises:
          flags.Error: A flag ``launch.train`` refuses.
        """
        return cls.from_flags(train_flags.parse(list(args)))

    @classmethod
    def default(cls) -> TrainConfig:
        """``launch.train`` without flags."""
        return cls.from_args([])

    def replace(self, **changes: Any) -> TrainConfig:
        """A checked copy with ``changes`` applied (``method=`` swaps the exchange method)."""
        return dataclasses.replace(self, **changes)

    def flag_values(self) -> dict[str, Any]:
        """Every ``launch.train`` flag's value for this run, as absl holds it (a list flag
        as strings), by name, sorted: the ``flags`` of the metrics record."""
        values = {name: getattr(self, name) for name in self.run_flags()}
        values["synthetic_shape"] = [str(v) for v in self.synthetic_shape]
        values.update(self.method.flag_values())
        return dict(sorted(values.items()))

    def to_flags(self) -> list[str]:
        """The ``launch.train`` flags that make this config: every run flag not at its
        default (sorted by name), then the method's (:meth:`Method.to_flags`)."""
        values, defaults = self.flag_values(), train_flags.defaults()
        return [train_flags.flag_text(name, values[name]) for name in values
                if name not in METHOD_FLAGS and values[name] != defaults[name]
                ] + self.method.to_flags()
