"""`python -m host` runs the ephost command line (as does `python -m host.cli`)."""

import sys

from host.cli import main

sys.exit(main())
