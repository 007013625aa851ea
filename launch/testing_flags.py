"""The fault-injection flags of ``launch.train`` that only its tests use.

They are defined here rather than in :mod:`launch.flags` so that absl records this module
as theirs: :func:`launch.script.own_flags` leaves them out of the script's key flags, so
``python -m launch.train --help`` does not show them, while ``--helpfull`` lists them under
this module and the command line accepts them as any other flag.
"""

from __future__ import annotations

from absl import flags

#: The flags :func:`define_testing_flags` defines.
TESTING_FLAGS = ("fail_at_step", "fail_worker", "dump_restored", "slow_state_write_s")


def define_testing_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Defines ``--fail_at_step``, ``--fail_worker``, ``--dump_restored`` and
    ``--slow_state_write_s``.

    Args:
      flag_values: Where to define them; absl's global ``FLAGS`` by default.
    """
    fv = {"flag_values": flag_values}
    flags.DEFINE_integer("fail_at_step", -1, "Fault injection for tests: worker "
                         "--fail_worker exits with code 17 after this many steps.", **fv)
    flags.DEFINE_integer("fail_worker", 1, "Worker index that --fail_at_step kills.", **fv)
    flags.DEFINE_string("dump_restored", None, "For tests: after restoring a backup, each "
                        "worker saves its local residuals to PATH.worker_<i>.npz.", **fv)
    flags.DEFINE_float("slow_state_write_s", 0.0, "Fault injection for tests: worker "
                       "--fail_worker writes each backup's per-replica state file this many "
                       "seconds late (in the background, as always).", lower_bound=0.0, **fv)
    flags.register_validator("fail_worker", lambda w: w >= 0, "--fail_worker must be >= 0",
                             **fv)
