"""``python -m bench.report``: see ``bench/report/__init__.py``."""

import sys

from bench.report import main

sys.exit(main())
