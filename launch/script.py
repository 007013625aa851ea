"""The one way a launch script starts: its flags, quiet logging, then its ``main``.

Every script ends with ``script.run(main, define_flags)``.  :func:`run` defines the flags,
makes each of them a key flag of the script (so ``python -m launch.X --help`` lists them,
also those defined in a shared module such as :mod:`launch.flags`) and runs ``main`` under
``absl.app`` with Python logging at WARNING: absl would otherwise lower it to INFO after
parsing the flags, and TensorFlow's INFO lines (``Collective all_reduce tensors: ...``)
would flood the output.  ``--verbosity=0`` (or ``-v 0``) asks for them back.  A
:class:`UserError` out of ``main`` (a data set not on this machine, ...) ends the script
with its message alone, no traceback, and exit status 1.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

from absl import app, flags
from absl import logging as absl_logging

FLAGS = flags.FLAGS


class UserError(Exception):
    """What the command line asks for cannot be done here; the message says which flag to
    change.  :func:`run` prints ``FATAL <message>`` to stderr and exits with status 1."""


#: Modules whose flags stay out of a script's key flags: ``--help`` omits them, ``--helpfull``
#: lists them under the module, and the command line takes them as usual.
UNLISTED_MODULES = ("launch.testing_flags",)


def own_flags(define: Callable[[], Any], flag_values: flags.FlagValues = FLAGS
              ) -> list[str]:
    """Calls ``define`` and makes the flags it defines key flags of the running script
    (all but those a module of :data:`UNLISTED_MODULES` defined).

    Returns:
        The names of the flags ``define`` defined, sorted (the unlisted ones included).
    """
    before = set(flag_values)
    define()
    names = sorted(set(flag_values) - before)
    for name in names:
        if flag_values.find_module_defining_flag(name) not in UNLISTED_MODULES:
            flag_values.register_key_flag_for_module(sys.argv[0], flag_values[name])
    return names


def quiet_logging(flag_values: flags.FlagValues = FLAGS) -> None:
    """Python logging (absl's and TensorFlow's loggers) at WARNING unless ``--verbosity``
    was given on the command line."""
    if not flag_values["verbosity"].present:
        absl_logging.set_verbosity(absl_logging.WARNING)
        for name in ("", "absl", "tensorflow"):  # root: absl's handler hangs there
            logging.getLogger(name).setLevel(logging.WARNING)


def run(main: Callable[[list[str]], Any], *define: Callable[[], Any]) -> None:
    """Defines the flags (each ``define``), then ``absl.app.run``-s ``main`` quietly.

    ``main``'s return value is the exit status (``None``: 0), as with ``absl.app.run``.
    """
    for d in define:
        own_flags(d)

    def quiet_main(argv: Sequence[str]) -> Any:
        quiet_logging()
        try:
            return main(list(argv))
        except UserError as err:
            print(f"FATAL {err}", file=sys.stderr, flush=True)
            return 1

    app.run(quiet_main)


def require_root(argv: Sequence[str], what: str = "shaped links") -> None:
    """A benchmark main's first check: no positional arguments, and root for ``what``
    (network namespaces and ``tc``).

    Raises:
      app.UsageError: Positional arguments were given, or the process is not root.
    """
    import os

    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {list(argv[1:])}")
    if os.geteuid() != 0:
        raise app.UsageError(f"{what} need root (network namespaces and tc)")
