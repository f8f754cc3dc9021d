"""``python -m flowalign ...``: the ``flowalign`` command."""

import sys

from flowalign.cli import main

sys.exit(main())
