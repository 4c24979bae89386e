"""`python -m conveyor` runs the `conveyor` command line."""

import sys

from conveyor.cli import main

sys.exit(main())
