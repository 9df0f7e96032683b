"""``python -m mhc_cupy.bench``: see :mod:`mhc_cupy.bench` and benchmarks/README.md."""

import sys

from .cli import main

sys.exit(main())
