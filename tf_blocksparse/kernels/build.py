"""Builds the fused CPU kernels: ``python -m tf_blocksparse.kernels.build [--force]``.

``python tf_blocksparse/kernels/build.py`` (by path) does the same, and when the library is
up to date it answers without importing TensorFlow (the package's ``__init__`` does).

Compiles ``blocksparse_ops.cc`` with ``g++`` (or ``$CXX``) against the installed
TensorFlow's headers and library (``tf.sysconfig``) into ``_blocksparse_ops-tf<major.minor>.so``
next to it (one per TensorFlow version).
Plain ``-O3`` (no ``-march=native``), so the library runs on any x86-64 / arm64 machine of
the same platform.  Skips the build when the library is not older than the source (``--force``
rebuilds).  Exits 0 on success and 1, with the reason on stderr, on failure; the library
then falls back to its pure-TensorFlow path.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

if __package__:
    from tf_blocksparse.kernels.library import SOURCE, library_path, up_to_date
else:  # run by path: the package's __init__, which imports TensorFlow, stays unloaded
    from library import SOURCE, library_path, up_to_date  # type: ignore[no-redef]

FAIL = ("tf_blocksparse: the fused CPU kernels were not built ({}); the pure-TensorFlow path "
        "will be used (slower).")


def command(output: pathlib.Path, compiler: str = "g++") -> list[str]:
    """The compile-and-link command line that writes ``output``."""
    import tensorflow as tf

    return [compiler, "-O3", "-shared", "-fPIC", "-Wno-deprecated-declarations", str(SOURCE),
            "-o", str(output), *tf.sysconfig.get_compile_flags(),
            *tf.sysconfig.get_link_flags()]


def build(output: pathlib.Path | None = None, force: bool = False) -> pathlib.Path:
    """Compiles the kernels into ``output`` (default: the loader's library path).

    Returns:
      The library's path.

    Raises:
      RuntimeError: No compiler, or the compilation failed (its output in the message).
    """
    output = pathlib.Path(output or library_path())
    if not force and up_to_date(output):
        return output
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler: {compiler!r} is not on PATH")
    # Written beside the target and renamed, so a process never loads a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=output.parent)
    os.close(fd)
    try:
        proc = subprocess.run(command(pathlib.Path(tmp), compiler), capture_output=True,
                              text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed:\n{proc.stderr[-4000:]}")
        os.replace(tmp, output)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return output


def main(argv: list[str]) -> int:
    """Command line; returns the exit status."""
    force = "--force" in argv
    unknown = [a for a in argv if a != "--force"]
    if unknown:
        print(f"usage: python -m tf_blocksparse.kernels.build [--force] (got {unknown})",
              file=sys.stderr)
        return 2
    path = library_path()
    if not force and up_to_date(path):
        print(f"tf_blocksparse: fused CPU kernels up to date in {path}")
        return 0
    try:
        build(path, force=force)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        print(FAIL.format(e), file=sys.stderr)
        return 1
    print(f"tf_blocksparse: fused CPU kernels in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
