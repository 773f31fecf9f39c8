"""`python -m kvpool COMMAND ...`: the `kvpool` command, where its script is not on PATH."""

import sys

from kvpool.cli.main import main

sys.exit(main())
