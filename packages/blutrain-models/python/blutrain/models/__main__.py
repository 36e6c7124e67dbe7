"""`python -m blutrain.models` is the `blutrain` command."""

import sys

from .cli import main

sys.exit(main())
