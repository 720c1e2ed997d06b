"""``python -m shadowd`` is the ``shadowd`` command."""

from shadowd.cli import app

app()
