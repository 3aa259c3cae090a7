"""``python -m benchmarks.engine_bench``: see the package docstring."""

import sys

from benchmarks.engine_bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
