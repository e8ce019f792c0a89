"""``python -m neardup``: the ``neardup`` command."""

import sys

from neardup.cli import main

sys.exit(main())
