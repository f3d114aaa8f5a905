"""``python -m stalebound.config`` (see :mod:`stalebound.config.cli`)."""

import sys

from stalebound.config.cli import main

sys.exit(main())
