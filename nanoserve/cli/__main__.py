"""`python -m nanoserve.cli`: the same as the `nanoserve` command."""

import sys

from nanoserve.cli.main import main

sys.exit(main())
