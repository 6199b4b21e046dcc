"""``python -m asyncrl.replay``: the ``asyncrl`` command (``asyncrl.replay.cli``)."""

import sys

from asyncrl.replay.cli import main

sys.exit(main())
