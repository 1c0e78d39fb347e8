"""``python -m dflash``: the same as the ``dflash`` command."""

import sys

from dflash.cli import main

sys.exit(main())
