"""``mooncakectl``: the admin CLI. ``python -m mooncakectl --help``."""

from __future__ import annotations

import sys

from mooncakectl.cli import main

if __name__ == "__main__":
    sys.exit(main())
