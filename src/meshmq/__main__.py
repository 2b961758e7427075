import sys

from meshmq.cli import main

sys.exit(main())
