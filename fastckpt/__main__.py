"""``python -m fastckpt``: the ``fastckpt`` command."""
import sys

from .cli import main

sys.exit(main())
