"""``python -m twinkle.cli``: the same as the `twinkle` command."""

import sys

from twinkle.cli import main

sys.exit(main())
