"""``python -m tf_blocksparse.launcher``: the ``tfbs-run`` command line."""

import sys

from tf_blocksparse.launcher.cli import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m tf_blocksparse.launcher"))
