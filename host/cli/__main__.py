"""`python -m host.cli` runs the ephost command line."""

import sys

from host.cli.app import main

sys.exit(main())
