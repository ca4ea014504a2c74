"""``python -m keras_longattn.benchmarks``: the same as ``keras-longattn bench``."""

import sys

from .command import main

if __name__ == "__main__":
    sys.exit(main())
