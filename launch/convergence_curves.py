"""The accuracy curves of ``launch.bench_convergence`` results files, for the wall-clock
composition (``launch.bench_wall_clock``) and the local-steps report.

A results file holds ``runs`` (each with ``model``, ``method``, ``flags.seed`` and
``history.val_accuracy``, one exact test accuracy per epoch) and the ``budget`` they share.
"""

from __future__ import annotations

import json

__all__ = ["PER_MODEL_BUDGET", "epochs_to_target", "load_convergence", "load_curves"]


def epochs_to_target(curve: list[float], target: float) -> int | None:
    """1-based epoch at which ``curve`` first reaches ``target`` (``None``: never)."""
    for epoch, accuracy in enumerate(curve, start=1):
        if accuracy >= target:
            return epoch
    return None


def load_curves(path: str) -> tuple[dict, dict]:
    """``({(model, method): {seed: curve}}, budget)`` of a convergence results file."""
    with open(path) as fh:
        doc = json.load(fh)
    curves: dict = {}
    for run in doc["runs"]:
        curves.setdefault((run["model"], run["method"]), {})[run["flags"]["seed"]] = \
            run["history"]["val_accuracy"]
    return curves, doc["budget"]


#: Budget entries that differ per model (the rest must agree across the files).
PER_MODEL_BUDGET = ("epochs", "lr_by_model", "rule", "converged")


def load_convergence(entries: list[str]) -> tuple[dict, dict, dict]:
    """Curves and budgets of ``--convergence``: ``PATH`` for every model, ``MODEL=PATH``
    for one model's curves (a later entry for a model replaces an earlier one).

    Returns:
      ``(curves, budgets, files)``: ``{(model, method): {seed: curve}}``,
      ``{model: budget}`` and ``{model: path}``.

    Raises:
      ValueError: A file's shared budget (batch, schedule, dataset, ...) differs from the
        first file's, naming ``--convergence``.
    """
    curves: dict = {}
    budgets: dict = {}
    files: dict = {}
    shared = None
    for entry in entries:
        only, _, path = entry.rpartition("=")
        file_curves, budget = load_curves(path)
        common = {k: v for k, v in budget.items() if k not in PER_MODEL_BUDGET}
        if shared is None:
            shared = common
        elif common != shared:
            raise ValueError(f"--convergence: {path}'s budget {common} differs from "
                             f"{shared} outside {PER_MODEL_BUDGET}")
        for model in budget.get("epochs", {}):
            if only and model != only:
                continue
            budgets[model], files[model] = budget, path
            for key in [k for k in curves if k[0] == model]:
                del curves[key]
            curves.update({k: v for k, v in file_curves.items() if k[0] == model})
    return curves, budgets, files
