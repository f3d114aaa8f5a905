import sys

from stalebound.cli import main

sys.exit(main())
