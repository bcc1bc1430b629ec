"""`python -m camkv` runs the camkv command (see camkv.cli)."""

import sys

from .cli import main

sys.exit(main())
