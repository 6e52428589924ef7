"""`python -m host` runs the ephost command line (as does `python -m host.cli`)."""

import sys

from host.cli.app import main

sys.exit(main())
