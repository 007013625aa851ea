"""Prints a model's block table (dry run: builds the model, trains nothing).

Examples::

  python -m launch.print_blocks --model=cnn_small
  python -m launch.print_blocks --model=resnet50 --density=0.01
  python -m launch.print_blocks --model=vgg16 --k=4 --json

With ``--k`` or ``--density`` every variable also shows how many blocks a step keeps and
the payload fraction (kept values / variable size; block ids are extra, one int32 each).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from absl import flags

from launch import script
from models import registry
from tf_blocksparse import block_report

if TYPE_CHECKING:  # TensorFlow and Keras load in the functions: --help answers at once
    import keras

#: The registry's image models.
MODELS = tuple(n for n in registry.MODELS if not registry.is_sequence_model(n))


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Defines this script's flags on ``flag_values`` (kept out of import time)."""
    flags.DEFINE_enum("model", "cnn_small", list(MODELS), "Registry model to build.",
                      flag_values=flag_values)
    flags.DEFINE_string("input_shape", None,
                        "Comma separated input shape without the batch axis "
                        "(default: 224,224,3 for resnet50, resnet101 and vgg16, else "
                        "32,32,3).",
                        flag_values=flag_values)
    flags.DEFINE_integer("k", None, "Blocks kept per variable.", flag_values=flag_values)
    flags.DEFINE_float("density", None, "Fraction of blocks kept per variable.",
                       flag_values=flag_values)
    flags.DEFINE_boolean("json", False, "Print the table as JSON.", flag_values=flag_values)
    flags.register_validator("k", lambda k: k is None or k >= 1, "--k must be >= 1",
                             flag_values=flag_values)
    flags.register_validator("density", lambda d: d is None or 0.0 < d <= 1.0,
                             "--density must be in (0, 1]", flag_values=flag_values)
    flags.register_multi_flags_validator(
        ["k", "density"], lambda f: f["k"] is None or f["density"] is None,
        "give at most one of --k and --density", flag_values=flag_values)
    flags.register_validator("input_shape", _valid_input_shape,
                             "--input_shape must be comma separated positive ints",
                             flag_values=flag_values)


def _valid_input_shape(text: str | None) -> bool:
    try:
        parse_input_shape(text)
    except ValueError:
        return False
    return True


def parse_input_shape(text: str | None, model: str = "cnn_small") -> tuple[int, ...]:
    """``"32,32,3"`` -> ``(32, 32, 3)``; ``None``/empty -> the model's default."""
    if not text:
        return registry.default_input(model)[0]
    try:
        shape = tuple(int(d) for d in text.split(","))
    except ValueError:
        raise ValueError(f"--input_shape must be comma separated ints, got {text!r}") from None
    if any(d < 1 for d in shape):
        raise ValueError(f"--input_shape must be positive, got {text!r}")
    return shape


def build_model(name: str, input_shape: Sequence[int] | None = None) -> keras.Model:
    """Registry model ``name`` with random weights at ``input_shape`` (default: its own)."""
    if name not in MODELS:
        raise ValueError(f"--model must be one of {MODELS}, got {name!r}")
    shape, classes = registry.default_input(name)
    return registry.build_model(name, tuple(input_shape) if input_shape else shape, classes)


def _kept_rows(rows: Sequence[block_report.BlockTableRow], k: int | None, density: float | None
               ) -> list[tuple[int, int, float]]:
    """Per row: ``(kept blocks, kept values, payload fraction)``."""
    from tf_blocksparse import selection

    out = []
    for r in rows:
        kept = selection.num_selected(r.num_blocks, k, density)
        values = kept * r.block_size
        out.append((kept, values, values / max(1, math.prod(r.shape))))
    return out


def render(model: str = "cnn_small", input_shape: Sequence[int] | None = None,
           k: int | None = None, density: float | None = None, as_json: bool = False) -> str:
    """The text (or JSON) this script prints."""
    if model not in MODELS:
        raise ValueError(f"--model must be one of {MODELS}, got {model!r}")
    selecting = k is not None or density is not None
    if selecting:
        from tf_blocksparse.feedback import validate_k_density

        k, density = validate_k_density(k, density)
    shape = tuple(input_shape) if input_shape else registry.default_input(model)[0]
    rows = block_report.block_table(build_model(model, shape))
    kept = _kept_rows(rows, k, density) if selecting else None
    params = sum(math.prod(r.shape) for r in rows)
    total_blocks = sum(r.num_blocks for r in rows)

    if as_json:
        variables = []
        for i, r in enumerate(rows):
            v = {"path": r.path, "layer_class": r.layer_class, "rule": r.rule,
                 "shape": list(r.shape), "num_blocks": r.num_blocks,
                 "block_size": r.block_size}
            if kept:
                v.update(kept=kept[i][0], kept_values=kept[i][1], payload_fraction=kept[i][2])
            variables.append(v)
        totals = {"variables": len(rows), "blocks": total_blocks, "parameters": params}
        if kept:
            kv = sum(x[1] for x in kept)
            totals.update(kept=sum(x[0] for x in kept), kept_values=kv,
                          payload_fraction=kv / max(1, params))
        return json.dumps({"model": model, "input_shape": list(shape), "k": k,
                           "density": density, "variables": variables, "totals": totals},
                          indent=2)

    head = f"model {model}, input shape {'x'.join(map(str, shape))}"
    table = block_report.format_block_table(rows)
    if not kept:
        return f"{head}\n{table}"
    how = f"k={k}" if density is None else f"density={density:g}"
    width = max(len(r.path) for r in rows)
    lines = [f"{head}, {how}", table, "", f"{'path'.ljust(width)}  {'kept'.rjust(6)}  payload"]
    for r, (n, _, frac) in zip(rows, kept):
        lines.append(f"{r.path.ljust(width)}  {str(n).rjust(6)}  {frac:.4f}")
    kb = sum(x[0] for x in kept)
    kv = sum(x[1] for x in kept)
    lines.append(f"kept {kb} of {total_blocks} blocks, {kv} of {params} values "
                 f"(payload fraction {kv / max(1, params):.4f}, plus {kb} int32 ids)")
    return "\n".join(lines)


def render_from_flags(fv: flags.FlagValues = flags.FLAGS) -> str:
    """:func:`render` with the arguments taken from parsed flags."""
    return render(fv.model, parse_input_shape(fv.input_shape, fv.model), k=fv.k,
                  density=fv.density, as_json=fv.json)


def main(argv: Sequence[str]) -> None:
    del argv
    print(render_from_flags(flags.FLAGS))


if __name__ == "__main__":
    script.run(main, define_flags)
