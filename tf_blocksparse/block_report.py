"""The block table of a Keras model: how each trainable variable splits into blocks under
the rules of :mod:`tf_blocksparse.blocks` (the one place that decides it), as rows and as
an aligned text table (``tfbs.block_table``, ``tfbs.format_block_table``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from tf_blocksparse.blocks import BlockRule, layouts_for

__all__ = ["BlockTableRow", "block_table", "format_block_table"]


@dataclasses.dataclass(frozen=True)
class BlockTableRow:
    """One row of :func:`block_table`."""

    path: str
    layer_class: str | None
    rule: str
    shape: tuple[int, ...]
    num_blocks: int
    block_size: int


def block_table(model: Any, overrides: Mapping[str, str | BlockRule] | None = None
                ) -> list[BlockTableRow]:
    """The block table of a Keras model's trainable variables (exact layer classes)."""
    return [BlockTableRow(lay.path, lay.layer_class, lay.rule.name, lay.shape, lay.num_blocks,
                          lay.block_size)
            for lay in layouts_for(model.trainable_variables, model, overrides)]


def format_block_table(rows: Sequence[BlockTableRow]) -> str:
    """Renders rows as an aligned text table with a totals line."""
    header = ("path", "layer", "rule", "shape", "blocks", "block_size")
    body = [(r.path, r.layer_class or "-", r.rule, "x".join(map(str, r.shape)) or "scalar",
             str(r.num_blocks), str(r.block_size)) for r in rows]
    widths = [max(len(x) for x in col) for col in zip(header, *body)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in (header, *body)]
    total = sum(r.num_blocks for r in rows)
    lines.append(f"{len(rows)} variables, {total} blocks, "
                 f"{sum(math.prod(r.shape) for r in rows)} parameters")
    return "\n".join(lines)
