"""`python -m dartree.bench ...`: the `dartree bench` command alone."""

import sys

from .cli import main

sys.exit(main())
