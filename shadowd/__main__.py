"""``python -m shadowd`` is the ``shadowd`` command."""

import sys

from shadowd.cli import main

if __name__ == "__main__":  # the collector's writer process imports this module again under another name
    sys.exit(main())
