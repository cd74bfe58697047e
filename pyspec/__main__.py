"""``python -m pyspec``: the command line (see :mod:`pyspec.cli.commands`)."""

import sys

from pyspec.cli.commands import main

sys.exit(main())
