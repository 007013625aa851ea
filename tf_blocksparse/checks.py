"""Argument checks shared by the options object and the shells: each returns the checked
value or raises a ``ValueError`` naming the argument.  Pure Python (no TensorFlow).
"""

from __future__ import annotations

import difflib
import re
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tf_blocksparse import blocks

__all__ = ["check_choice", "unknown_keywords_message", "validate_block_rules",
           "validate_dense_below", "validate_dense_steps", "validate_k_density"]


def check_choice(value: Any, choices: Sequence[str], argument: str) -> str:
    """Returns ``value`` if it is one of ``choices``.

    Raises:
      ValueError: Naming ``argument``.
    """
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"`{argument}` must be one of {tuple(choices)}, got {value!r}")
    return value


def unknown_keywords_message(owner: str, unknown: Iterable[str], known: Sequence[str]) -> str:
    """The error message for keyword arguments ``unknown`` that ``owner`` does not take.

    Each is named with the closest of ``known`` (``difflib``) as "did you mean"; when one
    has none, the message lists ``known``.
    """
    parts, unmatched = [], False
    for name in sorted(unknown):
        close = difflib.get_close_matches(name, list(known), n=1)
        parts.append(f"`{name}` (did you mean {close[0]!r}?)" if close else f"`{name}`")
        unmatched = unmatched or not close
    noun = "an unknown keyword argument" if len(parts) == 1 else "unknown keyword arguments"
    message = f"{owner} got {noun}: {', '.join(parts)}"
    return message + (f"; known keywords: {', '.join(known)}" if unmatched else "")


def validate_k_density(k: int | None, density: float | None) -> tuple[int | None, float | None]:
    """Checks the selection-size arguments; returns ``(k, density)`` with k=1 as default.

    Raises:
      ValueError: Both given, ``k < 1`` or not an int, or ``density`` outside (0, 1].
    """
    if k is not None and density is not None:
        raise ValueError(f"give exactly one of `k` and `density`, got k={k!r}, "
                         f"density={density!r}")
    if k is not None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"`k` must be an int >= 1, got {k!r}")
        return k, None
    if density is not None:
        if isinstance(density, bool) or not isinstance(density, (int, float)) \
                or not 0.0 < float(density) <= 1.0:
            raise ValueError(f"`density` must be a float in (0, 1], got {density!r}")
        return None, float(density)
    return 1, None


def validate_dense_below(dense_below: int | None) -> int:
    """Checks the small-variable threshold (elements); ``None`` means 0 (compress all).

    Raises:
      ValueError: Not an int >= 0.
    """
    if dense_below is None:
        return 0
    if isinstance(dense_below, bool) or not isinstance(dense_below, int) or dense_below < 0:
        raise ValueError(f"`dense_below` must be an int >= 0 (elements), got {dense_below!r}")
    return dense_below


def validate_block_rules(rules: Any) -> tuple[tuple[str, str | blocks.BlockRule], ...]:
    """Checks ``{path regex: rule or rule name}`` overrides; returns them as ordered pairs.

    Every pattern is compiled here, so a bad regex fails at construction, not in a step.

    Raises:
      ValueError: Not a mapping (or pairs), a pattern that is not a valid regex, or an
        unknown rule name; the message names ``block_rules`` and the pattern.
    """
    if rules is None:
        return ()
    if isinstance(rules, Mapping):
        pairs = list(rules.items())
    elif isinstance(rules, (str, bytes)) or not isinstance(rules, Sequence) or not all(
            isinstance(p, Sequence) and not isinstance(p, str) and len(p) == 2 for p in rules):
        raise ValueError(f"`block_rules` must be a mapping {{path regex: rule name}}, "
                         f"got {rules!r}")
    else:
        pairs = [tuple(p) for p in rules]
    out = []
    for pattern, rule in pairs:
        if not isinstance(pattern, str):
            raise ValueError(f"`block_rules`: pattern {pattern!r} must be a string")
        try:
            re.compile(pattern)
        except re.error as err:
            raise ValueError(f"`block_rules`: pattern {pattern!r} is not a valid regular "
                             f"expression ({err})") from err
        blocks.as_rule(rule, f"`block_rules`[{pattern!r}]")
        out.append((pattern, rule))
    return tuple(out)


def validate_dense_steps(dense_steps: Any) -> int:
    """Checks the length of the dense phase (optimizer steps); ``None`` means 0 (none).

    Raises:
      ValueError: Not an int >= 0.
    """
    if dense_steps is None:
        return 0
    if isinstance(dense_steps, bool) or not isinstance(dense_steps, int) or dense_steps < 0:
        raise ValueError(f"`dense_steps` must be an int >= 0 (optimizer steps), got "
                         f"{dense_steps!r}")
    return dense_steps


class RecurrentCompressionWarning(UserWarning):
    """A fixed sparse exchange delays recurrent layers' gradients."""


def warn_compressed_recurrent(compressor: Any) -> None:
    """Warns (:class:`RecurrentCompressionWarning`) when ``compressor`` (a
    :class:`~tf_blocksparse.feedback.BlockTopK`) delays recurrent layers' variables: keeps
    fewer than all blocks of one it does not send whole.  With k=1 our GRU translation task
    needs 2.3x dense's epochs and its LSTM twin never converges (0.48 token accuracy against
    1.00), while the automatic exchange keeps them dense."""
    names = [lay.path for lay, whole, kept in zip(compressor.layouts, compressor.whole,
                                                  compressor.counts)
             if lay.recurrent and not whole and kept < lay.num_blocks]
    if names:
        warnings.warn(
            f"the sparse exchange compresses recurrent layers' variables {names}: error "
            "feedback's delay of them slows or stops convergence (k=1 on an LSTM translation "
            "model never converged). Use exchange='auto' (the default), which keeps them "
            "dense, or send them whole every step with recurrent='whole' (whose "
            "default momentum_masking, 'none', converged at dense's pace on GRU and LSTM "
            "translation models)",
            RecurrentCompressionWarning, stacklevel=3)
