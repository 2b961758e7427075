"""``python -m meshmq``: the same command line as the ``meshmq`` script."""

import sys

from meshmq.cli import main

sys.exit(main())
