"""``python -m pyspec``: the command line (see :mod:`pyspec.cli`)."""

import sys

from pyspec.cli import main

sys.exit(main())
