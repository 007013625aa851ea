"""What Keras saving (``model.save``, ``BackupAndRestore``) writes and reads of a
``BlockSparseOptimizer`` (its ``save_own_variables`` / ``load_own_variables``): the
per-replica state as its sums over replicas, read without a collective, or, while a backup
saves that state per worker (:mod:`~tf_blocksparse.keras.replica_state`), nothing of it.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

from tf_blocksparse import _compat
from tf_blocksparse.keras.replica_state import cluster_value

__all__ = ["KerasSaving"]


class KerasSaving:
    """What Keras saving (``save_own_variables`` / ``load_own_variables``) writes and reads of
    a ``BlockSparseOptimizer``: every variable, the per-replica ones as their sums over
    replicas, or, within :meth:`apart`, every variable but the per-replica ones (saved per
    worker by :func:`save` instead)."""

    def __init__(self) -> None:
        self.state_apart = False

    @contextlib.contextmanager
    def apart(self) -> Iterator[None]:
        """Within it, saving leaves out the per-replica state and loading expects it left
        out."""
        before, self.state_apart = self.state_apart, True
        try:
            yield
        finally:
            self.state_apart = before

    def saved_variables(self, variables: Sequence[Any]) -> list[Any]:
        """The variables of ``variables`` that Keras saving writes now."""
        if self.state_apart:
            return [v for v in variables if not _compat.is_on_read(v)]
        return list(variables)

    def save(self, store: Any, variables: Sequence[Any], num_replicas: int) -> None:
        """Writes ``variables`` into ``store`` with no collective (per-replica state as its
        sum over replicas, see :func:`cluster_value`)."""
        for i, variable in enumerate(self.saved_variables(variables)):
            store[str(i)] = (cluster_value(variable, num_replicas)
                             if _compat.is_on_read(variable) else variable.numpy())

    def load(self, store: Any, variables: Sequence[Any], name: str) -> None:
        """Assigns ``store``'s values to ``variables``; a store of another length is
        skipped with a warning, as Keras does."""
        variables = self.saved_variables(variables)
        if len(store.keys()) != len(variables):  # as Keras: warn and keep the current state
            warnings.warn(f"Skipping variable loading for optimizer {name!r}: the file "
                          f"holds {len(store.keys())} variables, this optimizer "
                          f"{len(variables)} (not built yet, or another configuration)",
                          stacklevel=3)
            return
        for i, variable in enumerate(variables):
            variable.assign(store[str(i)])
