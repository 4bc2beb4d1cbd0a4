"""`python -m benchmarks.serve_bench` is `nanoserve bench`: the harness is nanoserve.bench."""

import sys

from nanoserve.bench.serve_bench import main

if __name__ == "__main__":
    sys.exit(main())
